//! The request path, as named phases in their fixed order:
//! screen -> extract -> verify -> resolve (+ unseal) -> inject -> forward -> log.
//!
//! Each phase is one small function ([`phases`]); [`Proxy::handle`] ([`flow`]) runs them top to
//! bottom and turns any failure into a response in one place
//! ([`crate::error::ProxyError::into_response`]). Must never:
//! forward a request after any failure, or write a token or credential to a log line.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::HeaderValue;

use crate::login::{Login, LoginConfig};
use crate::screen::{self, Limits};
use crate::session::Sessions;
use crate::telemetry::RequestCounts;
use crate::token::{TokenSource, Verifier};
use crate::upstream::Upstream;
use crate::Config;

mod ctx;
mod flow;
mod keys;
mod observed;
mod phases;
mod redirect;
mod settings;
mod websocket;

pub use ctx::Peer;
use ctx::RequestCtx;
pub use keys::{ReadyKeys, ReloadError};
pub use settings::WebSocketConfig;
pub use websocket::ConnectionHold;
use websocket::WebSockets;

/// Everything the request path needs, built once from the config.
pub struct Proxy {
    limits: Limits,
    /// `server.allow_encoded_slashes_under`: path prefixes screened as with
    /// `allow_encoded_slashes`.
    slashes_under: Vec<String>,
    /// `upstream.strip_request_headers`.
    stripped: screen::Stripped,
    /// `server.max_connections`: client connections open now, all serving threads together;
    /// `None` without a limit.
    client_connections: Option<Arc<crate::share::Share>>,
    /// `server.max_connections_per_ip`; `None` without a limit.
    per_ip: Option<Arc<crate::per_ip::PerIp>>,
    /// `server.client_body_timeout_ms`.
    body_timeout: Duration,
    sources: Vec<TokenSource>,
    /// The cookies removed before a request goes upstream: every token source's and, with
    /// `[login]`, those of the default sources (`tessera`, `Authorization`), which a login
    /// deployment reads no more (config/login.rs) but browsers may still carry.
    token_cookies: Vec<TokenSource>,
    verifier: Verifier,
    sessions: Sessions,
    upstream: Upstream,
    /// Upstream path prefix (no trailing `/`), prepended to every request path.
    base_path: String,
    /// `Host` sent upstream when `preserve_host = false`.
    upstream_host: HeaderValue,
    /// `upstream.url`'s scheme, `http` or `https`: redirects naming it are the upstream's own.
    upstream_scheme: &'static str,
    preserve_host: bool,
    strip_response: Vec<HeaderName>,
    /// With `[login]`, the cookies tessera sets (the login cookie, `-csrf`, `-device`): an
    /// upstream `Set-Cookie` of one of them is dropped.
    own_cookies: Vec<String>,
    /// `upstream.request_id_header`.
    request_id: Option<HeaderName>,
    /// `server.response_headers`: set on every response.
    response_headers: Vec<(HeaderName, HeaderValue)>,
    /// `server.private_responses`.
    private_responses: screen::PrivateResponses,
    access_log: bool,
    /// The session-side endpoints, when `[login]` is configured.
    login: Option<Login>,
    /// Requests by status, when `[metrics]` is configured.
    request_counts: Option<RequestCounts>,
    /// Outcomes of configuration reloads (SIGHUP).
    reload_counts: crate::telemetry::ReloadCounts,
    /// QUIC handshakes; `None` without `[http3]`.
    quic_counts: Option<Arc<crate::telemetry::QuicCounts>>,
    /// TLS handshakes over TCP; `None` without `[tls]`.
    tls_counts: Option<crate::telemetry::TlsCounts>,
    /// `server.trusted_proxies`.
    trusted_proxies: Vec<ipnet::IpNet>,
    /// `[websocket]`; `None` when `websocket.max_connections = 0` (upgrades not passed).
    websockets: Option<WebSockets>,
    /// `[jmap]`: the session resource's URLs made absolute.
    jmap: Option<crate::jmap::JmapConfig>,
    /// `[cors]`: preflights answered, allowed origins' answers marked.
    cors: Option<crate::cors::Cors>,
    /// How a WebSocket's client side is made from hyper's upgraded connection (the downstream's
    /// own socket, see [`Proxy::with_client_side`]).
    client_side: crate::upstream::ClientSideFn,
}

