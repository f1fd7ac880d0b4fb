//! The downstream HTTP/1.1 fast path: a connection's plain HTTP/1.1 requests (no body, or a
//! `Content-Length` body of at most [`MAX_FAST_BODY`] bytes) are read, handed to the proxy and
//! answered by this loop in the connection's own task, without hyper's dispatcher.
//!
//! Everything else goes to hyper for the rest of the connection, together with the bytes already
//! read (hyper parses the request from its first byte): h2c prior knowledge, HTTP/1.0,
//! `Transfer-Encoding`, `Expect`, `Upgrade`, `CONNECT`, a second `Content-Length`, a body larger
//! than the fast path buffers or than `server.max_body_bytes`, a head over the size limit, and any
//! head `httparse` (hyper's own parser) refuses. hyper's answers to those stay what they were.
//!
//! Why: hyper's server side (read, dispatch, head encoding, its flush) was about a third of a
//! warm request's user CPU in the profile (BENCHMARKS.md, "Downstream HTTP/1.1 fast path").
//!
//! Framing (RFC 9112 section 6.3): a request is taken here only when one `Content-Length` of
//! plain digits, or none, frames it; its whole body is read before the proxy sees the request,
//! so no body byte is ever left in the buffer to be mistaken for the next request. Responses
//! are framed by the body's exact length when known, else chunked; bodyless for `HEAD`, 204 and
//! 304. Must never: guess at a request's framing (any doubt goes to hyper), or keep a
//! connection whose response was cut short.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use crate::forward::{ProxyBody, RawHead};
use crate::proxy::{Peer, Proxy};
use crate::screen::{content_length, has_token};

/// Largest request body, bytes, the fast path reads into memory before forwarding; a larger
/// `Content-Length` goes to hyper, which streams it.
pub const MAX_FAST_BODY: u64 = 64 * 1024;
/// Most request header fields the fast path parses (hyper's default limit); more go to hyper.
const MAX_HEADERS: usize = 100;
/// Bytes read per `recv`.
const READ_CHUNK: usize = 8 * 1024;

/// What every connection of one serving thread shares.
pub struct Serving {
    /// The request path.
    pub proxy: Arc<Proxy>,
    /// The server for connections handed to hyper before any request was served (h1 + h2c,
    /// the same limits).
    pub hyper: auto::Builder<TokioExecutor>,
    /// The same, HTTP/1 only: for a connection that already carried HTTP/1.1 requests (an h2
    /// preface there is a bad request, not a protocol switch).
    pub hyper_h1: hyper::server::conn::http1::Builder,
    /// Time a client has for a request head (and a fast-path body), counted from the request's
    /// first byte; an idle keep-alive connection closes after it too.
    pub header_read_timeout: Duration,
    /// Longest a response write may wait for the client to take a byte (`server.send_timeout_ms`);
    /// past it the connection is closed. Connections handed to hyper: see [`Checks`].
    pub send_timeout: Duration,
    /// Largest head, bytes, the fast path waits for; a longer one goes to hyper (which answers
    /// 431). The same size as hyper's read buffer limit.
    pub max_head: usize,
    /// Largest body, bytes, the fast path buffers: [`MAX_FAST_BODY`] or `server.max_body_bytes`
    /// when that is smaller and set.
    pub max_body: u64,
    /// Cancelled when the server shuts down: idle connections close, busy ones finish their
    /// request and answer it with `Connection: close`.
    pub shutdown: CancellationToken,
}

/// Serves one accepted connection until it closes, the client asks to close, or shutdown.
pub async fn serve(serving: Arc<Serving>, io: TcpStream, peer: Peer) {
    // Never unwatched: a client connection stays on this thread (also after a hand-off to
    // hyper), and a socket leaves the set when it is closed.
    crate::busy_poll::watch(&io);
    let mut conn = Conn {
        io,
        incoming: Incoming::default(),
        out: Vec::new(),
        send_timeout: serving.send_timeout,
        stalled: false,
    };
    let timer = tokio::time::sleep(serving.header_read_timeout);
    let cancelled = serving.shutdown.cancelled();
    tokio::pin!(timer, cancelled);
    let mut wait = Wait {
        timer: timer.as_mut(),
        cancelled: cancelled.as_mut(),
        timeout: serving.header_read_timeout,
        deadline: None,
        stopping: false,
    };
    let mut served = false;
    // The client asked to close after a request it sent whole (`Connection: close`).
    let mut asked_close = false;
    loop {
        let (req, close) = match conn.read_request(&serving, &mut wait).await {
            Next::Request(req, close) => (req, close),
            Next::HandOff => return hand_off(&serving, conn, peer, served).await,
            Next::Close => break,
            Next::Timeout => {
                tracing::debug!(peer = %peer.addr.ip(), "request head not received in time");
                if let Some(counts) = serving.proxy.request_counts() {
                    counts.count_status(StatusCode::REQUEST_TIMEOUT.as_u16());
                }
                let _ = conn.send(&[REQUEST_TIMEOUT]).await;
                break;
            }
        };
        let head = req.method() == Method::HEAD;
        // Pipelined requests already read: the client is waiting for their answers too, even
        // if it has half-closed after sending them (hyper's rule too).
        let mut watch = ClientWatch {
            done: !conn.incoming.buf.is_empty(),
        };
        let resp = {
            let respond = serving.proxy.respond(req, &peer);
            tokio::pin!(respond);
            poll_fn(|cx| match respond.as_mut().poll(cx) {
                Poll::Ready(resp) => Poll::Ready(Some(resp)),
                Poll::Pending => watch.poll_gone(&conn.io, cx).map(|()| None),
            })
            .await
        };
        let Some(resp) = resp else {
            // Dropping the answer in the making freed its upstream connection (closed, or kept
            // after its rest is read in the background), or took the request out of the pool's
            // queue (its access line says 499).
            tracing::debug!(peer = %peer.addr.ip(), "client closed the connection before its answer");
            return;
        };
        asked_close = close;
        let close = close || serving.shutdown.is_cancelled();
        if !conn.write_response(resp, head, close, &mut watch).await || close {
            break;
        }
        served = true;
    }
    if conn.stalled {
        // The client took nothing for `send_timeout`: a graceful close would leave the kernel
        // retrying the full send buffer for minutes. Reset instead (nginx's
        // `reset_timedout_connection`).
        reset_on_close(&conn.io);
        return;
    }
    // Nothing of the client's is unread, here or in the socket, and it will send nothing more
    // (RFC 9112 section 9.6: a client that sent `close` sends no further request): closing now
    // sends a FIN, and no RST can follow, so there is nothing to drain. nginx closes such
    // connections at once too. This saves a `shutdown`, a wait for the client's FIN and a timer.
    if asked_close && conn.incoming.buf.is_empty() && nothing_queued(&conn.io) {
        return;
    }
    let _ = conn.io.shutdown().await;
    let mut linger = Linger::new();
    poll_fn(|cx| linger.poll(&mut conn.io, cx)).await;
}

