//! The downstream HTTP/1.1 fast path's connection loop: a connection's plain HTTP/1.1 requests (no
//! body, or a `Content-Length` body of at most [`MAX_FAST_BODY`] bytes) are read ([`super::parse`]),
//! handed to the proxy and answered ([`super::write`]) in the connection's own task, without
//! hyper's dispatcher. Everything else goes to hyper ([`super::handoff`]) for the rest of the
//! connection, with the bytes already read: h2c prior knowledge, HTTP/1.0, `Transfer-Encoding`,
//! `Expect`, `Upgrade`, `CONNECT`, a second `Content-Length`, a body larger than the fast path
//! buffers or than `server.max_body_bytes`, a head over the size limit, and any head `httparse`
//! (hyper's own parser) refuses.
//!
//! Why: hyper's server side (read, dispatch, head encoding, its flush) was about a third of a
//! warm request's user CPU in the profile. Must never: guess at a request's framing (any doubt
//! goes to hyper), or keep a connection whose response was cut short.

use std::future::{poll_fn, Future};
use std::io::{self};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use hyper_util::rt::TokioExecutor;
use hyper_util::server::conn::auto;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use crate::proxy::{Peer, Proxy};

use super::handoff::{hand_off, Mode};
use super::io::{Linger, Socket};
use super::parse::{recycle_read_buf, spare_read_buf, Incoming, Taken, READ_CHUNK};

/// Largest request body, bytes, the fast path reads into memory before forwarding; a larger
/// `Content-Length` goes to hyper, which streams it. The fast path reads the body before the
/// request is authenticated, so this bounds what any client can make a connection hold
/// unauthenticated (with the head, about 41 KiB at the default limits); a JSON API call or a
/// JMAP method call fits in it.
pub const MAX_FAST_BODY: u64 = 16 * 1024;

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
    /// The same, HTTP/2 only: for TLS connections that chose `h2` by ALPN.
    pub hyper_h2: hyper::server::conn::http2::Builder<TokioExecutor>,
    /// Time a client has for a request head (and a fast-path body), counted from the request's
    /// first byte; an idle keep-alive connection closes after it too.
    pub header_read_timeout: Duration,
    /// Longest a response write may wait for the client to take a byte (`server.send_timeout_ms`);
    /// past it the connection is closed. Connections handed to hyper: see [`super::handoff`].
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
    /// `server.proxy_protocol`: each connection starts with a load balancer's PROXY header.
    pub proxy_protocol: bool,
    /// `server.redirect_to_https`: the plain listener answers every request with a redirect
    /// to this TLS port.
    pub redirect_to_https: Option<u16>,
}

/// Serves a TLS connection whose client chose HTTP/2 (ALPN `h2`): hyper's, from its preface on.
pub(super) async fn serve_h2<S: Socket>(serving: Arc<Serving>, io: S, peer: Peer) {
    crate::busy_poll::watch(io.tcp());
    let conn = Conn::new(io, &serving);
    hand_off(&serving, conn, peer, Mode::H2).await
}

/// Serves one accepted connection (TCP, or TLS that chose HTTP/1.1) until it closes, the client
/// asks to close, or shutdown.
pub(super) async fn serve<S: Socket>(serving: Arc<Serving>, io: S, peer: Peer) {
    // Never unwatched: a client connection stays on this thread (also after a hand-off to
    // hyper), and a socket leaves the set when it is closed.
    crate::busy_poll::watch(io.tcp());
    let mut conn = Conn::new(io, &serving);
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
            Next::HandOff => {
                let mode = if served { Mode::H1 } else { Mode::Auto };
                return hand_off(&serving, conn, peer, mode).await;
            }
            Next::Close => break,
            Next::Timeout => {
                let reason = "request head not received in time (server.header_read_timeout_ms)";
                let status = StatusCode::REQUEST_TIMEOUT.as_u16();
                serving.proxy.record_unread(peer.addr.ip(), status, reason);
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
                Poll::Pending => watch
                    .poll_gone(&mut conn.io, &mut conn.incoming.buf, cx)
                    .map(|()| None),
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
        let close = close || serving.shutdown.is_cancelled() || peer.is_plain_on_tls_port();
        if !conn.write_response(resp, head, close, &mut watch).await || close {
            break;
        }
        served = true;
    }
    if conn.reset {
        // The client took nothing for `send_timeout`: a graceful close would leave the kernel
        // retrying the full send buffer for minutes. Or a response was cut by its session's end:
        // what is queued for it must not arrive. Reset instead (nginx's
        // `reset_timedout_connection`).
        reset_on_close(conn.io.tcp());
        return;
    }
    // Nothing of the client's is unread, here or in the socket, and it will send nothing more
    // (RFC 9112 section 9.6: a client that sent `close` sends no further request): closing now
    // sends a FIN, and no RST can follow, so there is nothing to drain. nginx closes such
    // connections at once too. This saves a `shutdown`, a wait for the client's FIN and a timer.
    if asked_close && conn.incoming.buf.is_empty() && conn.io.nothing_queued() {
        return;
    }
    // TLS sends close_notify first, which waits behind response bytes a client no longer
    // takes: bounded by the send timeout, as every write is; past it, a reset.
    if tokio::time::timeout(conn.send_timeout, conn.io.shutdown())
        .await
        .is_err()
    {
        reset_on_close(conn.io.tcp());
        return;
    }
    let mut linger = Linger::new();
    poll_fn(|cx| linger.poll(&mut conn.io, cx)).await;
}

