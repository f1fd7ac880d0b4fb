//! The request path, as named phases in their fixed order:
//! screen -> extract -> verify -> resolve (+ unseal) -> inject -> forward -> log.
//!
//! Each phase is one small function; [`Proxy::handle`] runs them top to bottom and turns any
//! failure into a response in one place ([`ProxyError::into_response`]). Must never: forward a
//! request after any failure, or write a token or credential to a log line.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{HeaderValue, Request, Response, Uri, Version};
use http_body::Body;

use crate::Config;

mod settings;
use crate::error::ProxyError;
use crate::login::Login;
use crate::screen::{self, Limits, Screened};
use crate::session::{Session, Sessions};
use crate::telemetry::RequestCounts;
use crate::token::{self, TokenSource, Verifier};
use crate::unix_now;
use crate::upstream::{
    BoxError, ConnectionShare, ProxyBody, RequestShares, Tunnel, UpBody, Upstream,
};
pub use settings::WebSocketConfig;

/// Everything the request path needs, built once from the config.
pub struct Proxy {
    limits: Limits,
    /// `server.client_body_timeout_ms`.
    body_timeout: Duration,
    sources: Vec<TokenSource>,
    verifier: Verifier,
    sessions: Sessions,
    upstream: Upstream,
    /// Upstream path prefix (no trailing `/`), prepended to every request path.
    base_path: String,
    /// `Host` sent upstream when `preserve_host = false`.
    upstream_host: HeaderValue,
    preserve_host: bool,
    strip_response: Vec<HeaderName>,
    access_log: bool,
    /// The session-side endpoints, when `[login]` is configured.
    login: Option<Login>,
    /// Requests by status, when `[metrics]` is configured.
    request_counts: Option<RequestCounts>,
    /// Outcomes of configuration reloads (SIGHUP).
    reload_counts: crate::telemetry::ReloadCounts,
    /// `server.trusted_proxies`.
    trusted_proxies: Vec<ipnet::IpNet>,
    /// `[websocket]`; `None` when `websocket.max_connections = 0` (upgrades not passed).
    websockets: Option<WebSockets>,
}

/// WebSocket upgrades: the limit on open tunnels and the origin policy (`[websocket]`).
struct WebSockets {
    /// One permit per tunnel open now, `websocket.max_connections` in all.
    slots: Arc<tokio::sync::Semaphore>,
    max: usize,
    idle_timeout: Option<Duration>,
    allowed_origins: Vec<String>,
    /// Tunnels opened since start.
    opened: AtomicU64,
    /// The running tunnels, for the shutdown to wait on.
    tunnels: tokio_util::task::TaskTracker,
    /// Cancelled at shutdown: every tunnel closes (Close 1001 to both sides).
    stop: tokio_util::sync::CancellationToken,
}

/// Longest wait for hyper to write a 101 and hand the client's connection over (the client
/// reads it) before the tunnel is given up.
const UPGRADE_WAIT: Duration = Duration::from_secs(10);

/// What an upgrade the proxy passes on needs once the upstream has answered 101: the client's
/// side of the switch (resolved by hyper after the 101 is written) and the tunnel's slot.
struct Upgrading {
    downstream: hyper::upgrade::OnUpgrade,
    slot: tokio::sync::OwnedSemaphorePermit,
}

/// `WWW-Authenticate` sent when the upstream answered 401 to the injected credentials (RFC 6750 3).
const UPSTREAM_REJECTED: &str =
    "Bearer realm=\"tessera\", error=\"invalid_token\", error_description=\"upstream rejected credentials\"";

/// The downstream peer of a connection, with its `X-Forwarded-For` value formatted once per
/// connection rather than per request (formatting the address was 2-3% of a warm request's
/// user CPU in the profile).
pub struct Peer {
    /// The client's socket address (for a request relayed by a trusted proxy: the client it
    /// names, port 0).
    pub addr: SocketAddr,
    forwarded_for: Option<HeaderValue>,
    /// The peer is a trusted proxy (`server.trusted_proxies`): each request names its client.
    trusted: bool,
    /// `X-Forwarded-Proto` sent upstream: `http`, or what a trusted proxy reported.
    proto: &'static str,
    /// The connection's share of the upstream pool, made at its first HTTP/2 request (an
    /// HTTP/1.1 connection carries one request at a time and needs none).
    share: std::sync::OnceLock<ConnectionShare>,
}

