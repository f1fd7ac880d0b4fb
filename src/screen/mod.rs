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
use http::{HeaderMap, HeaderValue, Version};
use std::net::IpAddr;

use crate::fields::has_token;
use crate::upstream::RawHead;

pub mod body;
pub mod path;

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

/// Hop-by-hop headers always removed (RFC 9110 7.6.1, plus the legacy `Proxy-Connection` and
/// `Keep-Alive`), and the headers the upstream must not see from a client; lowercase.
///
/// Names are kept as `&str` and compared as such (length first): a `const` array of `HeaderName`
/// (which has drop glue) was built and dropped on every use, once per response field.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authorization",
];

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

/// Checks limits and cleans the request head in place.
///
/// Errors: [`ScreenError`] (400, 405, 413, 414, 431, 501; mapped in `error.rs`).
pub fn screen_request(parts: &mut Parts, limits: &Limits) -> Result<Screened, ScreenError> {
    if parts.method == http::Method::TRACE || parts.method == http::Method::CONNECT {
        return Err(ScreenError::MethodNotAllowed);
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
    let target_len = parts.uri.path_and_query().map_or(1, |pq| pq.as_str().len());
    if target_len > limits.max_uri_bytes {
        return Err(ScreenError::UriTooLong);
    }
    let header_bytes: usize = parts
        .headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len())
        .sum();
    if header_bytes > limits.max_header_bytes {
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
    let host = authority(parts)?;
    let (cookie_is_hop_by_hop, websocket) =
        remove_connection_named(&mut parts.headers, &parts.method, parts.version);
    remove_present(&mut parts.headers, [&HOP_BY_HOP, &SPOOFABLE]);
    Ok(Screened {
        host,
        cookie_is_hop_by_hop,
        websocket,
    })
}

/// Removes those of the names in `lists` (at most 32 in all) that are present, found in one
/// pass over the header names: a removal of an absent name costs a hash and a probe, and
/// removing the 13 hop-by-hop and spoofable names one by one was 5% of a warm request's user
/// CPU in the profile (most requests carry none of them).
fn remove_present(headers: &mut HeaderMap, lists: [&[&'static str]; 2]) {
    let names = || lists.iter().flat_map(|l| l.iter());
    debug_assert!(names().count() <= 32);
    let mut present = 0u32;
    let mut forwarded: Vec<HeaderName> = Vec::new();
    for name in headers.keys() {
        let key = name.as_str();
        if let Some(i) = names().position(|n| *n == key) {
            present |= 1 << i;
        } else if forwarding_field(key) {
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

fn authority(parts: &Parts) -> Result<HeaderValue, ScreenError> {
    let mut hosts = parts.headers.get_all(header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(ScreenError::BadRequest("more than one Host header"));
    }
    // RFC 9112 3.2.2: an absolute-form target (and HTTP/2 `:authority`) wins over `Host`.
    let value = match (parts.uri.authority(), host) {
        (Some(a), _) => HeaderValue::from_str(a.as_str())
            .map_err(|_| ScreenError::BadRequest("bad authority"))?,
        (None, Some(h)) => h.clone(),
        (None, None) if parts.version == Version::HTTP_10 => HeaderValue::from_static(""),
        (None, None) => return Err(ScreenError::BadRequest("missing Host header")),
    };
    if value.as_bytes().contains(&b'@') {
        return Err(ScreenError::BadRequest("userinfo in Host"));
    }
    if !value.is_empty()
        && value
            .to_str()
            .ok()
            .and_then(|s| s.parse::<http::uri::Authority>().ok())
            .is_none()
    {
        return Err(ScreenError::BadRequest("invalid Host header"));
    }
    Ok(value)
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

/// Cleans an upstream response head, its fields as received ([`RawHead`]): hop-by-hop fields,
/// those named in `Connection`, and the configured extras (`Alt-Svc` by default: Cyrus advertises
/// its own h2c/h3, which is not ours); names compare ASCII case-insensitively.
pub fn screen_response(fields: &mut RawHead, strip: &[HeaderName]) {
    // The tokens of `Connection` (nginx and Cyrus send one, `keep-alive`); past 8, the slow way.
    let mut listed: [&[u8]; 8] = [&[]; 8];
    let mut count = 0;
    for value in fields.get_all(b"connection") {
        for token in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
            if let Some(slot) = listed.get_mut(count) {
                *slot = token;
            }
            count += 1;
        }
    }
    let in_connection = |name: &[u8]| {
        if count <= listed.len() {
            listed[..count].iter().any(|t| t.eq_ignore_ascii_case(name))
        } else {
            fields.get_all(b"connection").any(|v| has_token(v, name))
        }
    };
    let mut drop = 0u128;
    for (i, (name, _)) in fields.iter().enumerate() {
        let screened = HOP_BY_HOP
            .iter()
            .any(|n| n.as_bytes().eq_ignore_ascii_case(name))
            || strip
                .iter()
                .any(|n| n.as_str().as_bytes().eq_ignore_ascii_case(name))
            || in_connection(name);
        // A head has at most 128 fields (the upstream parser's limit).
        if screened && i < 128 {
            drop |= 1 << i;
        }
    }
    if drop != 0 {
        let mut i = 0;
        fields.retain(|_, _| {
            let keep = drop & (1 << i) == 0;
            i += 1;
            keep
        });
    }
}

/// Sets `X-Forwarded-For`, `-Proto` and `-Host` from the connection (the client's values were
/// removed by [`screen_request`]).
pub fn set_forwarded(
    headers: &mut HeaderMap,
    forwarded_for: Option<&HeaderValue>,
    proto: &'static str,
    host: &HeaderValue,
) {
    // Validated at compile time (a `from_static` call outside a const checks the name per call).
    const FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
    const PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
    const HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
    if let Some(v) = forwarded_for {
        headers.insert(FOR, v.clone());
    }
    headers.insert(PROTO, HeaderValue::from_static(proto));
    if !host.is_empty() {
        headers.insert(HOST, host.clone());
    }
}

/// The client of a request that came through trusted proxies (`server.trusted_proxies`): walking
/// the `X-Forwarded-For` entries (every such field, in order, comma-separated) from the right,
/// the first that is not a trusted address. Each trusted hop appended the address it received the
/// request from, so entries left of the first untrusted one are the client's own claims and are
/// not believed. An entry that is not an IP address ends the walk: the last address passed (a
/// trusted hop, or `peer` itself) is the client. Ports and `Forwarded` (RFC 7239) are not read.
pub fn forwarded_client(headers: &HeaderMap, trusted: &[ipnet::IpNet], peer: IpAddr) -> IpAddr {
    let mut client = peer;
    let fields: Vec<&[u8]> = headers
        .get_all("x-forwarded-for")
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    for entry in fields.iter().rev().flat_map(|f| f.rsplit(|&b| b == b',')) {
        let Some(ip) = std::str::from_utf8(entry)
            .ok()
            .and_then(|t| t.trim().parse::<IpAddr>().ok())
            .map(|ip| ip.to_canonical())
        else {
            break;
        };
        client = ip;
        if !trusted.iter().any(|net| net.contains(&ip)) {
            break;
        }
    }
    client
}

/// The scheme a trusted proxy says the client used (`X-Forwarded-Proto: https` or `http`, the
/// last such field); `None` when absent or anything else.
pub fn forwarded_proto(headers: &HeaderMap) -> Option<&'static str> {
    let v = headers.get_all("x-forwarded-proto").iter().next_back()?;
    let v = v.as_bytes().trim_ascii();
    if v.eq_ignore_ascii_case(b"https") {
        Some("https")
    } else if v.eq_ignore_ascii_case(b"http") {
        Some("http")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_is_the_rightmost_untrusted_forwarded_for_entry() {
        let trusted: Vec<ipnet::IpNet> = ["10.0.0.0/8", "2001:db8::/32"]
            .iter()
            .map(|n| n.parse().unwrap())
            .collect();
        let lb: IpAddr = "10.0.0.2".parse().unwrap();
        let client = |fields: &[&str]| {
            let mut h = HeaderMap::new();
            for f in fields {
                h.append("x-forwarded-for", HeaderValue::from_str(f).unwrap());
            }
            forwarded_client(&h, &trusted, lb).to_string()
        };
        assert_eq!(client(&[]), "10.0.0.2", "no header: the peer");
        assert_eq!(client(&["198.51.100.7"]), "198.51.100.7");
        // A client's own (spoofed) entry is left of the address the load balancer saw.
        assert_eq!(client(&["1.2.3.4, 198.51.100.7"]), "198.51.100.7");
        // Trusted hops are skipped, across fields and with odd spacing.
        assert_eq!(
            client(&["1.2.3.4,198.51.100.7", " 10.1.1.1 ,2001:db8::5"]),
            "198.51.100.7"
        );
        assert_eq!(
            client(&["2001:db8::9, 2001:db8::5"]),
            "2001:db8::9",
            "all trusted"
        );
        assert_eq!(client(&["2a00::1"]), "2a00::1");
        // Garbage ends the walk at the last address passed.
        assert_eq!(client(&["198.51.100.7, unknown"]), "10.0.0.2");
        assert_eq!(client(&["198.51.100.7, bogus, 10.9.9.9"]), "10.9.9.9");
        assert_eq!(
            client(&["198.51.100.7:443"]),
            "10.0.0.2",
            "ports are not read"
        );
        // An IPv4-mapped entry is matched (and named) as IPv4.
        assert_eq!(client(&["198.51.100.7, ::ffff:10.3.3.3"]), "198.51.100.7");
        assert_eq!(client(&["::ffff:198.51.100.7"]), "198.51.100.7");
    }

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

    #[test]
    fn only_http_or_https_is_taken_from_forwarded_proto() {
        let proto = |v: Option<&str>| {
            let mut h = HeaderMap::new();
            if let Some(v) = v {
                h.insert("x-forwarded-proto", HeaderValue::from_str(v).unwrap());
            }
            forwarded_proto(&h)
        };
        assert_eq!(proto(Some("https")), Some("https"));
        assert_eq!(proto(Some(" HTTP ")), Some("http"));
        assert_eq!(proto(Some("javascript")), None);
        assert_eq!(proto(None), None);
    }

    #[test]
    fn response_screening_keeps_only_end_to_end_fields_in_order() {
        let mut raw = crate::upstream::raw::from_pairs(&[
            ("Connection", "keep-alive, X-Internal"),
            ("Keep-Alive", "timeout=5"),
            ("x-internal", "secret"),
            ("Transfer-Encoding", "chunked"),
            ("Upgrade", "h2c"),
            ("Alt-Svc", "h2=\":443\""),
            ("Set-Cookie", "a=1"),
            ("Content-Type", "text/plain"),
            ("set-cookie", "b=2"),
        ]);
        screen_response(&mut raw, &[HeaderName::from_static("alt-svc")]);
        let kept: Vec<_> = raw
            .iter()
            .map(|(n, v)| String::from_utf8_lossy(&[n, b": ", v].concat()).into_owned())
            .collect();
        assert_eq!(
            kept,
            [
                "Set-Cookie: a=1",
                "Content-Type: text/plain",
                "set-cookie: b=2"
            ]
        );
        // More `Connection` tokens than the fast path collects: each is still honoured.
        let mut pairs = vec![("connection", "a, b, c, d, e, f, g, h, x-ninth")];
        pairs.extend([("x-ninth", "1"), ("x-a", "2")]);
        let mut raw = crate::upstream::raw::from_pairs(&pairs);
        screen_response(&mut raw, &[]);
        assert_eq!(raw.iter().map(|(n, _)| n).collect::<Vec<_>>(), [b"x-a"]);
        // Long names, named in `Connection` or configured, are compared in full.
        let long = format!("x-{}", "l".repeat(70));
        let strip = HeaderName::from_bytes(format!("{long}-s").as_bytes()).unwrap();
        let pairs = [
            ("connection", long.as_str()),
            (long.as_str(), "1"),
            (strip.as_str(), "2"),
            ("x-b", "3"),
        ];
        let mut raw = crate::upstream::raw::from_pairs(&pairs);
        screen_response(&mut raw, std::slice::from_ref(&strip));
        assert_eq!(raw.iter().map(|(n, _)| n).collect::<Vec<_>>(), [b"x-b"]);
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
    fn every_hop_by_hop_and_spoofable_name_is_removed_and_nothing_else() {
        let prefixed = [
            "x-forwarded-user",
            "x-forwarded-prefix",
            "x-forwarded-port",
            "x_forwarded_user",
            "x_forwarded-for",
            "x_real_ip",
        ];
        for name in HOP_BY_HOP.iter().chain(SPOOFABLE.iter()).chain(&prefixed) {
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
        assert!(matches!(
            screen_request(&mut parts(&[("host", "a b")], "/"), &L),
            Err(ScreenError::BadRequest(_))
        ));
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
    fn response_hygiene() {
        let mut h = crate::upstream::raw::from_pairs(&[
            ("connection", "Upgrade, x-internal"),
            ("upgrade", "h2c"),
            ("alt-svc", "h3=\":443\""),
            ("x-internal", "1"),
            ("content-type", "a/b"),
        ]);
        screen_response(&mut h, &[HeaderName::from_static("alt-svc")]);
        assert_eq!(
            h.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            [b"content-type"]
        );
    }
}