/// [`Proxy::token_cookies`]'s list: with `[login]`, also tessera's own cookies (the login
/// form's CSRF cookie and the device cookie besides the login cookie), which no upstream is
/// to see.
fn token_cookies(sources: &[TokenSource], login: Option<&LoginConfig>) -> Vec<TokenSource> {
    let mut all = sources.to_vec();
    if let Some(login) = login {
        for default in TokenSource::defaults() {
            if default != TokenSource::Bearer && !all.contains(&default) {
                all.push(default);
            }
        }
        for own in login.own_cookies().map(TokenSource::Cookie) {
            if !all.contains(&own) {
                all.push(own);
            }
        }
    }
    all
}

impl Proxy {
    /// Builds the proxy over an already-opened session layer.
    pub fn new(cfg: &Config, sessions: Sessions) -> Self {
        let url = &cfg.upstream.url;
        let authority = url.authority().expect("validated: upstream.url has a host");
        let upstream = Upstream::new(cfg.upstream.addr(), &cfg.upstream, cfg.server.threads);
        let verifier = Verifier::new(&cfg.token);
        let login = Login::from_config(cfg, &verifier);
        Self {
            login,
            // A client's own request id goes in every spelling (`_` for `-` included); a
            // trusted proxy's was read before the screen.
            stripped: screen::Stripped::new(
                &(cfg
                    .upstream
                    .strip_request_headers
                    .iter()
                    .map(String::as_str))
                .chain(cfg.upstream.request_id_header.as_ref().map(|n| n.as_str()))
                .collect::<Vec<_>>(),
            ),
            client_connections: (cfg.server.max_connections > 0)
                .then(|| Arc::new(crate::share::Share::new(cfg.server.max_connections))),
            per_ip: (cfg.server.max_connections_per_ip > 0)
                .then(|| Arc::new(crate::per_ip::PerIp::new(cfg.server.max_connections_per_ip))),
            slashes_under: cfg.server.allow_encoded_slashes_under.clone(),
            limits: Limits {
                max_header_bytes: cfg.server.max_header_bytes,
                max_uri_bytes: cfg.server.max_uri_bytes,
                max_body_bytes: cfg.server.max_body_bytes,
                allow_encoded_slashes: cfg.server.allow_encoded_slashes,
            },
            body_timeout: cfg.server.client_body_timeout,
            sources: cfg.token.sources.clone(),
            token_cookies: token_cookies(&cfg.token.sources, cfg.login.as_ref()),
            verifier,
            sessions,
            upstream,
            base_path: url.path().trim_end_matches('/').to_owned(),
            upstream_host: HeaderValue::from_str(authority.as_str())
                .expect("authority is a valid header"),
            upstream_scheme: match url.scheme_str() {
                Some("https") => "https",
                _ => "http",
            },
            preserve_host: cfg.upstream.preserve_host,
            // An upstream field that `server.response_headers`, the request id or `[cors]`
            // sets is replaced, not doubled.
            strip_response: (cfg.upstream.strip_response_headers.iter())
                .chain(cfg.server.response_headers.iter().map(|(name, _)| name))
                .chain(&cfg.upstream.request_id_header)
                .chain(cfg.cors.iter().flat_map(|_| &crate::cors::UPSTREAM_FIELDS))
                .cloned()
                .collect(),
            own_cookies: cfg.login.iter().flat_map(|l| l.own_cookies()).collect(),
            response_headers: cfg.server.response_headers.clone(),
            private_responses: cfg.server.private_responses,
            request_id: cfg.upstream.request_id_header.clone(),
            access_log: cfg.log.access_log,
            request_counts: cfg
                .metrics
                .as_ref()
                .map(|_| RequestCounts::new(cfg.server.threads)),
            reload_counts: Default::default(),
            quic_counts: cfg.http3.as_ref().map(|_| Default::default()),
            tls_counts: cfg.tls.as_ref().map(|_| Default::default()),
            trusted_proxies: cfg.server.trusted_proxies.clone(),
            client_side: crate::upstream::upgraded_as_is,
            jmap: cfg.jmap.clone(),
            cors: cfg.cors.clone(),
            websockets: (cfg.websocket.max_connections > 0).then(|| WebSockets {
                slots: Arc::new(tokio::sync::Semaphore::new(cfg.websocket.max_connections)),
                users: crate::upstream::Shares::new(
                    cfg.websocket.max_connections_per_user,
                    cfg.websocket.max_connections,
                ),
                max: cfg.websocket.max_connections,
                idle_timeout: cfg.websocket.idle_timeout,
                send_timeout: cfg.server.send_timeout,
                allowed_origins: cfg.websocket.allowed_origins.clone(),
                opened: AtomicU64::new(0),
                tunnels: tokio_util::task::TaskTracker::new(),
                stop: tokio_util::sync::CancellationToken::new(),
            }),
        }
    }

