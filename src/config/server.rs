//! `[server]` -> [`ServerConfig`].

use std::time::Duration;

use crate::downstream::{ServerConfig, TlsConfig};

use super::raw::RawServer;
use super::{in_range, ms, socket_addr, ConfigError};

pub(super) fn validate_server(
    s: RawServer,
    tls: Option<&TlsConfig>,
) -> Result<ServerConfig, ConfigError> {
    let (listen, redirect_to_https) = plain_listener(&s, tls)?;
    let max_header_bytes = in_range(
        "server.max_header_bytes",
        s.max_header_bytes,
        16 * 1024,
        1024..=1024 * 1024,
    )?;
    let max_uri_bytes = in_range(
        "server.max_uri_bytes",
        s.max_uri_bytes,
        8 * 1024,
        256..=65534,
    )?;
    let threads = threads(s.threads)?;
    let busy_poll_us = s.busy_poll_us.unwrap_or(0);
    if busy_poll_us > crate::busy_poll::MAX_BUSY_POLL_US {
        return Err(ConfigError::new(
            "server.busy_poll_us",
            format!(
                "must be between 0 (off, the default) and {} microseconds",
                crate::busy_poll::MAX_BUSY_POLL_US
            ),
        ));
    }
    let (trusted_proxies, proxy_protocol) = trust(s.trusted_proxies, s.proxy_protocol)?;
    let response_headers = response_headers(s.response_headers.unwrap_or_default())?;
    Ok(ServerConfig {
        listen,
        redirect_to_https,
        fastopen: s.fastopen.unwrap_or(false),
        threads,
        trusted_proxies,
        proxy_protocol,
        private_responses: private_responses(s.private_responses.as_deref(), &response_headers)?,
        response_headers,
        busy_poll: Duration::from_micros(busy_poll_us),
        max_header_bytes,
        max_uri_bytes,
        max_body_bytes: s.max_body_bytes.unwrap_or(0),
        header_read_timeout: ms(
            "server.header_read_timeout_ms",
            s.header_read_timeout_ms,
            30_000,
        )?,
        send_timeout: ms("server.send_timeout_ms", s.send_timeout_ms, 60_000)?,
        shutdown_timeout: Duration::from_millis(in_range(
            "server.shutdown_timeout_ms",
            s.shutdown_timeout_ms,
            10_000,
            1..=3_600_000,
        )?),
        shutdown_delay: Duration::from_millis(in_range(
            "server.shutdown_delay_ms",
            s.shutdown_delay_ms,
            0,
            0..=600_000,
        )?),
        client_body_timeout: ms(
            "server.client_body_timeout_ms",
            s.client_body_timeout_ms,
            60_000,
        )?,
        allow_encoded_slashes: s.allow_encoded_slashes.unwrap_or(false),
        allow_encoded_slashes_under: path_prefixes(
            s.allow_encoded_slashes_under.unwrap_or_default(),
        )?,
        max_connections: connections("server.max_connections", s.max_connections, 10_000)?,
        max_connections_per_ip: connections(
            "server.max_connections_per_ip",
            s.max_connections_per_ip,
            0,
        )?,
        http2_max_concurrent_streams: in_range(
            "server.http2_max_concurrent_streams",
            s.http2_max_concurrent_streams,
            200,
            1..=1000,
        )?,
    })
}

/// `server.threads`: 1..=1024, one per CPU when left out.
fn threads(n: Option<usize>) -> Result<usize, ConfigError> {
    match n {
        None => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
        Some(n @ 1..=1024) => Ok(n),
        Some(_) => Err(ConfigError::new(
            "server.threads",
            "must be between 1 and 1024 (leave it out for one per CPU)",
        )),
    }
}

