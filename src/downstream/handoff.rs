//! The hand-off to hyper: a connection the fast path does not take (h2c, chunked or large
//! uploads, `Expect`, `Upgrade`, unusual heads) is served by hyper's HTTP/1.1 or auto (h1 + h2c)
//! server for the rest of its life, with the bytes already read. Applies the same limits:
//! `server.send_timeout_ms` per h2 stream, idle h2c connections closed, graceful shutdown. Must
//! never: lose a byte the fast path read.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::Body;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::proxy::Peer;
use crate::upstream::ProxyBody;

use super::conn::{Conn, Serving};
use super::io::Stall;
use super::io::{Prefixed, Socket};

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
            let head = req.method() == http::Method::HEAD;
            let resp = bodyless_if(head, proxy.handle(req, &peer).await);
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
    let done: Option<Result<(), Box<dyn std::error::Error + Send + Sync>>> = match mode {
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
    type Error = crate::upstream::BoxError;

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
