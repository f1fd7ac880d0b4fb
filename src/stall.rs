//! Send timeouts: a write, flush or close that makes no progress for a stated time fails with
//! `TimedOut` (nginx's `send_timeout`, counted between two writes), for the client side of every
//! TCP and TLS connection (HTTP/3 bounds each write with a timer of its own) and for both sides
//! of a WebSocket tunnel. Must never: time out a write that is
//! making progress, or allocate a timer before a write first has to wait.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// The send timeout of one connection's writes: armed by a write the socket could not take,
/// disarmed by one it took. The timer is allocated at the first full send buffer and reused.
#[derive(Default)]
pub(crate) struct Stall {
    timer: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl Stall {
    /// A write made progress.
    pub(crate) fn progress(&mut self) {
        self.armed = false;
    }

    /// A write found the send buffer full: whether `stall` has passed since the first such
    /// write after the last progress; registers for the wake-up otherwise.
    pub(crate) fn poll_expired(&mut self, stall: Duration, cx: &mut Context<'_>) -> bool {
        if !self.armed {
            self.armed = true;
            let deadline = Instant::now() + stall;
            match &mut self.timer {
                Some(timer) => timer.as_mut().reset(deadline),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        let timer = self.timer.as_mut().expect("armed above");
        timer.as_mut().poll(cx).is_ready()
    }

    /// `r`, the result of a write, a flush or a close, within `stall` of the last progress:
    /// `TimedOut` once a `Pending` has lasted that long; any other result is progress.
    pub(crate) fn timed<T>(
        &mut self,
        stall: Duration,
        cx: &mut Context<'_>,
        r: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match r {
            Poll::Pending if self.poll_expired(stall, cx) => {
                Poll::Ready(Err(io::ErrorKind::TimedOut.into()))
            }
            Poll::Pending => Poll::Pending,
            r => {
                self.progress();
                r
            }
        }
    }
}

/// A stream whose writes, flushes and close fail with `TimedOut` once none has made progress
/// for `send_timeout`: an HTTP/2 stream waits on the client's flow-control window, which a
/// client can keep shut while its connection lives on; an upstream that reads nothing holds a
/// tunnel's bytes the same way.
pub(crate) struct SendTimed<T> {
    io: T,
    send_timeout: Duration,
    stall: Stall,
}

impl<T> SendTimed<T> {
    /// `io` with its writes, flushes and close bounded by `send_timeout`.
    pub(crate) fn new(io: T, send_timeout: Duration) -> Self {
        Self {
            io,
            send_timeout,
            stall: Stall::default(),
        }
    }
}

impl<T: AsyncWrite + Unpin> SendTimed<T> {
    fn timed<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        self.stall.timed(self.send_timeout, cx, r)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for SendTimed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for SendTimed<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.timed(cx, r)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.timed(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_shutdown(cx);
        self.timed(cx, r)
    }
}
