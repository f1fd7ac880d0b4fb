//! HTTP/1.1 on one pooled upstream connection, driven by the task of the request that holds it
//! (RFC 9112): the request head and body are written and the response is read and de-framed
//! right where the downstream connection's task polls them, with no connection task, no channel
//! and no wake-up between tasks in between. Parsing is `httparse` (hyper's own parser).
//!
//! Why ours and not hyper's client connection: hyper's client runs each connection in a task of
//! its own and hands the request over a channel and the response and every body chunk back over
//! channels: four task hand-offs per request. Measured in BENCHMARKS.md ("Upstream HTTP/1.1 in
//! the request's task"); the downstream side stays hyper's server.
//!
//! Must never: reuse a connection whose request was not written in full or whose response was
//! not read exactly to its end, accept a response head over [`MAX_HEAD`] bytes, or replay a
//! request whose body was partly consumed.

use std::future::poll_fn;
use std::io::{self, IoSlice, Write};
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use tokio::io::AsyncWrite;
use tokio::net::TcpStream;

use super::raw::RawHead;
use super::{BoxError, ForwardError, UpBody};
use crate::busy_poll;

/// Largest response head accepted (status line + headers), bytes. Larger: 502.
pub const MAX_HEAD: usize = 64 * 1024;
/// Most response header fields accepted (hyper's default is 100).
const MAX_HEADERS: usize = 128;
// `screen::screen_response` marks fields in a 128-bit mask.
const _: () = assert!(MAX_HEADERS <= 128);
/// Read size, bytes: enough for a typical JSON response with its head in one `recv`.
const READ_CHUNK: usize = 16 * 1024;
/// Longest chunk-size line (size + extensions), bytes.
const MAX_CHUNK_LINE: usize = 4096;
/// The default of `upstream.drain_max_bytes`: most response-body bytes read to finish an
/// exchange whose requester went away ([`H1::finish`]), 64 KiB: a longer body costs less as a
/// new connection than as a read nobody wants.
pub const DRAIN_BYTES: u64 = 64 * 1024;

/// One upstream connection: the socket and the bytes read from it but not yet consumed.
pub struct H1 {
    io: TcpStream,
    buf: BytesMut,
    /// The write queue, kept between requests so that sending one allocates no queue.
    out: Out,
    /// The busy-poll watch set of the thread the socket is registered with (`None`: polling off
    /// there, or the registration failed).
    watched: Option<Arc<OwnedFd>>,
    /// How long the upstream said, on its last response, that it keeps the connection open
    /// while idle (`Keep-Alive: timeout=N`); `None`: it did not say.
    announced_idle: Option<Duration>,
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

fn broken(what: impl Into<String>) -> ForwardError {
    ForwardError::Broken(what.into())
}

impl H1 {
    /// Wraps a connected socket (registered with the calling thread's runtime), and adds it to
    /// that thread's busy-poll watch set.
    pub fn new(io: TcpStream) -> Self {
        let watched = busy_poll::watch(&io);
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
        if !self.buf.is_empty() {
            return false;
        }
        let mut cx = Context::from_waker(Waker::noop());
        match self.io.poll_read_ready(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Err(_)) => false,
            Poll::Ready(Ok(())) => {
                let mut probe = [0u8; 1];
                matches!(self.io.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
            }
        }
    }

