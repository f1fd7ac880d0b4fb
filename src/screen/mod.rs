//! The screen phase: limits and header hygiene before any work (RFC 9110 section 7.6.1,
//! RFC 9112 section 3.2).
//!
//! Removes hop-by-hop headers and every header named in `Connection`, except `Authorization` and
//! `Cookie`, which tessera itself reads (they are removed or rewritten by the inject phase, so the
//! client's copies never reach the upstream either way). Removes client-supplied forwarding
//! headers (they are set anew from the connection). Must never: forward a header the client marked
//! hop-by-hop, or trust a client's claim about its own address.

use http::header::{self, HeaderName};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Uri, Version};

use crate::fields::has_token;
pub use cache::PrivateResponses;
pub use forwarded::{forwarded_client, forwarded_proto, set_forwarded};
pub use identity::Stripped;
pub use response::{drop_set_cookies, screen_response, unlisted_in_trailers};

mod authority;
pub mod body;
mod cache;
mod forwarded;
pub(crate) mod h3;
pub mod identity;
pub mod path;
mod response;

/// Why the screen refused a request; `error.rs` maps each to its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ScreenError {
    /// Malformed (the reason is static text, safe to log and answer). 400.
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    /// TRACE or CONNECT (TRACE would reflect the injected credential, RFC 9110 9.3.8). 405.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// `Content-Length` over `server.max_body_bytes`. 413.
    #[error("request body too large")]
    BodyTooLarge,
    /// A `Transfer-Encoding` other than `chunked` alone (RFC 9112 section 6.1). 501.
    #[error("transfer coding not implemented")]
    TransferCoding,
    /// Request-target over `server.max_uri_bytes`. 414.
    #[error("request-target too long")]
    UriTooLong,
    /// Header section over `server.max_header_bytes`. 431.
    #[error("request header fields too large")]
    HeadersTooLarge,
}

/// Request limits from `[server]`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Max sum of header name + value bytes.
    pub max_header_bytes: usize,
    /// Max request-target bytes.
    pub max_uri_bytes: usize,
    /// Max body bytes, 0 = unlimited.
    pub max_body_bytes: u64,
    /// `server.allow_encoded_slashes`: forward `%2F`, `%5C` and `\` outside dot segments
    /// instead of refusing them (see [`path::check`]).
    pub allow_encoded_slashes: bool,
}

/// What the screen learnt that later phases need.
#[derive(Debug)]
pub struct Screened {
    /// The authority the client asked for (`Host`, or `:authority` in HTTP/2).
    pub host: HeaderValue,
    /// The client named `Cookie` in `Connection`: no cookie may be forwarded.
    pub cookie_is_hop_by_hop: bool,
    /// The request asks to become a WebSocket (RFC 6455 section 4.1): an HTTP/1.1 `GET` whose
    /// `Connection` lists `upgrade` and whose `Upgrade` lists `websocket`. Its `Connection` and
    /// `Upgrade` fields are removed all the same; the proxy sets its own when it passes the
    /// upgrade on.
    pub websocket: bool,
}

pub(crate) use crate::fields::HOP_BY_HOP;

/// Client-supplied forwarding headers, replaced from the connection by [`set_forwarded`]. Every
/// other `X-Forwarded-*` field (`-User`, `-Email`, `-Prefix`, `-Port`, `-Ssl`: identity and URL
/// headers some upstreams trust) is removed too, by its prefix.
const SPOOFABLE: [&str; 5] = [
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-real-ip",
];

/// Fields tessera answers itself: hyper's HTTP/1 server sends the client its `100 Continue` as
/// the body is read, and the body goes upstream whatever the upstream would answer first, so an
/// upstream that answered a forwarded `Expect` early could take the rest of the body for a new
/// request.
const ANSWERED_HERE: [&str; 1] = ["expect"];

