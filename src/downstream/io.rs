//! The socket wrappers: [`Socket`] is what the fast path needs of a client connection (TCP, or
//! TLS over it); [`Prefixed`] yields the bytes the fast path already read before the
//! socket's own, times out stalled writes ([`crate::stall::Stall`], as the fast path does) and
//! closes with a lingering close (nginx's `lingering_close`). Must never: let a client's unread
//! request bytes turn the close into a reset that loses the response.

use std::future::Future;
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_rustls::server::TlsStream;

use super::conn::{peek, reset_on_close};
use crate::stall::Stall;

/// A client connection the fast path and the hand-off serve: a TCP socket, or TLS over one.
/// Writes must be flushed (TLS holds records back until then; TCP's flush does nothing).
pub(crate) trait Socket: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// The TCP socket underneath: busy polling, `SO_LINGER`, the client-gone watch.
    fn tcp(&self) -> &TcpStream;

    /// Ready when the client has gone (FIN, reset, TLS `close_notify`): `Ready(true)`; or when
    /// bytes of a next request arrived: `Ready(false)`, those bytes then being either still in
    /// the socket (TCP: seen by a peek) or appended to `buf` (TLS: they had to be decrypted to
    /// tell them from an alert).
    fn poll_gone(&mut self, buf: &mut BytesMut, cx: &mut Context<'_>) -> Poll<bool>;

    /// Whether nothing of the client's is unread, in the socket or decrypted: then a close needs
    /// no lingering. TLS always lingers (its `close_notify` is a write the client may answer).
    fn nothing_queued(&self) -> bool;
}

impl Socket for TcpStream {
    fn tcp(&self) -> &TcpStream {
        self
    }

    fn poll_gone(&mut self, _buf: &mut BytesMut, cx: &mut Context<'_>) -> Poll<bool> {
        loop {
            if std::task::ready!(self.poll_read_ready(cx)).is_err() {
                return Poll::Ready(true);
            }
            // Through the runtime, so a `WouldBlock` clears the readiness it acted on.
            match self.try_io(tokio::io::Interest::READABLE, || peek(self)) {
                Ok(0) => return Poll::Ready(true),
                Ok(_) => return Poll::Ready(false),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return Poll::Ready(true),
            }
        }
    }

    fn nothing_queued(&self) -> bool {
        !matches!(peek(self), Ok(n) if n > 0)
    }
}

impl Socket for TlsStream<TcpStream> {
    fn tcp(&self) -> &TcpStream {
        self.get_ref().0
    }

    fn poll_gone(&mut self, buf: &mut BytesMut, cx: &mut Context<'_>) -> Poll<bool> {
        buf.reserve(super::parse::READ_CHUNK / 2);
        match tokio_util::io::poll_read_buf(Pin::new(self), cx, buf) {
            Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => Poll::Ready(true),
            Poll::Ready(Ok(_)) => Poll::Ready(false),
            Poll::Pending => Poll::Pending,
        }
    }

    fn nothing_queued(&self) -> bool {
        false
    }
}

/// Longest a closing connection is drained in all, and with no bytes arriving (the lingering
/// close of nginx's `lingering_time` / `lingering_timeout`, shorter).
const LINGER_TOTAL: Duration = Duration::from_secs(5);
const LINGER_IDLE: Duration = Duration::from_secs(1);

/// A lingering close: after the last response and our FIN (`shutdown(SHUT_WR)`), the client's
/// remaining bytes (an upload answered early, say with 413; pipelined requests after a close) are
/// read and discarded until it closes too, for at most [`LINGER_TOTAL`] and [`LINGER_IDLE`]
/// without data. Closing a socket with unread bytes makes the kernel send RST (RFC 9112
/// section 9.6 warns of it), and an RST can reach the client before it has read the response,
/// which it then never sees.
pub(super) struct Linger {
    /// The total deadline.
    until: Instant,
    /// The idle timer, made when the first read finds nothing to read (a client that has closed
    /// already costs one read and no timer).
    idle: Option<Pin<Box<Sleep>>>,
}

impl Linger {
    /// Starts lingering now (once the write side is shut down).
    pub(super) fn new() -> Self {
        Self {
            until: Instant::now() + LINGER_TOTAL,
            idle: None,
        }
    }

