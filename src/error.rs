//! The one place a failure becomes an HTTP status (fail closed: no error ever forwards).
//!
//! | failure | status |
//! |---|---|
//! | malformed request (Host missing/empty/duplicated/with userinfo, dot segments, encoded slashes) | 400 |
//! | request body cut short or malformed by the client while it streams upstream | 400 |
//! | no token, bad token, unknown/expired/unusable session | 401 + `WWW-Authenticate: Bearer` (RFC 6750 3) |
//! | WebSocket upgrade from a foreign origin; CORS preflight from an origin not in `cors.allow_origins` | 403 |
//! | WebSocket handshake of a version other than 13 | 426 + `Sec-WebSocket-Version: 13` |
//! | TRACE, TRACK (would echo the injected credential) or CONNECT | 405 + `Allow` |
//! | request body paused longer than `server.client_body_timeout_ms` | 408 |
//! | body larger than `server.max_body_bytes` | 413 |
//! | request-target longer than `server.max_uri_bytes` | 414 |
//! | header bytes above `server.max_header_bytes` | 431 |
//! | a `Transfer-Encoding` other than `chunked` alone | 501 |
//! | upstream refused, reset, invalid answer; pool shut down | 502 |
//! | session store down or slow; `websocket.max_connections` tunnels or `upstream.max_event_streams` event streams open | 503 + `Retry-After` |
//! | a user's `websocket.max_connections_per_user` tunnels open | 429 + `Retry-After: 1` |
//! | upstream connect or response-head timeout | 504 |
//! | upstream 401 to the stored credentials, refused again at `login.verify_path` (session deleted) | 401 + `WWW-Authenticate: Bearer ... error_description="upstream rejected credentials"` |
//!
//! The session endpoints' refusals ([`LoginRefusal`]), answered as JSON to API clients and as the
//! login page to form posts:
//!
//! | refusal | status |
//! |---|---|
//! | unreadable or incomplete form, `rd` not a same-origin path | 400 |
//! | user name or password refused by the upstream | 401 + `WWW-Authenticate: Bearer` |
//! | cross-origin POST, CSRF token mismatch | 403 |
//! | login body over 8 KiB | 413 |
//! | neither a form nor JSON | 415 |
//! | too many failed logins for the client address or user name | 429 + `Retry-After` |
//! | the upstream or the session store failed | as the table above (502, 503 + `Retry-After`, 504) |

use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderValue, Response, StatusCode};

use crate::screen::ScreenError;
use crate::session::ResolveError;
use crate::token::extract::ExtractError;
use crate::token::TokenError;
use crate::upstream::{ForwardError, ProxyBody};

/// `WWW-Authenticate` of [`ProxyError::UpstreamRejected`] (RFC 6750 3).
const UPSTREAM_REJECTED: &str = "Bearer realm=\"tessera\", error=\"invalid_token\", \
     error_description=\"upstream rejected credentials\"";

