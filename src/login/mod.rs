//! The session side: `{prefix}/login` (page and endpoint), `{prefix}/logout`, `{prefix}/session`.
//!
//! Login checks the user's credentials against the upstream itself (`login.verify_path` must
//! answer 2xx to them), creates a fresh session with the credentials sealed, and issues a token
//! signed by the active key, as a cookie and in the JSON body ([`attempt`]). Failed attempts are
//! limited per client address and per user name: in this process ([`limit`]), and across every
//! instance on the same session store (counters in the store). Must never: log a password or
//! token, reuse a session id a client sent, create a session when the upstream did not say yes,
//! or redirect anywhere but a same-origin path.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use http_body::Body;

use crate::token::TokenConfig;
use crate::Config;

mod settings;

use crate::session::Sessions;
use crate::token::{Keys, Verifier};
use crate::upstream::{BoxError, ProxyBody, Upstream};
pub use settings::{LoginConfig, SameSite};

mod attempt;
mod device;
mod issue;
mod limit;
mod page;
mod recheck;
mod request;
mod routes;

use attempt::InFlightKey;
use limit::FailureLimit;
pub use page::safe_redirect;
use page::{json_error, redirect};
use request::query_param;

/// What a session-endpoint request carries besides its body: its head, its client and the parts
/// of the proxy it uses.
#[derive(Clone, Copy)]
pub struct EndpointRequest<'a> {
    /// The screened request head.
    pub parts: &'a Parts,
    /// The screened `Host` (for the same-origin check).
    pub host: &'a HeaderValue,
    /// The client (for the failed-login limits).
    pub peer: SocketAddr,
    /// Verifies the token of a logout or who-am-I request.
    pub verifier: &'a Verifier,
    /// Where sessions are made, read and revoked.
    pub sessions: &'a Sessions,
    /// Checks a login's credentials (`login.verify_path`).
    pub upstream: &'a Upstream,
    /// The request's id (`upstream.request_id_header`), sent with the credential check.
    pub request_id: Option<&'a HeaderValue>,
}

/// Largest login/logout request body, bytes.
pub(super) const MAX_FORM_BYTES: usize = 8 * 1024;

/// Time a client has to send that body.
pub(super) const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest accepted `rd` value, bytes.
pub(super) const MAX_RD_BYTES: usize = 2048;

/// Which endpoint a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `{prefix}/login`: GET the page, POST credentials.
    Login,
    /// `{prefix}/logout`: POST.
    Logout,
    /// `{prefix}/session`: GET who am I.
    Session,
}

/// The session-side endpoints, built once from `[login]`.
pub struct Login {
    cfg: LoginConfig,
    /// `[token]` for issued tokens' `iss`/`aud` and the token sources; `keys` left empty.
    token: TokenConfig,
    keys: Arc<Keys>,
    session_ttl: u64,
    /// Upstream path of the credential check (base path + `login.verify_path`).
    verify_target: http::Uri,
    /// `Host` sent with the credential check: the upstream URL's authority.
    upstream_host: HeaderValue,
    /// `upstream.request_id_header`: the check carries the id of the request that caused it.
    request_id_header: Option<http::HeaderName>,
    by_ip: FailureLimit<IpAddr>,
    by_user: FailureLimit<String>,
    /// Login checks running now, per client address and per user: the failure count only learns
    /// of a failure after the upstream answered, so parallel guesses are capped here.
    in_flight: Mutex<HashMap<InFlightKey, u32>>,
    /// Most checks in flight in all ([`attempt::max_checks`]).
    max_checks: u32,
    csrf_cookie: String,
    /// `{cookie_name}-device` ([`device`]).
    device_cookie: String,
    /// Re-checks of stored credentials after an upstream 401 ([`Login::still_accepted`]).
    rechecks: recheck::Rechecks,
}

/// How a login attempt failed, before any response is shaped (statuses decided in `error`).
pub(super) use crate::error::LoginRefusal as Refusal;

