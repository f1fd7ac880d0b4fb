//! The forward phase: send the prepared request upstream over the pool and hand back the
//! streaming response.
//!
//! Owns: timeouts (connect, response head) and the single retry. The response-head timeout counts
//! from the later of the request entering the queue and the last request-body byte sent, so a
//! slow upload is not cut off while it makes progress. A request is retried once, on a
//! fresh connection, only when it went out on a *reused* connection and either the socket took
//! none of it, or it is idempotent with no body and the connection closed before any response byte
//! (the keep-alive race of RFC 9112 section 9.3.1). Must never: retry a request whose body was
//! partly sent.
//!
//! A request whose response head timed out closes its connection; one dropped by its requester
//! (the client went away) after it was written in full, less than `upstream.drain_wait_ms`
//! after its sending began, leaves its connection to finish the exchange in the background (see
//! `pool.rs`).
//!
//! The HTTP/1.1 exchange itself runs in the request's own task (`upstream/h1.rs`): no connection task.

mod body;
pub(crate) mod chunked;
pub(crate) mod codec;
mod conn;
mod encode;
mod exchange;
mod frames;
mod io;
mod outgoing;
mod pool;
pub(crate) mod raw;
mod request;
mod settings;
mod share;
mod tls;
mod tunnel;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::Body;
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;

pub use body::{ProxyBody, UpstreamBody};
use conn::SendError;
pub(crate) use frames::frame_edges;
pub use io::{Transport, UpIo};
pub(crate) use pool::serving_thread;
pub use pool::{
    set_serving_thread, Affinity, AffinityKey, Closed, Drain, Pool, PoolStats, AFFINITY_STALE,
    AFFINITY_WAIT, DRAIN_BYTES, DRAIN_WAIT,
};
pub use raw::RawHead;
pub use request::{empty_body, recycle_header_map, spare_header_map};
use request::{Progress, Tracked};
pub use settings::UpstreamConfig;
pub use share::default_per_user;
pub(crate) use share::Shares;
pub use tls::{TlsClient, TlsSettingError, UpstreamTlsSettings};
pub use tunnel::{
    upgraded_as_is, ClientIo, ClientSide, ClientSideFn, Tunnel, TunnelEnd, TunnelReport,
    CLOSING_WAIT,
};

/// Boxed error type of request bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Request body sent upstream (the client's body, possibly length-limited).
pub type UpBody = BoxBody<Bytes, BoxError>;

/// The error a request body yields when its client sent nothing for
/// `server.client_body_timeout_ms` (made by the body's reader, `screen::body`); the forward phase
/// reports it as [`ForwardError::BodyTimeout`].
#[derive(Debug, thiserror::Error)]
#[error("request body stalled: no data for {0:?}")]
pub struct BodyStalled(pub Duration);

/// Why forwarding failed.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// TCP connect failed (refused, unreachable, reset). 502.
    #[error("upstream connect failed: {0}")]
    Connect(String),
    /// The TCP connect took longer than `upstream.connect_timeout_ms`. 504.
    #[error("upstream connect timed out")]
    ConnectTimeout,
    /// No response head within `upstream.response_header_timeout_ms` (queue wait included). 504.
    #[error("upstream response timed out")]
    Timeout,
    /// The client's body exceeded `server.max_body_bytes` while streaming. 413.
    #[error("request body too large")]
    BodyTooLarge,
    /// The client sent no request-body data for `server.client_body_timeout_ms` while it was
    /// streamed upstream. 408, as nginx's `client_body_timeout`.
    #[error("client request body timed out")]
    BodyTimeout,
    /// The client's body broke off or was malformed while being sent upstream (the client closed
    /// or reset its connection before the announced end, a bad chunk). 400, as nginx's "client
    /// prematurely closed connection" (the client is usually gone; the status is for the log).
    #[error("client request body: {0}")]
    ClientBody(String),
    /// The connection broke or the upstream sent an invalid response. 502.
    #[error("upstream failed: {0}")]
    Broken(String),
    /// The pool is shut down.
    #[error("upstream pool closed")]
    Closed,
    /// `upstream.max_event_streams` event streams are open already. 503 with `Retry-After`.
    #[error("too many event streams (upstream.max_event_streams)")]
    TooManyEventStreams,
}

/// The upstream: one address, one pool.
pub struct Upstream {
    pool: Arc<Pool>,
    header_timeout: Duration,
    /// Each user's and each HTTP/2 connection's share of the pool, and the event streams'.
    shares: share::Shares,
}

/// The downstream connection a request came on, as the pool's shares see it: `None` for one
/// that carries one request at a time (HTTP/1.1), else its share ([`Upstream::connection_share`]).
pub type ConnectionShare = Option<Arc<crate::share::Share>>;

/// The shares of the pool one request counts against ([`share`]): its user's (a session keeps
/// it, from [`Upstream::user_share`]) and its HTTP/2 connection's.
/// Borrowed for the request's life: taking a permit is the only reference count it pays.
#[derive(Default, Clone, Copy)]
pub struct RequestShares<'a> {
    /// The user's share; `None` with shares off.
    pub user: Option<&'a Arc<crate::share::Share>>,
    /// The downstream HTTP/2 connection's share; `None` for HTTP/1.1.
    pub connection: Option<&'a Arc<crate::share::Share>>,
}

fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

impl Upstream {
    /// An upstream at `addr` (`host:port`) with these `[upstream]` settings (its `url` is not
    /// read: `addr` is where to connect), used from `threads` serving threads.
    pub fn new(addr: String, settings: &UpstreamConfig, threads: usize) -> Self {
        Self {
            pool: Pool::new(addr, settings, threads),
            header_timeout: settings.response_header_timeout,
            shares: share::Shares::new(settings.max_connections_per_user, settings.max_connections)
                .bounding_event_streams(settings.max_event_streams, settings.max_connections),
        }
    }

    /// A new HTTP/2 connection's share of the pool, for all its streams together; `None` when
    /// shares are off.
    pub fn connection_share(&self) -> ConnectionShare {
        self.shares.for_connection()
    }

    /// The share of the user whose upstream credential is `credential`; `None` when shares are
    /// off. A session keeps it, so its requests skip the lookup.
    pub fn user_share(&self, credential: &http::HeaderValue) -> Option<Arc<crate::share::Share>> {
        self.shares.user(Some(credential))
    }

    /// Requests that waited because their user or connection held its share of the pool.
    pub fn share_waits(&self) -> u64 {
        self.shares.waited()
    }

    /// Pool counters.
    pub fn stats(&self) -> &PoolStats {
        &self.pool.stats
    }

    /// TLS handshakes with an `https://` upstream, `(full, resumed)`; `None` for `http://`.
    pub fn tls_handshakes(&self) -> Option<(u64, u64)> {
        self.pool.tls().map(TlsClient::handshakes)
    }

    /// Puts the trusted roots and client certificate of `new` (a reloaded configuration's
    /// client) in place for new connections ([`TlsClient::take_trust_of`]); nothing for an
    /// `http://` upstream, or when `new` is none (a changed `upstream.url` needs a restart) or
    /// checks another server name (warned). Returns whether they were kept for that reason.
    pub fn reload_tls(&self, new: Option<&TlsClient>) -> bool {
        if let (Some(running), Some(new)) = (self.pool.tls(), new) {
            if !running.take_trust_of(new) {
                tracing::warn!(
                    "SIGHUP: the upstream's CA and client certificate are kept: the file names \
                     another upstream server name, which a restart applies with them"
                );
                return true;
            }
        }
        false
    }

    /// Upstream connections open now, `(busy, idle)` (see [`Pool::connections`]).
    pub fn connections(&self) -> (usize, usize) {
        self.pool.connections()
    }

    /// Sends `req` (origin-form URI, headers final) and returns the response with a streaming body.
    /// The response's `HeaderMap` is empty: the upstream's fields stay raw in the body
    /// ([`ProxyBody::fields_mut`]) until [`materialize`] moves them into it.
    ///
    /// Errors: [`ForwardError`], after at most one retry (see module docs).
    pub async fn forward(&self, req: Request<UpBody>) -> Result<Response<ProxyBody>, ForwardError> {
        let user = self
            .shares
            .user(req.headers().get(http::header::AUTHORIZATION));
        let shares = RequestShares {
            user: user.as_ref(),
            connection: None,
        };
        self.forward_on(req, shares).await
    }

    /// [`Upstream::forward`] for a request whose shares of the pool are already known (its
    /// session's user share, its HTTP/2 connection's from [`Upstream::connection_share`]).
    ///
    /// Errors: as [`Upstream::forward`].
    pub async fn forward_on(
        &self,
        mut req: Request<UpBody>,
        shares: RequestShares<'_>,
    ) -> Result<Response<ProxyBody>, ForwardError> {
        // The body is swapped in place: the request itself is not moved (a copy per request).
        let progress = (!req.body().is_end_stream()).then(|| {
            let progress = Arc::new(Progress::default());
            let inner = std::mem::replace(req.body_mut(), empty_body());
            *req.body_mut() = Tracked {
                inner,
                progress: progress.clone(),
            }
            .boxed();
            progress
        });
        // In an `Option` so that a timeout can drop it in place, marked as abandoned.
        let mut send = std::pin::pin!(Some(self.send(req, shares)));
        let mut last = 0;
        loop {
            let sending = send.as_mut().as_pin_mut().expect("dropped only to return");
            match tokio::time::timeout(self.header_timeout, sending).await {
                Ok(result) => return result,
                Err(_) => {
                    let now = progress
                        .as_ref()
                        .map_or(0, |p| p.frames.load(Ordering::Relaxed));
                    if now == last {
                        // An upstream slower than the timeout: its connection is closed, not
                        // left to finish the exchange in the background.
                        pool::abandoning(|| send.set(None));
                        return Err(ForwardError::Timeout);
                    }
                    last = now;
                }
            }
        }
    }

