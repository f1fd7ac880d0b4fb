//! The session side: `{prefix}/login` (page and endpoint), `{prefix}/logout`, `{prefix}/session`.
//!
//! Login checks the user's credentials against the upstream itself (`login.verify_path` must
//! answer 2xx to them), creates a fresh session with the credentials sealed, and issues a token
//! signed by the active key, as a cookie and in the JSON body. Failed attempts are limited per
//! client address and per user name: in this process (GCRA, `governor`), and across every
//! instance on the same session store (counters in the store). Must never: log a password or token,
//! reuse a session id a client sent, create a session when the upstream did not say yes, or
//! redirect anywhere but a same-origin path.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use bytes::Bytes;
use governor::clock::{Clock, MonotonicClock};
use governor::middleware::StateInformationMiddleware;
use governor::state::keyed::HashMapStateStore;
use governor::{Quota, RateLimiter};
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use crate::token::TokenConfig;
use crate::Config;

mod settings;
use crate::error::ProxyError;
use crate::seal::Credentials;
use crate::session::{sid_hash, Sessions, Store};
use crate::token::{self, Keys, Verifier};
use crate::unix_now;
use crate::upstream::{empty_body, BoxError, ProxyBody, Upstream};
pub use settings::{LoginConfig, SameSite};

/// Largest login/logout request body, bytes.
const MAX_FORM_BYTES: usize = 8 * 1024;
/// Time a client has to send that body.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest accepted `rd` value, bytes.
const MAX_RD_BYTES: usize = 2048;

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
    by_ip: FailureLimit<IpAddr>,
    by_user: FailureLimit<String>,
    /// Login checks running now, per client address and per user: the failure count only learns
    /// of a failure after the upstream answered, so parallel guesses are capped here.
    in_flight: Mutex<HashMap<InFlightKey, u32>>,
    csrf_cookie: String,
}

/// Most concurrent login checks per client address (one per user name).
const MAX_IN_FLIGHT_PER_IP: u32 = 4;
/// Longest accepted user name, bytes.
const MAX_USER_BYTES: usize = 256;

#[derive(Hash, PartialEq, Eq, Clone)]
enum InFlightKey {
    Ip(IpAddr),
    User(String),
}

/// Releases an in-flight slot when the login check ends, however it ends.
struct InFlight<'a> {
    map: &'a Mutex<HashMap<InFlightKey, u32>>,
    keys: [InFlightKey; 2],
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        for k in &self.keys {
            if let Some(n) = map.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    map.remove(k);
                }
            }
        }
    }
}

/// Records a login failure for its client address and user name in this process when dropped
/// still holding them: the attempt's future was dropped while the upstream checked the password.
/// (The shared count in the store was taken before the check, and is kept.)
struct ChargeIfAbandoned<'a> {
    login: &'a Login,
    keys: Option<(IpAddr, String)>,
}

impl Drop for ChargeIfAbandoned<'_> {
    fn drop(&mut self) {
        if let Some((ip, user)) = self.keys.take() {
            self.login.by_ip.record_failure(ip);
            self.login.by_user.record_failure(user);
        }
    }
}

/// Store key prefix of the failed-login counts that every instance on one store shares. Outside
/// the session key prefix: never listed as a session, never an invalidation.
const SHARED_FAILURES: &str = "tessera:login-failures:";

/// The store keys of the shared failed-login counts of a client address (its rate-limit key)
/// and of a user name: its SHA-256 in hex, which bounds the key's length and keeps the name out
/// of plain sight (a hash of a guessable name is not a secret).
fn shared_failure_keys(ip: IpAddr, user: &str) -> [String; 2] {
    use sha2::{Digest, Sha256};
    use std::fmt::Write;
    let mut hex = String::with_capacity(64);
    for b in Sha256::digest(user.as_bytes()) {
        let _ = write!(hex, "{b:02x}");
    }
    [
        format!("{SHARED_FAILURES}ip:{ip}"),
        format!("{SHARED_FAILURES}user:{hex}"),
    ]
}

