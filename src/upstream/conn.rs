//! HTTP/1.1 on one pooled upstream connection, driven by the task of the request that holds it
//! (RFC 9112): the request head and body are written ([`super::exchange`]) and the response is
//! read and de-framed ([`super::codec`], [`super::chunked`]) right where the downstream
//! connection's task polls them, with no connection task, no channel and no wake-up between
//! tasks in between. Parsing is `httparse` (hyper's own parser).
//!
//! Why ours and not hyper's client connection: hyper's client runs each connection in a task of
//! its own and hands the request over a channel and the response and every body chunk back over
//! channels: four task hand-offs per request. The downstream side stays hyper's server.
//!
//! Must never: reuse a connection whose request was not written in full or whose response was
//! not read exactly to its end, accept a response head over [`MAX_HEAD`] bytes, or replay a
//! request whose body was partly consumed.

use std::future::poll_fn;
use std::io::{self, IoSlice};
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Request, Response, StatusCode};
use http_body::{Frame, SizeHint};
use tokio::io::AsyncWrite;
use tokio::net::TcpStream;

use super::io::{Transport, UpIo};
use tokio_util::either::Either;

use super::raw::RawHead;
use super::{BoxError, ForwardError, UpBody};
use crate::busy_poll;

use super::chunked::{body_eof, decode_body};
use super::codec::idle_limit;
use super::outgoing::Out;

/// Largest response head accepted (status line + headers), bytes. Larger: 502.
pub const MAX_HEAD: usize = 64 * 1024;

/// Read size, bytes: enough for a typical JSON response with its head in one `recv`.
pub(super) const READ_CHUNK: usize = 16 * 1024;

/// The default of `upstream.drain_max_bytes`: most response-body bytes read to finish an
/// exchange whose requester went away ([`H1::finish`]), 64 KiB: a longer body costs less as a
/// new connection than as a read nobody wants.
pub const DRAIN_BYTES: u64 = 64 * 1024;

/// One upstream connection: the socket and the bytes read from it but not yet consumed.
pub struct H1 {
    pub(super) io: UpIo,
    pub(super) buf: BytesMut,
    /// The write queue, kept between requests so that sending one allocates no queue.
    pub(super) out: Out,
    /// The busy-poll watch set of the thread the socket is registered with (`None`: polling off
    /// there, or the registration failed).
    pub(super) watched: Option<Arc<OwnedFd>>,
    /// How long the upstream said, on its last response, that it keeps the connection open
    /// while idle (`Keep-Alive: timeout=N`); `None`: it did not say.
    pub(super) announced_idle: Option<Duration>,
}

/// Where a request's sending is ([`H1::send`] keeps it up to date), for the owner of the
/// connection should the sending be dropped (its requester went away). One byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Sending {
    /// No sending in progress, or one past the point where the connection can be saved by
    /// either of the others (partly written, or its head read).
    #[default]
    Idle,
    /// Nothing of the request written yet (the socket was not yet writable): nothing was sent
    /// or read, so the connection can be reused. (A reused one goes back with its idle time
    /// counted from its previous request's send, so it may come back past its deadline.)
    Unsent,
    /// Written in full and the response head awaited (no close from the upstream seen): the
    /// exchange can still be finished ([`H1::finish`] with [`Unfinished::Head`]).
    HeadDue { head_request: bool },
}

/// What is left of an exchange whose request was written to its end: read it with
/// [`H1::finish`] and the connection can carry another request (see [`Sending`] and
/// [`worth_finishing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unfinished {
    /// The response head has not been read yet (`head_request`: the request was a `HEAD`, so the
    /// response has no body).
    Head { head_request: bool },
    /// The head was read; the body is left, framed as given.
    Body(Framing),
}