impl Peer {
    /// The peer at `addr`, itself the client (see [`Proxy::peer`] for trusted proxies); an
    /// IPv4-mapped IPv6 address (a dual-stack listener's IPv4 peer) is taken as IPv4.
    pub fn new(addr: SocketAddr) -> Self {
        let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
        Self {
            addr,
            forwarded_for: HeaderValue::from_str(&addr.ip().to_string()).ok(),
            trusted: false,
            proto: "http",
            share: std::sync::OnceLock::new(),
        }
    }

    /// The client a trusted proxy relayed this request for (see [`screen::forwarded_client`]).
    fn relayed(&self, headers: &http::HeaderMap, trusted: &[ipnet::IpNet]) -> Self {
        let ip = screen::forwarded_client(headers, trusted, self.addr.ip());
        Self {
            proto: screen::forwarded_proto(headers).unwrap_or("http"),
            ..Self::new(SocketAddr::new(ip, 0))
        }
    }
}

/// Per-request facts carried through the phases, for the access log.
#[derive(Default)]
struct Ctx {
    /// The verified session id (hashed only when a log line is written).
    sid: Option<Arc<str>>,
    /// Log reason of a response that is not a [`ProxyError`] (login endpoints).
    reason: Option<String>,
    /// The downstream connection's share of the upstream pool (HTTP/2 only).
    share: ConnectionShare,
}

impl Proxy {
    /// Builds the proxy over an already-opened session layer.
    pub fn new(cfg: &Config, sessions: Sessions) -> Self {
        let url = &cfg.upstream.url;
        let authority = url.authority().expect("validated: upstream.url has a host");
        let port = authority.port_u16().unwrap_or(80);
        let addr = format!(
            "{}:{port}",
            authority
                .host()
                .trim_start_matches('[')
                .trim_end_matches(']')
        );
        let upstream = Upstream::new(
            addr,
            cfg.upstream.max_connections,
            cfg.upstream.connect_timeout,
            cfg.upstream.idle_timeout,
            cfg.upstream.response_header_timeout,
            cfg.upstream.affinity,
            cfg.upstream.drain,
            cfg.server.threads,
        )
        .with_shares(cfg.upstream.max_connections_per_user);
        let verifier = Verifier::new(&cfg.token);
        let login = Login::from_config(cfg, &verifier);
        Self {
            login,
            limits: Limits {
                max_header_bytes: cfg.server.max_header_bytes,
                max_uri_bytes: cfg.server.max_uri_bytes,
                max_body_bytes: cfg.server.max_body_bytes,
                allow_encoded_slashes: cfg.server.allow_encoded_slashes,
            },
            body_timeout: cfg.server.client_body_timeout,
            sources: cfg.token.sources.clone(),
            verifier,
            sessions,
            upstream,
            base_path: url.path().trim_end_matches('/').to_owned(),
            upstream_host: HeaderValue::from_str(authority.as_str())
                .expect("authority is a valid header"),
            preserve_host: cfg.upstream.preserve_host,
            strip_response: cfg.upstream.strip_response_headers.clone(),
            access_log: cfg.log.access_log,
            request_counts: cfg
                .metrics
                .as_ref()
                .map(|_| RequestCounts::new(cfg.server.threads)),
            reload_counts: Default::default(),
            trusted_proxies: cfg.server.trusted_proxies.clone(),
            websockets: (cfg.websocket.max_connections > 0).then(|| WebSockets {
                slots: Arc::new(tokio::sync::Semaphore::new(cfg.websocket.max_connections)),
                max: cfg.websocket.max_connections,
                idle_timeout: cfg.websocket.idle_timeout,
                allowed_origins: cfg.websocket.allowed_origins.clone(),
                opened: AtomicU64::new(0),
                tunnels: tokio_util::task::TaskTracker::new(),
                stop: tokio_util::sync::CancellationToken::new(),
            }),
        }
    }

    /// Shutdown of WebSocket tunnels: every open one (and any opened from now on) sends both
    /// sides a Close frame 1001 (going away) and ends within about a second
    /// ([`crate::upstream::CLOSING_WAIT`]). Call it when shutdown starts; [`Self::tunnels_closed`]
    /// waits for them.
    pub fn close_websockets(&self) {
        if let Some(ws) = &self.websockets {
            ws.stop.cancel();
            ws.tunnels.close();
        }
    }