/// Everything that can stop a request, by phase.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// screen: the request is malformed, over a limit or of a refused method (each
    /// [`ScreenError`] gets its status below).
    #[error(transparent)]
    Screen(#[from] ScreenError),
    /// inject/websocket: the request is malformed for a later phase (the reason is static text,
    /// safe to log and answer).
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    /// inject: the upstream target (base path + the client's) is no valid URI (too long).
    #[error("request-target too long")]
    UriTooLong,
    /// extract: no token in any configured source.
    #[error("no token")]
    NoToken,
    /// extract/verify: a token was present but is not acceptable.
    #[error("invalid token: {0}")]
    BadToken(&'static str),
    /// resolve/unseal: the session is unknown, expired, revoked or unusable.
    #[error("session refused: {0}")]
    Session(&'static str),
    /// resolve: the store did not answer.
    #[error("session store unavailable")]
    StoreUnavailable,
    /// A request in plain HTTP on the TLS listener (nginx's 497, answered 400 there too); the
    /// connection closes after it.
    #[error("plain HTTP request on the TLS port")]
    PlainHttpOnTlsPort,
    /// forward: a WebSocket upgrade from a browser page of another origin (its `Origin` names
    /// neither the request's host nor one of `websocket.allowed_origins`). 403.
    #[error("WebSocket upgrade from a foreign origin")]
    ForeignOrigin,
    /// screen: a CORS preflight from an origin not in `cors.allow_origins`. 403.
    #[error("CORS preflight from an origin not in cors.allow_origins")]
    CorsOrigin,
    /// forward: a WebSocket handshake of a version other than 13 (RFC 6455 section 4.2.2). 426
    /// with `Sec-WebSocket-Version: 13`.
    #[error("WebSocket handshake of another version than 13")]
    WebSocketVersion,
    /// forward: `websocket.max_connections` WebSockets are open already. 503 with `Retry-After`.
    #[error("too many WebSocket connections")]
    TooManyWebSockets,
    /// forward: the user has `websocket.max_connections_per_user` WebSockets open already. 429
    /// (RFC 6585) with `Retry-After`.
    #[error("too many WebSocket connections for this user")]
    TooManyWebSocketsForUser,
    /// forward: the upstream refused the session's stored credentials, and refused them again
    /// at `login.verify_path`; the session was deleted. 401 with a Bearer challenge saying why
    /// (never the upstream's `Basic` one, which would make a browser prompt for its password).
    #[error("upstream rejected credentials")]
    UpstreamRejected,
    /// forward: the upstream failed, or the client's body broke off while it was streamed
    /// upstream ([`ForwardError::ClientBody`], 400).
    #[error(transparent)]
    Upstream(#[from] ForwardError),
}

impl From<ExtractError> for ProxyError {
    fn from(e: ExtractError) -> Self {
        match e {
            ExtractError::Missing => Self::NoToken,
            ExtractError::Malformed => Self::BadToken("malformed token source"),
        }
    }
}

impl From<TokenError> for ProxyError {
    fn from(e: TokenError) -> Self {
        Self::BadToken(match e {
            TokenError::TooLarge => "token too large",
            TokenError::Malformed => "malformed token",
            TokenError::Source => "malformed token source",
            TokenError::Algorithm => "algorithm not allowed",
            TokenError::ForbiddenHeader => "forbidden header parameter",
            TokenError::UnknownKey => "unknown key id",
            TokenError::Signature => "bad signature",
            TokenError::MissingExp => "exp claim missing",
            TokenError::Expired => "token expired",
            TokenError::NotYetValid => "token not yet valid",
            TokenError::IssuedInFuture => "token issued in the future",
            TokenError::Issuer => "wrong issuer",
            TokenError::Audience => "wrong audience",
            TokenError::Type => "wrong token type",
            TokenError::MissingSid => "session id claim missing",
        })
    }
}

impl From<ResolveError> for ProxyError {
    fn from(e: ResolveError) -> Self {
        match e {
            ResolveError::Unknown => Self::Session("unknown session"),
            ResolveError::Corrupt(why) => Self::Session(why),
            ResolveError::Store(_) => Self::StoreUnavailable,
        }
    }
}

impl ProxyError {
    /// The HTTP status for this failure (exhaustive: adding a variant fails to compile here).
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Screen(s) => match s {
                ScreenError::BadRequest(_) => StatusCode::BAD_REQUEST,
                ScreenError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
                ScreenError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
                ScreenError::UriTooLong => StatusCode::URI_TOO_LONG,
                ScreenError::TransferCoding => StatusCode::NOT_IMPLEMENTED,
                ScreenError::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            },
            Self::BadRequest(_) | Self::PlainHttpOnTlsPort => StatusCode::BAD_REQUEST,
            Self::UriTooLong => StatusCode::URI_TOO_LONG,
            Self::NoToken | Self::BadToken(_) | Self::Session(_) | Self::UpstreamRejected => {
                StatusCode::UNAUTHORIZED
            }
            Self::StoreUnavailable | Self::TooManyWebSockets => StatusCode::SERVICE_UNAVAILABLE,
            Self::TooManyWebSocketsForUser => StatusCode::TOO_MANY_REQUESTS,
            Self::WebSocketVersion => StatusCode::UPGRADE_REQUIRED,
            Self::ForeignOrigin | Self::CorsOrigin => StatusCode::FORBIDDEN,
            Self::Upstream(f) => match f {
                ForwardError::Connect(_) | ForwardError::Broken(_) | ForwardError::Closed => {
                    StatusCode::BAD_GATEWAY
                }
                ForwardError::ConnectTimeout | ForwardError::Timeout => StatusCode::GATEWAY_TIMEOUT,
                ForwardError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
                ForwardError::ClientBody(_) => StatusCode::BAD_REQUEST,
                ForwardError::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
                ForwardError::TooManyEventStreams => StatusCode::SERVICE_UNAVAILABLE,
            },
        }
    }

    /// The local response: status, a one-line plain-text reason, and the auth challenge where due.
    /// Never includes the token, credentials or upstream error details.
    pub fn into_response(self) -> Response<ProxyBody> {
        let status = self.status();
        let text = match self {
            // Said in full: a person typed http:// for an https:// address.
            Self::PlainHttpOnTlsPort => "Bad Request: plain HTTP sent to the HTTPS port\n".into(),
            _ => format!("{}\n", status.canonical_reason().unwrap_or("error")),
        };
        let mut resp = Response::new(ProxyBody::full(text));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        match self {
            Self::NoToken => {
                h.insert(
                    WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"tessera\""),
                );
            }
            Self::BadToken(_) | Self::Session(_) => {
                h.insert(
                    WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"tessera\", error=\"invalid_token\""),
                );
            }
            Self::UpstreamRejected => {
                h.insert(
                    WWW_AUTHENTICATE,
                    HeaderValue::from_static(UPSTREAM_REJECTED),
                );
            }
            Self::StoreUnavailable
            | Self::TooManyWebSockets
            | Self::TooManyWebSocketsForUser
            | Self::Upstream(ForwardError::TooManyEventStreams) => {
                h.insert(RETRY_AFTER, HeaderValue::from_static("1"));
            }
            Self::WebSocketVersion => {
                h.insert(
                    http::header::SEC_WEBSOCKET_VERSION,
                    HeaderValue::from_static("13"),
                );
            }
            // Heeded where hyper serves the connection (the fast path closes by itself).
            Self::PlainHttpOnTlsPort => {
                h.insert(http::header::CONNECTION, HeaderValue::from_static("close"));
            }
            Self::Screen(ScreenError::MethodNotAllowed) => {
                h.insert(
                    http::header::ALLOW,
                    HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"),
                );
            }
            _ => {}
        }
        resp
    }
}