/// Gives back an attempt taken from the shared counts at `keys` (see `Login::login`), in a task
/// of its own, so that a client leaving meanwhile cannot keep it counted. A store that cannot
/// take it back is logged: the attempt stays counted as a failure. (A window that ends while the
/// upstream checks the password has the attempt given back to the next one: one too few there.)
fn give_back(store: &Store, keys: Vec<String>) {
    let store = store.clone();
    tokio::spawn(async move {
        for key in &keys {
            if let Err(e) = store.decrement(key).await {
                tracing::warn!(cause = %e, "login: cannot take back an attempt counted in the store");
            }
        }
    });
}

/// The rate-limit key of a client address: IPv6 by /64 (one subscriber's whole prefix), IPv4
/// as is.
fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
    }
}

/// What a login request carried.
#[derive(Deserialize)]
struct LoginForm {
    username: String,
    #[serde(deserialize_with = "zeroizing_string")]
    password: Zeroizing<String>,
    #[serde(default)]
    rd: Option<String>,
    #[serde(default)]
    csrf: Option<String>,
}

fn zeroizing_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Zeroizing<String>, D::Error> {
    String::deserialize(d).map(Zeroizing::new)
}

#[derive(Serialize)]
struct LoginOk<'a> {
    token: &'a str,
    expires_at: u64,
    sub: &'a str,
}

#[derive(Serialize)]
struct WhoAmI<'a> {
    sub: Option<&'a str>,
    sid_hash: String,
    expires_at: u64,
}