    /// Resolves once no WebSocket tunnel runs (at once when upgrades are off), after
    /// [`Self::close_websockets`]; a tunnel spawned by a handshake still being answered is
    /// waited for too if that handshake's connection was waited for first. The tunnels of every
    /// serving thread count, so each thread's drain waits for the slowest (bounded by the
    /// caller's drain time; a thread that gives up drops its own tunnels).
    pub async fn tunnels_closed(&self) {
        if let Some(ws) = &self.websockets {
            ws.tunnels.wait().await;
        }
    }

    /// WebSocket tunnels `(open now, opened since start)`; `None` when upgrades are not passed
    /// (`websocket.max_connections = 0`).
    pub fn websockets(&self) -> Option<(u64, u64)> {
        self.websockets.as_ref().map(|w| {
            let open = w.max.saturating_sub(w.slots.available_permits()) as u64;
            (open, w.opened.load(Ordering::Relaxed))
        })
    }

    /// The peer of a connection from `addr`: trusted (its requests name their client in
    /// `X-Forwarded-For`) when `addr` is in `server.trusted_proxies` (an IPv4-mapped IPv6
    /// address, as a dual-stack listener reports IPv4 peers, is matched as IPv4).
    pub fn peer(&self, addr: SocketAddr) -> Peer {
        let peer = Peer::new(addr);
        Peer {
            trusted: self
                .trusted_proxies
                .iter()
                .any(|net| net.contains(&peer.addr.ip())),
            ..peer
        }
    }

    /// Builds the sealer + store + cached session layer + proxy from config (what `serve` uses;
    /// needs a tokio runtime).
    ///
    /// Errors: the session store cannot be opened.
    pub fn from_config(cfg: &Config) -> Result<Self, crate::session::StoreError> {
        Ok(Self::new(cfg, crate::serving_sessions(cfg)?))
    }

    /// The token verifier (its key set refreshes the JWKS).
    pub fn verifier(&self) -> &Verifier {
        &self.verifier
    }