    async fn send(
        &self,
        req: Request<UpBody>,
        shares: RequestShares<'_>,
    ) -> Result<Response<ProxyBody>, ForwardError> {
        let key = self.pool.affinity_key(req.headers());
        let stream = self.shares.event_stream(req.method(), req.headers())?;
        let held = self.shares.take(shares.user, shares.connection).await;
        let mut conn = self.pool.checkout(key.clone()).await?;
        conn.hold(held.with(stream));
        let (retry, err) = match conn.send(req).await {
            Ok(head) => return Ok(wrap(head, conn)),
            Err(e) => {
                conn.close_as(closed_by(&e));
                match e {
                    SendError::Unsent(req, e) => (Some(req), e),
                    SendError::ClosedBeforeResponse(req, e) => {
                        (req.filter(|r| idempotent(r.method())), e)
                    }
                    SendError::Failed(e) => (None, e),
                }
            }
        };
        let reused = conn.reused;
        drop(conn);
        let Some(req) = retry.filter(|_| reused) else {
            return Err(err);
        };
        tracing::debug!(cause = %err, "reused upstream connection failed; retrying once on a fresh one");
        // Boxed: the rare retry (and its connect) would otherwise double the size of every
        // request's future, which is copied as it is awaited.
        Box::pin(self.retry(key, req, shares)).await
    }

    /// The single retry of [`Upstream::send`], on a fresh connection.
    async fn retry(
        &self,
        key: Option<AffinityKey>,
        req: Request<UpBody>,
        shares: RequestShares<'_>,
    ) -> Result<Response<ProxyBody>, ForwardError> {
        let stream = self.shares.event_stream(req.method(), req.headers())?;
        let held = self.shares.take(shares.user, shares.connection).await;
        let mut conn = self.pool.checkout_fresh(key).await?;
        conn.hold(held.with(stream));
        match conn.send(req).await {
            Ok(head) => Ok(wrap(head, conn)),
            Err(e) => {
                conn.close_as(closed_by(&e));
                match e {
                    SendError::Unsent(_, e)
                    | SendError::ClosedBeforeResponse(_, e)
                    | SendError::Failed(e) => Err(e),
                }
            }
        }
    }
}

/// Why a connection whose send failed with `e` is closed: the upstream closed or reset it
/// before answering; the client's request body broke off or was too large (the exchange left
/// unfinished); else an error (a broken connection, a malformed response).
fn closed_by(e: &SendError) -> Closed {
    match e {
        SendError::Unsent(..) | SendError::ClosedBeforeResponse(..) => Closed::Upstream,
        SendError::Failed(
            ForwardError::ClientBody(_) | ForwardError::BodyTooLarge | ForwardError::BodyTimeout,
        ) => Closed::Abandoned,
        SendError::Failed(_) => Closed::Error,
    }
}

fn wrap(head: conn::Head, conn: pool::Conn) -> Response<ProxyBody> {
    let conn::Head {
        response,
        fields,
        framing,
        keep_alive,
        // Already kept by the connection itself (`H1::idle_limit`).
        announced_idle: _,
    } = head;
    if response.status() == http::StatusCode::SWITCHING_PROTOCOLS {
        return response
            .map(|()| ProxyBody::Upstream(Box::new(UpstreamBody::switched(fields, conn))));
    }
    response.map(|()| {
        ProxyBody::Upstream(Box::new(UpstreamBody::new(
            fields, conn, framing, keep_alive,
        )))
    })
}

/// Moves the upstream's fields, if still kept raw in the body, into the response's `HeaderMap`
/// (ahead of any entries already there): what every consumer but the HTTP/1.1 fast path needs.
pub fn materialize(resp: &mut Response<ProxyBody>) {
    if let Some(fields) = resp.body_mut().take_fields() {
        let added = std::mem::take(resp.headers_mut());
        let status = resp.status();
        let map = resp.headers_mut();
        fields.append_to(map);
        one_content_length(status, map);
        for (name, value) in added.iter() {
            map.append(name.clone(), value.clone());
        }
    }
}

/// The upstream's `Content-Length` as one value: a list of equal values or several equal field
/// lines, which the codec read as one length (RFC 9110 section 8.6), is one field, as HTTP/2 and
/// HTTP/3 clients refuse a list (RFC 9113 section 8.1.1); a 1xx or 204 keeps none, which a
/// server must not send (RFC 9110 section 8.6). A single plain value is left as it is.
fn one_content_length(status: http::StatusCode, map: &mut http::HeaderMap) {
    let mut values = map.get_all(http::header::CONTENT_LENGTH).iter();
    let Some(first) = values.next() else {
        return;
    };
    let bodyless = status.is_informational() || status == http::StatusCode::NO_CONTENT;
    let single = values.next().is_none();
    if single && !bodyless && crate::fields::content_length(first.as_bytes()).is_some() {
        return;
    }
    let length = first.as_bytes().split(|&b| b == b',').next();
    let length = length.and_then(|v| crate::fields::content_length(v.trim_ascii()));
    map.remove(http::header::CONTENT_LENGTH);
    if let (Some(n), false) = (length, bodyless) {
        map.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(n));
    }
}