/// How a login attempt failed, before any response is shaped.
enum Refusal {
    /// 400: unreadable body, missing fields.
    Bad(&'static str),
    /// 413: a body over the 8 KiB cap (refused by its `Content-Length` before any of it is
    /// read, so a client that sent `Expect: 100-continue` never gets a `100`).
    TooLarge,
    /// 401: the upstream said no.
    Credentials,
    /// 403: cross-origin POST or CSRF token mismatch.
    Forbidden(&'static str),
    /// 415: neither form nor JSON.
    MediaType,
    /// 429: too many failures; seconds to wait.
    Limited(u64),
    /// Upstream or store failure (502/503/504).
    Proxy(ProxyError),
}

impl Login {
    /// Builds the endpoints; `None` when `[login]` is not configured.
    pub fn from_config(cfg: &Config, verifier: &Verifier) -> Option<Self> {
        let l = cfg.login.clone()?;
        let base = cfg.upstream.url.path().trim_end_matches('/');
        let verify_target = format!("{base}{}", l.verify_path)
            .parse()
            .expect("validated path under a valid base");
        let authority = cfg.upstream.url.authority().expect("validated");
        let window = l.failure_window;
        Some(Self {
            in_flight: Mutex::new(HashMap::new()),
            by_ip: FailureLimit::new(l.max_failures_per_ip, window),
            by_user: FailureLimit::new(l.max_failures_per_user, window),
            csrf_cookie: format!("{}-csrf", l.cookie_name),
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

    /// Serves one endpoint request. `host` is the screened request `Host` (for the Origin check).
    /// Never fails: every outcome is a response, with the reason for the access log when there
    /// is one. The sid the request named (if any) is written to `sid_out`, for the same log.
    #[allow(clippy::too_many_arguments)]
    pub async fn handle<B>(
        &self,
        endpoint: Endpoint,
        parts: &Parts,
        body: B,
        host: &HeaderValue,
        peer: SocketAddr,
        verifier: &Verifier,
        sessions: &Sessions,
        upstream: &Upstream,
        sid_out: &mut Option<Arc<str>>,
    ) -> (Response<ProxyBody>, Option<String>)
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        match (endpoint, &parts.method) {
            (Endpoint::Login, &Method::GET | &Method::HEAD) => {
                let rd = query_param(parts, "rd");
                let rd = rd.as_deref().and_then(safe_redirect).unwrap_or("/");
                (self.page(StatusCode::OK, rd, None), None)
            }
            (Endpoint::Login, &Method::POST) => {
                self.login(parts, body, host, peer, sessions, upstream, sid_out)
                    .await
            }
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

    #[allow(clippy::too_many_arguments)]
    async fn login<B>(
        &self,
        parts: &Parts,
        body: B,
        host: &HeaderValue,
        peer: SocketAddr,
        sessions: &Sessions,
        upstream: &Upstream,
        sid_out: &mut Option<Arc<str>>,
    ) -> (Response<ProxyBody>, Option<String>)
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let is_form = content_type_is(parts, "application/x-www-form-urlencoded");
        let form = match self.read_login(parts, body, host, is_form).await {
            Ok(f) => f,
            Err(r) => return self.refuse(r, is_form, None),
        };
        let rd = form.rd.as_deref().and_then(safe_redirect);
        if form.rd.is_some() && rd.is_none() {
            return self.refuse(Refusal::Bad("rd must be a same-origin path"), is_form, None);
        }
        let user_key = form.username.trim().to_lowercase();
        let ip_key = client_key(peer.ip());
        let wait = self
            .by_ip
            .blocked_for(&ip_key)
            .max(self.by_user.blocked_for(&user_key));
        if let Some(wait) = wait {
            return self.refuse(Refusal::Limited(wait.as_secs().max(1)), is_form, rd);
        }
        let Some(_slot) = self.enter(ip_key, &user_key) else {
            return self.refuse(Refusal::Limited(1), is_form, rd);
        };
        let creds =
            match Credentials::new(form.username.trim().to_owned(), form.password.to_string()) {
                Ok(c) => c,
                Err(_) => {
                    return self.refuse(Refusal::Bad("user name or password unusable"), is_form, rd)
                }
            };
        drop(form.password);
        // The count every instance on the store shares (without it, n instances behind a load
        // balancer would allow n times the attempts): the attempt is counted as a failure before
        // the upstream is asked, and given back if it was not one. Counting first, atomically,
        // means parallel attempts on several instances cannot all pass the last free one.
        let store = sessions.store();
        let shared = shared_failure_keys(ip_key, &user_key);
        let window = self.cfg.failure_window.as_secs();
        let counted = tokio::join!(
            store.increment(&shared[0], window),
            store.increment(&shared[1], window)
        );
        let ((ip_n, ip_left), (user_n, user_left)) = match counted {
            (Ok(ip), Ok(user)) => (ip, user),
            (ip, user) => {
                // Whichever side was counted is taken back: the attempt was not made.
                let counted: Vec<String> = [(ip.is_ok(), &shared[0]), (user.is_ok(), &shared[1])]
                    .into_iter()
                    .filter(|(ok, _)| *ok)
                    .map(|(_, key)| key.clone())
                    .collect();
                give_back(store, counted);
                return self.refuse(Refusal::Proxy(ProxyError::StoreUnavailable), is_form, rd);
            }
        };
        let over = [
            (ip_n > u64::from(self.cfg.max_failures_per_ip)).then_some(ip_left),
            (user_n > u64::from(self.cfg.max_failures_per_user)).then_some(user_left),
        ];
        if let Some(secs) = over.into_iter().flatten().max() {
            // Refused without asking: counts for neither side, so an address over its cap
            // cannot lock out the users it names, nor a user over hers the address she shares.
            give_back(store, shared.to_vec());
            return self.refuse(Refusal::Limited(secs), is_form, rd);
        }
        // A client that leaves while the upstream checks its password drops this future (the
        // server watches for that): it is charged a failure all the same, or closing each
        // connection early would try passwords against the upstream without limit.
        let mut abandoned = ChargeIfAbandoned {
            login: self,
            keys: Some((ip_key, user_key)),
        };
        let checked = self.check_upstream(&creds, upstream).await;
        let (ip_key, user_key) = abandoned.keys.take().expect("taken only here");
        match checked {
            Ok(true) => give_back(store, shared.to_vec()),
            Ok(false) => {
                self.by_ip.record_failure(ip_key);
                self.by_user.record_failure(user_key);
                return self.refuse(Refusal::Credentials, is_form, rd);
            }
            // The upstream did not answer: not the client's failure.
            Err(e) => {
                give_back(store, shared.to_vec());
                return self.refuse(Refusal::Proxy(e), is_form, rd);
            }
        }
        let created = match sessions.create(&creds, self.session_ttl).await {
            Ok(c) => c,
            Err(_) => {
                return self.refuse(Refusal::Proxy(ProxyError::StoreUnavailable), is_form, rd)
            }
        };
        let now = unix_now();
        let exp = (now + self.cfg.token_ttl_seconds).min(created.expires_at);
        let signer = self
            .keys
            .signer()
            .expect("validated: login has a signing key");
        let jwt = match signer.issue(&self.token, creds.user(), &created.sid, now, exp) {
            Ok(t) => t,
            Err(_) => {
                let _ = sessions.revoke(&created.sid).await;
                return (
                    json_error(StatusCode::INTERNAL_SERVER_ERROR, "cannot sign token"),
                    Some("token signing failed".into()),
                );
            }
        };
        *sid_out = Some(created.sid.into());
        let cookie = self.token_cookie(&jwt, exp - now);
        let mut resp = match rd {
            Some(rd) => redirect(rd, Some(cookie)),
            None => {
                let body = serde_json::to_vec(&LoginOk {
                    token: &jwt,
                    expires_at: exp,
                    sub: creds.user(),
                })
                .expect("serializes");
                let mut r = json(StatusCode::OK, body);
                r.headers_mut().append(header::SET_COOKIE, cookie);
                r
            }
        };
        if is_form {
            resp.headers_mut()
                .append(header::SET_COOKIE, self.clear_cookie(&self.csrf_cookie));
        }
        (resp, Some("login".into()))
    }

    /// Takes an in-flight slot for this address and user, or `None` when either is at its cap.
    fn enter(&self, ip: IpAddr, user: &str) -> Option<InFlight<'_>> {
        let keys = [InFlightKey::Ip(ip), InFlightKey::User(user.to_owned())];
        let mut map = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        let busy = |k: &InFlightKey, cap: u32| map.get(k).is_some_and(|n| *n >= cap);
        if busy(&keys[0], MAX_IN_FLIGHT_PER_IP) || busy(&keys[1], 1) {
            return None;
        }
        for k in &keys {
            *map.entry(k.clone()).or_insert(0) += 1;
        }
        drop(map);
        Some(InFlight {
            map: &self.in_flight,
            keys,
        })
    }

    /// Reads and checks a login body: same-origin POST, size/time caps, form or JSON, and the
    /// double-submit CSRF token for forms.
    async fn read_login<B>(
        &self,
        parts: &Parts,
        body: B,
        host: &HeaderValue,
        is_form: bool,
    ) -> Result<LoginForm, Refusal>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        check_same_origin(parts, host)?;
        let is_json = content_type_is(parts, "application/json");
        if !is_form && !is_json {
            return Err(Refusal::MediaType);
        }
        let bytes = read_body(body).await?;
        let form: LoginForm = if is_json {
            serde_json::from_slice(&bytes).map_err(|_| {
                Refusal::Bad("body must be {\"username\": string, \"password\": string}")
            })?
        } else {
            let mut fields: HashMap<String, Zeroizing<String>> = HashMap::new();
            for (k, v) in form_urlencoded::parse(&bytes) {
                if fields
                    .insert(k.into_owned(), Zeroizing::new(v.into_owned()))
                    .is_some()
                {
                    return Err(Refusal::Bad("repeated form field"));
                }
            }
            let mut take = |k: &str| fields.remove(k);
            LoginForm {
                username: take("username")
                    .map(|v| v.to_string())
                    .ok_or(Refusal::Bad("username missing"))?,
                password: take("password").ok_or(Refusal::Bad("password missing"))?,
                rd: take("rd").map(|v| v.to_string()),
                csrf: take("csrf").map(|v| v.to_string()),
            }
        };
        if is_form {
            let cookie = cookie_value(&parts.headers, &self.csrf_cookie);
            let ok = matches!((&form.csrf, cookie), (Some(f), Some(c)) if !f.is_empty() && constant_eq(f.as_bytes(), c.as_bytes()));
            if !ok {
                return Err(Refusal::Forbidden(
                    "CSRF token missing or wrong; reload the login page",
                ));
            }
        }
        if form.username.trim().is_empty() || form.password.is_empty() {
            return Err(Refusal::Bad("username and password are required"));
        }
        if form.username.len() > MAX_USER_BYTES {
            return Err(Refusal::Bad("username too long"));
        }
        Ok(form)
    }

    /// Asks the upstream whether `creds` are good: `GET login.verify_path` with them.
    /// Ok(true) on 2xx, Ok(false) on 401/403; anything else is an upstream failure.
    async fn check_upstream(
        &self,
        creds: &Credentials,
        upstream: &Upstream,
    ) -> Result<bool, ProxyError> {
        let req = Request::get(self.verify_target.clone())
            .header(header::HOST, self.upstream_host.clone())
            .header(header::AUTHORIZATION, creds.basic_header())
            .body(empty_body())
            .expect("valid request");
        let resp = upstream.forward(req).await?;
        let status = resp.status();
        // Drain (bounded) so the connection goes back to the pool.
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            http_body_util::Limited::new(resp.into_body(), 1 << 20).collect(),
        )
        .await;
        match status.as_u16() {
            200..=299 => Ok(true),
            401 | 403 => Ok(false),
            _ => {
                tracing::warn!(
                    status = status.as_u16(),
                    "login check: unexpected upstream status"
                );
                Err(ProxyError::Upstream(crate::upstream::ForwardError::Broken(
                    "unexpected status to the login check".into(),
                )))
            }
        }
    }

    async fn logout<B>(
        &self,
        parts: &Parts,
        body: B,
        host: &HeaderValue,
        verifier: &Verifier,
        sessions: &Sessions,
        sid_out: &mut Option<Arc<str>>,
    ) -> (Response<ProxyBody>, Option<String>)
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let is_form = content_type_is(parts, "application/x-www-form-urlencoded");
        if let Err(r) = check_same_origin(parts, host) {
            return self.refuse(r, is_form, None);
        }
        let bytes = match read_body(body).await {
            Ok(b) => b,
            Err(r) => return self.refuse(r, is_form, None),
        };
        let rd_raw = if is_form {
            form_urlencoded::parse(&bytes)
                .find(|(k, _)| k == "rd")
                .map(|(_, v)| v.into_owned())
        } else {
            query_param(parts, "rd")
        };
        let rd = rd_raw.as_deref().and_then(safe_redirect);
        if rd_raw.is_some() && rd.is_none() {
            return self.refuse(Refusal::Bad("rd must be a same-origin path"), is_form, None);
        }
        let mut reason = "logout without a valid token";
        if let Ok(tok) = token::extract(&parts.headers, &self.token.sources) {
            // An expired token still names a session worth deleting: everything but `exp` must hold.
            if let Ok(v) = verifier.verify_ignoring_expiry(&tok, unix_now()) {
                if sessions.revoke(&v.sid).await.is_err() {
                    *sid_out = Some(v.sid);
                    return (
                        ProxyError::StoreUnavailable.into_response(),
                        Some("logout: session store unavailable".into()),
                    );
                }
                *sid_out = Some(v.sid);
                reason = "logout";
            }
        }
        let clear = self.clear_cookie(&self.cfg.cookie_name);
        let resp = match rd {
            Some(rd) => redirect(rd, Some(clear)),
            None => {
                let mut r = Response::new(ProxyBody::empty());
                *r.status_mut() = StatusCode::NO_CONTENT;
                r.headers_mut()
                    .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
                r.headers_mut().append(header::SET_COOKIE, clear);
                r
            }
        };
        (resp, Some(reason.into()))
    }

    async fn who(
        &self,
        parts: &Parts,
        verifier: &Verifier,
        sessions: &Sessions,
        sid_out: &mut Option<Arc<str>>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let tok = token::extract(&parts.headers, &self.token.sources)?;
        let v = verifier.verify_refreshing(&tok, unix_now()).await?;
        let session = sessions.resolve(&v.sid).await;
        *sid_out = Some(v.sid.clone());
        let session = session?;
        let body = serde_json::to_vec(&WhoAmI {
            sub: session.sub.as_deref().or(v.sub.as_deref()),
            sid_hash: sid_hash(&v.sid),
            expires_at: session.expires_at.map_or(v.exp, |e| e.min(v.exp)),
        })
        .expect("serializes");
        Ok(json(StatusCode::OK, body))
    }

    /// Shapes a refusal: JSON for API clients, the login page again for form posts.
    fn refuse(
        &self,
        r: Refusal,
        is_form: bool,
        rd: Option<&str>,
    ) -> (Response<ProxyBody>, Option<String>) {
        let (status, message, log): (StatusCode, &str, String) = match &r {
            Refusal::Bad(why) => (StatusCode::BAD_REQUEST, why, format!("login: {why}")),
            Refusal::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "login form too large",
                "login: body over 8 KiB".into(),
            ),
            Refusal::Credentials => (
                StatusCode::UNAUTHORIZED,
                "user name or password is wrong",
                "login: upstream rejected the credentials".into(),
            ),
            Refusal::Forbidden(why) => (StatusCode::FORBIDDEN, why, format!("login: {why}")),
            Refusal::MediaType => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "send application/x-www-form-urlencoded or application/json",
                "login: unsupported content type".into(),
            ),
            Refusal::Limited(_) => (
                StatusCode::TOO_MANY_REQUESTS,
                "too many failed attempts; try again later",
                "login: rate limited".into(),
            ),
            Refusal::Proxy(e) => {
                let log = format!("login: {e}");
                let status = e.status();
                let mut resp = if is_form {
                    self.page(
                        status,
                        rd.unwrap_or("/"),
                        Some("the mail server is not answering; try again shortly"),
                    )
                } else {
                    json_error(status, "upstream unavailable")
                };
                if status == StatusCode::SERVICE_UNAVAILABLE {
                    resp.headers_mut()
                        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                }
                return (resp, Some(log));
            }
        };
        let mut resp = if is_form {
            self.page(status, rd.unwrap_or("/"), Some(message))
        } else {
            json_error(status, message)
        };
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"tessera\""),
            );
        }
        if let Refusal::Limited(secs) = r {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        (resp, Some(log))
    }

    /// The login page: a plain HTML form, no script, no external asset; a fresh CSRF token in a
    /// hidden field and a cookie (double submit).
    fn page(&self, status: StatusCode, rd: &str, error: Option<&str>) -> Response<ProxyBody> {
        let mut raw = [0u8; 18];
        getrandom::getrandom(&mut raw).expect("OS random source");
        let csrf = URL_SAFE_NO_PAD.encode(raw);
        let title = html_escape(&self.cfg.page_title);
        let error = error.map_or_else(String::new, |e| {
            format!(
                "<p class=\"error\" role=\"alert\" id=\"error\">{}</p>\n",
                html_escape(e)
            )
        });
        let html = format!(
            include_str!("login_page.html"),
            title = title,
            error = error,
            action = html_escape(&format!("{}/login", self.cfg.path_prefix)),
            csrf = csrf,
            rd = html_escape(rd),
        );
        let mut resp = Response::new(ProxyBody::full(html));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static("default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
        );
        h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
        h.insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
        h.insert(
            header::REFERRER_POLICY,
            HeaderValue::from_static("same-origin"),
        );
        h.append(
            header::SET_COOKIE,
            self.cookie(&self.csrf_cookie, &csrf, None),
        );
        resp
    }

    fn cookie(&self, name: &str, value: &str, max_age: Option<u64>) -> HeaderValue {
        let mut c = format!(
            "{name}={value}; Path=/; HttpOnly; SameSite={}",
            self.cfg.cookie_same_site.as_str()
        );
        if let Some(age) = max_age {
            c.push_str(&format!("; Max-Age={age}"));
        }
        if self.cfg.cookie_secure {
            c.push_str("; Secure");
        }
        let mut v = HeaderValue::from_str(&c).expect("token and names are header-safe");
        v.set_sensitive(true);
        v
    }

    fn token_cookie(&self, jwt: &str, max_age: u64) -> HeaderValue {
        self.cookie(&self.cfg.cookie_name, jwt, Some(max_age))
    }

    /// `Set-Cookie` that deletes the token cookie (Max-Age=0).
    pub fn clear_token_cookie(&self) -> HeaderValue {
        self.clear_cookie(&self.cfg.cookie_name)
    }

    fn clear_cookie(&self, name: &str) -> HeaderValue {
        self.cookie(name, "", Some(0))
    }

    /// True when an unauthenticated request should be sent to the login page instead of a 401:
    /// a browser navigation (`GET`, `Accept` has `text/html`).
    pub fn wants_login_page(parts: &Parts) -> bool {
        parts.method == Method::GET
            && parts
                .headers
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|a| a.contains("text/html"))
    }
}