    /// Puts the keys of a reloaded configuration in place (SIGHUP): the JWT keys
    /// (`token.secret`, `[[token.keys]]`, `token.active_kid`) and the sealing keys
    /// (`credentials.keys`, `credentials.active`). No connection is dropped and requests in
    /// flight go on. Cached verifications and cached sessions are forgotten, and sessions with
    /// open responses read again, so a key removed stops working at once. Every other setting
    /// in `cfg` is ignored: a restart applies it. Needs a tokio runtime (the rereads are
    /// tasks).
    ///
    /// Returns a summary for the log (key ids only). Errors, as a sentence naming the key,
    /// with nothing changed: see [`Verifier::load_keys`]; or the login endpoints are served and
    /// no key of `cfg` can sign.
    pub fn reload_keys(&self, cfg: &Config) -> Result<String, String> {
        let keys = self.verifier.load_keys(&cfg.token)?;
        if self.login.is_some() && !keys.can_sign() {
            return Err(
                "config key `token.active_kid`: no key can sign, and tessera serves \
                 [login]; name a key with a secret or private_key (a restart applies a config \
                 without [login])"
                    .into(),
            );
        }
        let summary = format!(
            "token kids [{}], signing {}; sealing keys [{}], active {}",
            keys.kids().join(", "),
            keys.signing_kid().unwrap_or("none"),
            cfg.credentials
                .keys
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", "),
            cfg.credentials.active
        );
        self.verifier.install_keys(keys);
        self.sessions.replace_sealing_keys(&cfg.credentials);
        Ok(summary)
    }

    /// The session layer (its counters, for metrics).
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// Outcomes of configuration reloads (counted by [`crate::run`]).
    pub fn reload_counts(&self) -> &crate::telemetry::ReloadCounts {
        &self.reload_counts
    }

    /// Requests answered by status code (`None` unless `[metrics]` is configured).
    pub fn request_counts(&self) -> Option<&RequestCounts> {
        self.request_counts.as_ref()
    }

    /// The upstream (pool counters for tests and benchmarks).
    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    /// Handles one downstream request end to end. Never fails: errors become responses.
    pub async fn handle<B>(&self, req: Request<B>, peer: &Peer) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        let mut resp = self.respond(req, peer).await;
        crate::upstream::materialize(&mut resp);
        resp
    }

    /// [`Proxy::handle`] for a writer that reads an upstream response's fields from the body
    /// ([`ProxyBody::take_fields`], already screened) and the rest from the `HeaderMap`: the
    /// fields never become map entries.
    pub async fn respond<B>(&self, req: Request<B>, peer: &Peer) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        let mut ctx = Ctx::default();
        if req.version() == Version::HTTP_2 {
            ctx.share = peer
                .share
                .get_or_init(|| self.upstream.connection_share())
                .clone();
        }
        let relayed;
        let peer = if peer.trusted {
            relayed = peer.relayed(req.headers(), &self.trusted_proxies);
            &relayed
        } else {
            peer
        };
        let logged = (self.access_log && crate::access_log::enabled())
            .then(|| (req.method().clone(), req.uri().path().to_owned()));
        let started = (logged.is_some() || self.request_counts.is_some()).then(Instant::now);
        // Written below when the answer is ready, or as 499 if this future is dropped first.
        let mut record = Record {
            proxy: self,
            peer: peer.addr.ip(),
            logged,
            started,
            written: false,
        };
        let (resp, reason) = match self.process(req, peer, &mut ctx).await {
            Ok(resp) => (resp, None),
            Err(e) => {
                let reason = e.to_string();
                (e.into_response(), Some(reason))
            }
        };
        record.write(
            resp.status().as_u16(),
            ctx.sid.as_deref(),
            reason.as_deref().or(ctx.reason.as_deref()),
        );
        resp
    }

    async fn process<B>(
        &self,
        req: Request<B>,
        peer: &Peer,
        ctx: &mut Ctx,
    ) -> Result<Response<ProxyBody>, ProxyError>
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        let (mut parts, body) = req.into_parts();
        let screened = screen::screen_request(&mut parts, &self.limits)?;
        if let Some(login) = &self.login {
            if let Some(endpoint) = login.route(parts.uri.path()) {
                // Boxed: the login future (an upstream check, a store write) is many times the
                // size of the proxy path's, and every request's future would carry its size.
                let (resp, reason) = Box::pin(login.handle(
                    endpoint,
                    &parts,
                    body,
                    &screened.host,
                    peer.addr,
                    &self.verifier,
                    &self.sessions,
                    &self.upstream,
                    &mut ctx.sid,
                ))
                .await;
                ctx.reason = reason;
                return Ok(resp);
            }
        }
        let session = match self.authenticate(&parts, ctx).await {
            Ok(s) => s,
            Err(e) => {
                return match &self.login {
                    Some(login)
                        if e.status() == http::StatusCode::UNAUTHORIZED
                            && Login::wants_login_page(&parts) =>
                    {
                        ctx.reason = Some(format!("{e}; sent to the login page"));
                        let target = parts.uri.path_and_query().map_or("/", PathAndQuery::as_str);
                        Ok(login.login_redirect(target))
                    }
                    _ => Err(e),
                };
            }
        };
        let upgrading = if screened.websocket {
            self.upgrading(&mut parts, &screened, peer.proto, body.is_end_stream())?
        } else {
            None
        };
        let target = self.upstream_uri(&parts.uri)?;
        self.inject(&mut parts, &screened, &session, peer, target);
        if upgrading.is_some() {
            let h = &mut parts.headers;
            h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        }
        let req = Request::from_parts(parts, self.limit_body(body));
        let shares = RequestShares {
            user: session
                .upstream_share
                .get_or_init(|| self.upstream.user_share(&session.authorization))
                .clone(),
            connection: ctx.share.take(),
        };
        let mut resp = self.upstream.forward_on(req, shares).await?;
        if let Some(upgrading) = upgrading {
            if let Some(tunnel) = resp.body_mut().take_tunnel() {
                return Ok(self.switch(resp, tunnel, upgrading, ctx, &session));
            }
        }
        if resp.body_mut().may_wait() {
            // The body may wait for the upstream: it ends with the session (logout, expiry).
            // (Not asked of a body already in memory: a watch is an allocation, 1.5% of a
            // warm request's instructions.)
            if let Some(sid) = &ctx.sid {
                if let Some(w) = self.sessions.revocable(sid.clone(), &session) {
                    resp.body_mut().end_with_session(w);
                }
            }
        }
        // An upstream response's fields are all in its body until `materialize` (its map is
        // empty), so they are screened there.
        if let Some(fields) = resp.body_mut().fields_mut() {
            screen::screen_response(fields, &self.strip_response);
        }
        if resp.status() == http::StatusCode::UNAUTHORIZED {
            // Boxed, as the session store's futures are (see `Sessions::resolve`).
            return Ok(Box::pin(self.upstream_rejected(ctx)).await);
        }
        Ok(resp)
    }

    /// Whether a WebSocket upgrade request (authenticated) is passed on as one: `None` when
    /// upgrades are off or the connection cannot switch (no `OnUpgrade`: not hyper's HTTP/1.1),
    /// and the request then goes upstream as a plain `GET` (its `Upgrade` already removed).
    ///
    /// Errors: 403 when a browser page of a foreign origin asks ([`ProxyError::ForeignOrigin`]);
    /// 400 when the request has a body; 503 when `websocket.max_connections` tunnels are open.
    fn upgrading(
        &self,
        parts: &mut Parts,
        screened: &Screened,
        scheme: &str,
        no_body: bool,
    ) -> Result<Option<Upgrading>, ProxyError> {
        let Some(ws) = &self.websockets else {
            return Ok(None);
        };
        // Taken out at once: a refused handshake is answered as any request (no switch).
        let Some(downstream) = parts.extensions.remove::<hyper::upgrade::OnUpgrade>() else {
            return Ok(None);
        };
        if let Some(origin) = parts.headers.get(header::ORIGIN) {
            if !origin_allowed(origin, scheme, &screened.host, &ws.allowed_origins) {
                return Err(ProxyError::ForeignOrigin);
            }
        }
        if !no_body {
            return Err(ProxyError::BadRequest(
                "WebSocket upgrade request with a body",
            ));
        }
        let slot = ws
            .slots
            .clone()
            .try_acquire_owned()
            .map_err(|_| ProxyError::TooManyWebSockets)?;
        Ok(Some(Upgrading { downstream, slot }))
    }

    /// The upstream switched to WebSocket: answers the client 101 with the upstream's fields
    /// (screened; `Connection` and `Upgrade` set anew) and starts the tunnel, which runs in a
    /// task of its own once hyper has written the 101, until either side closes, it idles out
    /// (`websocket.idle_timeout_ms`), the session is revoked or expires, or shutdown
    /// ([`Self::close_websockets`]).
    fn switch(
        &self,
        mut resp: Response<ProxyBody>,
        tunnel: Tunnel,
        upgrading: Upgrading,
        ctx: &Ctx,
        session: &Session,
    ) -> Response<ProxyBody> {
        let ws = self
            .websockets
            .as_ref()
            .expect("upgrading implies websockets");
        ws.opened.fetch_add(1, Ordering::Relaxed);
        let mut out = Response::new(ProxyBody::empty());
        *out.status_mut() = http::StatusCode::SWITCHING_PROTOCOLS;
        if let Some(mut fields) = resp.body_mut().take_fields() {
            screen::screen_response(&mut fields, &self.strip_response);
            fields.append_to(out.headers_mut());
        }
        let h = out.headers_mut();
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        let sid = ctx.sid.clone();
        let watch = sid
            .as_ref()
            .and_then(|sid| self.sessions.revocable(sid.clone(), session));
        let idle = ws.idle_timeout;
        let stop = ws.stop.clone();
        ws.tunnels.spawn(async move {
            let Upgrading { downstream, slot } = upgrading;
            let sid_hash = sid.as_deref().map(crate::session::sid_hash);
            // hyper hands the connection over once the 101 is written; a client that does not
            // read it must not hold the slot and the upstream connection for ever, nor hold up
            // a shutdown.
            let upgraded = tokio::select! {
                taken = tokio::time::timeout(UPGRADE_WAIT, downstream) => Some(taken),
                () = stop.cancelled() => None,
            };
            let Some(upgraded) = upgraded else {
                tracing::debug!("WebSocket 101 not taken by the client before shutdown");
                return;
            };
            match upgraded {
                Ok(Ok(io)) => {
                    let report = tunnel
                        .run(crate::downstream::downstream(io), idle, watch, stop)
                        .await;
                    tracing::info!(
                        sid_hash = sid_hash.as_deref().unwrap_or("-"),
                        end = %report.end,
                        close_code = report.close_code.unwrap_or(0),
                        up_bytes = report.up_bytes,
                        down_bytes = report.down_bytes,
                        duration_ms = report.duration.as_millis() as u64,
                        "WebSocket closed"
                    );
                }
                Ok(Err(e)) => {
                    tracing::debug!(cause = %e, "client side of a WebSocket upgrade failed")
                }
                Err(_) => tracing::debug!("WebSocket 101 not taken by the client in time"),
            }
            drop(slot);
        });
        out
    }

    /// extract -> verify -> resolve (+ unseal): the session a request's token names.
    async fn authenticate(
        &self,
        parts: &Parts,
        ctx: &mut Ctx,
    ) -> Result<std::sync::Arc<Session>, ProxyError> {
        let token = token::extract(&parts.headers, &self.sources)?;
        let verified = self.verifier.verify_refreshing(&token, unix_now()).await?;
        drop(token);
        let session = self.sessions.resolve(&verified.sid).await;
        ctx.sid = Some(verified.sid);
        Ok(session?)
    }

    /// The upstream refused the stored credentials (the password was changed or the account
    /// closed): the session is useless, so it is deleted, and the client gets a Bearer challenge
    /// saying why instead of the upstream's `Basic` one (which would make a browser prompt for
    /// the upstream password).
    async fn upstream_rejected(&self, ctx: &mut Ctx) -> Response<ProxyBody> {
        if let Some(sid) = &ctx.sid {
            match self.sessions.revoke(sid).await {
                Ok(_) => ctx.reason = Some("upstream rejected credentials; session deleted".into()),
                Err(e) => {
                    ctx.reason = Some(format!("upstream rejected credentials; delete failed: {e}"))
                }
            }
        }
        let mut resp = Response::new(ProxyBody::full("Unauthorized\n"));
        *resp.status_mut() = http::StatusCode::UNAUTHORIZED;
        let h = resp.headers_mut();
        h.insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static(UPSTREAM_REJECTED),
        );
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(login) = &self.login {
            h.append(header::SET_COOKIE, login.clear_token_cookie());
        }
        resp
    }

    /// inject: drop every client credential, set the upstream's, set forwarding headers and
    /// rewrite the target for the upstream (origin-form, base path, `Host`).
    fn inject(
        &self,
        parts: &mut Parts,
        screened: &Screened,
        session: &Session,
        peer: &Peer,
        target: Uri,
    ) {
        let headers = &mut parts.headers;
        // The client's `Authorization` values go with the insert of the upstream's below.
        if screened.cookie_is_hop_by_hop {
            headers.remove(header::COOKIE);
        } else {
            token::strip_token_cookies(headers, &self.sources);
        }
        headers.insert(header::AUTHORIZATION, session.authorization.clone());
        screen::set_forwarded(
            headers,
            peer.forwarded_for.as_ref(),
            peer.proto,
            &screened.host,
        );
        let host = if self.preserve_host && !screened.host.is_empty() {
            screened.host.clone()
        } else {
            self.upstream_host.clone()
        };
        headers.insert(header::HOST, host);
        parts.uri = target;
        parts.version = Version::HTTP_11;
    }

    /// The origin-form target sent upstream: the base path + the client's path and query.
    ///
    /// Errors: 400 for `*` under a base path, 414 if the result is no valid URI (too long).
    fn upstream_uri(&self, uri: &Uri) -> Result<Uri, ProxyError> {
        if self.base_path.is_empty() && uri.scheme().is_none() && uri.authority().is_none() {
            // Already origin-form: reused as is (its bytes are shared, not copied or re-parsed).
            return Ok(uri.clone());
        }
        let pq = uri.path_and_query().map_or("/", PathAndQuery::as_str);
        if self.base_path.is_empty() {
            return pq.parse().map_err(|_| ProxyError::UriTooLong);
        }
        if pq == "*" {
            return Err(ProxyError::BadRequest("asterisk-form under a base path"));
        }
        format!("{}{pq}", self.base_path)
            .parse()
            .map_err(|_| ProxyError::UriTooLong)
    }

    fn limit_body<B>(&self, body: B) -> UpBody
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        screen::body::limit(body, self.limits.max_body_bytes, self.body_timeout)
    }
}