/// Why sending a request failed, and whether it may be replayed on another connection.
pub enum SendError {
    /// Not one byte of the request was accepted by the socket; the request is handed back whole.
    Unsent(Request<UpBody>, ForwardError),
    /// The connection closed (EOF or reset) before any response byte arrived. The request is
    /// handed back when it had no body (only its head was sent).
    ClosedBeforeResponse(Option<Request<UpBody>>, ForwardError),
    /// Anything else; never replayed.
    Failed(ForwardError),
}

/// A response head read from the upstream, with how its body is framed.
pub struct Head {
    /// Status and version; the header map is empty (the fields are in `fields`).
    pub response: Response<()>,
    /// The fields as received (the framing fields included).
    pub fields: RawHead,
    /// How the body ends.
    pub framing: Framing,
    /// Whether the connection may carry another request after this response.
    pub keep_alive: bool,
    /// How long the upstream keeps the connection open while idle, as its `Keep-Alive:
    /// timeout=N` field says (seconds; `None`: no such field).
    pub announced_idle: Option<Duration>,
}

/// How a response body is delimited (RFC 9112 section 6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body (HEAD, 1xx, 204, 304) or nothing left to read.
    Done,
    /// `Content-Length`: this many bytes are left.
    Length(u64),
    /// `Transfer-Encoding: chunked`, in the given decoding state.
    Chunked(Chunk),
    /// Neither: the body runs until the upstream closes the connection.
    Close,
}

/// Where the chunked decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// Inside chunk data, this many bytes left.
    Data(u64),
    /// Expecting the CRLF after chunk data.
    DataEnd,
    /// After the last chunk: the trailer section up to its empty line.
    Trailers,
}

pub(super) fn broken(what: impl Into<String>) -> ForwardError {
    ForwardError::Broken(what.into())
}

/// Whether a response body left unread with this much of it to come (on a connection the
/// upstream keeps open) is worth finishing in the background ([`H1::finish`]) within `budget`
/// body bytes (`upstream.drain_max_bytes`, default [`DRAIN_BYTES`]): a `Content-Length` rest of
/// at most `budget`, or a chunked rest when `budget` is not zero (then read up to `budget`
/// bytes). A close-delimited body never is.
pub fn worth_finishing(framing: Framing, budget: u64) -> bool {
    match framing {
        Framing::Length(left) => left <= budget,
        Framing::Chunked(_) => budget > 0,
        Framing::Done | Framing::Close => false,
    }
}

/// Size hint of a response body in the given framing.
pub fn size_hint(framing: Framing) -> SizeHint {
    match framing {
        Framing::Done => SizeHint::with_exact(0),
        Framing::Length(n) => SizeHint::with_exact(n),
        _ => SizeHint::default(),
    }
}

impl H1 {
    /// Wraps a connected socket, or TLS over one (registered with the calling thread's
    /// runtime), and adds it to that thread's busy-poll watch set.
    pub fn new(io: UpIo) -> Self {
        let watched = busy_poll::watch(io.tcp());
        Self {
            io,
            buf: BytesMut::with_capacity(READ_CHUNK),
            out: Out::default(),
            watched,
            announced_idle: None,
        }
    }

    /// Whether an idle connection can still take a request: no bytes left over and no close
    /// (or stray bytes) signalled by the socket. Costs a `recv` only when the socket has
    /// signalled readiness since it went idle.
    pub fn is_alive(&mut self) -> bool {
        self.buf.is_empty() && self.io.is_idle_open()
    }

    /// Moves the socket to the calling thread's runtime: deregisters it from the I/O driver it
    /// was registered with and registers it with the current one, so its readiness wakes the
    /// calling thread directly; likewise with the busy-poll watch sets. Must be called within a
    /// tokio runtime.
    ///
    /// A TLS connection stays where it is (its session cannot be taken apart and put back).
    ///
    /// Errors: deregistration or registration failed (the socket is then closed).
    pub fn rehome(self) -> io::Result<Self> {
        let Either::Left(tcp) = self.io else {
            return Ok(self);
        };
        if let Some(set) = &self.watched {
            busy_poll::unwatch(set, &tcp);
        }
        let io = TcpStream::from_std(tcp.into_std()?)?;
        Ok(Self {
            watched: busy_poll::watch(&io),
            io: Either::Left(io),
            buf: self.buf,
            out: self.out,
            announced_idle: self.announced_idle,
        })
    }