/// Why a session-endpoint request (login, logout) was refused, before its response is shaped.
#[derive(Debug, thiserror::Error)]
pub enum LoginRefusal {
    /// 400: unreadable body, missing fields, a bad `rd`.
    #[error("login: {0}")]
    Bad(&'static str),
    /// 413: a body over the 8 KiB cap (refused by its `Content-Length` before any of it is read,
    /// so a client that sent `Expect: 100-continue` never gets a `100`).
    #[error("login: body over 8 KiB")]
    TooLarge,
    /// 401: the upstream said no.
    #[error("login: upstream rejected the credentials")]
    Credentials,
    /// 403: cross-origin POST or CSRF token mismatch.
    #[error("login: {0}")]
    Forbidden(&'static str),
    /// 415: neither form nor JSON.
    #[error("login: unsupported content type")]
    MediaType,
    /// 429: too many failures; seconds to wait (sent as `Retry-After`).
    #[error("login: rate limited")]
    Limited(u64),
    /// 503 with `Retry-After: 1`: as many logins as may be checked at once (a quarter of the
    /// upstream pool) are being checked.
    #[error("login: too many checks in flight")]
    Busy,
    /// The upstream or the store failed: its [`ProxyError`]'s status.
    #[error("login: {0}")]
    Proxy(ProxyError),
}

impl LoginRefusal {
    /// The HTTP status (exhaustive, as [`ProxyError::status`]).
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Bad(_) => StatusCode::BAD_REQUEST,
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Credentials => StatusCode::UNAUTHORIZED,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::MediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::Limited(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Busy => StatusCode::SERVICE_UNAVAILABLE,
            Self::Proxy(e) => e.status(),
        }
    }

    /// What the user is told: on the login page (`page`), or in the JSON error. Static text,
    /// never a detail of the upstream's or the store's failure.
    pub fn message(&self, page: bool) -> &'static str {
        match self {
            Self::Bad(why) | Self::Forbidden(why) => why,
            Self::TooLarge => "login form too large",
            Self::Credentials => "user name or password is wrong",
            Self::MediaType => "send application/x-www-form-urlencoded or application/json",
            Self::Limited(_) => "too many failed attempts; try again later",
            Self::Busy => "too many sign-ins at once; try again in a moment",
            // The session store, not the mail server: the user is told to wait either way, and
            // an operator reading the JSON is pointed at the right part.
            Self::Proxy(ProxyError::StoreUnavailable) if page => {
                "sign-in is unavailable for a moment; try again shortly"
            }
            Self::Proxy(ProxyError::StoreUnavailable) => "session store unavailable",
            Self::Proxy(_) if page => "the mail server is not answering; try again shortly",
            Self::Proxy(_) => "upstream unavailable",
        }
    }