/// Most field lines a request may carry (HTTP/2 and HTTP/3 cookie crumbs each count): a line
/// costs about 100 bytes of header map however short it is, and HTTP/2's own bound
/// (`SETTINGS_MAX_HEADER_LIST_SIZE`, 32 bytes a line) lets some 700 one-byte lines through, held
/// per stream while a body is awaited. HTTP/1.1 requests stop at 100 (hyper's limit), as Envoy's
/// `max_headers_count` does for every protocol; 200 leaves room for a browser's cookie crumbs.
const MAX_FIELD_LINES: usize = 200;

/// Checks limits and cleans the request head in place.
///
/// Errors: [`ScreenError`] (400, 405, 413, 414, 431, 501; mapped in `error.rs`).
pub fn screen_request(parts: &mut Parts, limits: &Limits) -> Result<Screened, ScreenError> {
    screen_request_with(parts, limits, &Stripped::default())
}

/// [`screen_request`], also removing the identity and routing fields `stripped` lists
/// (`upstream.strip_request_headers`).
///
/// Errors: as [`screen_request`].
pub fn screen_request_with(
    parts: &mut Parts,
    limits: &Limits,
    stripped: &Stripped,
) -> Result<Screened, ScreenError> {
    if reflects_or_tunnels(&parts.method) {
        return Err(ScreenError::MethodNotAllowed);
    }
    if parts.version == Version::HTTP_3 {
        if let Some(why) = h3::malformed(&parts.headers) {
            return Err(ScreenError::BadRequest(why));
        }
    }
    if let Some(te) = parts.headers.get(header::TRANSFER_ENCODING) {
        // hyper de-chunks the body; any other coding would be dropped unnamed on the way.
        if parts
            .headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .count()
            > 1
        {
            return Err(ScreenError::BadRequest(
                "more than one Transfer-Encoding field",
            ));
        }
        if !te.as_bytes().trim_ascii().eq_ignore_ascii_case(b"chunked") {
            return Err(ScreenError::TransferCoding);
        }
    }
    // RFC 9112 section 3.2.3: the authority form (`host:port`) is only for CONNECT.
    if parts.uri.scheme().is_none() && parts.uri.authority().is_some() {
        return Err(ScreenError::BadRequest("authority-form request target"));
    }
    if !origin_or_asterisk(&parts.method, parts.version, &parts.uri) {
        return Err(ScreenError::BadRequest(
            "request target not starting with /",
        ));
    }
    let target_len = parts.uri.path_and_query().map_or(1, |pq| pq.as_str().len());
    if target_len > limits.max_uri_bytes {
        return Err(ScreenError::UriTooLong);
    }
    let header_bytes: usize = parts
        .headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len())
        .sum();
    if header_bytes > limits.max_header_bytes || parts.headers.len() > MAX_FIELD_LINES {
        return Err(ScreenError::HeadersTooLarge);
    }
    if limits.max_body_bytes > 0 {
        if let Some(len) = parts.headers.get(header::CONTENT_LENGTH) {
            let len: u64 = len
                .to_str()
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or(ScreenError::BadRequest("bad content-length"))?;
            if len > limits.max_body_bytes {
                return Err(ScreenError::BodyTooLarge);
            }
        }
    }
    path::check(parts.uri.path(), limits.allow_encoded_slashes)
        .map_err(|e| ScreenError::BadRequest(e.reason()))?;
    let host = authority::authority(parts)?;
    let (cookie_is_hop_by_hop, websocket) =
        remove_connection_named(&mut parts.headers, &parts.method, parts.version);
    remove_present(
        &mut parts.headers,
        [&HOP_BY_HOP, &SPOOFABLE, &ANSWERED_HERE],
        stripped,
    );
    Ok(Screened {
        host,
        cookie_is_hop_by_hop,
        websocket,
    })
}