    /// How long this connection may wait idle in a pool whose own limit is `pool_idle`: that
    /// limit, or less when the upstream announced a shorter keep-alive on its last response
    /// (`Keep-Alive: timeout=N`, which Apache httpd and Node.js send, 5 s by default): then N
    /// less 1 s, or N / 2 when N is 2 s or less. The margin covers the time between the
    /// upstream's sending its response, when its idle clock starts, and this side's reading
    /// it, so that a request is not sent just as the upstream closes the connection (a request
    /// with a body, lost that way, cannot be replayed: a 502).
    pub fn idle_limit(&self, pool_idle: Duration) -> Duration {
        idle_limit(pool_idle, self.announced_idle)
    }

    /// Reads the rest of an exchange whose requester went away (see [`H1::send`]):
    /// the response head if it is still due, then the body, discarded. Returns whether the
    /// connection can carry another request: the response was read exactly to its end within
    /// `budget` body bytes and the upstream keeps the connection open. The caller bounds
    /// the time. `false` for a 101 (the connection belongs to the switched protocol), a response
    /// that ends the connection (`Connection: close`, HTTP/1.0 without keep-alive, a
    /// close-delimited body), a malformed response, a longer body (a `Content-Length` over the
    /// budget is refused from the head), bytes after the response's end, or a closed
    /// connection. The budget counts body data only: chunk-size lines and trailers are bounded
    /// by the caller's time limit. `rest` becomes [`Unfinished::Body`] once the head is read,
    /// so a caller that gives up on the future knows whether the upstream had answered.
    pub async fn finish(&mut self, rest: &mut Unfinished, mut budget: u64) -> bool {
        let mut framing = match *rest {
            Unfinished::Head { head_request } => match self.read_head(head_request, false).await {
                // A body too long to finish is known from the head: closed without reading it.
                Ok(head)
                    if head.keep_alive
                        && head.response.status() != StatusCode::SWITCHING_PROTOCOLS
                        && (head.framing == Framing::Done
                            || worth_finishing(head.framing, budget)) =>
                {
                    self.announced_idle = head.announced_idle;
                    *rest = Unfinished::Body(head.framing);
                    head.framing
                }
                _ => return false,
            },
            Unfinished::Body(framing) => framing,
        };
        loop {
            match poll_fn(|cx| self.poll_body(cx, &mut framing)).await {
                None => return !self.has_leftover(),
                Some(Ok(frame)) => {
                    let len = frame.data_ref().map_or(0, |d| d.len() as u64);
                    match budget.checked_sub(len) {
                        Some(left) => budget = left,
                        None => return false,
                    }
                }
                Some(Err(_)) => return false,
            }
        }
    }

    /// Whether bytes beyond the last response are buffered, here or in the TLS session (the
    /// connection is then unusable: they would be read as the next request's response).
    pub fn has_leftover(&self) -> bool {
        !self.buf.is_empty() || self.io.holds_unread()
    }

    /// Whether a body framed as `framing` is already read in full (no more bytes to wait for):
    /// nothing left, or a `Content-Length` rest the buffer holds. A chunked or close-delimited
    /// body is never reported whole before its end is parsed.
    pub fn holds_body(&self, framing: Framing) -> bool {
        match framing {
            Framing::Done => true,
            Framing::Length(left) => self.buf.len() as u64 >= left,
            Framing::Chunked(_) | Framing::Close => false,
        }
    }