/// Watches a client connection, while its request is answered, for the client going away: its
/// FIN or a reset (nginx's `proxy_ignore_client_abort off`). The answer is then dropped, which
/// frees its upstream connection (after a bounded background read of a short rest, see
/// `forward/pool.rs`); without this, a client that left a silent response (an event stream, a
/// long poll) held an upstream connection until the upstream next wrote, and a few such
/// clients exhausted `upstream.max_connections`.
///
/// No syscall while the runtime's readiness says nothing arrived. When it says the socket is
/// readable (also still, after a request read without meeting `EAGAIN`), one `recv(MSG_PEEK)`
/// tells a close from bytes; in the second case it stands in for the `EAGAIN` read the next
/// request's read would have made, so the syscalls per request stay the same. Bytes (a
/// pipelined request; the client is still there) end the watch for this request, since the
/// peek could not tell a later close from them; so do pipelined requests already read. A
/// client that half-closes (`shutdown(SHUT_WR)`) right after its request counts as gone, as
/// with nginx and hyper.
#[derive(Default)]
struct ClientWatch {
    /// Bytes of a next request arrived: no longer watching.
    done: bool,
}

impl ClientWatch {
    /// Ready when the client is gone; never ready once bytes of a next request arrived.
    fn poll_gone(&mut self, io: &TcpStream, cx: &mut Context<'_>) -> Poll<()> {
        while !self.done {
            if std::task::ready!(io.poll_read_ready(cx)).is_err() {
                return Poll::Ready(());
            }
            // Through the runtime, so a `WouldBlock` clears the readiness it acted on.
            let peeked = io.try_io(tokio::io::Interest::READABLE, || peek(io));
            match peeked {
                Ok(0) => return Poll::Ready(()),
                Ok(_) => self.done = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return Poll::Ready(()),
            }
        }
        Poll::Pending
    }
}

/// Whether the socket's receive queue is empty (or the connection already ended), asked of the
/// kernel, not of the runtime's readiness cache (which can lag behind bytes that have just
/// arrived).
fn nothing_queued(io: &TcpStream) -> bool {
    !matches!(peek(io), Ok(n) if n > 0)
}

/// `SO_LINGER` 0: closing the socket then resets the connection at once, dropping what its send
/// buffer still holds (a zero linger never blocks the close). For a client that took nothing for
/// `server.send_timeout_ms`.
fn reset_on_close(io: &TcpStream) {
    let _ = rustix::net::sockopt::set_socket_linger(io, Some(Duration::ZERO));
}

