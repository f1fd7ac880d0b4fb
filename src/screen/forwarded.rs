//! Forwarding fields: `X-Forwarded-For`, `-Proto` and `-Host` set from the connection, and, from
//! a trusted proxy (`server.trusted_proxies`), the client and scheme it names. Must never:
//! believe a client's own claim about its address.

use http::header::HeaderName;
use http::{HeaderMap, HeaderValue};
use std::net::IpAddr;

/// Sets `X-Forwarded-For`, `-Proto` and `-Host` from the connection (the client's values were
/// removed by [`super::screen_request`]).
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
/// not believed. An entry is an IP address, with or without a port (`198.51.100.7:50123`,
/// `[2001:db8::1]:443`, `[2001:db8::1]`: some balancers append one, as nginx's realip module
/// reads); anything else ends the walk: the last address passed (a trusted hop, or `peer`
/// itself) is the client. `Forwarded` (RFC 7239) is not read.
pub fn forwarded_client(headers: &HeaderMap, trusted: &[ipnet::IpNet], peer: IpAddr) -> IpAddr {
    let mut client = peer;
    let fields: Vec<&[u8]> = headers
        .get_all("x-forwarded-for")
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    for entry in fields.iter().rev().flat_map(|f| f.rsplit(|&b| b == b',')) {
        let Some(ip) = std::str::from_utf8(entry).ok().and_then(entry_ip) else {
            break;
        };
        client = ip;
        if !trusted.iter().any(|net| net.contains(&ip)) {
            break;
        }
    }
    client
}

/// The address of one `X-Forwarded-For` entry (see [`forwarded_client`]), IPv4-mapped ones as
/// IPv4.
fn entry_ip(entry: &str) -> Option<IpAddr> {
    let entry = entry.trim();
    let ip = entry
        .parse::<IpAddr>()
        .or_else(|_| entry.parse::<std::net::SocketAddr>().map(|a| a.ip()))
        .or_else(|_| {
            let inner = entry.strip_prefix('[').and_then(|e| e.strip_suffix(']'));
            inner
                .unwrap_or("")
                .parse::<std::net::Ipv6Addr>()
                .map(IpAddr::V6)
        })
        .ok()?;
    Some(ip.to_canonical())
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
        // A port, and brackets around an IPv6 address, are read past.
        assert_eq!(client(&["198.51.100.7:50123"]), "198.51.100.7");
        assert_eq!(client(&["[2a00::1]:443"]), "2a00::1");
        assert_eq!(client(&["198.51.100.7, [2001:db8::5]"]), "198.51.100.7");
        assert_eq!(client(&["198.51.100.7:x"]), "10.0.0.2", "not a port");
        // An IPv4-mapped entry is matched (and named) as IPv4.
        assert_eq!(client(&["198.51.100.7, ::ffff:10.3.3.3"]), "198.51.100.7");
        assert_eq!(client(&["::ffff:198.51.100.7"]), "198.51.100.7");
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
}