/// Whether a WebSocket upgrade with this `Origin` may go on (RFC 6455 section 10.2): the origin
/// is the request's own, `scheme://host` (`scheme` as the client used it: `http`, or what a
/// trusted proxy reported in `X-Forwarded-Proto`; a plain-HTTP page cannot speak for an HTTPS
/// site), or one of `allowed` (lowercase `scheme://host[:port]`, default ports removed). ASCII
/// case is ignored; `null` and anything else are refused.
fn origin_allowed(
    origin: &HeaderValue,
    scheme: &str,
    host: &HeaderValue,
    allowed: &[String],
) -> bool {
    let origin = origin.as_bytes();
    let own = origin.len() == scheme.len() + 3 + host.len()
        && origin[..scheme.len()].eq_ignore_ascii_case(scheme.as_bytes())
        && &origin[scheme.len()..scheme.len() + 3] == b"://"
        && origin[scheme.len() + 3..].eq_ignore_ascii_case(host.as_bytes());
    own || allowed
        .iter()
        .any(|a| a.as_bytes().eq_ignore_ascii_case(origin))
}

/// One request's access line and metrics, written once: by [`Proxy::respond`] when the answer is
/// ready, or, when its future is dropped before (the client went away: see
/// `downstream::h1::ClientWatch`; hyper drops it on an h2 stream reset), as 499 (nginx's "client
/// closed request").
struct Record<'a> {
    proxy: &'a Proxy,
    peer: std::net::IpAddr,
    /// Method and path, when the access log is on.
    logged: Option<(http::Method, String)>,
    /// When the request head was read (`None`: neither log nor metrics want it).
    started: Option<Instant>,
    written: bool,
}