/// One `recv(MSG_PEEK | MSG_DONTWAIT)` of at most 1 byte, left in the queue: `Ok(1)` bytes are
/// waiting, `Ok(0)` the client closed (FIN), `Err(WouldBlock)` nothing yet, another error a
/// reset or failed socket.
fn peek(io: &TcpStream) -> io::Result<usize> {
    use rustix::net::{recv, RecvFlags};
    let mut probe = [0u8; 1];
    recv(io, &mut probe, RecvFlags::PEEK | RecvFlags::DONTWAIT)
        .map(|(n, _)| n)
        .map_err(io::Error::from)
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
struct Linger {
    /// The total deadline.
    until: Instant,
    /// The idle timer, made when the first read finds nothing to read (a client that has closed
    /// already costs one read and no timer).
    idle: Option<Pin<Box<Sleep>>>,
}

impl Linger {
    /// Starts lingering now (once the write side is shut down).
    fn new() -> Self {
        Self {
            until: Instant::now() + LINGER_TOTAL,
            idle: None,
        }
    }

    /// Drains `io` (whose write side is shut down); ready at the client's EOF, a read error, or
    /// a deadline. Reads at most 16 times per poll, then yields.
    fn poll(&mut self, io: &mut TcpStream, cx: &mut Context<'_>) -> Poll<()> {
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

thread_local! {
    /// Read buffers given back by this thread's idle fast-path connections.
    static SPARE_READ_BUFS: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

/// Most spare read buffers kept per thread.
const MAX_SPARE_READ_BUFS: usize = 64;

/// An empty read buffer: one of this thread's spares, else a new one of [`READ_CHUNK`] bytes.
fn spare_read_buf() -> BytesMut {
    SPARE_READ_BUFS
        .with(|s| s.borrow_mut().pop())
        .unwrap_or_else(|| BytesMut::with_capacity(READ_CHUNK))
}

/// Gives an empty read buffer back for [`spare_read_buf`]; kept only while this thread holds
/// fewer than [`MAX_SPARE_READ_BUFS`] and when it has at least half a [`READ_CHUNK`] of room and
/// at most four (one grown by a large head is dropped).
fn recycle_read_buf(buf: BytesMut) {
    debug_assert!(buf.is_empty());
    if !(READ_CHUNK / 2..=4 * READ_CHUNK).contains(&buf.capacity()) {
        return;
    }
    SPARE_READ_BUFS.with(|s| {
        let mut spare = s.borrow_mut();
        if spare.len() < MAX_SPARE_READ_BUFS {
            spare.push(buf);
        }
    });
}

/// Sent when a request started but its head (or fast-path body) did not arrive in time.
const REQUEST_TIMEOUT: &[u8] =
    b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

/// Gives the connection, and the bytes read but not yet served, to hyper: h1 or h2c, or h1 only
/// once the fast path has `served` a request on it.
async fn hand_off(serving: &Serving, conn: Conn, peer: Peer, served: bool) {
    let io = Prefixed {
        pre: conn.incoming.buf.freeze(),
        io: conn.io,
        linger: None,
        lingers: true,
        send_timeout: conn.send_timeout,
        stall: Stall::default(),
        stalled: false,
    };
    let peer = Arc::new(peer);
    let proxy = serving.proxy.clone();
    let streams = Arc::new(Streams::default());
    let watched = streams.clone();
    let service = service_fn(move |req| {
        let (proxy, peer) = (proxy.clone(), peer.clone());
        let open = Streams::open(&streams);
        let streams = streams.clone();
        async move {
            let resp = proxy.handle(req, &peer).await;
            Ok::<_, std::convert::Infallible>(resp.map(|body| Tracked::new(&streams, body, open)))
        }
    });
    let idle = Checks {
        streams: &watched,
        after: serving.header_read_timeout,
        send: serving.send_timeout,
    };
    // With upgrades: a WebSocket handshake the upstream accepted hands the connection over to
    // its tunnel (see `Proxy::switch`).
    let done: Option<Result<(), Box<dyn std::error::Error + Send + Sync>>> = if served {
        let conn = serving
            .hyper_h1
            .serve_connection(TokioIo::new(io), service)
            .with_upgrades();
        until_done(conn, |c| c.graceful_shutdown(), &serving.shutdown, idle)
            .await
            .map(|done| done.map_err(Into::into))
    } else {
        let conn = serving
            .hyper
            .serve_connection_with_upgrades(TokioIo::new(io), service);
        until_done(conn, |c| c.graceful_shutdown(), &serving.shutdown, idle).await
    };
    let Some(done) = done else {
        tracing::debug!("downstream connection closed: idle, and it did not close when asked");
        return;
    };
    if let Err(e) = done {
        tracing::debug!(cause = %e, "downstream connection ended with an error");
        if let (Some(status), Some(counts)) = (hyper_answered(&*e), serving.proxy.request_counts())
        {
            counts.count_status(status);
        }
    }
}

/// Drives a hyper connection to its end. Once `shutdown` is cancelled, asks it to finish
/// gracefully (`graceful`: the connection type's own `graceful_shutdown`) and waits for that.
/// Once it has been idle (see [`Checks`]) for `idle.after`, asks the same (HTTP/2: GOAWAY); idle
/// for `idle.after` again, it is dropped, which closes the socket: `None`. A response body that
/// hyper has not asked for its next frame for `idle.send` since it took the last one (an HTTP/2
/// client that grants no window) is cut ([`Streams::cut_stalled`]); a client whose socket takes
/// nothing is [`Prefixed`]'s to end.
///
/// Why: hyper's HTTP/2 server has no idle or connection-preface timeout, so an h2c client that
/// sent half a preface, or finished its requests and kept the connection, held it (a socket
/// and about 17 KiB) for ever; and a client that ignores GOAWAY's PING keeps a gracefully
/// closing one. HTTP/1 connections have hyper's own `header_read_timeout` as well.
async fn until_done<C: Future>(
    conn: C,
    graceful: impl Fn(Pin<&mut C>),
    shutdown: &CancellationToken,
    idle: Checks<'_>,
) -> Option<C::Output> {
    tokio::pin!(conn);
    // Checked four times per `after`: a connection is asked to close between 1 and 1.5 times
    // `after` after its last request ended (1.5: one that started and ended between two checks);
    // likewise for `send`.
    let period = (idle.after.min(idle.send) / 4).max(Duration::from_millis(10));
    let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen = 0;
    let mut idle_since: Option<Instant> = None;
    let mut asked = false;
    let mut stopping = false;
    loop {
        tokio::select! {
            done = conn.as_mut() => return Some(done),
            () = shutdown.cancelled(), if !stopping => {
                stopping = true;
                graceful(conn.as_mut());
            }
            now = ticks.tick() => {
                idle.streams.cut_stalled(now, idle.send);
                let started = idle.streams.started.load(Ordering::Relaxed);
                if started != seen || idle.streams.open.load(Ordering::Relaxed) > 0 {
                    seen = started;
                    idle_since = None;
                    continue;
                }
                let since = *idle_since.get_or_insert(now);
                if now.duration_since(since) < idle.after {
                    continue;
                }
                if asked {
                    return None;
                }
                asked = true;
                idle_since = Some(now);
                graceful(conn.as_mut());
            }
        }
    }
}

/// The periodic checks of a connection served by hyper. It counts as idle with no request in
/// flight and none started since the last check, for `after` (`server.header_read_timeout_ms`);
/// a response stalls when the client takes none of it for `send` (`server.send_timeout_ms`).
struct Checks<'a> {
    streams: &'a Streams,
    after: Duration,
    send: Duration,
}

/// The requests (HTTP/1 requests or HTTP/2 streams) of one connection served by hyper: how many
/// reached the proxy, how many of them are still open (from their head until their response
/// body has been sent, dropped or cut), and the response bodies being sent. Read by the checks.
#[derive(Default)]
struct Streams {
    started: AtomicU64,
    open: AtomicUsize,
    /// The response bodies given to hyper; an entry whose [`Tracked`] is gone is pruned at the
    /// next check, or when the list would grow.
    sending: Mutex<Vec<Arc<Mutex<Sending>>>>,
}

impl Streams {
    /// Counts a request in; it stays open until the returned guard is dropped.
    fn open(this: &Arc<Self>) -> Open {
        this.started.fetch_add(1, Ordering::Relaxed);
        this.open.fetch_add(1, Ordering::Relaxed);
        Open(this.clone())
    }

    /// Cuts every response body that hyper took a frame of at least `send` before `now` and has
    /// not asked for the next one since: hyper's own buffers for it are full because the client
    /// does not take them (HTTP/2: it grants no flow-control window; a full socket buffer is
    /// caught sooner by [`Prefixed`]'s send timeout). The body is dropped, which closes its
    /// upstream connection if it was mid-body, and ends its request's open count; hyper's next
    /// poll of it, if any, gets an error (HTTP/2: `RST_STREAM`; HTTP/1: the connection ends).
    /// Checked once per tick, so a cut comes up to a quarter of `send` late.
    fn cut_stalled(&self, now: Instant, send: Duration) {
        let mut cut = Vec::new();
        let mut sending = lock(&self.sending);
        sending.retain(|s| {
            if Arc::strong_count(s) == 1 {
                return false; // hyper dropped its body
            }
            let mut s = lock(s);
            if s.handed
                .is_some_and(|t| now.saturating_duration_since(t) >= send)
            {
                s.handed = None;
                cut.push((s.body.take(), s.open.take()));
            }
            true
        });
        drop(sending);
        if !cut.is_empty() {
            tracing::debug!(
                responses = cut.len(),
                "client took no response bytes for server.send_timeout_ms; response cut"
            );
        }
    }
}

/// Locks `m`; a panic while it was held leaves plain data behind, still usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One open request of [`Streams`]; dropping it closes the request.
struct Open(Arc<Streams>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body being sent by hyper, shared with the connection's checks.
struct Sending {
    /// `None` once cut for a stall.
    body: Option<ProxyBody>,
    /// Keeps the request open (see [`Streams`]) until hyper drops the body, or it is cut.
    open: Option<Open>,
    /// When hyper took a frame, while it has not asked for the next one since.
    handed: Option<Instant>,
}

/// A response body that keeps its request open (see [`Streams`]) until hyper has taken its last
/// frame or dropped it (the last bytes may still wait to be written), and that the connection's
/// checks can cut when the client stops taking it (see [`Streams::cut_stalled`]); everything
/// else is the body's own.
struct Tracked(Arc<Mutex<Sending>>);

impl Tracked {
    fn new(streams: &Streams, body: ProxyBody, open: Open) -> Self {
        let sending = Arc::new(Mutex::new(Sending {
            body: Some(body),
            open: Some(open),
            handed: None,
        }));
        let mut all = lock(&streams.sending);
        if all.len() == all.capacity() {
            // Bodies hyper has dropped since the last check, pruned before the list grows: it
            // stays within about twice the open responses on a busy connection.
            all.retain(|s| Arc::strong_count(s) > 1);
        }
        all.push(sending.clone());
        drop(all);
        Self(sending)
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut s = lock(&self.0);
        let gone = (s.body.take(), s.open.take());
        drop(s);
        drop(gone);
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = crate::forward::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let mut s = lock(&self.0);
        s.handed = None;
        let Some(body) = s.body.as_mut() else {
            return Poll::Ready(Some(Err(
                "response cut: the client took no bytes for server.send_timeout_ms".into(),
            )));
        };
        let frame = Pin::new(body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &frame {
            s.handed = Some(Instant::now());
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        lock(&self.0)
            .body
            .as_ref()
            .is_some_and(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        lock(&self.0)
            .body
            .as_ref()
            .map_or_else(http_body::SizeHint::default, |b| b.size_hint())
    }
}

/// The status hyper sent by itself before ending a connection with `e`: a request head it could
/// not parse is answered 400, 414 or 431 (hyper's `role::Server::on_error`) and never reaches
/// the proxy. `None` for every other error (hyper sent nothing).
fn hyper_answered(e: &(dyn std::error::Error + 'static)) -> Option<u16> {
    let e = e.downcast_ref::<hyper::Error>()?;
    if !e.is_parse() || e.is_parse_version_h2() || e.is_parse_status() {
        return None;
    }
    // The public API tells "too large" apart from the rest, not the URI from the head, nor an
    // internal parse failure (no answer) from a bad request: hyper's fixed messages do.
    let text = e.to_string();
    if e.is_parse_too_large() {
        Some(if text.starts_with("URI too long") {
            414
        } else {
            431
        })
    } else if text.starts_with("internal error") {
        None
    } else {
        Some(400)
    }
}

/// One downstream connection on the fast path.
struct Conn {
    io: TcpStream,
    /// Bytes read and not yet served, and the request being read.
    incoming: Incoming,
    /// The response head being written (reused).
    out: Vec<u8>,
    /// `server.send_timeout_ms`: see [`send`].
    send_timeout: Duration,
    /// A response write timed out ([`send`]): the connection is reset, not closed gracefully.
    stalled: bool,
}

/// A connection's received bytes and what the fast path has made of them so far: the requests
/// are taken from here ([`Incoming::take`]) with no socket involved, so the fuzz targets
/// (`fuzz/`) drive exactly the code that serves.
#[derive(Default)]
pub(crate) struct Incoming {
    /// Bytes read and not yet served (the next request's head, pipelined requests).
    buf: BytesMut,
    /// Offsets of the parsed head's header names and values (reused).
    spans: Vec<[u32; 4]>,
    /// The head parsed while its body is still arriving.
    pending: Option<Parsed>,
}

/// What [`Incoming::take`] made of the bytes received so far.
// Made once per request and moved straight on: see `Next`.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Taken {
    /// A whole request (its body read), and whether the client asked to close after it.
    Request(Request<Full<Bytes>>, bool),
    /// Not for the fast path: hyper takes the connection with every byte not yet taken.
    HandOff,
    /// More bytes are needed.
    More,
}

/// The head-read timer and the shutdown signal, kept across a connection's requests.
struct Wait<'a, 'b> {
    /// Fires at or before the current deadline; pushed forward lazily, only when it fires
    /// early, so a busy connection does not touch the timer wheel per request.
    timer: Pin<&'a mut Sleep>,
    cancelled: Pin<&'a mut WaitForCancellationFuture<'b>>,
    timeout: Duration,
    /// When the request being read must be complete; set on the first wait for it.
    deadline: Option<Instant>,
    /// Shutdown was seen (the cancellation future is done and must not be polled again).
    stopping: bool,
}

// Made once per request and moved straight into the proxy: boxing the request would cost an
// allocation per request to save a move.
#[allow(clippy::large_enum_variant)]
enum Next {
    /// A request, and whether the client asked to close after it.
    Request(Request<Full<Bytes>>, bool),
    /// Not for the fast path: hyper takes the connection.
    HandOff,
    /// EOF, a read error, or shutdown while idle.
    Close,
    /// A started request did not complete within the head-read timeout.
    Timeout,
}

enum Fill {
    Read,
    Closed,
    Timeout,
}

/// A request head the fast path takes: where its parts are in the buffer.
struct Parsed {
    len: usize,
    method: Method,
    path: (usize, usize),
    body: u64,
    close: bool,
}

enum Parse {
    Partial,
    HandOff,
    Head(Parsed),
}

impl Conn {
    async fn read_request(&mut self, serving: &Serving, wait: &mut Wait<'_, '_>) -> Next {
        wait.deadline = None;
        let mut started = false;
        loop {
            match self.incoming.take(serving.max_head, serving.max_body) {
                Taken::Request(req, close) => return Next::Request(req, close),
                Taken::HandOff => return Next::HandOff,
                Taken::More => {}
            }
            // A lone CR may be the first half of an empty line (see `Incoming::take`).
            if !matches!(&self.incoming.buf[..], [] | [b'\r']) && !started {
                // The request's first bytes: its own timeout starts now (the idle wait before
                // it has one of its own, ended silently as hyper's is).
                started = true;
                wait.deadline = None;
            }
            match self.fill(wait).await {
                Fill::Read => {}
                Fill::Closed => return Next::Close,
                Fill::Timeout if started => return Next::Timeout,
                Fill::Timeout => return Next::Close,
            }
        }
    }

    /// Reads more bytes, waiting at most until the current request's deadline.
    async fn fill(&mut self, wait: &mut Wait<'_, '_>) -> Fill {
        poll_fn(|cx| {
            if self.incoming.buf.capacity() == 0 {
                self.incoming.buf = spare_read_buf();
            } else if self.incoming.buf.capacity() - self.incoming.buf.len() < READ_CHUNK / 2 {
                self.incoming.buf.reserve(READ_CHUNK);
            }
            match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.incoming.buf)
            {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(Fill::Closed),
                Poll::Ready(Ok(_)) => return Poll::Ready(Fill::Read),
                Poll::Pending => {}
            }
            if self.incoming.buf.is_empty() {
                // Nothing of a next request yet: the connection waits without a read buffer
                // (most of an idle keep-alive connection's memory) and takes one when woken.
                recycle_read_buf(std::mem::take(&mut self.incoming.buf));
            }
            if wait.poll_expired(cx) {
                return Poll::Ready(Fill::Timeout);
            }
            if !wait.stopping
                && self.incoming.buf.is_empty()
                && wait.cancelled.as_mut().poll(cx).is_ready()
            {
                wait.stopping = true;
                return Poll::Ready(Fill::Closed);
            }
            Poll::Pending
        })
        .await
    }

    /// Writes `parts` ([`send`]); `false` when that failed or timed out (then `stalled`).
    async fn send(&mut self, parts: &[&[u8]]) -> bool {
        match send(&mut self.io, parts, self.send_timeout).await {
            Ok(()) => true,
            Err(stalled) => {
                self.stalled |= stalled;
                false
            }
        }
    }

    /// Writes the response; `false` when the connection cannot carry another request (a write
    /// failed, or the body ended early, failed or ran long).
    async fn write_response(
        &mut self,
        resp: Response<ProxyBody>,
        head: bool,
        close: bool,
        watch: &mut ClientWatch,
    ) -> bool {
        let (mut parts, mut body) = resp.into_parts();
        let status = parts.status;
        let framing =
            if head || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
                Framing::Bodyless
            } else {
                match body.size_hint().exact() {
                    Some(n) => Framing::Length(n),
                    None => Framing::Chunked,
                }
            };
        let fields = body.take_fields();
        if head && fields.is_none() && !parts.headers.contains_key(header::CONTENT_LENGTH) {
            // A local answer to HEAD states the length its GET would have, as hyper did.
            if let Some(n) = body.size_hint().exact() {
                parts
                    .headers
                    .insert(header::CONTENT_LENGTH, HeaderValue::from(n));
            }
        }
        encode_head(
            &mut self.out,
            status,
            fields.as_ref(),
            &parts.headers,
            framing,
            close,
        );
        match framing {
            Framing::Bodyless | Framing::Length(0) => {
                drop(body);
                let out = std::mem::take(&mut self.out);
                let ok = self.send(&[&out]).await;
                self.out = out;
                ok
            }
            Framing::Length(n) => self.write_sized(body, n, watch).await,
            Framing::Chunked => self.write_chunked(&mut body, watch).await,
        }
    }

    /// A body of exactly `n` bytes, its first frame in the head's write.
    async fn write_sized(&mut self, mut body: ProxyBody, n: u64, watch: &mut ClientWatch) -> bool {
        let mut head = Some(std::mem::take(&mut self.out));
        let mut left = n;
        let complete = loop {
            let data = match next_data(&mut body, &self.io, watch).await {
                Ok(Some(d)) => d,
                Ok(None) => break left == 0,
                Err(()) => break false,
            };
            if data.len() as u64 > left {
                tracing::debug!("response body longer than its length; connection closed");
                break false;
            }
            left -= data.len() as u64;
            let sent = match head.take() {
                Some(h) => {
                    let ok = self.send(&[&h[..], &data[..]]).await;
                    self.out = h;
                    ok
                }
                None => self.send(&[&data[..]]).await,
            };
            if !sent {
                return false;
            }
        };
        if let Some(h) = head {
            // The body ended before its first byte: the head alone, then the connection closes.
            let _ = self.send(&[&h[..]]).await;
            self.out = h;
        }
        if !complete {
            tracing::debug!("response body ended before its length; connection closed");
        }
        complete
    }

    /// A body of unknown length, chunked (RFC 9112 section 7.1); the head goes with the first
    /// chunk.
    async fn write_chunked(&mut self, body: &mut ProxyBody, watch: &mut ClientWatch) -> bool {
        let mut head = Some(std::mem::take(&mut self.out));
        loop {
            let data = match next_data(body, &self.io, watch).await {
                Ok(Some(d)) if d.is_empty() => continue,
                Ok(Some(d)) => d,
                Ok(None) => break,
                Err(()) => {
                    if let Some(h) = head {
                        let _ = self.send(&[&h[..]]).await;
                        self.out = h;
                    }
                    return false;
                }
            };
            let mut size = [0u8; 18];
            let size = chunk_size_line(data.len(), &mut size);
            let h = head.take().unwrap_or_default();
            let parts = [&h[..], size, &data[..], b"\r\n"];
            let ok = self.send(&parts).await;
            if !h.is_empty() {
                self.out = h;
            }
            if !ok {
                return false;
            }
        }
        let h = head.take().unwrap_or_default();
        let ok = self.send(&[&h[..], b"0\r\n\r\n"]).await;
        if !h.is_empty() {
            self.out = h;
        }
        ok
    }
}

impl Incoming {
    /// Takes the next request from the bytes received so far, given the largest head (bytes)
    /// the fast path waits for and the largest body (bytes) it buffers. Called again after
    /// more bytes arrived, it goes on where it stopped (a parsed head waiting for its body is
    /// not parsed again).
    ///
    /// Empty lines (CRLF, or a bare LF as hyper and httparse allow) before a request line are
    /// dropped (RFC 9112 section 2.2: some clients send CRLF after a body); they neither start a
    /// request nor keep one open. A bare CR is not an empty line (RFC 9112 section 2.2 makes it
    /// invalid): it stays, and the request it starts goes to hyper, which refuses it.
    pub(crate) fn take(&mut self, max_head: usize, max_body: u64) -> Taken {
        let parsed = match self.pending.take() {
            Some(p) => p,
            None => {
                let blank = empty_lines(&self.buf);
                self.buf.advance(blank);
                if self.buf.is_empty() {
                    return Taken::More;
                }
                match self.parse(max_body) {
                    Parse::Head(p) => p,
                    Parse::HandOff => return Taken::HandOff,
                    Parse::Partial if self.buf.len() >= max_head => return Taken::HandOff,
                    Parse::Partial => return Taken::More,
                }
            }
        };
        if self.buf.len() < parsed.len + parsed.body as usize {
            self.pending = Some(parsed);
            return Taken::More;
        }
        match self.build(&parsed) {
            Some(req) => Taken::Request(req, parsed.close),
            None => Taken::HandOff,
        }
    }

    /// Appends received bytes (the fuzz targets' way in; serving reads into `buf` directly).
    pub(crate) fn extend(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The bytes not taken: what hyper gets after [`Taken::HandOff`].
    pub(crate) fn rest(&self) -> &[u8] {
        &self.buf
    }

    /// Parses the head at the front of the buffer, recording its header offsets in `spans`.
    fn parse(&mut self, max_body: u64) -> Parse {
        let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut []);
        let len = match httparse::ParserConfig::default().parse_request_with_uninit_headers(
            &mut req,
            &self.buf,
            &mut headers,
        ) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Parse::Partial,
            Err(_) => return Parse::HandOff,
        };
        if req.version != Some(1) {
            return Parse::HandOff;
        }
        let Ok(method) = Method::from_bytes(req.method.unwrap_or("").as_bytes()) else {
            return Parse::HandOff;
        };
        if method == Method::CONNECT {
            return Parse::HandOff;
        }
        let base = self.buf.as_ptr() as usize;
        let offset = |s: &[u8]| s.as_ptr() as usize - base;
        let path = req.path.unwrap_or("");
        let path = (
            offset(path.as_bytes()),
            offset(path.as_bytes()) + path.len(),
        );
        let (mut body, mut close) = (None, false);
        self.spans.clear();
        for h in req.headers.iter() {
            let name = h.name.as_bytes();
            if name.eq_ignore_ascii_case(b"content-length") {
                match (body, content_length(h.value)) {
                    (None, Some(n)) if n <= max_body => body = Some(n),
                    _ => return Parse::HandOff,
                }
            } else if name.eq_ignore_ascii_case(b"connection") {
                close |= has_token(h.value, b"close");
            } else if name.eq_ignore_ascii_case(b"transfer-encoding")
                || name.eq_ignore_ascii_case(b"expect")
                || name.eq_ignore_ascii_case(b"upgrade")
            {
                return Parse::HandOff;
            }
            // Offsets within the buffer, which is far below 4 GiB (a head arriving in pieces is
            // handed off past `max_head`; one read adds at most a few KiB to it).
            let (n, v) = (offset(name) as u32, offset(h.value) as u32);
            self.spans
                .push([n, n + name.len() as u32, v, v + h.value.len() as u32]);
        }
        Parse::Head(Parsed {
            len,
            method,
            path,
            body: body.unwrap_or(0),
            close,
        })
    }

    /// Splits the parsed head and its body off the buffer and builds the request; `None` (the
    /// bytes put back) when hyper should answer it: an invalid target or header.
    fn build(&mut self, p: &Parsed) -> Option<Request<Full<Bytes>>> {
        let head = self.buf.split_to(p.len).freeze();
        let body = self.buf.split_to(p.body as usize).freeze();
        match request(&head, p, &self.spans) {
            Some(req) => Some(req.map(|()| Full::new(body))),
            None => {
                let mut all = BytesMut::with_capacity(head.len() + body.len() + self.buf.len());
                all.extend_from_slice(&head);
                all.extend_from_slice(&body);
                all.extend_from_slice(&self.buf);
                self.buf = all;
                None
            }
        }
    }
}

/// Length, bytes, of the empty lines (CRLF or LF) at the front of `buf`.
fn empty_lines(buf: &[u8]) -> usize {
    let mut at = 0;
    loop {
        match &buf[at..] {
            [b'\n', ..] => at += 1,
            [b'\r', b'\n', ..] => at += 2,
            _ => return at,
        }
    }
}

/// The next data frame of `body` (trailers are dropped: HTTP/1.1 clients did not ask for them);
/// `Err` when the body failed, or when the client on `io` went away while waiting for it
/// (`watch`).
async fn next_data(
    body: &mut ProxyBody,
    io: &TcpStream,
    watch: &mut ClientWatch,
) -> Result<Option<Bytes>, ()> {
    loop {
        let frame = poll_fn(|cx| match Pin::new(&mut *body).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(Ok(frame)),
            Poll::Pending => watch.poll_gone(io, cx).map(Err),
        })
        .await;
        let Ok(frame) = frame else {
            tracing::debug!("client closed the connection during the response body");
            return Err(());
        };
        match frame {
            None => return Ok(None),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    return Ok(Some(data));
                }
            }
            Some(Err(e)) => {
                tracing::debug!(cause = %e, "response body failed; connection closed");
                return Err(());
            }
        }
    }
}

/// Writes every slice (at most 4), in as few `writev` calls as the socket takes. `Err(false)`
/// when a write fails; `Err(true)` when the client takes no byte for `stall`
/// (`server.send_timeout_ms`, counted from a write the socket's full send buffer could not take,
/// and again after every write it took: nginx's `send_timeout`). The timer is made only when
/// the send buffer is full, so a response the kernel takes whole costs none.
async fn send(io: &mut TcpStream, parts: &[&[u8]], stall: Duration) -> Result<(), bool> {
    let mut bufs = [IoSlice::new(&[]); 4];
    let mut n = 0;
    for p in parts.iter().filter(|p| !p.is_empty()) {
        bufs[n] = IoSlice::new(p);
        n += 1;
    }
    let mut bufs = &mut bufs[..n];
    let mut timer = Stall::default();
    poll_fn(|cx| {
        while !bufs.is_empty() {
            match Pin::new(&mut *io).poll_write_vectored(cx, bufs) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(Err(false)),
                Poll::Ready(Ok(written)) => {
                    IoSlice::advance_slices(&mut bufs, written);
                    timer.progress();
                }
                Poll::Pending => {
                    if timer.poll_expired(stall, cx) {
                        tracing::debug!(
                            "client took no response bytes for server.send_timeout_ms; \
                             connection reset"
                        );
                        return Poll::Ready(Err(true));
                    }
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(Ok(()))
    })
    .await
}

/// The send timeout of one connection's writes: armed by a write the socket could not take,
/// disarmed by one it took. The timer is allocated at the first full send buffer and reused.
#[derive(Default)]
struct Stall {
    timer: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl Stall {
    /// A write made progress.
    fn progress(&mut self) {
        self.armed = false;
    }

    /// A write found the send buffer full: whether `stall` has passed since the first such
    /// write after the last progress; registers for the wake-up otherwise.
    fn poll_expired(&mut self, stall: Duration, cx: &mut Context<'_>) -> bool {
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
}

impl Wait<'_, '_> {
    /// Whether the current request's deadline passed; registers for the wake-up otherwise.
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> bool {
        let deadline = *self
            .deadline
            .get_or_insert_with(|| Instant::now() + self.timeout);
        while self.timer.as_mut().poll(cx).is_ready() {
            if Instant::now() >= deadline {
                return true;
            }
            self.timer.as_mut().reset(deadline);
        }
        false
    }
}

#[derive(Clone, Copy)]
enum Framing {
    Bodyless,
    Length(u64),
    Chunked,
}

/// The status line and header section: the upstream's raw `fields` (as received, already
/// screened), then `headers`. tessera's own framing fields replace any there (a bodyless answer
/// keeps `Content-Length`, which then describes the representation, except on 204 where RFC 9110
/// section 8.6 forbids it). Adds `Date` when missing, as hyper did.
fn encode_head(
    out: &mut Vec<u8>,
    status: StatusCode,
    fields: Option<&RawHead>,
    headers: &HeaderMap,
    framing: Framing,
    close: bool,
) {
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let keep_length = matches!(framing, Framing::Bodyless) && status != StatusCode::NO_CONTENT;
    // This writer frames the body and says whether the connection stays open.
    let passed = |name: &[u8]| {
        !(name.eq_ignore_ascii_case(b"transfer-encoding")
            || (name.eq_ignore_ascii_case(b"content-length") && !keep_length)
            || name.eq_ignore_ascii_case(b"connection"))
    };
    if let Some(fields) = fields {
        fields.write_lines(out, passed);
    }
    for (name, value) in headers {
        if passed(name.as_str().as_bytes()) {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
    }
    match framing {
        Framing::Bodyless => {}
        Framing::Length(n) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa(n, &mut [0; 20]));
            out.extend_from_slice(b"\r\n");
        }
        Framing::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    if !headers.contains_key(header::DATE) && !fields.is_some_and(|f| f.contains(b"date")) {
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(&http_date());
        out.extend_from_slice(b"\r\n");
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// `{n:x}\r\n`, the size line of a chunk (RFC 9112 section 7.1), written into `buf`.
fn chunk_size_line(mut n: usize, buf: &mut [u8; 18]) -> &[u8] {
    let mut i = buf.len() - 2;
    buf[i..].copy_from_slice(b"\r\n");
    loop {
        i -= 1;
        buf[i] = b"0123456789abcdef"[n % 16];
        n /= 16;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// `n` in decimal, written into the end of `buf`.
fn itoa(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// The current time as an IMF-fixdate (RFC 9110 section 5.6.7), formatted once a second per
/// thread.
fn http_date() -> [u8; 29] {
    use std::cell::Cell;
    use std::time::{SystemTime, UNIX_EPOCH};
    thread_local! {
        static CACHED: Cell<(u64, [u8; 29])> = const { Cell::new((u64::MAX, [0; 29])) };
    }
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHED.with(|c| {
        let (at, text) = c.get();
        if at == secs {
            return text;
        }
        let mut text = [0u8; 29];
        text.copy_from_slice(&httpdate::fmt_http_date(now).as_bytes()[..29]);
        c.set((secs, text));
        text
    })
}

/// The request (its body attached by the caller) from a parsed head; `None` for a target or
/// header `http` refuses.
fn request(head: &Bytes, p: &Parsed, spans: &[[u32; 4]]) -> Option<Request<()>> {
    let uri = Uri::from_maybe_shared(head.slice(p.path.0..p.path.1)).ok()?;
    // Room for what inject adds (credential, X-Forwarded-*), so the map never grows; a map an
    // earlier request gave back when it was sent upstream, so no allocation either.
    let mut headers = crate::forward::spare_header_map(spans.len() + 6);
    for &[ns, ne, vs, ve] in spans {
        let name = HeaderName::from_bytes(&head[ns as usize..ne as usize]).ok()?;
        let value = HeaderValue::from_maybe_shared(head.slice(vs as usize..ve as usize)).ok()?;
        headers.append(name, value);
    }
    let mut req = Request::new(());
    *req.method_mut() = p.method.clone();
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = headers;
    Some(req)
}

/// A stream that first yields bytes already read from it: how a connection reaches hyper with
/// the request the fast path did not take.
pub(crate) struct Prefixed {
    pre: Bytes,
    io: TcpStream,
    /// Set once the write side is shut down: the lingering close in progress.
    linger: Option<Linger>,
    /// Whether a shutdown lingers (reads and drops the client's bytes); not once the connection
    /// carries a WebSocket, whose client bytes are the tunnel's to read.
    lingers: bool,
    /// `server.send_timeout_ms`: a write that finds the send buffer full and stays so this long
    /// fails with `TimedOut` (hyper then ends the connection, a WebSocket tunnel its tunnel).
    send_timeout: Duration,
    stall: Stall,
    /// A write timed out: the shutdown resets the connection instead of closing it.
    stalled: bool,
}

/// The client side of a WebSocket tunnel: the connection's own socket (with the bytes hyper had
/// read past the handshake first, and no lingering close), or hyper's upgraded stream when the
/// connection is of another kind (tests driving the proxy directly).
pub(crate) enum Downstream {
    /// The socket, unwrapped.
    Socket(Prefixed),
    /// Anything else, through hyper.
    Upgraded(TokioIo<hyper::upgrade::Upgraded>),
}

/// The downstream side of an upgraded connection (see [`Downstream`]): hyper's upgraded stream
/// unwrapped to the socket when it is one of tessera's (served by either hyper builder).
pub(crate) fn downstream(upgraded: hyper::upgrade::Upgraded) -> Downstream {
    type Io = TokioIo<Prefixed>;
    let (io, read_buf) = match hyper_util::server::conn::auto::upgrade::downcast::<Io>(upgraded) {
        Ok(parts) => (parts.io, parts.read_buf),
        Err(upgraded) => match upgraded.downcast::<Io>() {
            Ok(parts) => (parts.io, parts.read_buf),
            Err(upgraded) => return Downstream::Upgraded(TokioIo::new(upgraded)),
        },
    };
    let mut io = io.into_inner();
    // hyper read `read_buf` from the stream, so it came before what is left of `pre`.
    if !read_buf.is_empty() {
        let mut all = BytesMut::with_capacity(read_buf.len() + io.pre.len());
        all.extend_from_slice(&read_buf);
        all.extend_from_slice(&io.pre);
        io.pre = all.freeze();
    }
    io.lingers = false;
    Downstream::Socket(io)
}

impl AsyncRead for Downstream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Socket(s) => Pin::new(s).poll_read(cx, buf),
            Self::Upgraded(u) => Pin::new(u).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Downstream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Socket(s) => Pin::new(s).poll_write(cx, buf),
            Self::Upgraded(u) => Pin::new(u).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Socket(s) => Pin::new(s).poll_flush(cx),
            Self::Upgraded(u) => Pin::new(u).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Socket(s) => Pin::new(s).poll_shutdown(cx),
            Self::Upgraded(u) => Pin::new(u).poll_shutdown(cx),
        }
    }
}

impl AsyncRead for Prefixed {
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

impl Prefixed {
    /// A write's result, through the send timeout ([`Stall`]).
    fn stalled(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match r {
            Poll::Pending => {
                if !self.stall.poll_expired(self.send_timeout, cx) {
                    return Poll::Pending;
                }
                tracing::debug!(
                    "client took no response bytes for server.send_timeout_ms; connection reset"
                );
                self.stalled = true;
                // Closed without lingering or a FIN queued behind a full buffer: reset (nginx's
                // `reset_timedout_connection`).
                reset_on_close(&self.io);
                Poll::Ready(Err(io::ErrorKind::TimedOut.into()))
            }
            r => {
                self.stall.progress();
                r
            }
        }
    }
}

impl AsyncWrite for Prefixed {
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
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// Shuts the write side down, then drains the client's remaining bytes ([`Linger`]): hyper
    /// calls this when it closes a connection, also one whose request body it left unread.
    /// Without `lingers` (a WebSocket's), only the write side is shut down.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.stalled {
            // Nothing more can be sent: the drop that follows resets the connection.
            return Poll::Ready(Ok(()));
        }
        if !this.lingers {
            return Pin::new(&mut this.io).poll_shutdown(cx);
        }
        if this.linger.is_none() {
            std::task::ready!(Pin::new(&mut this.io).poll_shutdown(cx))?;
            this.linger = Some(Linger::new());
        }
        let linger = this.linger.as_mut().expect("set above");
        linger.poll(&mut this.io, cx).map(Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recycled_read_buffer_comes_back_with_its_room_and_an_odd_one_is_dropped() {
        let mut buf = BytesMut::with_capacity(READ_CHUNK);
        buf.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
        buf.clear();
        let at = buf.as_ptr();
        recycle_read_buf(buf);
        let again = spare_read_buf();
        assert!(again.is_empty());
        assert_eq!(again.as_ptr(), at, "not the recycled allocation");
        recycle_read_buf(BytesMut::with_capacity(16 * READ_CHUNK));
        recycle_read_buf(BytesMut::new());
        let fresh = spare_read_buf();
        assert_eq!(
            fresh.capacity(),
            READ_CHUNK,
            "a too large or too small buffer was kept"
        );
    }

    #[test]
    fn head_framing_fields_are_tesseras_own() {
        let h: HeaderMap = [
            ("content-length", "999"),
            ("transfer-encoding", "chunked"),
            ("connection", "keep-alive"),
            ("date", "Sat, 21 Nov 2026 00:00:00 GMT"),
            ("x-a", "1"),
        ]
        .into_iter()
        .map(|(k, v)| (HeaderName::from_static(k), HeaderValue::from_static(v)))
        .collect();
        let text = |status, framing, close| {
            let mut out = Vec::new();
            encode_head(&mut out, status, None, &h, framing, close);
            String::from_utf8(out).unwrap()
        };
        assert_eq!(
            text(StatusCode::OK, Framing::Length(5), false),
            "HTTP/1.1 200 OK\r\ndate: Sat, 21 Nov 2026 00:00:00 GMT\r\nx-a: 1\r\ncontent-length: 5\r\n\r\n"
        );
        assert_eq!(
            text(StatusCode::OK, Framing::Chunked, true),
            "HTTP/1.1 200 OK\r\ndate: Sat, 21 Nov 2026 00:00:00 GMT\r\nx-a: 1\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        );
        // HEAD / 304 keep the representation's length; 204 may not carry one.
        assert!(text(StatusCode::NOT_MODIFIED, Framing::Bodyless, false)
            .contains("content-length: 999\r\n"));
        assert!(!text(StatusCode::NO_CONTENT, Framing::Bodyless, false).contains("content-length"));
        let mut out = Vec::new();
        encode_head(
            &mut out,
            StatusCode::BAD_GATEWAY,
            None,
            &HeaderMap::new(),
            Framing::Length(0),
            false,
        );
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\ndate: "),
            "{text}"
        );
        assert!(text.ends_with(" GMT\r\n\r\n") && text.len() == 84, "{text}");
    }

    #[test]
    fn raw_upstream_fields_go_first_as_received_minus_framing() {
        let raw = crate::forward::raw::from_pairs(&[
            ("Server", "up"),
            ("Content-Length", "999"),
            ("Transfer-Encoding", "chunked"),
            ("Connection", "keep-alive"),
            ("Date", "Sat, 21 Nov 2026 00:00:00 GMT"),
        ]);
        let mut map = HeaderMap::new();
        map.insert("x-local", HeaderValue::from_static("1"));
        let mut out = Vec::new();
        encode_head(
            &mut out,
            StatusCode::OK,
            Some(&raw),
            &map,
            Framing::Length(3),
            false,
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 200 OK\r\nServer: up\r\nDate: Sat, 21 Nov 2026 00:00:00 GMT\r\nx-local: 1\r\ncontent-length: 3\r\n\r\n"
        );
    }

    #[test]
    fn only_crlf_and_lf_are_empty_lines_before_a_request() {
        assert_eq!(empty_lines(b"\r\n\n\r\nGET"), 5);
        assert_eq!(empty_lines(b"GET"), 0);
        // A bare CR is no empty line (found by fuzz/ `fast_path`: the fast path dropped it and
        // took "\rT / HTTP/1.1" as method T; hyper refuses it).
        assert_eq!(empty_lines(b"\r\n\rT / HTTP/1.1"), 2);
        assert_eq!(empty_lines(b"\r"), 0);
        let mut incoming = Incoming::default();
        incoming.extend(b"\rT / HTTP/1.1\r\nHost: a\r\n\r\n");
        assert!(matches!(incoming.take(8192, 1024), Taken::HandOff));
    }

    #[test]
    fn decimal_and_chunk_size_lines() {
        for n in [0u64, 7, 10, 1024, u64::MAX] {
            assert_eq!(itoa(n, &mut [0; 20]), n.to_string().as_bytes());
        }
        for n in [0usize, 9, 10, 255, 65536, usize::MAX] {
            assert_eq!(
                chunk_size_line(n, &mut [0; 18]),
                format!("{n:x}\r\n").as_bytes()
            );
        }
    }
}
