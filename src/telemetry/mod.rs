//! Logging setup and the operator's listener. Access lines are written by `access_log` in this
//! log's format, as target `tessera::access` (the filter set up here decides whether they are
//! written); no module logs tokens or credentials (headers carrying them are marked sensitive and
//! never formatted).
//!
//! **Metrics** (`[metrics] listen`): `GET /metrics` on a listener of its own ([`endpoint`]), in
//! the OpenMetrics 1.0 text format that Prometheus scrapes ([`metrics`]). The request path pays
//! three relaxed increments per request ([`counts`]: its status, its duration bucket, the
//! duration sum), into a row of counters owned by its serving thread, so two cores never write
//! the same cache line; every other value is read from counters the proxy keeps anyway, at
//! scrape time.

mod settings;
pub use settings::{LogConfig, LogFormat, MetricsConfig};

mod counts;
mod endpoint;
mod metrics;

pub use counts::{QuicCounts, ReloadCounts, RequestCounts, RequestSnapshot, DURATION_BOUNDS_US};
pub use endpoint::{serve_metrics, Phase, MAX_METRICS_CONNECTIONS};
pub use metrics::{render, Observed, Scrape, CONTENT_TYPE};

/// Installs a `tracing` subscriber writing to stderr with `filter` (e.g. `info`,
/// `tessera=debug`) in `format`, the access log's lines included; `RUST_LOG` overrides the
/// filter. Text has colours (ANSI escapes) only when stderr is a terminal, so a log file or
/// journald gets plain `key=value` text. Safe to call twice (the second call is a no-op).
pub fn init(filter: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    if installed.is_ok() {
        crate::access_log::set_json(format == LogFormat::Json);
    }
}