    /// Moves the socket to the calling thread's runtime: deregisters it from the I/O driver it
    /// was registered with and registers it with the current one, so its readiness wakes the
    /// calling thread directly; likewise with the busy-poll watch sets. Must be called within a
    /// tokio runtime.
    ///
    /// Errors: deregistration or registration failed (the socket is then closed).
    pub fn rehome(self) -> io::Result<Self> {
        if let Some(set) = &self.watched {
            busy_poll::unwatch(set, &self.io);
        }
        let io = TcpStream::from_std(self.io.into_std()?)?;
        Ok(Self {
            watched: busy_poll::watch(&io),
            io,
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
    /// by the caller's time limit.
    pub async fn finish(&mut self, rest: Unfinished, mut budget: u64) -> bool {
        let mut framing = match rest {
            Unfinished::Head { head_request } => match self.read_head(head_request, false).await {
                // A body too long to finish is known from the head: closed without reading it.
                Ok(head)
                    if head.keep_alive
                        && head.response.status() != StatusCode::SWITCHING_PROTOCOLS
                        && (head.framing == Framing::Done
                            || worth_finishing(head.framing, budget)) =>
                {
                    self.announced_idle = head.announced_idle;
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

    /// Whether bytes beyond the last response are buffered (the connection is then unusable).
    pub fn has_leftover(&self) -> bool {
        !self.buf.is_empty()
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
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
            self.buf.reserve(READ_CHUNK);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
    }

    /// Writes the first of `out` (advancing it); `Ok(0)` from the socket is an error.
    fn poll_write_out(&mut self, cx: &mut Context<'_>, out: &mut Out) -> Poll<io::Result<usize>> {
        let mut slices = [IoSlice::new(&[]); 3];
        let n = out.slices(&mut slices);
        let written = ready!(Pin::new(&mut self.io).poll_write_vectored(cx, &slices[..n]))?;
        if written == 0 {
            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
        }
        out.advance(written);
        Poll::Ready(Ok(written))
    }

    /// Sends `req` (origin-form URI, final headers) and reads the response head. The body is then
    /// read with [`H1::poll_body`].
    ///
    /// Framing sent: no body for a bodyless GET/HEAD/DELETE/OPTIONS/TRACE, else
    /// `Content-Length` when the body's size is known, else `Transfer-Encoding: chunked`; the
    /// client's framing headers are replaced. Heads that arrive while the body is being sent:
    /// 1xx are skipped; an error (>= 400) ends the sending and is returned at once; another
    /// final head waits until the body was sent. The connection is marked reusable
    /// ([`Head::keep_alive`]) only if the whole request was written.
    ///
    /// `sending` says, should this future be dropped (its requester went away), whether the
    /// connection can be kept as it is ([`Sending::Unsent`]), or after the exchange is finished
    /// ([`Sending::HeadDue`]); it is [`Sending::Idle`] when this returns. `sent_ms` is set to
    /// [`super::pool::coarse_ms`] when the first bytes are written, and left as it is if none
    /// are. (Both the caller's, not fields of this struct: the pool's connection has room for
    /// them in its padding, and this struct, moved with every checkout, none.)
    ///
    /// Errors: see [`SendError`]; request-body errors are [`ForwardError::BodyTooLarge`] when the
    /// body exceeded its limit, else [`ForwardError::ClientBody`].
    pub async fn send(
        &mut self,
        req: Request<UpBody>,
        sending: &mut Sending,
        sent_ms: &mut u32,
    ) -> Result<Head, SendError> {
        let head_request = req.method() == Method::HEAD;
        let (parts, mut body) = req.into_parts();
        let framing = if body.is_end_stream() {
            match parts.method {
                Method::GET
                | Method::HEAD
                | Method::DELETE
                | Method::OPTIONS
                | Method::TRACE
                | Method::CONNECT => BodyFraming::None,
                _ => BodyFraming::Length(0),
            }
        } else {
            match body.size_hint().exact() {
                Some(n) => BodyFraming::Length(n),
                None => BodyFraming::Chunked,
            }
        };
        let mut out = std::mem::take(&mut self.out);
        out.push(encode_head(&parts, framing));
        let mut sent_any = false;
        let mut body_done = matches!(framing, BodyFraming::None | BodyFraming::Length(0));
        let mut polled_body = false;
        let mut eof = false;
        // A final response head that arrived while the request was still being sent.
        let mut early: Option<Head> = None;
        *sending = Sending::Unsent;
        let result = poll_fn(|cx| {
            while !(body_done && out.is_empty()) {
                // Watch for an answer while sending (RFC 9112 section 9.5): interim (1xx) heads
                // are consumed, an error (>= 400, or 101) stops the sending, any other final head
                // is kept and the body is still sent in full.
                if !eof && early.is_none() {
                    match self.poll_fill(cx) {
                        Poll::Ready(Ok(_)) if !sent_any => {
                            // Bytes or a close before any of the request was written: nothing
                            // of it was sent, so it may be replayed on another connection.
                            return Poll::Ready(Err(Fail::Io(io::Error::new(
                                io::ErrorKind::ConnectionAborted,
                                "upstream spoke or closed before the request",
                            ))));
                        }
                        Poll::Ready(Ok(0)) => eof = true,
                        Poll::Ready(Ok(_)) => match self.early_head(head_request) {
                            Ok(None) => continue,
                            Ok(Some(head)) => {
                                let stop = head.response.status().as_u16() >= 400
                                    || head.response.status() == StatusCode::SWITCHING_PROTOCOLS;
                                early = Some(head);
                                if stop {
                                    return Poll::Ready(Ok(()));
                                }
                                continue;
                            }
                            Err(e) => return Poll::Ready(Err(Fail::Head(e))),
                        },
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(Fail::Io(e))),
                        Poll::Pending => {}
                    }
                }
                if !out.is_empty() {
                    match self.poll_write_out(cx, &mut out) {
                        Poll::Ready(Ok(_)) => {
                            if !sent_any {
                                *sent_ms = super::pool::coarse_ms();
                            }
                            sent_any = true;
                            *sending = Sending::Idle;
                            continue;
                        }
                        Poll::Ready(Err(e)) => {
                            // An upstream that answered early (413, 401, even 200) and closed
                            // with the body unread makes the write fail (EPIPE, ECONNRESET); its
                            // answer came before the close, so it is in the receive queue.
                            if early.is_none() && !eof {
                                early = self.queued_head(head_request);
                            }
                            if early.is_some() {
                                return Poll::Ready(Ok(()));
                            }
                            return Poll::Ready(Err(Fail::Io(e)));
                        }
                        Poll::Pending => return Poll::Pending,
                    }
                }
                polled_body = true;
                match ready!(Pin::new(&mut body).poll_frame(cx)) {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            if data.is_empty() {
                                continue;
                            }
                            if framing == BodyFraming::Chunked {
                                out.push(Bytes::from(format!("{:x}\r\n", data.len())));
                                out.push(data);
                                out.push(Bytes::from_static(b"\r\n"));
                            } else {
                                out.push(data);
                            }
                        }
                        // Request trailers are dropped (hop-by-hop `TE`/`Trailer` were removed).
                    }
                    Some(Err(e)) => return Poll::Ready(Err(Fail::Body(e))),
                    None => {
                        if framing == BodyFraming::Chunked {
                            out.push(Bytes::from_static(b"0\r\n\r\n"));
                        }
                        body_done = true;
                    }
                }
            }
            Poll::Ready(Ok(()))
        })
        .await;
        *sending = Sending::Idle;
        if let Err(fail) = result {
            return Err(match fail {
                Fail::Body(e) => SendError::Failed(body_error(e)),
                Fail::Head(e) => SendError::Failed(e),
                Fail::Io(e) if !sent_any && !polled_body => SendError::Unsent(
                    Request::from_parts(parts, body),
                    broken(format!("writing the request: {e}")),
                ),
                Fail::Io(e) => SendError::Failed(broken(format!("writing the request: {e}"))),
            });
        }
        // The upstream may take another request only if this one was written to its end.
        let request_complete = body_done && out.is_empty();
        out.queue.clear();
        self.out = out;
        let head = match early {
            Some(head) => Ok(head),
            None => {
                if request_complete && !eof {
                    *sending = Sending::HeadDue { head_request };
                }
                let head = self.read_head(head_request, eof).await;
                *sending = Sending::Idle;
                match head {
                    Err(SendError::ClosedBeforeResponse(None, e)) if !polled_body => {
                        return Err(SendError::ClosedBeforeResponse(
                            Some(Request::from_parts(parts, body)),
                            e,
                        ))
                    }
                    other => other,
                }
            }
        };
        let head = match head {
            Ok(head) if head.response.status() == StatusCode::SWITCHING_PROTOCOLS => {
                switched(head, &parts.headers).map_err(SendError::Failed)
            }
            other => other,
        };
        super::recycle_header_map(parts.headers);
        if let Ok(head) = &head {
            self.announced_idle = head.announced_idle;
        }
        head.map(|mut head| {
            head.keep_alive &= request_complete;
            head
        })
    }

    /// The socket of a connection whose response switched protocols (101), and the bytes the
    /// upstream sent after that response's head (the new protocol's first bytes, possibly none).
    pub fn switched_io(&mut self) -> (&mut TcpStream, BytesMut) {
        (&mut self.io, self.buf.split())
    }

    /// Consumes the complete response heads buffered while the request is being sent: interim
    /// (1xx, but 101) heads are dropped; the first other one is returned. `None`: no final head
    /// yet. A head growing past [`MAX_HEAD`] is an error here, not a reason to read on.
    fn early_head(&mut self, head_request: bool) -> Result<Option<Head>, ForwardError> {
        if !head_complete(&self.buf) && self.buf.len() <= MAX_HEAD {
            return Ok(None);
        }
        final_head(&mut self.buf, head_request)
    }

    /// Reads what the kernel already holds for the socket, without waiting, until a final
    /// response head is complete, and returns that head (`None`: no complete, valid final head
    /// is there). Used after a write failed: an upstream that answered early and closed sent its
    /// answer before the close (RFC 9112 section 9.5), but the runtime may not have seen the
    /// socket readable yet (its readiness is only updated when its event loop next polls), so a
    /// readiness-gated read would report nothing. A `recv` with `MSG_DONTWAIT` asks the kernel.
    fn queued_head(&mut self, head_request: bool) -> Option<Head> {
        loop {
            if let Some(head) = self.early_head(head_request).ok()? {
                return Some(head);
            }
            let start = self.buf.len();
            self.buf.resize(start + READ_CHUNK, 0);
            let got = rustix::net::recv(
                &self.io,
                &mut self.buf[start..],
                rustix::net::RecvFlags::DONTWAIT,
            )
            .map(|(n, _)| n);
            self.buf.truncate(start + got.unwrap_or(0));
            if !matches!(got, Ok(n) if n > 0) {
                return None;
            }
        }
    }

    /// Reads response heads until a final (non-1xx) one, or a 101.
    async fn read_head(&mut self, head_request: bool, mut eof: bool) -> Result<Head, SendError> {
        let mut received_any = !self.buf.is_empty();
        loop {
            if let Some(head) =
                final_head(&mut self.buf, head_request).map_err(SendError::Failed)?
            {
                return Ok(head);
            }
            let closed = |what: String| {
                if received_any {
                    SendError::Failed(broken(format!("{what} inside the response head")))
                } else {
                    SendError::ClosedBeforeResponse(
                        None,
                        broken(format!("{what} before a response")),
                    )
                }
            };
            if eof {
                return Err(closed("connection closed".into()));
            }
            match poll_fn(|cx| self.poll_fill(cx)).await {
                Ok(0) => eof = true,
                Ok(_) => received_any = true,
                Err(e) => return Err(closed(format!("read failed ({e})"))),
            }
        }
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

/// Parses one response head from the buffer, consuming it; `None` when incomplete.
pub(crate) fn parse_head(
    buf: &mut BytesMut,
    head_request: bool,
) -> Result<Option<Head>, ForwardError> {
    let mut headers =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    let config = httparse::ParserConfig::default();
    let len = match config.parse_response_with_uninit_headers(&mut parsed, &*buf, &mut headers) {
        Ok(httparse::Status::Complete(len)) if len <= MAX_HEAD => len,
        Ok(httparse::Status::Partial) if buf.len() <= MAX_HEAD => return Ok(None),
        Ok(_) => {
            return Err(broken(format!(
                "invalid response head: larger than {MAX_HEAD} bytes"
            )))
        }
        Err(e) => return Err(broken(format!("invalid response head: {e}"))),
    };
    let status = StatusCode::from_u16(parsed.code.unwrap_or(0))
        .map_err(|_| broken("invalid response status"))?;
    let version = if parsed.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    // The fields stay in the frozen head as offsets (see `raw.rs`).
    let base = buf.as_ptr() as usize;
    let spans = parsed
        .headers
        .iter()
        .map(|h| {
            // Offsets within the head, which is at most MAX_HEAD (64 KiB) long.
            let name = (h.name.as_ptr() as usize - base) as u32;
            let value = (h.value.as_ptr() as usize - base) as u32;
            [
                name,
                name + h.name.len() as u32,
                value,
                value + h.value.len() as u32,
            ]
        })
        .collect();
    let mut fields = RawHead::new(buf.split_to(len).freeze(), spans);
    let mut keep_alive = keep_alive(version, &fields);
    if fields.contains(b"transfer-encoding") {
        // RFC 9112 section 6.1: chunked framing is HTTP/1.1; section 6.3: with both fields,
        // Transfer-Encoding wins, Content-Length must not be forwarded, and the connection
        // is not trusted with another request.
        if version == Version::HTTP_10 {
            return Err(broken(
                "invalid response head: Transfer-Encoding in an HTTP/1.0 response",
            ));
        }
        if fields.contains(b"content-length") {
            fields.remove(b"content-length");
            keep_alive = false;
        }
    }
    let framing = framing(head_request, status, &fields)?;
    let announced_idle = announced_idle(&fields);
    let mut response = Response::new(());
    *response.status_mut() = status;
    *response.version_mut() = version;
    Ok(Some(Head {
        response,
        fields,
        framing,
        keep_alive: keep_alive && framing != Framing::Close,
        announced_idle,
    }))
}

/// See [`H1::idle_limit`].
fn idle_limit(pool_idle: Duration, announced: Option<Duration>) -> Duration {
    match announced {
        None => pool_idle,
        Some(n) if n <= Duration::from_secs(2) => pool_idle.min(n / 2),
        Some(n) => pool_idle.min(n - Duration::from_secs(1)),
    }
}

/// The `timeout` parameter of a `Keep-Alive` field (`timeout=5, max=100`: seconds the server
/// keeps an idle connection open; RFC 2068 section 19.7.1.1, obsolete but still sent by Apache
/// httpd and Node.js), if there is one and it is a whole number (optionally quoted).
fn announced_idle(fields: &RawHead) -> Option<Duration> {
    fields
        .get_all(b"keep-alive")
        .flat_map(|v| v.split(|&b| b == b','))
        .find_map(|param| {
            let (name, value) = param.split_at(param.iter().position(|&b| b == b'=')?);
            if !name.trim_ascii().eq_ignore_ascii_case(b"timeout") {
                return None;
            }
            let value = value[1..].trim_ascii();
            let value = value
                .strip_prefix(b"\"")
                .and_then(|v| v.strip_suffix(b"\""))
                .unwrap_or(value);
            if value.is_empty() || value.len() > 9 || !value.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let secs = std::str::from_utf8(value).ok()?.parse().ok()?;
            Some(Duration::from_secs(secs))
        })
}

/// Parses response heads from `buf`, consuming them, until a final one (not 1xx, or a 101):
/// interim heads are dropped. `None` when no final head is complete yet. Errors: as
/// [`parse_head`].
pub(crate) fn final_head(
    buf: &mut BytesMut,
    head_request: bool,
) -> Result<Option<Head>, ForwardError> {
    while let Some(head) = parse_head(buf, head_request)? {
        let status = head.response.status();
        if !status.is_informational() || status == StatusCode::SWITCHING_PROTOCOLS {
            return Ok(Some(head));
        }
    }
    Ok(None)
}

/// The next body frame from the bytes in `buf`, consuming them and advancing `framing`:
/// `Ready(None)` once the body ended (then `framing` is [`Framing::Done`]), `Pending` when more
/// bytes are needed. Errors: the chunked coding is malformed.
pub(crate) fn decode_body(
    buf: &mut BytesMut,
    framing: &mut Framing,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    loop {
        match *framing {
            Framing::Done => return Poll::Ready(None),
            Framing::Length(left) => {
                if buf.is_empty() {
                    return Poll::Pending;
                }
                let n = (buf.len() as u64).min(left) as usize;
                *framing = match left - n as u64 {
                    0 => Framing::Done,
                    left => Framing::Length(left),
                };
                return Poll::Ready(Some(Ok(Frame::data(buf.split_to(n).freeze()))));
            }
            Framing::Close => {
                if buf.is_empty() {
                    return Poll::Pending;
                }
                return Poll::Ready(Some(Ok(Frame::data(buf.split().freeze()))));
            }
            Framing::Chunked(state) => match chunk_step(buf, state) {
                Ok(Step::Next(next)) => *framing = next,
                Ok(Step::Data(data, next)) => {
                    *framing = next;
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(Step::Trailers(trailers)) => {
                    *framing = Framing::Done;
                    return Poll::Ready(trailers.map(|t| Ok(Frame::trailers(t))));
                }
                Ok(Step::More) => return Poll::Pending,
                Err(e) => return Poll::Ready(Some(Err(e.into()))),
            },
        }
    }
}

/// What the end of the connection means for a body in `framing` that [`decode_body`] could take
/// no further: the end of a close-delimited body, else an error (the body was cut short).
pub(crate) fn body_eof(framing: &mut Framing) -> Option<Result<Frame<Bytes>, BoxError>> {
    match *framing {
        Framing::Close | Framing::Done => {
            *framing = Framing::Done;
            None
        }
        _ => Some(Err(
            "upstream closed the connection before the body's end".into()
        )),
    }
}

/// One step of the chunked decoder over the buffered bytes.
fn chunk_step(buf: &mut BytesMut, state: Chunk) -> Result<Step, String> {
    match state {
        Chunk::Size => {
            let end = match find_crlf(buf) {
                Some(end) if end <= MAX_CHUNK_LINE => end,
                None if buf.len() <= MAX_CHUNK_LINE => return Ok(Step::More),
                _ => return Err("chunk-size line too long".into()),
            };
            let size = chunk_size(&buf[..end])?;
            buf.advance(end + 2);
            Ok(Step::Next(Framing::Chunked(if size == 0 {
                Chunk::Trailers
            } else {
                Chunk::Data(size)
            })))
        }
        Chunk::Data(left) => {
            if buf.is_empty() {
                return Ok(Step::More);
            }
            let n = (buf.len() as u64).min(left) as usize;
            let next = match left - n as u64 {
                0 => Chunk::DataEnd,
                left => Chunk::Data(left),
            };
            Ok(Step::Data(buf.split_to(n).freeze(), Framing::Chunked(next)))
        }
        Chunk::DataEnd => {
            if buf.len() < 2 {
                return Ok(Step::More);
            }
            if &buf[..2] != b"\r\n" {
                return Err("chunk data not followed by CRLF".into());
            }
            buf.advance(2);
            Ok(Step::Next(Framing::Chunked(Chunk::Size)))
        }
        Chunk::Trailers => {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            match httparse::parse_headers(buf, &mut headers) {
                Ok(httparse::Status::Complete((len, fields))) => {
                    let mut map = HeaderMap::new();
                    for h in fields {
                        if let (Ok(name), Ok(value)) = (
                            HeaderName::from_bytes(h.name.as_bytes()),
                            HeaderValue::from_bytes(h.value),
                        ) {
                            map.append(name, value);
                        }
                    }
                    buf.advance(len);
                    Ok(Step::Trailers((!map.is_empty()).then_some(map)))
                }
                Ok(httparse::Status::Partial) if buf.len() <= MAX_HEAD => Ok(Step::More),
                Ok(httparse::Status::Partial) => Err("trailer section too large".into()),
                Err(e) => Err(format!("invalid trailer section: {e}")),
            }
        }
    }
}

/// What one step of the chunked decoder produced.
enum Step {
    /// A new state; keep decoding.
    Next(Framing),
    /// Chunk data and the state after it.
    Data(Bytes, Framing),
    /// The body ended, with its trailer fields if any.
    Trailers(Option<HeaderMap>),
    /// More bytes are needed.
    More,
}

enum Fail {
    Io(io::Error),
    Body(BoxError),
    Head(ForwardError),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum BodyFraming {
    None,
    Length(u64),
    Chunked,
}

/// Bytes queued for the socket (the head, then body pieces), written with one `writev` where
/// several are queued.
#[derive(Default)]
struct Out {
    queue: std::collections::VecDeque<Bytes>,
}

impl Out {
    fn push(&mut self, b: Bytes) {
        if !b.is_empty() {
            self.queue.push_back(b);
        }
    }

    fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    fn slices<'a>(&'a self, into: &mut [IoSlice<'a>; 3]) -> usize {
        let mut n = 0;
        for (slot, b) in into.iter_mut().zip(self.queue.iter()) {
            *slot = IoSlice::new(b);
            n += 1;
        }
        n
    }

    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let Some(front) = self.queue.front_mut() else {
                return;
            };
            if n >= front.len() {
                n -= front.len();
                self.queue.pop_front();
            } else {
                front.advance(n);
                n = 0;
            }
        }
    }
}

/// The request line and header section, with tessera's framing header. The bytes of the
/// `Authorization` value (the injected upstream credential) are zeroized when the returned
/// buffer is dropped, once written (see [`SecretHead`]).
fn encode_head(parts: &http::request::Parts, framing: BodyFraming) -> Bytes {
    let (out, secret) = encode_head_bytes(parts, framing);
    if secret.is_empty() {
        Bytes::from(out)
    } else {
        Bytes::from_owner(SecretHead { out, secret })
    }
}

/// [`encode_head`]'s bytes, in a buffer allocated once at its final size, and the byte range
/// in them of the `Authorization` value (empty when there is none).
fn encode_head_bytes(
    parts: &http::request::Parts,
    framing: BodyFraming,
) -> (Vec<u8>, std::ops::Range<usize>) {
    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let sent =
        |name: &HeaderName| name != header::CONTENT_LENGTH && name != header::TRANSFER_ENCODING;
    // Sized up front so the buffer never moves: a reallocation would free a copy of the
    // credential without wiping it. 40 bytes cover the longest framing field.
    let fields: usize = parts
        .headers
        .iter()
        .filter(|(name, _)| sent(name))
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    let size = parts.method.as_str().len() + 1 + target.len() + 11 + fields + 40 + 2;
    let mut out = Vec::with_capacity(size);
    let capacity = out.capacity();
    let mut secret = 0..0;
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        if !sent(name) {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        if name == header::AUTHORIZATION {
            // The injected upstream credential (the proxy sets exactly one).
            secret = out.len()..out.len() + value.len();
        }
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        BodyFraming::None => {}
        BodyFraming::Length(n) => {
            // Writing into a Vec cannot fail.
            let _ = write!(out, "content-length: {n}\r\n");
        }
        BodyFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    out.extend_from_slice(b"\r\n");
    debug_assert_eq!(out.capacity(), capacity, "the head buffer was reallocated");
    (out, secret)
}

/// An encoded request head holding the upstream credential (the `Authorization` value) at
/// `secret` (byte offsets into `out`): those bytes are zeroized on drop. Only that span, not the whole buffer: zeroizing
/// all of it cost 3% more instructions per request (BENCHMARKS.md, session 12).
struct SecretHead {
    out: Vec<u8>,
    secret: std::ops::Range<usize>,
}

impl AsRef<[u8]> for SecretHead {
    fn as_ref(&self) -> &[u8] {
        &self.out
    }
}

impl SecretHead {
    fn wipe(&mut self) {
        if let Some(bytes) = self.out.get_mut(self.secret.clone()) {
            zeroize::Zeroize::zeroize(bytes);
        }
    }
}

impl Drop for SecretHead {
    fn drop(&mut self) {
        self.wipe();
    }
}

/// Whether the buffer holds a complete response head (blank line seen).
fn head_complete(buf: &[u8]) -> bool {
    buf.windows(4).any(|w| w == b"\r\n\r\n")
}

fn find_crlf(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\r\n")
}

/// `chunk-size [ chunk-ext ]` (RFC 9112 section 7.1): hex digits, then nothing, or whitespace
/// or `;` starting extensions (ignored).
fn chunk_size(line: &[u8]) -> Result<u64, String> {
    if line.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f) {
        return Err("invalid chunk size".into());
    }
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || digits > 16 {
        return Err("invalid chunk size".into());
    }
    match line.get(digits) {
        None | Some(b';' | b' ' | b'\t') => {}
        Some(_) => return Err("invalid chunk size".into()),
    }
    let text = std::str::from_utf8(&line[..digits]).map_err(|_| "invalid chunk size")?;
    u64::from_str_radix(text, 16).map_err(|_| "invalid chunk size".into())
}

/// A 101 answer to a request whose `Upgrade` field is `upgrade`: accepted only when both name
/// `websocket` (RFC 9110 section 15.2.2: a server switches only to a protocol the client listed;
/// tessera asks for nothing else). The connection then belongs to the new protocol and never
/// goes back to the pool.
///
/// Errors (502): a 101 to a request that asked for no upgrade, or to another protocol.
fn switched(mut head: Head, request: &HeaderMap) -> Result<Head, ForwardError> {
    let websocket = |v: &[u8]| crate::screen::has_token(v, b"websocket");
    if !request
        .get_all(header::UPGRADE)
        .iter()
        .any(|v| websocket(v.as_bytes()))
    {
        return Err(broken("upstream switched protocols unasked"));
    }
    if !head.fields.get_all(b"upgrade").any(websocket) {
        return Err(broken(
            "upstream switched to a protocol other than websocket",
        ));
    }
    head.keep_alive = false;
    head.framing = Framing::Done;
    Ok(head)
}

/// Persistence after this response (RFC 9112 section 9.3): HTTP/1.1 unless `Connection: close`;
/// HTTP/1.0 only with `Connection: keep-alive`.
fn keep_alive(version: Version, fields: &RawHead) -> bool {
    let has = |token: &str| {
        fields
            .get_all(b"connection")
            .any(|v| crate::screen::has_token(v, token.as_bytes()))
    };
    if version == Version::HTTP_10 {
        has("keep-alive")
    } else {
        !has("close")
    }
}

/// The response body's framing (RFC 9112 section 6.3).
///
/// Errors: `Content-Length` values that are not one non-negative integer, also on a HEAD or 304
/// response (no body, but the field is passed downstream); 1xx and 204 ignore the field.
fn framing(
    head_request: bool,
    status: StatusCode,
    fields: &RawHead,
) -> Result<Framing, ForwardError> {
    if status.is_informational() || status == StatusCode::NO_CONTENT {
        return Ok(Framing::Done);
    }
    if head_request || status == StatusCode::NOT_MODIFIED {
        // No body, but a Content-Length is passed downstream (it describes the representation,
        // RFC 9110 section 8.6), so it must be one a client can trust. (With Transfer-Encoding
        // too, `parse_head` has already removed it.)
        declared_length(fields)?;
        return Ok(Framing::Done);
    }
    if fields.contains(b"transfer-encoding") {
        let codings = fields
            .get_all(b"transfer-encoding")
            .flat_map(|v| v.split(|&b| b == b','))
            .map(<[u8]>::trim_ascii);
        // Any coding but chunked (`gzip, chunked`) would reach the client still coded, with
        // nothing saying so: the downstream side frames bodies itself, and names no coding.
        let chunked = |c: &[u8]| {
            let name = c.split(|&b| b == b';').next().unwrap_or_default();
            name.trim_ascii().eq_ignore_ascii_case(b"chunked")
        };
        let mut last = None;
        for coding in codings {
            if !coding.is_empty() {
                if !transfer_coding(coding) {
                    return Err(broken("invalid transfer-encoding"));
                }
                if !chunked(coding) {
                    return Err(broken(
                        "transfer coding other than chunked (not decoded, so not relayed)",
                    ));
                }
            }
            last = Some(coding);
        }
        // RFC 9110 section 5.6.1.2: empty elements are ignored, but an empty *last* one is
        // refused (hyper reads `chunked,` as not chunked; this does not guess between them).
        if last.is_none_or(<[u8]>::is_empty) {
            return Err(broken("invalid transfer-encoding"));
        }
        return Ok(Framing::Chunked(Chunk::Size));
    }
    Ok(match declared_length(fields)? {
        Some(0) => Framing::Done,
        Some(n) => Framing::Length(n),
        None => Framing::Close,
    })
}

/// Whether a non-empty `element` of a `Transfer-Encoding` list is a transfer-coding (RFC 9112
/// section 7: a token, then parameters after `;`, which are not looked into) with no byte
/// outside visible ASCII, space and tab. Stricter than the RFC on purpose: a quoted parameter
/// holding obs-text fails too, as does any framing field two parsers could read two ways.
fn transfer_coding(element: &[u8]) -> bool {
    let tchar = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b);
    let name = element
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    !name.is_empty()
        && name.iter().all(tchar)
        && element
            .iter()
            .all(|&b| b == b'\t' || (b' '..=b'~').contains(&b))
}

/// The response's Content-Length (RFC 9110 section 8.6), bytes; `None` without the field. Errors
/// (502) on a value that is not 1*DIGIT within `u64`, and on differing values (RFC 9112 section
/// 6.3 item 5); repeated equal values, in one field line or several, count once.
fn declared_length(fields: &RawHead) -> Result<Option<u64>, ForwardError> {
    let mut length = None;
    for v in fields.get_all(b"content-length") {
        for item in v.split(|&b| b == b',') {
            let n = crate::screen::content_length(item.trim_ascii())
                .ok_or_else(|| broken("invalid content-length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(broken("conflicting content-length values"));
            }
            length = Some(n);
        }
    }
    Ok(length)
}

/// A request-body error as the forward phase reports it.
fn body_error(e: BoxError) -> ForwardError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&*e);
    while let Some(s) = src {
        if s.is::<http_body_util::LengthLimitError>() {
            return ForwardError::BodyTooLarge;
        }
        if s.is::<crate::screen::body::BodyStalled>() {
            return ForwardError::BodyTimeout;
        }
        src = s.source();
    }
    ForwardError::ClientBody(e.to_string())
}

/// Size hint of a response body in the given framing.
pub fn size_hint(framing: Framing) -> SizeHint {
    match framing {
        Framing::Done => SizeHint::with_exact(0),
        Framing::Length(n) => SizeHint::with_exact(n),
        _ => SizeHint::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::forward::raw::from_pairs;

    /// `Keep-Alive: timeout=N` read from a response, and the idle limit it sets.
    #[test]
    fn announced_keep_alive_timeout() {
        let announced = |v: &str| announced_idle(&from_pairs(&[("keep-alive", v)]));
        assert_eq!(
            announced("timeout=5, max=100"),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            announced("max=100,Timeout = \"7\""),
            Some(Duration::from_secs(7))
        );
        assert_eq!(announced("max=100"), None);
        assert_eq!(announced("timeout=abc"), None);
        assert_eq!(announced("timeout=-1"), None);
        assert_eq!(announced("timeout=9999999999"), None);
        assert_eq!(announced_idle(&from_pairs(&[("x", "timeout=5")])), None);
        let limit = |announced: Option<u64>| {
            idle_limit(Duration::from_secs(30), announced.map(Duration::from_secs))
        };
        assert_eq!(limit(None), Duration::from_secs(30));
        assert_eq!(limit(Some(5)), Duration::from_secs(4));
        assert_eq!(limit(Some(2)), Duration::from_secs(1));
        assert_eq!(limit(Some(0)), Duration::ZERO);
        assert_eq!(limit(Some(75)), Duration::from_secs(30));
    }

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
            let h1 = rt.block_on(async { H1::new(TcpStream::connect(addr).await.unwrap()) });
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
            rt.block_on(h1.io.readable()).unwrap();
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

    #[test]
    fn response_framing_follows_rfc_9112_section_6_3() {
        let ok = StatusCode::OK;
        let f = |head, status, h: &[(&str, &str)]| framing(head, status, &from_pairs(h));
        assert_eq!(
            f(true, ok, &[("content-length", "5")]).unwrap(),
            Framing::Done
        );
        assert_eq!(
            f(false, StatusCode::NO_CONTENT, &[]).unwrap(),
            Framing::Done
        );
        assert_eq!(
            f(false, StatusCode::NOT_MODIFIED, &[("content-length", "5")]).unwrap(),
            Framing::Done
        );
        // HEAD and 304 pass Content-Length on, so a broken one is refused there too; 204 and
        // 1xx drop it (the downstream writer does not send it).
        for bad in [
            &[("content-length", "abc")][..],
            &[("content-length", "5, 6")],
        ] {
            assert!(f(true, ok, bad).is_err());
            assert!(f(false, StatusCode::NOT_MODIFIED, bad).is_err());
            assert_eq!(
                f(false, StatusCode::NO_CONTENT, bad).unwrap(),
                Framing::Done
            );
        }
        assert_eq!(
            f(
                true,
                ok,
                &[("content-length", "5"), ("content-length", "5")]
            )
            .unwrap(),
            Framing::Done
        );
        assert_eq!(
            f(false, ok, &[("content-length", "5")]).unwrap(),
            Framing::Length(5)
        );
        assert_eq!(
            f(false, ok, &[("content-length", "5, 5")]).unwrap(),
            Framing::Length(5)
        );
        assert_eq!(
            f(false, ok, &[("content-length", "0")]).unwrap(),
            Framing::Done
        );
        assert!(f(
            false,
            ok,
            &[("content-length", "5"), ("content-length", "6")]
        )
        .is_err());
        assert!(f(false, ok, &[("content-length", "-1")]).is_err());
        assert!(f(false, ok, &[("content-length", "+5")]).is_err());
        assert!(f(false, ok, &[("content-length", "99999999999999999999")]).is_err());
        // Transfer-Encoding wins over Content-Length; chunked must be the last coding.
        assert_eq!(
            f(
                false,
                ok,
                &[("transfer-encoding", "chunked"), ("content-length", "5")]
            )
            .unwrap(),
            Framing::Chunked(Chunk::Size)
        );
        // Codings other than chunked are not decoded, so such a body is refused (502) rather
        // than relayed still coded with nothing naming the coding.
        for coded in ["gzip, chunked", "chunked, gzip", "gzip", ", gzip,,chunked"] {
            assert!(
                f(false, ok, &[("transfer-encoding", coded)]).is_err(),
                "{coded}"
            );
        }
        assert!(f(
            false,
            ok,
            &[
                ("transfer-encoding", "gzip ; q=1"),
                ("transfer-encoding", "Chunked")
            ]
        )
        .is_err());
        assert_eq!(f(false, ok, &[]).unwrap(), Framing::Close);
        // Empty elements are ignored (RFC 9110 section 5.6.1.2); fields across lines count.
        assert_eq!(
            f(false, ok, &[("transfer-encoding", ", ,chunked")]).unwrap(),
            Framing::Chunked(Chunk::Size)
        );
        assert_eq!(
            f(
                false,
                ok,
                &[("transfer-encoding", ""), ("transfer-encoding", "Chunked")]
            )
            .unwrap(),
            Framing::Chunked(Chunk::Size)
        );
        // A list two parsers could read two ways fails (found by fuzz/ `upstream`: hyper reads
        // a non-ASCII coding's response to EOF, tessera read it chunked).
        for bad in [
            "\u{9c}p\u{c8}, chunked",
            "chunked,",
            " , ",
            "chun ked",
            "a\u{1}",
        ] {
            assert!(
                f(false, ok, &[("transfer-encoding", bad)]).is_err(),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn keep_alive_by_version_and_connection_tokens() {
        assert!(keep_alive(Version::HTTP_11, &from_pairs(&[])));
        assert!(!keep_alive(
            Version::HTTP_11,
            &from_pairs(&[("connection", "foo, Close")])
        ));
        assert!(!keep_alive(Version::HTTP_10, &from_pairs(&[])));
        assert!(keep_alive(
            Version::HTTP_10,
            &from_pairs(&[("connection", "Keep-Alive")])
        ));
    }

    #[test]
    fn chunk_size_lines() {
        assert_eq!(chunk_size(b"1a").unwrap(), 26);
        assert_eq!(chunk_size(b"0").unwrap(), 0);
        assert_eq!(chunk_size(b"A;name=value").unwrap(), 10);
        assert_eq!(chunk_size(b"a \t; x").unwrap(), 10);
        for bad in [
            &b""[..],
            b"g",
            b";",
            b"-1",
            b"1x",
            b"11111111111111111",
            b"a;x\ry",
            b"a;\n",
        ] {
            assert!(chunk_size(bad).is_err(), "{bad:?}");
        }
        assert_eq!(chunk_size(b"ffffffffffffffff").unwrap(), u64::MAX);
    }

    #[test]
    fn head_keeps_everything_but_the_framing_headers_and_sets_its_own() {
        let req = Request::builder()
            .method("POST")
            .uri("/a/b?c=d")
            .header("host", "up")
            .header("content-length", "999")
            .header("transfer-encoding", "chunked")
            .header("x-a", "1")
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        let text = |f| String::from_utf8(encode_head(&parts, f).to_vec()).unwrap();
        assert_eq!(
            text(BodyFraming::Length(3)),
            "POST /a/b?c=d HTTP/1.1\r\nhost: up\r\nx-a: 1\r\ncontent-length: 3\r\n\r\n"
        );
        assert_eq!(
            text(BodyFraming::Chunked),
            "POST /a/b?c=d HTTP/1.1\r\nhost: up\r\nx-a: 1\r\ntransfer-encoding: chunked\r\n\r\n"
        );
        assert_eq!(
            text(BodyFraming::None),
            "POST /a/b?c=d HTTP/1.1\r\nhost: up\r\nx-a: 1\r\n\r\n"
        );
        assert_eq!(encode_head_bytes(&parts, BodyFraming::None).1, 0..0);
    }

    #[test]
    fn the_credential_in_an_encoded_head_is_found_and_wiped() {
        let credential = crate::seal::Credentials::new("alice".into(), "pw".into())
            .unwrap()
            .basic_header();
        let req = Request::get("/x")
            .header("host", "up")
            .header("authorization", credential)
            .header("x-a", "1")
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        let (out, secret) = encode_head_bytes(&parts, BodyFraming::None);
        assert_eq!(&out[secret.clone()], b"Basic YWxpY2U6cHc=");
        assert_eq!(
            encode_head(&parts, BodyFraming::None),
            "GET /x HTTP/1.1\r\nhost: up\r\nauthorization: Basic YWxpY2U6cHc=\r\nx-a: 1\r\n\r\n"
        );
        // A large field after the credential must not move the buffer (a move would free a copy
        // of the credential unwiped): sized once, it ends with at most the framing's slack.
        let big = "c".repeat(20_000);
        let req = Request::post("/x")
            .header("authorization", parts.headers["authorization"].clone())
            .header("cookie", big.as_str())
            .body(())
            .unwrap();
        let (big_parts, ()) = req.into_parts();
        for framing in [
            BodyFraming::None,
            BodyFraming::Length(u64::MAX),
            BodyFraming::Chunked,
        ] {
            let (out, at) = encode_head_bytes(&big_parts, framing);
            assert_eq!(&out[at], b"Basic YWxpY2U6cHc=");
            assert!(
                out.capacity() - out.len() <= 40,
                "{} of {}",
                out.len(),
                out.capacity()
            );
        }
        let mut head = SecretHead { out, secret };
        head.wipe();
        assert_eq!(
            head.as_ref(),
            b"GET /x HTTP/1.1\r\nhost: up\r\nauthorization: \0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\r\nx-a: 1\r\n\r\n"
        );
    }
}