/// Watches a client connection, while its request is answered, for the client going away: its
/// FIN or a reset (nginx's `proxy_ignore_client_abort off`). The answer is then dropped, which
/// frees its upstream connection (after a bounded background read of a short rest, see
/// `upstream/pool.rs`); without this, a client that left a silent response (an event stream, a
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
pub(super) struct ClientWatch {
    /// Bytes of a next request arrived: no longer watching.
    done: bool,
}

impl ClientWatch {
    /// Ready when the client is gone; never ready once bytes of a next request arrived (on TLS
    /// they are read into `buf`, the connection's read buffer).
    pub(super) fn poll_gone<S: Socket>(
        &mut self,
        io: &mut S,
        buf: &mut BytesMut,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        if self.done {
            return Poll::Pending;
        }
        match std::task::ready!(io.poll_gone(buf, cx)) {
            true => Poll::Ready(()),
            false => {
                self.done = true;
                Poll::Pending
            }
        }
    }
}

/// `SO_LINGER` 0: closing the socket then resets the connection at once, dropping what its send
/// buffer still holds (a zero linger never blocks the close). For a client that took nothing for
/// `server.send_timeout_ms`.
pub(super) fn reset_on_close(io: &TcpStream) {
    let _ = rustix::net::sockopt::set_socket_linger(io, Some(Duration::ZERO));
}

/// One `recv(MSG_PEEK | MSG_DONTWAIT)` of at most 1 byte, left in the queue: `Ok(1)` bytes are
/// waiting, `Ok(0)` the client closed (FIN), `Err(WouldBlock)` nothing yet, another error a
/// reset or failed socket.
pub(super) fn peek(io: &TcpStream) -> io::Result<usize> {
    use rustix::net::{recv, RecvFlags};
    let mut probe = [0u8; 1];
    recv(io, &mut probe, RecvFlags::PEEK | RecvFlags::DONTWAIT)
        .map(|(n, _)| n)
        .map_err(io::Error::from)
}

/// Sent when a request started but its head (or fast-path body) did not arrive in time.
const REQUEST_TIMEOUT: &[u8] =
    b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

/// One downstream connection on the fast path.
pub(super) struct Conn<S> {
    pub(super) io: S,
    /// Bytes read and not yet served, and the request being read.
    pub(super) incoming: Incoming,
    /// The response head being written (reused).
    pub(super) out: Vec<u8>,
    /// `server.send_timeout_ms`: see [`super::write`].
    pub(super) send_timeout: Duration,
    /// The connection is reset (`SO_LINGER` 0), not closed gracefully: a response write timed
    /// out ([`super::write`]), or a response was cut because its session ended (its queued bytes must
    /// not reach the client).
    pub(super) reset: bool,
}

/// The head-read timer and the shutdown signal, kept across a connection's requests.
pub(super) struct Wait<'a, 'b> {
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

impl<S: Socket> Conn<S> {
    fn new(io: S, serving: &Serving) -> Self {
        Self {
            io,
            incoming: Incoming::default(),
            out: Vec::new(),
            send_timeout: serving.send_timeout,
            reset: false,
        }
    }

    async fn read_request(&mut self, serving: &Serving, wait: &mut Wait<'_, '_>) -> Next {
        wait.deadline = None;
        let mut started = false;
        loop {
            match self.incoming.take(serving.max_head, serving.max_body) {
                Taken::Request(req, close) => return Next::Request(req, close),
                Taken::HandOff if super::parse::speaks_tls(self.incoming.rest()) => {
                    // At most a line a second: any client can send them in a loop.
                    static LAST: std::sync::atomic::AtomicU64 =
                        std::sync::atomic::AtomicU64::new(0);
                    if crate::once_a_second(&LAST) {
                        tracing::info!(
                            "TLS handshake on the plain listener (server.listen); closed: point \
                             the client at http://, or put a TLS terminator in front"
                        );
                    }
                    return Next::Close;
                }
                Taken::HandOff if super::parse::speaks_no_http(self.incoming.rest()) => {
                    tracing::debug!("connection closed: its first line names no HTTP version");
                    return Next::Close;
                }
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