    /// Makes WebSocket client sides with `f` (the downstream's `client_side`, which unwraps
    /// hyper's upgraded connection to the socket) instead of hyper's upgraded stream as it is.
    pub fn with_client_side(mut self, f: crate::upstream::ClientSideFn) -> Self {
        self.client_side = f;
        self
    }

    /// The peer of a connection from `addr`: trusted (its requests name their client in
    /// `X-Forwarded-For`) when `addr` is in `server.trusted_proxies` (an IPv4-mapped IPv6
    /// address, as a dual-stack listener reports IPv4 peers, is matched as IPv4).
    pub fn peer(&self, addr: SocketAddr) -> Peer {
        let peer = Peer::new(addr);
        Peer {
            trusted: self.trusts(peer.addr.ip()),
            ..peer
        }
    }

    /// Whether `ip` is in `server.trusted_proxies` (an IPv4-mapped IPv6 address as IPv4).
    pub fn trusts(&self, ip: std::net::IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.trusted_proxies.iter().any(|net| net.contains(&ip))
    }

    /// Builds the sealer + store + cached session layer + proxy from config (what `serve` uses;
    /// needs a tokio runtime).
    ///
    /// Errors: the session store cannot be opened.
    pub fn from_config(cfg: &Config) -> Result<Self, crate::session::StoreError> {
        Ok(Self::new(cfg, crate::serving_sessions(cfg)?))
    }

    /// The bound on client connections (`server.max_connections`), taken by the accept loop
    /// for each connection; `None` without a limit.
    pub fn client_connections(&self) -> Option<&Arc<crate::share::Share>> {
        self.client_connections.as_ref()
    }

    /// A place for a client connection from `ip` under `server.max_connections_per_ip`:
    /// `Ok(None)` without a limit or for a trusted proxy (which relays many clients).
    ///
    /// Errors: [`crate::per_ip::OverLimit`] when `ip` holds its limit already (counted, and
    /// said once in the log).
    pub fn enter_per_ip(
        &self,
        ip: std::net::IpAddr,
    ) -> Result<Option<crate::per_ip::IpPlace>, crate::per_ip::OverLimit> {
        let Some(per_ip) = &self.per_ip else {
            return Ok(None);
        };
        if self.trusts(ip) {
            return Ok(None);
        }
        match per_ip.enter(ip) {
            Some(place) => Ok(Some(place)),
            None => {
                static WARNED: std::sync::atomic::AtomicBool =
                    std::sync::atomic::AtomicBool::new(false);
                if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(
                        max = per_ip.limit(),
                        "a client address holds server.max_connections_per_ip connections; its \
                         new ones are closed (counted in \
                         tessera_client_connections_over_ip_limit_total)"
                    );
                }
                Err(crate::per_ip::OverLimit)
            }
        }
    }

    /// Whether `server.max_connections_per_ip` is set.
    pub fn limits_per_ip(&self) -> bool {
        self.per_ip.is_some()
    }

    /// Connections refused under `server.max_connections_per_ip` since start; `None` without it.
    pub fn per_ip_refused(&self) -> Option<u64> {
        self.per_ip.as_ref().map(|p| p.refused())
    }

    /// The token verifier (its key set refreshes the JWKS).
    pub fn verifier(&self) -> &Verifier {
        &self.verifier
    }

    /// The session layer (its counters, for metrics).
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// Outcomes of configuration reloads (counted by [`crate::run`]).
    pub fn reload_counts(&self) -> &crate::telemetry::ReloadCounts {
        &self.reload_counts
    }

    /// QUIC handshakes (`None` without `[http3]`), counted by the HTTP/3 endpoint.
    pub fn quic_counts(&self) -> Option<&Arc<crate::telemetry::QuicCounts>> {
        self.quic_counts.as_ref()
    }

    /// TLS handshakes on the TLS listener (`None` without `[tls]`), counted by the downstream.
    pub fn tls_counts(&self) -> Option<&crate::telemetry::TlsCounts> {
        self.tls_counts.as_ref()
    }

    /// Requests answered by status code (`None` unless `[metrics]` is configured).
    pub fn request_counts(&self) -> Option<&RequestCounts> {
        self.request_counts.as_ref()
    }

    /// The upstream (pool counters for tests and benchmarks).
    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }
}
