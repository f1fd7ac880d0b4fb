//! The request path, as named phases in their fixed order:
//! screen -> extract -> verify -> resolve (+ unseal) -> inject -> forward -> log.
//!
//! Each phase is one small function; [`Proxy::handle`] runs them top to bottom and turns any
//! failure into a response in one place ([`ProxyError::into_response`]). Must never: forward a
//! request after any failure, or write a token or credential to a log line.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{HeaderValue, Request, Response, Uri, Version};
use http_body::Body;
use http_body_util::BodyExt;

use crate::config::Config;
use crate::error::ProxyError;
use crate::forward::{BoxError, ProxyBody, UpBody, Upstream};
use crate::login::Login;
use crate::screen::{self, Limits, Screened};
use crate::session::{Session, Sessions};
use crate::telemetry::RequestCounts;
use crate::token::{self, TokenSource, Verifier};
use crate::unix_now;

/// Everything the request path needs, built once from the config.
pub struct Proxy {
    limits: Limits,
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
    /// `server.trusted_proxies`.
    trusted_proxies: Vec<ipnet::IpNet>,
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
            cfg.server.threads,
        );
        let verifier = Verifier::new(&cfg.token);
        let login = Login::from_config(cfg, &verifier);
        Self {
            login,
            limits: Limits {
                max_header_bytes: cfg.server.max_header_bytes,
                max_uri_bytes: cfg.server.max_uri_bytes,
                max_body_bytes: cfg.server.max_body_bytes,
            },
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
            trusted_proxies: cfg.server.trusted_proxies.clone(),
        }
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

    /// The session layer (its counters, for metrics).
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
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
        crate::forward::materialize(&mut resp);
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
        let mut ctx = Ctx::default();
        let (resp, reason) = match self.process(req, peer, &mut ctx).await {
            Ok(resp) => (resp, None),
            Err(e) => {
                let reason = e.to_string();
                (e.into_response(), Some(reason))
            }
        };
        let took = started.map(|s| s.elapsed()).unwrap_or_default();
        if let Some((method, path)) = logged {
            crate::access_log::write(&crate::access_log::Line {
                peer: peer.addr.ip(),
                method: method.as_str(),
                path: &path,
                status: resp.status().as_u16(),
                duration_us: u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
                sid: ctx.sid.as_deref(),
                reason: reason.as_deref().or(ctx.reason.as_deref()),
            });
        }
        if let Some(counts) = &self.request_counts {
            counts.record(resp.status().as_u16(), took);
        }
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
        let target = self.upstream_uri(&parts.uri)?;
        self.inject(&mut parts, &screened, &session, peer, target);
        let req = Request::from_parts(parts, self.limit_body(body));
        let mut resp = self.upstream.forward(req).await?;
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
        if self.limits.max_body_bytes > 0 {
            http_body_util::Limited::new(body, self.limits.max_body_bytes as usize).boxed()
        } else {
            body.map_err(Into::into).boxed()
        }
    }
}