    /// Reads more bytes into the buffer. `Ok(0)` is end of stream.
    pub(super) fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
            self.buf.reserve(READ_CHUNK);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
    }

    /// Writes the first of `out` (advancing it); `Ok(0)` from the socket is an error.
    pub(super) fn poll_write_out(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut Out,
    ) -> Poll<io::Result<usize>> {
        let mut slices = [IoSlice::new(&[]); super::outgoing::MAX_SLICES];
        let n = out.slices(&mut slices);
        let written = ready!(Pin::new(&mut self.io).poll_write_vectored(cx, &slices[..n]))?;
        if written == 0 {
            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
        }
        out.advance(written);
        Poll::Ready(Ok(written))
    }

    /// Sends what TLS holds back (nothing to do on TCP).
    pub(super) fn poll_flush_io(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// The socket of a connection whose response switched protocols (101), and the bytes the
    /// upstream sent after that response's head (the new protocol's first bytes, possibly none).
    pub fn switched_io(&mut self) -> (&mut UpIo, BytesMut) {
        (&mut self.io, self.buf.split())
    }

    /// Reads the next body frame, advancing `framing`; `None` once the body ended (then
    /// `framing` is [`Framing::Done`]).
    ///
    /// Errors (as text for the downstream log): the connection closed or failed before the
    /// body's end, or the chunked coding is malformed.
    pub fn poll_body(
        &mut self,
        cx: &mut Context<'_>,
        framing: &mut Framing,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if let Poll::Ready(frame) = decode_body(&mut self.buf, framing) {
                return Poll::Ready(frame);
            }
            match ready!(self.poll_fill(cx)) {
                Ok(0) => return Poll::Ready(body_eof(framing)),
                Ok(_) => {}
                Err(e) => return Poll::Ready(Some(Err(e.into()))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection moved to another thread's runtime leaves the first thread's busy-poll watch
    /// set and joins the second's: its response ends the second thread's poll, not the first's.
    #[test]
    fn a_rehomed_connection_moves_between_busy_poll_watch_sets() {
        use std::io::Write as _;
        use std::time::Duration;

        /// A current-thread runtime on a thread that busy-polls for `spin`.
        fn polling_runtime(spin: Duration) -> tokio::runtime::Runtime {
            busy_poll::enable(spin);
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        }

        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (h1_tx, h1_rx) = std::sync::mpsc::channel::<H1>();
        let (moved_tx, moved_rx) = std::sync::mpsc::channel::<()>();
        let (sent_tx, sent_rx) = std::sync::mpsc::channel::<()>();

        // Thread A: connects (the socket joins A's set), hands the connection to B, then polls
        // after the upstream has written to it.
        let a = std::thread::spawn(move || {
            let rt = polling_runtime(Duration::from_millis(40));
            let h1 = rt
                .block_on(async { H1::new(Either::Left(TcpStream::connect(addr).await.unwrap())) });
            assert!(h1.watched.is_some());
            h1_tx.send(h1).unwrap();
            sent_rx.recv().unwrap();
            busy_poll::timed_poll(Duration::from_millis(40))
        });
        let (mut upstream, _) = listener.accept().unwrap();

        // Thread B: takes the connection over, then polls once the upstream wrote to it.
        let b = std::thread::spawn(move || {
            let rt = polling_runtime(Duration::from_secs(10));
            let h1 = h1_rx.recv().unwrap();
            let h1 = rt.block_on(async { h1.rehome().unwrap() });
            moved_tx.send(()).unwrap();
            rt.block_on(h1.io.tcp().readable()).unwrap();
            (busy_poll::timed_poll(Duration::from_secs(10)), h1)
        });
        moved_rx.recv().unwrap();
        upstream.write_all(b"H").unwrap();
        let (b_polled, _h1) = b.join().unwrap();
        sent_tx.send(()).unwrap();
        let a_polled = a.join().unwrap();
        assert!(b_polled < Duration::from_secs(5), "B: {b_polled:?}");
        assert!(a_polled >= Duration::from_millis(40), "A: {a_polled:?}");
    }
}