/// `server.private_responses`: `"unmarked"` (the default), `"always"` or `"off"`; off when
/// `server.response_headers` sets `Cache-Control`, which replaces the upstream's.
fn private_responses(
    name: Option<&str>,
    response_headers: &[(http::HeaderName, http::HeaderValue)],
) -> Result<crate::screen::PrivateResponses, ConfigError> {
    let name = name.unwrap_or("unmarked");
    let choice = crate::screen::PrivateResponses::from_name(name).ok_or_else(|| {
        ConfigError::new(
            "server.private_responses",
            format!("`{name}` is not a choice; use \"unmarked\", \"always\" or \"off\""),
        )
    })?;
    let replaced = response_headers
        .iter()
        .any(|(n, _)| n == http::header::CACHE_CONTROL);
    Ok(match replaced {
        true => crate::screen::PrivateResponses::Off,
        false => choice,
    })
}

/// A connection count at `key`: 0 (no limit) to 10,000,000; `default` when left out.
fn connections(key: &str, n: Option<usize>, default: usize) -> Result<usize, ConfigError> {
    match n {
        None => Ok(default),
        Some(n) if n <= 10_000_000 => Ok(n),
        Some(n) => Err(ConfigError::new(
            key,
            format!(
                "must be between 0 (no limit) and 10000000, not {n} (leave it out for {default})"
            ),
        )),
    }
}

/// `server.listen` (with `[tls]`, none unless set) and `server.redirect_to_https` (the TLS
/// port to send clients to).
fn plain_listener(
    s: &RawServer,
    tls: Option<&TlsConfig>,
) -> Result<(Option<std::net::SocketAddr>, Option<u16>), ConfigError> {
    // With `[tls]`, the plain listener is there only when asked for.
    let listen = match (s.listen.as_deref(), tls) {
        (Some(text), _) => Some(socket_addr("server.listen", text, "127.0.0.1:8080")?),
        (None, None) => Some(socket_addr("server.listen", "127.0.0.1:8080", "")?),
        (None, Some(_)) => None,
    };
    if let (Some(plain), Some(tls)) = (listen, tls) {
        if plain == tls.listen && plain.port() != 0 {
            return Err(ConfigError::new(
                "server.listen",
                "is the same address as tls.listen; give the plain listener its own port, or \
                 leave server.listen out to serve TLS only",
            ));
        }
    }
    let redirect = s.redirect_to_https.unwrap_or(false);
    if redirect && (tls.is_none() || listen.is_none()) {
        return Err(ConfigError::new(
            "server.redirect_to_https",
            "needs [tls] (the https listener to send clients to) and server.listen (the plain \
             listener that redirects)",
        ));
    }
    let port = tls.map_or(443, |t| t.listen.port());
    Ok((listen, redirect.then_some(port)))
}

/// Fields a response cannot be given from the config, besides the hop-by-hop ones (HTTP/2 and
/// HTTP/3 refuse those): the framing's and the content's, which would contradict the body;
/// those that belong to one answer (a redirect, a challenge, a cookie, a WebSocket's
/// handshake); and those tessera sets itself.
const NOT_SETTABLE: [&str; 16] = [
    "content-length",
    "content-type",
    "content-encoding",
    "content-range",
    "vary",
    "host",
    "date",
    "alt-svc",
    "location",
    "set-cookie",
    "www-authenticate",
    "sec-websocket-accept",
    "sec-websocket-protocol",
    "sec-websocket-extensions",
    "sec-websocket-version",
    "sec-websocket-key",
];

/// Whether `name` (lowercase) is hop-by-hop or in [`NOT_SETTABLE`].
pub(super) fn not_settable(name: &str) -> bool {
    crate::fields::HOP_BY_HOP.contains(&name) || NOT_SETTABLE.contains(&name)
}