/// `rd` accepted only as a same-origin absolute path: starts with one `/`, no `//` or `/\`
/// authority trick, no backslash, control character or whitespace, also after one more round of
/// percent-decoding (`/%09/evil`, `/%2F/evil`). Returns the value to put in `Location`.
pub fn safe_redirect(rd: &str) -> Option<&str> {
    fn no_authority(b: &[u8]) -> bool {
        b.first() == Some(&b'/')
            && !matches!(b.get(1), Some(b'/') | Some(b'\\'))
            && !b.iter().any(|&c| c == b'\\' || c.is_ascii_control())
    }
    let raw = rd.as_bytes();
    if rd.len() > MAX_RD_BYTES || !no_authority(raw) || raw.iter().any(|&c| c == b' ' || c >= 0x80)
    {
        return None;
    }
    let decoded = percent_decode(rd)?;
    no_authority(decoded.as_bytes()).then_some(rd)
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

fn html_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn constant_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn content_type_is(parts: &Parts, want: &str) -> bool {
    parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case(want))
}

fn query_param(parts: &Parts, name: &str) -> Option<String> {
    form_urlencoded::parse(parts.uri.query()?.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

fn cookie_value<'a>(headers: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.trim_matches('"'))
}

/// A state-changing POST must come from our own origin: `Origin` (when sent) names the request's
/// host, and `Sec-Fetch-Site` (when sent) is not `cross-site`.
fn check_same_origin(parts: &Parts, host: &HeaderValue) -> Result<(), Refusal> {
    if parts
        .headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"cross-site"))
    {
        return Err(Refusal::Forbidden("cross-site request refused"));
    }
    let Some(origin) = parts.headers.get(header::ORIGIN) else {
        return Ok(());
    };
    // Only the authority is compared: behind a TLS terminator tessera cannot know the public
    // scheme. Default ports are dropped on both sides (`https://h` == `Host: h:443`).
    let strip = |a: &str, scheme: &str| -> String {
        let a = a.to_ascii_lowercase();
        let default = if scheme == "https" { ":443" } else { ":80" };
        a.strip_suffix(default).map_or(a.clone(), str::to_owned)
    };
    let (scheme, authority) = match origin.to_str().ok().and_then(|o| o.split_once("://")) {
        Some(p) => p,
        None => return Err(Refusal::Forbidden("cross-origin request refused")),
    };
    let host = host.to_str().unwrap_or_default();
    let same = strip(authority, scheme) == strip(host, scheme)
        || strip(authority, scheme)
            == strip(host, if scheme == "https" { "http" } else { "https" });
    if same {
        Ok(())
    } else {
        Err(Refusal::Forbidden("cross-origin request refused"))
    }
}

