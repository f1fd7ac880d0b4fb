//! The hand-off to hyper: a connection the fast path does not take (h2c, chunked or large
//! uploads, `Expect`, `Upgrade`, unusual heads) is served by hyper's HTTP/1.1 or auto (h1 + h2c)
//! server for the rest of its life, with the bytes already read. Applies the same limits:
//! `server.send_timeout_ms` per h2 stream, idle h2c connections closed, graceful shutdown. Must
//! never: lose a byte the fast path read.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body::Body;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::proxy::Peer;
use crate::upstream::ProxyBody;

use super::conn::{Conn, Serving};
use super::io::{Prefixed, Socket};
use super::tracked::{Streams, Tracked};
use crate::stall::Stall;

/// Which of hyper's servers takes a connection.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// HTTP/1 only: the fast path already served a request on it (an h2 preface there is a
    /// bad request, not a protocol switch).
    H1,
    /// HTTP/1 or h2c prior knowledge, told by the first bytes.
    Auto,
    /// HTTP/2 only: TLS with ALPN `h2` (anything but the preface ends the connection, RFC 9113
    /// section 3.4).
    H2,
}

/// Gives the connection, and the bytes read but not yet served, to hyper (see [`Mode`]).
pub(super) async fn hand_off<S: Socket>(serving: &Serving, conn: Conn<S>, peer: Peer, mode: Mode) {
    let io = Prefixed {
        pre: conn.incoming.buf.freeze(),
        io: conn.io,
        linger: None,
        lingers: true,
        send_timeout: conn.send_timeout,
        stall: Stall::default(),
        stalled: false,
        reset: Arc::new(AtomicBool::new(false)),
    };
    let reset = io.reset.clone();
    let client = peer.addr.ip();
    let peer = Arc::new(peer);
    let proxy = serving.proxy.clone();
    let streams = Arc::new(Streams::default());
    let watched = streams.clone();
    let service = service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
        let (proxy, peer) = (proxy.clone(), peer.clone());
        let open = Streams::open(&streams);
        hold_if_connect(&mut req, &streams);
        let (streams, reset) = (streams.clone(), reset.clone());
        async move {
            let head = req.method() == http::Method::HEAD;
            // HTTP/1 only: an HTTP/2 stream ends alone (`RST_STREAM`).
            let reset = (req.version() < http::Version::HTTP_2).then_some(reset);
            // Boxed: hyper moves this future, copying it whole, several times per request (an
            // HTTP/2 stream's is spawned as a task); the handling is the bulk of its size.
            let resp = bodyless_if(head, Box::pin(proxy.handle(req, &peer)).await);
            Ok::<_, std::convert::Infallible>(
                resp.map(|body| Tracked::new(&streams, body, open, reset)),
            )
        }
    });
    let idle = Checks {
        streams: &watched,
        after: serving.header_read_timeout,
        send: serving.send_timeout,
        h1: mode != Mode::H2,
    };
    // With upgrades: a WebSocket handshake the upstream accepted hands the connection over to
    // its tunnel (see `Proxy::switch`).
    let done: End<Result<(), Box<dyn std::error::Error + Send + Sync>>> = match mode {
        Mode::H1 => {
            let conn = serving
                .hyper_h1
                .serve_connection(TokioIo::new(io), service)
                .with_upgrades();
            until_done(conn, |c| c.graceful_shutdown(), &serving.shutdown, idle)
                .await
                .map(|done| done.map_err(Into::into))
        }
        Mode::Auto => {
            let conn = serving
                .hyper
                .serve_connection_with_upgrades(TokioIo::new(io), service);
            until_done(conn, |c| c.graceful_shutdown(), &serving.shutdown, idle).await
        }
        Mode::H2 => {
            let conn = serving.hyper_h2.serve_connection(TokioIo::new(io), service);
            until_done(conn, |c| c.graceful_shutdown(), &serving.shutdown, idle)
                .await
                .map(|done| done.map_err(Into::into))
        }
    };
    let done = match done {
        End::Done(done) => done,
        End::Idle => {
            tracing::debug!("downstream connection closed: idle, and it did not close when asked");
            return;
        }
        End::SessionEnded => {
            tracing::debug!("response body ended with its session; connection reset");
            return;
        }
    };
    if let Err(e) = done {
        tracing::debug!(cause = %e, "downstream connection ended with an error");
        if let Some(status) = hyper_answered(&*e) {
            let reason = format!("request head refused: {e}");
            serving.proxy.record_unread(client, status, &reason);
        }
    }
}