/// The status logged for a request the client gave up on (nginx's non-standard 499).
const CLIENT_CLOSED: u16 = 499;

impl Record<'_> {
    /// Writes the access line (with the session's `sid` hashed, and `reason`) and counts the
    /// request under `status` with its duration so far.
    fn write(&mut self, status: u16, sid: Option<&str>, reason: Option<&str>) {
        self.written = true;
        let took = self.started.map(|s| s.elapsed()).unwrap_or_default();
        if let Some((method, path)) = &self.logged {
            crate::access_log::write(&crate::access_log::Line {
                peer: self.peer,
                method: method.as_str(),
                path,
                status,
                duration_us: u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
                sid,
                reason,
            });
        }
        if let Some(counts) = &self.proxy.request_counts {
            counts.record(status, took);
        }
    }
}

impl Drop for Record<'_> {
    fn drop(&mut self) {
        if !self.written {
            self.write(
                CLIENT_CLOSED,
                None,
                Some("answer dropped unfinished: the client went away (or shutdown's drain time ended)"),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_websocket_origin_must_name_the_requested_host_or_be_listed() {
        let host = HeaderValue::from_static("mail.example.com:8080");
        let allowed = ["https://app.example.net".to_string()];
        let ok = |origin: &str| {
            origin_allowed(
                &HeaderValue::from_str(origin).unwrap(),
                "https",
                &host,
                &allowed,
            )
        };
        assert!(ok("https://mail.example.com:8080"));
        assert!(ok("HTTPS://MAIL.example.com:8080"), "any case");
        assert!(
            !ok("http://mail.example.com:8080"),
            "a plain-HTTP page for an HTTPS site"
        );
        assert!(origin_allowed(
            &HeaderValue::from_static("http://mail.example.com:8080"),
            "http",
            &host,
            &allowed
        ));
        assert!(ok("https://app.example.net"));
        assert!(ok("HTTPS://APP.example.net"));
        assert!(
            !ok("https://mail.example.com"),
            "another port is another origin"
        );
        assert!(!ok("https://evil.example"));
        assert!(!ok("https://mail.example.com:8080.evil.example"));
        assert!(!ok("null"));
        assert!(!ok("mail.example.com:8080"), "no scheme");
    }
}