    /// Drains `io` (whose write side is shut down); ready at the client's EOF, a read error, or
    /// a deadline. Reads at most 16 times per poll, then yields.
    pub(super) fn poll<R: AsyncRead + Unpin>(
        &mut self,
        io: &mut R,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        let until = self.until;
        let mut scratch = [MaybeUninit::<u8>::uninit(); 16 * 1024];
        for _ in 0..16 {
            let mut buf = ReadBuf::uninit(&mut scratch);
            match Pin::new(&mut *io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                    let now = Instant::now();
                    if now >= until {
                        return Poll::Ready(());
                    }
                    if let Some(idle) = &mut self.idle {
                        idle.as_mut().reset((now + LINGER_IDLE).min(until));
                    }
                }
                Poll::Ready(_) => return Poll::Ready(()),
                Poll::Pending => {
                    let idle = self.idle.get_or_insert_with(|| {
                        Box::pin(tokio::time::sleep_until(
                            (Instant::now() + LINGER_IDLE).min(until),
                        ))
                    });
                    return idle.as_mut().poll(cx);
                }
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// A stream that first yields bytes already read from it: how a connection reaches hyper with
/// the request the fast path did not take.
pub(crate) struct Prefixed<S: Socket> {
    pub(super) pre: Bytes,
    pub(super) io: S,
    /// Set once the write side is shut down: the lingering close in progress.
    pub(super) linger: Option<Linger>,
    /// Whether a shutdown lingers (reads and drops the client's bytes); not once the connection
    /// carries a WebSocket, whose client bytes are the tunnel's to read.
    pub(super) lingers: bool,
    /// `server.send_timeout_ms`: a write that finds the send buffer full and stays so this long
    /// fails with `TimedOut` (hyper then ends the connection, a WebSocket tunnel its tunnel).
    pub(super) send_timeout: Duration,
    pub(super) stall: Stall,
    /// A write timed out: the shutdown resets the connection instead of closing it.
    pub(super) stalled: bool,
    /// Set by the connection's owner when a response's session ended mid-body (HTTP/1 has no
    /// per-response reset): no FIN is sent, and the drop resets the connection (`SO_LINGER` 0)
    /// so what the send buffer holds is dropped, not delivered.
    pub(super) reset: Arc<AtomicBool>,
}

impl<S: Socket> Drop for Prefixed<S> {
    fn drop(&mut self) {
        if self.reset.load(Ordering::Relaxed) {
            reset_on_close(self.io.tcp());
        }
    }
}

impl<S: Socket> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.pre.is_empty() {
            let n = self.pre.len().min(buf.remaining());
            buf.put_slice(&self.pre[..n]);
            self.pre.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: Socket> Prefixed<S> {
    /// A write's, a flush's or a close's result, through the send timeout ([`Stall`]): TLS
    /// takes the last bytes into its buffer as written, and only the flush (or the
    /// `close_notify` and FIN) then waits on a client that reads nothing.
    fn stalled<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        let r = self.stall.timed(self.send_timeout, cx, r);
        if matches!(&r, Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::TimedOut) {
            tracing::debug!(
                "client took no response bytes for server.send_timeout_ms; connection reset"
            );
            self.stalled = true;
            // Closed without lingering or a FIN queued behind a full buffer: reset (nginx's
            // `reset_timedout_connection`).
            reset_on_close(self.io.tcp());
        }
        r
    }
}

impl<S: Socket> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.stalled(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.stalled(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.stalled(cx, r)
    }

    /// Shuts the write side down (within the send timeout), then drains the client's remaining
    /// bytes ([`Linger`]): hyper calls this when it closes a connection, also one whose request
    /// body it left unread. Without `lingers` (a WebSocket's), only the write side is shut
    /// down.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.stalled || this.reset.load(Ordering::Relaxed) {
            // Nothing more can be sent: the drop that follows resets the connection.
            return Poll::Ready(Ok(()));
        }
        if this.linger.is_none() {
            let r = Pin::new(&mut this.io).poll_shutdown(cx);
            std::task::ready!(this.stalled(cx, r))?;
            if !this.lingers {
                return Poll::Ready(Ok(()));
            }
            this.linger = Some(Linger::new());
        }
        let linger = this.linger.as_mut().expect("set above");
        linger.poll(&mut this.io, cx).map(Ok)
    }
}

#[cfg(test)]
#[path = "io_tests.rs"]
mod tests;