/// Gives a CONNECT request (a WebSocket on an HTTP/2 stream, RFC 8441) a busy mark of its
/// connection for its tunnel to hold ([`crate::proxy::ConnectionHold`]).
fn hold_if_connect(req: &mut http::Request<hyper::body::Incoming>, streams: &Arc<Streams>) {
    if req.method() == http::Method::CONNECT {
        let hold = crate::proxy::ConnectionHold(Arc::new(Streams::open(streams)));
        req.extensions_mut().insert(hold);
    }
}

/// The answer to a HEAD request without its body (RFC 9110 section 9.3.2), its length kept in
/// `Content-Length`: hyper's HTTP/2 server would send a locally made answer's body (a 401's
/// text) in DATA frames, which the client takes as a protocol error. Others pass as they are.
pub(super) fn bodyless_if(
    head: bool,
    resp: http::Response<ProxyBody>,
) -> http::Response<ProxyBody> {
    if !head {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    if let Some(n) = body.size_hint().exact().filter(|&n| n > 0) {
        parts
            .headers
            .entry(http::header::CONTENT_LENGTH)
            .or_insert_with(|| n.into());
    }
    http::Response::from_parts(parts, ProxyBody::empty())
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
///
/// An HTTP/1 response whose session ends mid-body ends the connection at once
/// ([`End::SessionEnded`]): hyper polls a body only when its write buffer has room, which a
/// slow client may not give it for seconds, and HTTP/1 can only end a response by closing.
async fn until_done<C: Future>(
    conn: C,
    graceful: impl Fn(Pin<&mut C>),
    shutdown: &CancellationToken,
    idle: Checks<'_>,
) -> End<C::Output> {
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
            // In this order: the ticks first, as a connection that spends the task's budget
            // on every poll (a flood of HTTP/2 PINGs) would leave them none; then the
            // connection before the shutdown, which reaches it once it has read the bytes it
            // was handed (hyper-util's auto connection asked to stop before it has read the
            // version ends at once, dropping a complete request unanswered).
            biased;
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
                    return End::Idle;
                }
                asked = true;
                idle_since = Some(now);
                graceful(conn.as_mut());
            }
            done = conn.as_mut() => return End::Done(done),
            () = poll_fn(|cx| idle.streams.poll_h1_session_end(cx)), if idle.h1 => {
                return End::SessionEnded;
            }
            () = shutdown.cancelled(), if !stopping => {
                stopping = true;
                graceful(conn.as_mut());
            }
        }
    }
}

/// How [`until_done`] ended.
enum End<T> {
    /// The connection's own end.
    Done(T),
    /// Idle, asked to close and still open: dropped.
    Idle,
    /// An HTTP/1 response's session ended mid-body: dropped, to be reset.
    SessionEnded,
}

impl<T> End<T> {
    fn map<U>(self, f: impl FnOnce(T) -> U) -> End<U> {
        match self {
            Self::Done(t) => End::Done(f(t)),
            Self::Idle => End::Idle,
            Self::SessionEnded => End::SessionEnded,
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
    /// Whether HTTP/1 responses may be served (not on a TLS `h2` connection): their session's
    /// end is watched (see [`Streams::poll_h1_session_end`]).
    h1: bool,
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