/// Whether `uri`'s path starts with `/`, is `*` for OPTIONS, or is empty in an HTTP/1.1
/// absolute form (`http://host`, `http://host?q`: the path `/`, RFC 3986 section 6.2.3); RFC
/// 9112 section 3.2, RFC 9113 section 8.3.1, RFC 9114 section 4.3.1. The http crate also takes
/// an HTTP/2 or HTTP/3 `:path` of `?query` alone, which is malformed there.
fn origin_or_asterisk(method: &Method, version: Version, uri: &Uri) -> bool {
    let absolute_form = uri.authority().is_some() && version <= Version::HTTP_11;
    match uri.path_and_query().map(PathAndQuery::as_str) {
        None => true,
        Some(pq) if pq.starts_with('/') => true,
        Some("*") => method == Method::OPTIONS,
        Some(pq) if pq.is_empty() || pq.starts_with('?') => absolute_form,
        Some(_) => false,
    }
}

/// Removes those of the names in `lists` (at most 32 in all) that are present, found in one
/// pass over the header names: a removal of an absent name costs a hash and a probe, and
/// removing the 13 hop-by-hop and spoofable names one by one was 5% of a warm request's user
/// CPU in the profile (most requests carry none of them).
fn remove_present(headers: &mut HeaderMap, lists: [&[&'static str]; 3], stripped: &Stripped) {
    let names = || lists.iter().flat_map(|l| l.iter());
    debug_assert!(names().count() <= 32);
    let mut present = 0u32;
    let mut forwarded: Vec<HeaderName> = Vec::new();
    for name in headers.keys() {
        let key = name.as_str();
        if let Some(i) = names().position(|n| *n == key) {
            present |= 1 << i;
        } else if forwarding_field(key) || stripped.contains(key) || framing_underscored(key) {
            forwarded.push(name.clone());
        }
    }
    for name in forwarded {
        headers.remove(name);
    }
    if present != 0 {
        for (i, name) in names().enumerate() {
            if present & (1 << i) != 0 {
                headers.remove(*name);
            }
        }
    }
}

/// Whether a header name (lower case) is `x-forwarded-*`, or `x-real-ip`, also spelled with `_`
/// for `-` (CGI and WSGI servers read `X_Forwarded_User` as `HTTP_X_FORWARDED_USER`, the same
/// variable as `X-Forwarded-User`).
fn forwarding_field(name: &str) -> bool {
    let dashed = |prefix: &str| {
        name.len() >= prefix.len()
            && name
                .bytes()
                .zip(prefix.bytes())
                .all(|(a, b)| a == b || (a == b'_' && b == b'-'))
    };
    dashed("x-forwarded-") || (name.len() == 9 && dashed("x-real-ip"))
}

/// Whether a header name (lower case) is a hop-by-hop field or `Content-Length` spelled with
/// `_` for `-` (`transfer_encoding`): an upstream that reads `_` as `-`, as CGI and WSGI servers
/// do, would frame the body or keep the connection by a field tessera did not frame. nginx drops
/// every name with `_` by default (`underscores_in_headers off`).
fn framing_underscored(name: &str) -> bool {
    // Only the lengths of those names with a `-` (keep-alive, content-length, proxy-connection,
    // transfer-encoding, proxy-authorization): most names are not, and cost no scan.
    matches!(name.len(), 10 | 14 | 16 | 17 | 19)
        && memchr::memchr(b'_', name.as_bytes()).is_some()
        && HOP_BY_HOP.iter().chain(&["content-length"]).any(|n| {
            n.len() == name.len()
                && n.bytes()
                    .zip(name.bytes())
                    .all(|(a, b)| a == b || (a == b'-' && b == b'_'))
        })
}

/// Whether a method is refused (405): TRACE, and TRACK (IIS's), in any case, would reflect the
/// injected credential back to the client (RFC 9110 9.3.8); CONNECT would open a tunnel through
/// the proxy. Methods are case-sensitive, so `trace` is an extension method that an upstream may
/// still treat as TRACE.
fn reflects_or_tunnels(method: &http::Method) -> bool {
    if *method == http::Method::TRACE || *method == http::Method::CONNECT {
        return true;
    }
    let m = method.as_str();
    match m.len() {
        5 => m.eq_ignore_ascii_case("trace") || m.eq_ignore_ascii_case("track"),
        7 => m.eq_ignore_ascii_case("connect"),
        _ => false,
    }
}

/// Removes the headers named in `Connection` (RFC 9110 section 7.6.1), except `Authorization`
/// and `Cookie`, which the caller handles; returns whether `Cookie` was named, and whether
/// `upgrade` was named with an `Upgrade` field listing `websocket` (only looked at when the
/// request is an HTTP/1.1 GET). The fixed hop-by-hop names are removed by
/// [`screen_request`] with the spoofable ones.
fn remove_connection_named(
    headers: &mut HeaderMap,
    method: &http::Method,
    version: Version,
) -> (bool, bool) {
    let (mut cookie_named, mut websocket) = (false, false);
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .filter_map(|t| HeaderName::from_bytes(t.trim_ascii()).ok())
            .collect();
        for name in named {
            if name == header::AUTHORIZATION {
                continue;
            }
            if name == header::COOKIE {
                cookie_named = true;
                continue;
            }
            if name == header::UPGRADE && version == Version::HTTP_11 && method == http::Method::GET
            {
                websocket |= headers
                    .get_all(header::UPGRADE)
                    .iter()
                    .any(|v| has_token(v.as_bytes(), b"websocket"));
            }
            headers.remove(&name);
        }
    }
    (cookie_named, websocket)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_websocket_upgrade_is_an_http11_get_naming_upgrade_and_websocket_and_its_fields_go() {
        let screened = |method: &str, version: Version, fields: &[(&str, &str)]| {
            let mut b = http::Request::builder()
                .method(method)
                .uri("/ws")
                .version(version)
                .header("host", "a");
            for (n, v) in fields {
                b = b.header(*n, *v);
            }
            let (mut parts, ()) = b.body(()).unwrap().into_parts();
            let limits = Limits {
                max_header_bytes: 16384,
                max_uri_bytes: 8192,
                max_body_bytes: 0,
                allow_encoded_slashes: false,
            };
            let s = screen_request(&mut parts, &limits).unwrap();
            let gone = ["connection", "upgrade"]
                .iter()
                .all(|n| parts.headers.get(*n).is_none());
            assert!(gone, "hop-by-hop fields kept: {:?}", parts.headers);
            assert!(parts.headers.get("sec-websocket-key").is_some());
            s.websocket
        };
        let ws = [
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "WebSocket"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ];
        assert!(screened("GET", Version::HTTP_11, &ws));
        assert!(!screened("POST", Version::HTTP_11, &ws), "not a GET");
        assert!(!screened("GET", Version::HTTP_10, &ws), "not HTTP/1.1");
        let h2c = [
            ("connection", "upgrade"),
            ("upgrade", "h2c"),
            ("sec-websocket-key", "x"),
        ];
        assert!(!screened("GET", Version::HTTP_11, &h2c), "another protocol");
        let unnamed = [("upgrade", "websocket"), ("sec-websocket-key", "x")];
        assert!(
            !screened("GET", Version::HTTP_11, &unnamed),
            "Upgrade not named in Connection"
        );
    }

    fn parts(headers: &[(&str, &str)], uri: &str) -> Parts {
        let mut b = http::Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    const L: Limits = Limits {
        max_header_bytes: 1024,
        max_uri_bytes: 256,
        max_body_bytes: 100,
        allow_encoded_slashes: false,
    };

    #[test]
    fn a_target_is_an_origin_form_path_an_absolute_form_or_asterisk_for_options() {
        let target = |method: &str, uri: &str| {
            let mut p = parts(&[("host", "a")], uri);
            p.method = method.parse().unwrap();
            screen_request(&mut p, &L).map(|_| ())
        };
        assert!(target("GET", "/x?y").is_ok());
        assert!(target("GET", "http://a").is_ok());
        assert!(target("GET", "http://a/x").is_ok());
        assert!(target("GET", "http://a?x=1").is_ok(), "the path `/`");
        assert!(target("OPTIONS", "*").is_ok());
        let refused = Err(ScreenError::BadRequest(
            "request target not starting with /",
        ));
        assert_eq!(target("GET", "*"), refused);
        // As h2 builds it from `:scheme`, `:authority` and a `:path` of `?x=1`.
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(http::uri::Scheme::HTTPS);
        uri.authority = Some(http::uri::Authority::from_static("a"));
        uri.path_and_query = Some(PathAndQuery::from_static("?x=1"));
        let mut p = parts(&[("host", "a")], "/");
        p.uri = Uri::from_parts(uri).unwrap();
        p.version = Version::HTTP_2;
        assert_eq!(screen_request(&mut p, &L).map(|_| ()), refused);
    }

    #[test]
    fn connection_named_headers_removed_but_credentials_kept_for_later_phases() {
        let mut p = parts(
            &[
                ("host", "a"),
                ("connection", "x-secret, authorization, cookie"),
                ("x-secret", "1"),
                ("authorization", "Bearer t"),
                ("cookie", "c=1"),
                ("te", "trailers"),
                ("upgrade", "h2c"),
            ],
            "/",
        );
        let s = screen_request(&mut p, &L).unwrap();
        assert!(s.cookie_is_hop_by_hop);
        assert!(p.headers.get("x-secret").is_none());
        assert!(p.headers.get("connection").is_none());
        assert!(p.headers.get("te").is_none() && p.headers.get("upgrade").is_none());
        assert!(
            p.headers.get("authorization").is_some(),
            "read by extract, removed by inject"
        );
    }

    #[test]
    fn spoofable_forwarding_headers_removed_and_set_true() {
        let mut p = parts(
            &[
                ("host", "h.example"),
                ("x-forwarded-for", "6.6.6.6"),
                ("forwarded", "for=6.6.6.6"),
                ("x-real-ip", "6.6.6.6"),
            ],
            "/",
        );
        let s = screen_request(&mut p, &L).unwrap();
        set_forwarded(
            &mut p.headers,
            Some(&HeaderValue::from_static("127.0.0.9")),
            "http",
            &s.host,
        );
        assert_eq!(p.headers["x-forwarded-for"], "127.0.0.9");
        assert_eq!(p.headers["x-forwarded-host"], "h.example");
        assert!(p.headers.get("forwarded").is_none() && p.headers.get("x-real-ip").is_none());
    }

    #[test]
    fn every_hop_by_hop_spoofable_and_answered_name_is_removed_and_nothing_else() {
        let prefixed = [
            "x-forwarded-user",
            "x-forwarded-prefix",
            "x-forwarded-port",
            "x_forwarded_user",
            "x_forwarded-for",
            "x_real_ip",
            "transfer_encoding",
            "content_length",
            "keep_alive",
            "proxy_connection",
            "proxy_authorization",
        ];
        let names = HOP_BY_HOP.iter().chain(&SPOOFABLE).chain(&ANSWERED_HERE);
        for name in names.chain(&prefixed) {
            let value = if *name == "transfer-encoding" {
                "chunked"
            } else {
                "x"
            };
            let mut p = parts(&[("host", "a"), ("x-custom", "1"), (name, value)], "/");
            screen_request(&mut p, &L).unwrap();
            assert!(p.headers.get(*name).is_none(), "{name} kept");
            assert_eq!(p.headers["x-custom"], "1", "{name}");
            assert_eq!(p.headers.len(), 2, "{name}");
        }
    }

    #[test]
    fn transfer_codings_other_than_chunked_get_501() {
        let te = |values: &[&str]| {
            let mut h = vec![("host", "a")];
            h.extend(values.iter().map(|v| ("transfer-encoding", *v)));
            screen_request(&mut parts(&h, "/"), &L)
        };
        assert!(te(&["chunked"]).is_ok());
        assert!(te(&[" Chunked "]).is_ok());
        for bad in [&["gzip, chunked"][..], &["gzip"]] {
            assert!(
                matches!(te(bad), Err(ScreenError::TransferCoding)),
                "{bad:?}"
            );
        }
        assert!(matches!(
            te(&["chunked", "chunked"]),
            Err(ScreenError::BadRequest(_))
        ));
    }

    #[test]
    fn limits() {
        let long = format!("/{}", "a".repeat(300));
        assert!(matches!(
            screen_request(&mut parts(&[("host", "a")], &long), &L),
            Err(ScreenError::UriTooLong)
        ));
        let big = "v".repeat(1100);
        assert!(matches!(
            screen_request(&mut parts(&[("host", "a"), ("x", &big)], "/"), &L),
            Err(ScreenError::HeadersTooLarge)
        ));
        // Many short lines: counted, whatever their bytes.
        let lines = |n: usize| {
            let mut h = vec![("host", "a")];
            h.extend(std::iter::repeat_n(("a", ""), n - 1));
            screen_request(&mut parts(&h, "/"), &L)
        };
        assert!(lines(MAX_FIELD_LINES).is_ok());
        assert!(matches!(
            lines(MAX_FIELD_LINES + 1),
            Err(ScreenError::HeadersTooLarge)
        ));
        assert!(matches!(
            screen_request(
                &mut parts(&[("host", "a"), ("content-length", "101")], "/"),
                &L
            ),
            Err(ScreenError::BodyTooLarge)
        ));
        assert!(matches!(
            screen_request(
                &mut parts(&[("host", "a"), ("content-length", "x")], "/"),
                &L
            ),
            Err(ScreenError::BadRequest(_))
        ));
    }

    #[test]
    fn host_rules() {
        assert!(matches!(
            screen_request(&mut parts(&[], "/"), &L),
            Err(ScreenError::BadRequest(_))
        ));
        assert!(matches!(
            screen_request(&mut parts(&[("host", "a"), ("host", "b")], "/"), &L),
            Err(ScreenError::BadRequest(_))
        ));
        for bad in [
            "a b",
            "mail.example.com,evil.example",
            "mail.example.com:x",
            "a'b",
            "[::1",
            "[mail]:80",
            ":80",
        ] {
            assert!(
                matches!(
                    screen_request(&mut parts(&[("host", bad)], "/"), &L),
                    Err(ScreenError::BadRequest(_))
                ),
                "{bad}"
            );
        }
        for good in [
            "mail.example.com:8443",
            "127.0.0.1",
            "[2001:db8::1]:443",
            "in_ternal",
        ] {
            assert!(
                screen_request(&mut parts(&[("host", good)], "/"), &L).is_ok(),
                "{good}"
            );
        }
    }

    #[test]
    fn trace_connect_userinfo_and_dot_segments_refused() {
        let mut p = parts(&[("host", "a")], "/");
        p.method = http::Method::TRACE;
        assert!(matches!(
            screen_request(&mut p, &L),
            Err(ScreenError::MethodNotAllowed)
        ));
        let mut p = parts(&[("host", "a")], "/");
        p.method = http::Method::CONNECT;
        assert!(matches!(
            screen_request(&mut p, &L),
            Err(ScreenError::MethodNotAllowed)
        ));
        assert!(matches!(
            screen_request(&mut parts(&[("host", "u:pw@a")], "/"), &L),
            Err(ScreenError::BadRequest(_))
        ));
        assert!(matches!(
            screen_request(&mut parts(&[], "http://u:pw@a/x"), &L),
            Err(ScreenError::BadRequest(_))
        ));
        for path in [
            "/../x",
            "/a/./b",
            "/a/%2E%2e/b",
            "/a/.%2e",
            "/a/..",
            "/..;/admin",
            "/%2e%2e;/admin",
            "/.;/..;/admin",
            "/..;jsessionid=x/admin",
            "127.0.0.1:9999",
        ] {
            assert!(
                matches!(
                    screen_request(&mut parts(&[("host", "a")], path), &L),
                    Err(ScreenError::BadRequest(_))
                ),
                "{path}"
            );
        }
        assert!(screen_request(&mut parts(&[("host", "a")], "/a/.well-known/..x/b."), &L).is_ok());
        assert!(screen_request(&mut parts(&[("host", "a")], "/a;v=1/..x;/b"), &L).is_ok());
    }

    #[test]
    fn non_utf8_connection_value_still_removes_named_headers() {
        let mut p = parts(&[("host", "a"), ("x-internal", "1")], "/");
        p.headers.insert(
            header::CONNECTION,
            HeaderValue::from_bytes(b"x-internal, \xff").unwrap(),
        );
        screen_request(&mut p, &L).unwrap();
        assert_eq!(
            p.headers.keys().collect::<Vec<_>>(),
            [header::HOST],
            "{:?}",
            p.headers
        );
    }

    #[test]
    fn trace_track_and_connect_are_refused_in_any_case() {
        for method in [
            "TRACE", "trace", "Trace", "TRACK", "track", "CONNECT", "connect",
        ] {
            let mut p = parts(&[("host", "a")], "/");
            p.method = http::Method::from_bytes(method.as_bytes()).unwrap();
            assert_eq!(
                screen_request(&mut p, &L).err(),
                Some(ScreenError::MethodNotAllowed),
                "{method}"
            );
        }
        for method in ["GET", "TRACES", "TRAC", "PROPFIND"] {
            let mut p = parts(&[("host", "a")], "/");
            p.method = http::Method::from_bytes(method.as_bytes()).unwrap();
            assert!(screen_request(&mut p, &L).is_ok(), "{method}");
        }
    }

    #[test]
    fn an_empty_host_is_refused_in_http11_and_a_host_unlike_the_authority_in_http2() {
        assert!(screen_request(&mut parts(&[("host", "")], "/"), &L).is_err());
        let mut p = parts(&[("host", "")], "/");
        p.version = Version::HTTP_10;
        assert!(screen_request(&mut p, &L).is_ok(), "HTTP/1.0 may send none");
        let h2 = |host: &str| {
            let mut p = parts(&[("host", host)], "https://mail.example/x");
            p.version = Version::HTTP_2;
            screen_request(&mut p, &L)
        };
        assert!(h2("mail.example").is_ok());
        assert!(h2("MAIL.example").is_ok(), "any case");
        assert!(h2("mail.example:443").is_ok(), "the scheme's default port");
        assert!(h2("mail.example:8443").is_err());
        let mut h3 = parts(&[("host", "mail.example:443")], "https://mail.example/x");
        h3.version = Version::HTTP_3;
        assert!(
            screen_request(&mut h3, &L).is_err(),
            "HTTP/3: the same value"
        );
        assert_eq!(
            h2("evil.example").err(),
            Some(ScreenError::BadRequest("host differs from :authority"))
        );
        // HTTP/1.1 absolute form: Host is ignored (RFC 9112 3.2.2).
        let mut p = parts(&[("host", "other")], "http://mail.example/x");
        assert_eq!(screen_request(&mut p, &L).unwrap().host, "mail.example");
    }

    #[test]
    fn identity_and_routing_fields_are_removed_as_configured() {
        let stripped = Stripped::new(&identity::DEFAULT_STRIPPED);
        let mut p = parts(
            &[
                ("host", "a"),
                ("x-remote-user", "admin"),
                ("x_remote_user", "admin"),
                ("x-auth-request-email", "a@b"),
                ("x-original-url", "/admin"),
                ("true-client-ip", "1.2.3.4"),
                ("x-http-method-override", "DELETE"),
                ("x-custom", "kept"),
            ],
            "/",
        );
        screen_request_with(&mut p, &L, &stripped).unwrap();
        let kept: Vec<_> = p.headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(kept, ["host", "x-custom"]);
        let mut p = parts(&[("host", "a"), ("x-remote-user", "admin")], "/");
        screen_request_with(&mut p, &L, &Stripped::new::<&str>(&[])).unwrap();
        assert!(
            p.headers.contains_key("x-remote-user"),
            "an empty list strips none"
        );
    }
}