impl Login {
    /// Builds the endpoints; `None` when `[login]` is not configured.
    pub fn from_config(cfg: &Config, verifier: &Verifier) -> Option<Self> {
        let l = cfg.login.clone()?;
        let [_, csrf, device] = l.own_cookies();
        let base = cfg.upstream.url.path().trim_end_matches('/');
        let verify_target = format!("{base}{}", l.verify_path)
            .parse()
            .expect("validated path under a valid base");
        let authority = cfg.upstream.url.authority().expect("validated");
        let window = l.failure_window;
        if l.cookie_secure && !l.cookie_name.starts_with("__Host-") {
            // Only `__Host-` forbids `Domain`: any other name can be set for this host by a
            // sibling subdomain, with a longer path, so it is sent first (a login CSRF).
            tracing::warn!(
                key = %"login.cookie_name",
                name = %l.cookie_name,
                "a login cookie without the __Host- prefix can be planted by any subdomain of \
                 the same site, signing a browser into another account; name it __Host-..."
            );
        }
        Some(Self {
            in_flight: Mutex::new(HashMap::new()),
            max_checks: attempt::max_checks(cfg.upstream.max_connections),
            by_ip: FailureLimit::new(l.max_failures_per_ip, window),
            by_user: FailureLimit::new(l.max_failures_per_user, window),
            csrf_cookie: csrf,
            device_cookie: device,
            rechecks: recheck::Rechecks::default(),
            // Without its keys: the signing key is taken from `keys` (the one in place now, a
            // reload may change it), and a copy here would keep removed secrets alive.
            token: TokenConfig {
                keys: Vec::new(),
                ..cfg.token.clone()
            },
            keys: verifier.keys().clone(),
            session_ttl: cfg.session.ttl_seconds,
            verify_target,
            upstream_host: HeaderValue::from_str(authority.as_str()).expect("valid authority"),
            request_id_header: cfg.upstream.request_id_header.clone(),
            cfg: l,
        })
    }

    /// The endpoint `path` names, if any (exact match; other paths under the prefix are proxied).
    pub fn route(&self, path: &str) -> Option<Endpoint> {
        let rest = path.strip_prefix(self.cfg.path_prefix.as_str())?;
        match rest {
            "/login" => Some(Endpoint::Login),
            "/logout" => Some(Endpoint::Logout),
            "/session" => Some(Endpoint::Session),
            _ => None,
        }
    }

    /// Where an unauthenticated browser navigation to `target` is sent: the login page with
    /// `rd` set to it.
    pub fn login_redirect(&self, target: &str) -> Response<ProxyBody> {
        let rd: String = form_urlencoded::byte_serialize(target.as_bytes()).collect();
        redirect(&format!("{}/login?rd={rd}", self.cfg.path_prefix), None)
    }

    /// Serves one endpoint request. Never fails: every outcome is a response, with the reason
    /// for the access log when there is one. The sid the request named (if any) is written to
    /// `sid_out`, for the same log.
    pub async fn handle<B>(
        &self,
        endpoint: Endpoint,
        req: EndpointRequest<'_>,
        body: B,
        sid_out: &mut Option<Arc<str>>,
    ) -> (Response<ProxyBody>, Option<String>)
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let EndpointRequest {
            parts,
            host,
            verifier,
            sessions,
            ..
        } = req;
        match (endpoint, &parts.method) {
            (Endpoint::Login, &Method::GET | &Method::HEAD) => {
                let rd = query_param(parts, "rd");
                let rd = rd.as_deref().and_then(safe_redirect).unwrap_or("/");
                let held = request::cookie_value(&parts.headers, &self.csrf_cookie);
                (self.page(StatusCode::OK, rd, None, held), None)
            }
            (Endpoint::Login, &Method::POST) => self.login(&req, body, sid_out).await,
            (Endpoint::Logout, &Method::POST) => {
                self.logout(parts, body, host, verifier, sessions, sid_out)
                    .await
            }
            (Endpoint::Session, &Method::GET | &Method::HEAD) => {
                match self.who(parts, verifier, sessions, sid_out).await {
                    Ok(r) => (r, None),
                    Err(e) => {
                        let reason = e.to_string();
                        (e.into_response(), Some(reason))
                    }
                }
            }
            (e, _) => {
                let allow = match e {
                    Endpoint::Login => "GET, HEAD, POST",
                    Endpoint::Logout => "POST",
                    Endpoint::Session => "GET, HEAD",
                };
                let mut r = json_error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
                r.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static(allow));
                (r, Some("method not allowed".into()))
            }
        }
    }

    /// True when an unauthenticated request should be sent to the login page instead of a 401:
    /// a browser navigation (`GET`, `Accept` has `text/html`, and no `Sec-Fetch-Mode` other than
    /// `navigate`: a page's own `fetch` reads the 401 and renews its token, where a redirect
    /// would hand it a page it cannot use, or, from another origin, no answer at all).
    pub fn wants_login_page(parts: &Parts) -> bool {
        let h = &parts.headers;
        parts.method == Method::GET
            && h.get(header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|a| a.contains("text/html"))
            && h.get("sec-fetch-mode").is_none_or(|m| m == "navigate")
    }
}
