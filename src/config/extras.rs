//! `[websocket]`, `[metrics]`, `[jmap]` and `log.level` -> their settings.

use std::net::SocketAddr;
use std::time::Duration;

use super::raw::{RawJmap, RawMetrics, RawWebSocket};
use super::{socket_addr, ConfigError};
use crate::jmap::JmapConfig;
use crate::proxy::WebSocketConfig;
use crate::telemetry::{LogFormat, MetricsConfig};
use crate::upstream::UpstreamConfig;

pub(super) fn validate_websocket(
    w: RawWebSocket,
    upstream: &UpstreamConfig,
) -> Result<WebSocketConfig, ConfigError> {
    let cap = upstream.max_connections;
    let max_connections = w.max_connections.unwrap_or(cap / 2);
    if max_connections >= cap && max_connections > 0 {
        return Err(ConfigError::new(
            "websocket.max_connections",
            format!(
                "{max_connections} would let WebSockets hold every upstream connection \
                 (upstream.max_connections = {cap}); set it below {cap}, or 0 to pass no upgrades"
            ),
        ));
    }
    if max_connections == 0 && w.max_connections_per_user.is_some() {
        return Err(ConfigError::new(
            "websocket.max_connections_per_user",
            "is set while websocket.max_connections is 0 (no upgrades are passed): raise that, \
             or remove this",
        ));
    }
    let max_connections_per_user = w
        .max_connections_per_user
        .unwrap_or((max_connections / 4).max(1));
    if max_connections > 0 && !(1..=max_connections).contains(&max_connections_per_user) {
        return Err(ConfigError::new(
            "websocket.max_connections_per_user",
            format!("must be between 1 and websocket.max_connections ({max_connections})"),
        ));
    }
    let mut allowed_origins = Vec::new();
    for (i, text) in w.allowed_origins.unwrap_or_default().iter().enumerate() {
        let key = format!("websocket.allowed_origins[{i}]");
        allowed_origins.push(super::cors::origin(&key, text)?);
    }
    let idle_timeout = match w.idle_timeout_ms.unwrap_or(600_000) {
        0 => None,
        n => Some(Duration::from_millis(n)),
    };
    Ok(WebSocketConfig {
        max_connections,
        max_connections_per_user,
        idle_timeout,
        allowed_origins,
    })
}

pub(super) fn validate_metrics(
    m: RawMetrics,
    taken: [Option<SocketAddr>; 2],
) -> Result<MetricsConfig, ConfigError> {
    let Some(text) = m.listen else {
        return Err(ConfigError::new(
            "metrics.listen",
            "missing: set the address to serve /metrics on, e.g. \"127.0.0.1:9464\", or remove [metrics]",
        ));
    };
    let listen = socket_addr("metrics.listen", &text, "127.0.0.1:9464")?;
    for (other, key) in taken.iter().zip(["server.listen", "tls.listen"]) {
        if *other == Some(listen) && listen.port() != 0 {
            return Err(ConfigError::new(
                "metrics.listen",
                format!("is the same address as {key}; give the metrics their own port"),
            ));
        }
    }
    Ok(MetricsConfig { listen })
}

/// `[jmap]`: `None` unless `session_urls = "absolute"`.
pub(super) fn validate_jmap(j: RawJmap) -> Result<Option<JmapConfig>, ConfigError> {
    let absolute_urls = match j.session_urls.as_deref().unwrap_or("as_sent") {
        "absolute" => true,
        "as_sent" => false,
        other => {
            return Err(ConfigError::new(
                "jmap.session_urls",
                format!("`{other}` is neither \"absolute\" nor \"as_sent\""),
            ))
        }
    };
    if !absolute_urls && j.session_path.is_some() {
        return Err(ConfigError::new(
            "jmap.session_path",
            "is only used with jmap.session_urls = \"absolute\": set that, or remove this",
        ));
    }
    let session_path = j.session_path.unwrap_or_else(|| "/jmap/".into());
    if !session_path.starts_with('/') || session_path.parse::<http::uri::PathAndQuery>().is_err() {
        return Err(ConfigError::new(
            "jmap.session_path",
            format!("`{session_path}` is not a path; write it as clients request it (without upstream.url's path), e.g. \"/jmap/\""),
        ));
    }
    Ok(absolute_urls.then_some(JmapConfig {
        absolute_urls,
        session_path,
    }))
}

/// `log.format`: "text" (the default) or "json".
pub(super) fn validate_log_format(format: Option<String>) -> Result<LogFormat, ConfigError> {
    match format.as_deref().unwrap_or("text") {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        other => Err(ConfigError::new(
            "log.format",
            format!("`{other}` is not \"text\" or \"json\" (leave it out for text)"),
        )),
    }
}

/// `log.level`: a level (`error`, `warn`, `info`, `debug`, `trace`, `off`) or a filter of
/// comma-separated `target=level` directives and levels (`info,tessera::session=debug`, the
/// `RUST_LOG` syntax). A bare word that is no level (`warning`) would be read as a target name
/// and silence every tessera line, so it is refused.
pub(super) fn validate_log_level(level: Option<String>) -> Result<String, ConfigError> {
    let level = level.unwrap_or_else(|| "info".into());
    let levels = ["error", "warn", "info", "debug", "trace", "off"];
    // tracing's own reading of a level, the one the filter applies (which would take an empty
    // word for ERROR: refused as the slip it is).
    let is_level = |w: &str| {
        let w = w.trim();
        !w.is_empty() && w.parse::<tracing_subscriber::filter::LevelFilter>().is_ok()
    };
    let bad = level.split(',').find(|d| match d.split_once('=') {
        Some((target, l)) => target.trim().is_empty() || !is_level(l),
        None => !is_level(d),
    });
    if let Some(bad) = bad {
        return Err(ConfigError::new(
            "log.level",
            format!(
                "`{}` is not a level or a `target=level` directive; use one of {}, or a filter \
                 such as \"info,tessera::session=debug\"",
                bad.trim(),
                levels.join(", ")
            ),
        ));
    }
    Ok(level)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_level_is_a_level_or_a_filter_of_them() {
        for good in [
            "info",
            "WARN",
            "info,tessera=debug",
            "warn, tessera::session=trace",
        ] {
            assert_eq!(
                validate_log_level(Some(good.into())).ok().as_deref(),
                Some(good)
            );
        }
        assert_eq!(validate_log_level(None).ok().as_deref(), Some("info"));
        for bad in ["warning", "info,tessera", "tessera=loud", "=debug", ""] {
            let e = validate_log_level(Some(bad.into()))
                .unwrap_err()
                .to_string();
            assert!(e.contains("log.level"), "{bad}: {e}");
        }
    }
}