/// Reads a login or logout body: at most `MAX_FORM_BYTES` bytes, all of it within
/// `BODY_TIMEOUT`, into one buffer that is wiped when dropped, since a login body holds the
/// password. The buffer is allocated at its full size first, so it never moves and leaves no
/// unwiped copy of its own behind. The bytes it copies from are not wiped: the connection's
/// read buffer (the fast path's in `downstream::h1`, or hyper's), which is reused for later requests.
/// Errors: `Refusal::TooLarge` for a body over the cap (by its declared length, before any of it
/// is read, or as it arrives), `Refusal::Bad` for one cut or too slow. Trailers are ignored.
async fn read_body<B>(body: B) -> Result<Zeroizing<Vec<u8>>, Refusal>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > MAX_FORM_BYTES as u64 {
        return Err(Refusal::TooLarge);
    }
    let read = async {
        let mut body = std::pin::pin!(http_body_util::Limited::new(body, MAX_FORM_BYTES));
        let mut out = Zeroizing::new(Vec::with_capacity(MAX_FORM_BYTES));
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    Refusal::TooLarge
                } else {
                    Refusal::Bad("body broken")
                }
            })?;
            if let Ok(data) = frame.into_data() {
                out.extend_from_slice(&data);
            }
        }
        Ok(out)
    };
    tokio::time::timeout(BODY_TIMEOUT, read)
        .await
        .unwrap_or(Err(Refusal::Bad("body not sent in time")))
}

