//! `[log]` and `[metrics]`, as validated by `config`.

use std::net::SocketAddr;

/// `[log]`.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// `tracing` filter directive. Default `info`.
    pub level: String,
    /// Emit one access line per request on target `tessera::access` (written only when `level`
    /// lets that target through at INFO; see `src/access_log.rs`). Default true.
    pub access_log: bool,
    /// `log.format`: how every line is written. Default [`LogFormat::Text`].
    pub format: LogFormat,
}

/// `log.format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// `key=value` text after a timestamp, level and target (tracing-subscriber's default).
    Text,
    /// One JSON object per line, as tracing-subscriber's JSON formatter writes them:
    /// `{"timestamp": ..., "level": ..., "fields": {...}, "target": ...}` (and `span`, `spans`
    /// for events inside a span), for log pipelines (Loki, Elasticsearch, journald's JSON
    /// export).
    Json,
}

/// `[metrics]`.
#[derive(Debug, Clone)]
pub struct MetricsConfig {
    /// Address of the listener serving `GET /metrics` (OpenMetrics text), apart from
    /// `server.listen` so it can stay private. Required in `[metrics]`.
    pub listen: SocketAddr,
}
