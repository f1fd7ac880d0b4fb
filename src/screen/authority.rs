//! The request's authority: the absolute-form target's or `:authority` over `Host`, checked
//! against `Host` where both come (RFC 9112 3.2.2, RFC 9113 8.3.1, RFC 9114 4.3.1), and a
//! server name as clients write one.

use http::header::{self, HeaderValue};
use http::request::Parts;
use http::Version;

use super::ScreenError;

/// Whether `host` names the request's `:authority` (ASCII case ignored); over HTTP/2 after the
/// scheme's default port is dropped from both (RFC 9113 8.3.1 asks for the normalization of
/// RFC 3986 6.2.3), over HTTP/3 as it is (RFC 9114 4.3.1: the same value).
fn same_authority(parts: &Parts, authority: &http::uri::Authority, host: &HeaderValue) -> bool {
    let default = match parts.uri.scheme_str() {
        _ if parts.version != Version::HTTP_2 => None,
        Some("https") => Some(&b":443"[..]),
        Some("http") => Some(&b":80"[..]),
        _ => None,
    };
    let bare = |s: &[u8]| -> usize {
        match default {
            Some(d) if s.ends_with(d) => s.len() - d.len(),
            _ => s.len(),
        }
    };
    let (a, h) = (authority.as_str().as_bytes(), host.as_bytes());
    a[..bare(a)].eq_ignore_ascii_case(&h[..bare(h)])
}

/// The authority the client asked for (the screened `Host`): the absolute-form target's or
/// `:authority`, else `Host` (empty for HTTP/1.0 without one).
///
/// Errors: [`ScreenError::BadRequest`]: several `Host`s, one unlike `:authority`, an empty or
/// missing one in HTTP/1.1, userinfo, or no server name.
pub(super) fn authority(parts: &Parts) -> Result<HeaderValue, ScreenError> {
    let mut hosts = parts.headers.get_all(header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(ScreenError::BadRequest("more than one Host header"));
    }
    // RFC 9112 3.2.2: an absolute-form target (and HTTP/2 `:authority`) wins over `Host`; over
    // HTTP/2 and HTTP/3 a `host` that names another authority is malformed (RFC 9113 8.3.1,
    // RFC 9114 4.3.1).
    let value = match (parts.uri.authority(), host) {
        (Some(a), Some(h)) if parts.version >= Version::HTTP_2 && !same_authority(parts, a, h) => {
            return Err(ScreenError::BadRequest("host differs from :authority"))
        }
        (Some(a), _) => HeaderValue::from_str(a.as_str())
            .map_err(|_| ScreenError::BadRequest("bad authority"))?,
        // RFC 9110 7.2: an empty Host is for a target without an authority, never in HTTP/1.1.
        (None, Some(h)) if h.is_empty() && parts.version != Version::HTTP_10 => {
            return Err(ScreenError::BadRequest("empty Host header"))
        }
        (None, Some(h)) => h.clone(),
        (None, None) if parts.version == Version::HTTP_10 => HeaderValue::from_static(""),
        (None, None) => return Err(ScreenError::BadRequest("missing Host header")),
    };
    if value.as_bytes().contains(&b'@') {
        return Err(ScreenError::BadRequest("userinfo in Host"));
    }
    if !value.is_empty() && !server_name(&value) {
        return Err(ScreenError::BadRequest("invalid Host header"));
    }
    Ok(value)
}

/// Whether `host` names a server as clients do: a DNS name or IPv4 address (letters, digits,
/// `-`, `.`, `_`) or a bracketed IPv6 address, and a port of digits if any. RFC 3986's
/// reg-name also admits sub-delimiters (`,`, `'`, `;`, ...), which no DNS name has and which an
/// upstream writing absolute URLs from `Host` or `X-Forwarded-Host` would pass on (host-header
/// poisoning of links and redirects).
fn server_name(host: &HeaderValue) -> bool {
    let host = host.as_bytes();
    let (name_ok, rest) = match host.strip_prefix(b"[") {
        Some(v6) => {
            let Some(end) = v6.iter().position(|&b| b == b']') else {
                return false;
            };
            let addr = std::str::from_utf8(&v6[..end]).map(str::parse::<std::net::Ipv6Addr>);
            (matches!(addr, Ok(Ok(_))), &v6[end + 1..])
        }
        None => {
            let end = host.iter().position(|&b| b == b':').unwrap_or(host.len());
            let name = &host[..end];
            let ok = !name.is_empty()
                && name
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
            (ok, &host[end..])
        }
    };
    let port_ok = match rest.strip_prefix(b":") {
        None => rest.is_empty(),
        Some(port) => {
            port.iter().all(u8::is_ascii_digit)
                && std::str::from_utf8(port).is_ok_and(|p| p.parse::<u16>().is_ok())
        }
    };
    name_ok && port_ok
}