/// `server.response_headers`: at most 32 names, each a valid field name that is neither
/// hop-by-hop nor in [`NOT_SETTABLE`], with a valid value.
fn response_headers(
    listed: std::collections::BTreeMap<String, String>,
) -> Result<Vec<(http::HeaderName, http::HeaderValue)>, ConfigError> {
    if listed.len() > 32 {
        return Err(ConfigError::new(
            "server.response_headers",
            "at most 32 fields",
        ));
    }
    let mut out = Vec::with_capacity(listed.len());
    for (name, value) in listed {
        let key = format!("server.response_headers.\"{name}\"");
        let Ok(parsed) = http::HeaderName::from_bytes(name.as_bytes()) else {
            return Err(ConfigError::new(&key, "is not a valid field name"));
        };
        if not_settable(parsed.as_str()) {
            return Err(ConfigError::new(
                &key,
                "is a field of the connection, the framing, the content or one answer \
                 (hop-by-hop, Content-Length, -Type, -Encoding, -Range, Vary, Location, \
                 Set-Cookie, WWW-Authenticate, \
                 Sec-WebSocket-*) or one tessera sets itself (Host, Date, Alt-Svc); leave it out",
            ));
        }
        // RFC 9110 section 5.5; HTTP/2 and HTTP/3 refuse a value with spaces at either end.
        let visible = value.bytes().all(|b| b == b' ' || b.is_ascii_graphic());
        if !visible || value.trim() != value || value.is_empty() {
            return Err(ConfigError::new(
                &key,
                "needs a value of visible ASCII, with no space at its start or end",
            ));
        }
        let value = http::HeaderValue::from_str(&value).expect("visible ASCII");
        if out.iter().any(|(n, _)| *n == parsed) {
            return Err(ConfigError::new(&key, "is named twice (names ignore case)"));
        }
        out.push((parsed, value));
    }
    Ok(out)
}

/// `server.trusted_proxies` and `server.proxy_protocol`, which needs them.
fn trust(
    listed: Option<Vec<String>>,
    proxy_protocol: Option<bool>,
) -> Result<(Vec<ipnet::IpNet>, bool), ConfigError> {
    let trusted = trusted_proxies(listed.unwrap_or_default())?;
    let proxy_protocol = proxy_protocol.unwrap_or(false);
    if proxy_protocol && trusted.is_empty() {
        return Err(ConfigError::new(
            "server.proxy_protocol",
            "needs server.trusted_proxies: the load balancers' addresses, the only peers whose \
             PROXY protocol header names a client",
        ));
    }
    Ok((trusted, proxy_protocol))
}

/// `server.trusted_proxies`: addresses or CIDR blocks, IPv4 written as IPv4.
fn trusted_proxies(listed: Vec<String>) -> Result<Vec<ipnet::IpNet>, ConfigError> {
    let mut trusted_proxies = Vec::new();
    for (i, text) in listed.iter().enumerate() {
        let net = text
            .parse::<ipnet::IpNet>()
            .or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| {
                ConfigError::new(
                    &format!("server.trusted_proxies[{i}]"),
                    format!(
                        "`{text}` is not an IP address or CIDR block, e.g. \"10.0.0.0/8\" or \"::1\""
                    ),
                )
            })?;
        if let ipnet::IpNet::V6(v6) = net {
            if v6.network().to_ipv4_mapped().is_some() {
                return Err(ConfigError::new(
                    &format!("server.trusted_proxies[{i}]"),
                    format!(
                        "`{text}` is IPv4-mapped; write it as IPv4 (peers are matched as IPv4)"
                    ),
                ));
            }
        }
        trusted_proxies.push(net);
    }
    Ok(trusted_proxies)
}

/// `server.allow_encoded_slashes_under`: each a path prefix that starts and ends with `/` (a
/// whole segment), in plain characters, as a request path spells it.
fn path_prefixes(prefixes: Vec<String>) -> Result<Vec<String>, ConfigError> {
    for p in &prefixes {
        let plain = p
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'%' && b != b'\\');
        if !plain
            || !p.starts_with('/')
            || !p.ends_with('/')
            || p.contains("/../")
            || p.contains("/./")
        {
            return Err(ConfigError::new(
                "server.allow_encoded_slashes_under",
                "each entry is a path prefix that starts and ends with / (\"/jmap/download/\"), \
                 without %-escapes, backslashes or dot segments",
            ));
        }
    }
    Ok(prefixes)
}
