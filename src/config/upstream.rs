//! `[upstream]` -> [`UpstreamConfig`].

use std::time::Duration;

use crate::upstream::UpstreamConfig;

use super::raw::RawUpstream;
use super::upstream_tls::upstream_tls;
use super::{ms, ConfigError};

/// Longest `upstream.drain_wait_ms`: a drain holds a connection slot, so seconds at most.
const MAX_DRAIN_WAIT_MS: u64 = 10_000;

/// Largest `upstream.drain_max_bytes`: 16 MiB.
const MAX_DRAIN_BYTES: u64 = 16 * 1024 * 1024;

pub(super) fn validate_upstream(
    mut u: RawUpstream,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<UpstreamConfig, ConfigError> {
    let url = upstream_url(u.url.as_deref())?;
    let tls = upstream_tls(&url, &mut u, env)?;
    let max_connections = u.max_connections.unwrap_or(64);
    if max_connections == 0 || max_connections > 100_000 {
        return Err(ConfigError::new(
            "upstream.max_connections",
            "must be between 1 and 100000",
        ));
    }
    let max_connections_per_user = per_user(u.max_connections_per_user, max_connections)?;
    let max_event_streams = event_streams(u.max_event_streams, max_connections)?;
    let max_idle_connections = match u.max_idle_connections {
        None => max_connections.div_ceil(4),
        Some(n) if n <= max_connections => n,
        Some(n) => {
            return Err(ConfigError::new(
                "upstream.max_idle_connections",
                format!(
                    "must be between 0 and upstream.max_connections ({max_connections}), not {n} \
                     (leave it out for {})",
                    max_connections.div_ceil(4)
                ),
            ))
        }
    };
    let mut strip = Vec::new();
    for name in u
        .strip_response_headers
        .unwrap_or_else(|| vec!["alt-svc".into()])
    {
        let header = http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            ConfigError::new(
                "upstream.strip_response_headers",
                format!("`{name}` is not a header name"),
            )
        })?;
        strip.push(header);
    }
    let affinity = affinity(u.affinity.as_deref(), u.affinity_wait_ms)?;
    let drain = drain(u.drain_wait_ms, u.drain_max_bytes)?;
    Ok(UpstreamConfig {
        url,
        tls,
        max_connections,
        max_connections_per_user,
        max_event_streams,
        max_idle_connections,
        probe_timeout: match u.probe_timeout_ms.unwrap_or(0) {
            0 => None,
            n @ 1..=10_000 => Some(std::time::Duration::from_millis(n)),
            n => {
                return Err(ConfigError::new(
                    "upstream.probe_timeout_ms",
                    format!("{n} is over 10000; a served connection answers within milliseconds (0 turns the probe off)"),
                ))
            }
        },
        affinity,
        drain,
        connect_timeout: ms("upstream.connect_timeout_ms", u.connect_timeout_ms, 5_000)?,
        response_header_timeout: ms(
            "upstream.response_header_timeout_ms",
            u.response_header_timeout_ms,
            60_000,
        )?,
        idle_timeout: ms("upstream.idle_timeout_ms", u.idle_timeout_ms, 30_000)?,
        preserve_host: u.preserve_host.unwrap_or(true),
        request_id_header: u.request_id_header.as_deref().map(request_id).transpose()?,
        strip_response_headers: strip,
        strip_request_headers: request_strip_list(u.strip_request_headers)?,
    })
}

/// Fields a request id must not be sent under: the credential, the cookie and the forwarding
/// fields tessera sets, besides those no response field may be ([`super::server`]).
const NOT_AN_ID: [&str; 7] = [
    "authorization",
    "cookie",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-real-ip",
];

/// `upstream.request_id_header`: a field name that is none of tessera's own.
fn request_id(name: &str) -> Result<http::HeaderName, ConfigError> {
    let key = "upstream.request_id_header";
    let Ok(parsed) = http::HeaderName::from_bytes(name.as_bytes()) else {
        return Err(ConfigError::new(
            key,
            "is not a valid field name (e.g. \"X-Request-Id\")",
        ));
    };
    let lower = parsed.as_str();
    if NOT_AN_ID.contains(&lower) || super::server::not_settable(lower) {
        return Err(ConfigError::new(
            key,
            "names a field tessera sets or reads itself; use a name of its own (X-Request-Id)",
        ));
    }
    Ok(parsed)
}

/// `upstream.strip_request_headers`: header names, each maybe ending in `*` (a prefix).
fn request_strip_list(listed: Option<Vec<String>>) -> Result<Vec<String>, ConfigError> {
    let Some(listed) = listed else {
        return Ok(crate::screen::identity::DEFAULT_STRIPPED
            .iter()
            .map(|s| s.to_string())
            .collect());
    };
    for name in &listed {
        let bare = name.strip_suffix('*').unwrap_or(name);
        // A lone `*` would be a prefix of every field (Authorization and Host included).
        if bare.is_empty() || http::HeaderName::from_bytes(bare.as_bytes()).is_err() {
            return Err(ConfigError::new(
                "upstream.strip_request_headers",
                format!("`{name}` is not a header name (or a prefix ending in `*`)"),
            ));
        }
    }
    Ok(listed)
}