fn json(status: StatusCode, body: Vec<u8>) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn json_error(status: StatusCode, message: &str) -> Response<ProxyBody> {
    json(
        status,
        serde_json::to_vec(&serde_json::json!({ "error": message })).expect("serializes"),
    )
}

fn redirect(location: &str, cookie: Option<HeaderValue>) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::empty());
    *r.status_mut() = StatusCode::SEE_OTHER;
    let h = r.headers_mut();
    h.insert(
        header::LOCATION,
        HeaderValue::from_str(location).expect("validated redirect target"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(c) = cookie {
        h.append(header::SET_COOKIE, c);
    }
    r
}

type Gcra<K> = RateLimiter<K, HashMapStateStore<K>, MonotonicClock, StateInformationMiddleware>;

/// Counts failed attempts per key with GCRA (`burst` failures, refilled one per
/// `window / burst`), and remembers which keys used their last one, so that the next attempt is
/// refused before the upstream is asked.
struct FailureLimit<K: Hash + Eq + Clone> {
    gcra: Gcra<K>,
    clock: MonotonicClock,
    blocked: Mutex<HashMap<K, Instant>>,
    failures: std::sync::atomic::AtomicU64,
}

impl<K: Hash + Eq + Clone> FailureLimit<K> {
    fn new(burst: u32, window: Duration) -> Self {
        let burst = NonZeroU32::new(burst).expect("validated > 0");
        let period = (window / burst.get()).max(Duration::from_millis(1));
        let quota = Quota::with_period(period)
            .expect("non-zero period")
            .allow_burst(burst);
        let clock = MonotonicClock;
        Self {
            gcra: RateLimiter::<K, HashMapStateStore<K>, MonotonicClock>::new(
                quota,
                HashMapStateStore::default(),
                clock.clone(),
            )
            .with_middleware::<StateInformationMiddleware>(),
            clock,
            blocked: Mutex::new(HashMap::new()),
            failures: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Remaining wait when `key` is blocked.
    fn blocked_for(&self, key: &K) -> Option<Duration> {
        let blocked = self.blocked.lock().unwrap_or_else(|p| p.into_inner());
        let until = *blocked.get(key)?;
        until.checked_duration_since(Instant::now())
    }

    fn record_failure(&self, key: K) {
        // Keys whose counts have refilled are forgotten now and then, so memory follows the
        // attackers of the last window, not every name ever tried.
        if self
            .failures
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % 1024
            == 1023
        {
            self.gcra.retain_recent();
            self.gcra.shrink_to_fit();
            let now = Instant::now();
            self.blocked
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|_, t| *t > now);
        }
        let until = match self.gcra.check_key(&key) {
            Ok(snapshot) if snapshot.remaining_burst_capacity() == 0 => {
                Instant::now() + snapshot.quota().replenish_interval()
            }
            Ok(_) => return,
            Err(not_until) => Instant::now() + not_until.wait_time_from(self.clock.now()),
        };
        self.blocked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, until);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects_only_to_same_origin_paths() {
        for good in ["/", "/x", "/mail/inbox?id=3#top", "/a%20b"] {
            assert_eq!(safe_redirect(good), Some(good), "{good}");
        }
        for bad in [
            "//evil",
            "/\\evil",
            "/%09/evil",
            "https:evil",
            "https://evil",
            "evil",
            "",
            "/%2F/evil",
            "/%5Cevil",
            "/\t/evil",
            " /x",
            "/x\ny",
            "/%2f%2fevil",
        ] {
            assert_eq!(safe_redirect(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn failure_limit_blocks_after_burst_and_only_that_key() {
        let l = FailureLimit::new(3, Duration::from_secs(300));
        for _ in 0..2 {
            l.record_failure("a".to_string());
            assert!(l.blocked_for(&"a".to_string()).is_none());
        }
        l.record_failure("a".to_string());
        let wait = l
            .blocked_for(&"a".to_string())
            .expect("blocked after 3 failures");
        assert!(
            wait <= Duration::from_secs(100) && wait > Duration::from_secs(90),
            "{wait:?}"
        );
        assert!(l.blocked_for(&"b".to_string()).is_none());
    }

    #[test]
    fn ipv6_clients_are_limited_by_prefix() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(client_key(a), client_key(b));
        assert_ne!(client_key(a), client_key(c));
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        assert_eq!(client_key(mapped), "192.0.2.7".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn html_is_escaped() {
        assert_eq!(
            html_escape("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }
}