    /// The fields the refusal's status calls for: a Bearer challenge with a 401 (RFC 6750 3),
    /// `Retry-After` with a 429 (its wait) or a 503 (1 s).
    pub fn add_fields(&self, h: &mut http::HeaderMap) {
        match self {
            Self::Credentials => {
                h.insert(
                    WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"tessera\""),
                );
            }
            Self::Limited(secs) => {
                h.insert(RETRY_AFTER, HeaderValue::from(*secs));
            }
            Self::Busy => {
                h.insert(RETRY_AFTER, HeaderValue::from_static("1"));
            }
            Self::Proxy(e) if e.status() == StatusCode::SERVICE_UNAVAILABLE => {
                h.insert(RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variant (each `ForwardError` once) with the status the table above gives it.
    fn every_variant() -> Vec<(ProxyError, u16)> {
        vec![
            (ProxyError::BadRequest("x"), 400),
            (ScreenError::BadRequest("x").into(), 400),
            (ScreenError::MethodNotAllowed.into(), 405),
            (ScreenError::BodyTooLarge.into(), 413),
            (ScreenError::TransferCoding.into(), 501),
            (ScreenError::UriTooLong.into(), 414),
            (ScreenError::HeadersTooLarge.into(), 431),
            (ProxyError::UriTooLong, 414),
            (ProxyError::NoToken, 401),
            (ProxyError::BadToken("x"), 401),
            (ProxyError::Session("x"), 401),
            (ProxyError::UpstreamRejected, 401),
            (ProxyError::StoreUnavailable, 503),
            (ProxyError::ForeignOrigin, 403),
            (ProxyError::CorsOrigin, 403),
            (ProxyError::PlainHttpOnTlsPort, 400),
            (ProxyError::TooManyWebSockets, 503),
            (ProxyError::TooManyWebSocketsForUser, 429),
            (ProxyError::WebSocketVersion, 426),
            (ForwardError::Connect("x".into()).into(), 502),
            (ForwardError::ConnectTimeout.into(), 504),
            (ForwardError::Timeout.into(), 504),
            (ForwardError::BodyTooLarge.into(), 413),
            (ForwardError::BodyTimeout.into(), 408),
            (ForwardError::TooManyEventStreams.into(), 503),
            (ForwardError::ClientBody("x".into()).into(), 400),
            (ForwardError::Broken("x".into()).into(), 502),
            (ForwardError::Closed.into(), 502),
        ]
    }

    #[test]
    fn every_variant_has_its_status_and_the_table_lists_each_status() {
        let table = include_str!("error.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .filter(|l| l.starts_with("//! | ") && !l.contains("---"))
            .map(|l| l.rsplit('|').nth(1).unwrap_or("").trim().to_string())
            .collect::<Vec<_>>();
        for (error, status) in every_variant() {
            let reason = error.to_string();
            let response = error.into_response();
            assert_eq!(response.status().as_u16(), status, "{reason}");
            assert!(
                table
                    .iter()
                    .any(|cell| cell.starts_with(&status.to_string())),
                "{status} ({reason}) is not in the module's table: {table:?}"
            );
        }
    }

    /// Every login refusal with its status, each listed in the refusals' table.
    #[test]
    fn every_login_refusal_has_its_status_and_fields() {
        let table = include_str!("error.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .skip_while(|l| !l.contains("| refusal | status |"))
            .filter(|l| l.starts_with("//! | ") && !l.contains("---"))
            .map(|l| l.rsplit('|').nth(1).unwrap_or("").trim().to_string())
            .collect::<Vec<_>>();
        let cases = [
            (LoginRefusal::Bad("x"), 400, None),
            (LoginRefusal::TooLarge, 413, None),
            (LoginRefusal::Credentials, 401, Some("www-authenticate")),
            (LoginRefusal::Forbidden("x"), 403, None),
            (LoginRefusal::MediaType, 415, None),
            (LoginRefusal::Limited(7), 429, Some("retry-after")),
            (LoginRefusal::Busy, 503, Some("retry-after")),
            (
                LoginRefusal::Proxy(ProxyError::StoreUnavailable),
                503,
                Some("retry-after"),
            ),
            (LoginRefusal::Proxy(ForwardError::Timeout.into()), 504, None),
        ];
        for (refusal, status, field) in cases {
            assert_eq!(refusal.status().as_u16(), status, "{refusal}");
            let listed = status.to_string();
            assert!(
                table.iter().any(|cell| cell.contains(&listed)),
                "{status} ({refusal}) is not in the refusals' table: {table:?}"
            );
            let mut h = http::HeaderMap::new();
            refusal.add_fields(&mut h);
            assert_eq!(h.keys().next().map(|k| k.as_str()), field, "{refusal}");
        }
        let mut h = http::HeaderMap::new();
        LoginRefusal::Limited(7).add_fields(&mut h);
        assert_eq!(h["retry-after"], "7");
    }

    #[test]
    fn refusals_carry_their_headers() {
        let header = |e: ProxyError, name: &str| e.into_response().headers().get(name).cloned();
        assert!(header(ProxyError::NoToken, "www-authenticate").is_some());
        assert!(
            header(ProxyError::UpstreamRejected, "www-authenticate").is_some_and(|v| v
                .to_str()
                .unwrap()
                .contains("upstream rejected credentials"))
        );
        assert!(header(ProxyError::Session("x"), "www-authenticate").is_some());
        assert!(header(ProxyError::StoreUnavailable, "retry-after").is_some());
        assert!(header(ProxyError::TooManyWebSockets, "retry-after").is_some());
        assert!(header(ScreenError::MethodNotAllowed.into(), "allow").is_some());
    }
}