/// `upstream.url`: `http(s)://host[:port][/base]`, required, no query.
fn upstream_url(text: Option<&str>) -> Result<http::Uri, ConfigError> {
    let key = "upstream.url";
    let text = text.ok_or_else(|| {
        ConfigError::new(key, "is required, e.g. url = \"http://127.0.0.1:8008\"")
    })?;
    // The text itself is not echoed: it may hold a password (refused below).
    let url: http::Uri = text
        .parse()
        .map_err(|e| ConfigError::new(key, format!("is not a URL: {e}")))?;
    if url.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(ConfigError::new(
            key,
            "must not carry user:password@: tessera sends each session's own credential, and \
             the URL would be sent as Host and logged",
        ));
    }
    match url.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => {
            return Err(ConfigError::new(
                key,
                format!("scheme `{other}` is not supported; use http:// or https://"),
            ))
        }
        None => {
            return Err(ConfigError::new(
                key,
                "needs a scheme, e.g. http://host:port",
            ))
        }
    }
    if url.host().is_none() {
        return Err(ConfigError::new(
            key,
            "needs a host, e.g. http://127.0.0.1:8008",
        ));
    }
    if url.query().is_some() {
        return Err(ConfigError::new(key, "must not have a query string"));
    }
    Ok(url)
}

/// `upstream.affinity` (`"none"` or `"session"`) and `upstream.affinity_wait_ms`.
fn affinity(
    name: Option<&str>,
    wait_ms: Option<u64>,
) -> Result<crate::upstream::Affinity, ConfigError> {
    let affinity = match (name.unwrap_or("none"), wait_ms) {
        ("none", None) => crate::upstream::Affinity::None,
        ("none", Some(_)) => {
            return Err(ConfigError::new(
                "upstream.affinity_wait_ms",
                "applies only with affinity = \"session\"; remove it or set affinity = \"session\"",
            ))
        }
        ("session", wait) => match wait {
            Some(ms) if ms > 1000 => {
                return Err(ConfigError::new(
                    "upstream.affinity_wait_ms",
                    format!("must be between 0 (never wait) and 1000 milliseconds, not {ms} (leave it out for 5)"),
                ))
            }
            wait => crate::upstream::Affinity::Session {
                wait: wait.map_or(crate::upstream::AFFINITY_WAIT, Duration::from_millis),
                stale: crate::upstream::AFFINITY_STALE,
            },
        },
        (other, _) => {
            return Err(ConfigError::new(
                "upstream.affinity",
                format!("`{other}` is not an affinity; use \"none\" or \"session\""),
            ))
        }
    };
    Ok(affinity)
}

/// `upstream.drain_wait_ms` and `upstream.drain_max_bytes`.
fn drain(
    wait_ms: Option<u64>,
    max_bytes: Option<u64>,
) -> Result<crate::upstream::Drain, ConfigError> {
    let drain = crate::upstream::Drain {
        wait: match wait_ms {
            None => crate::upstream::DRAIN_WAIT,
            Some(ms) if ms <= MAX_DRAIN_WAIT_MS => Duration::from_millis(ms),
            Some(ms) => {
                return Err(ConfigError::new(
                    "upstream.drain_wait_ms",
                    format!(
                        "must be between 0 (close at once) and {MAX_DRAIN_WAIT_MS} milliseconds, not {ms} (leave it out for {})",
                        crate::upstream::DRAIN_WAIT.as_millis()
                    ),
                ))
            }
        },
        max_bytes: match max_bytes {
            None => crate::upstream::DRAIN_BYTES,
            Some(n) if n <= MAX_DRAIN_BYTES => n,
            Some(n) => {
                return Err(ConfigError::new(
                    "upstream.drain_max_bytes",
                    format!(
                        "must be between 0 and {MAX_DRAIN_BYTES} bytes (16 MiB), not {n} (leave it out for {})",
                        crate::upstream::DRAIN_BYTES
                    ),
                ))
            }
        },
    };
    if drain.wait.is_zero() && max_bytes.is_some() {
        return Err(ConfigError::new(
            "upstream.drain_max_bytes",
            "has no effect with drain_wait_ms = 0 (drains off); remove it or set drain_wait_ms \
             above 0",
        ));
    }
    Ok(drain)
}

/// `upstream.max_event_streams`: 1..=`max_connections`, default half of it (at least 1).
fn event_streams(n: Option<usize>, max_connections: usize) -> Result<usize, ConfigError> {
    let default = (max_connections / 2).max(1);
    match n {
        None => Ok(default),
        Some(n) if (1..=max_connections).contains(&n) => Ok(n),
        Some(n) => Err(ConfigError::new(
            "upstream.max_event_streams",
            format!(
                "must be between 1 and upstream.max_connections ({max_connections}), not {n} \
                 (equal: no bound; leave it out for {default})"
            ),
        )),
    }
}

/// `upstream.max_connections_per_user`: 1..=`max_connections`.
fn per_user(n: Option<usize>, max_connections: usize) -> Result<usize, ConfigError> {
    let default = crate::upstream::default_per_user(max_connections);
    match n {
        None => Ok(default),
        Some(n) if (1..=max_connections).contains(&n) => Ok(n),
        Some(n) => Err(ConfigError::new(
            "upstream.max_connections_per_user",
            format!(
                "must be between 1 and upstream.max_connections ({max_connections}), not {n} \
                 (leave it out for {default})"
            ),
        )),
    }
}
