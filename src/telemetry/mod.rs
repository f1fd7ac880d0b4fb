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
mod tls;

pub use counts::{QuicCounts, ReloadCounts, RequestCounts, RequestSnapshot, DURATION_BOUNDS_US};
pub use endpoint::{serve_metrics, Phase, MAX_METRICS_CONNECTIONS};
pub use metrics::{render, Observed, Scrape, CONTENT_TYPE};
pub use tls::{TlsCounts, TlsSnapshot};

/// Installs a `tracing` subscriber writing to stderr with `filter` (e.g. `info`,
/// `tessera=debug`) in `format`, the access log's lines included; `RUST_LOG` overrides the
/// filter. Text has colours (ANSI escapes) only when stderr is a terminal, so a log file or
/// journald gets plain `key=value` text. JSON also replaces the process's panic hook, so a
/// panic's report is a JSON line too. Safe to call twice, or after a program embedding tessera
/// set its own subscriber (then a no-op).
pub fn init(filter: &str, format: LogFormat) {
    let parse = |f: &str| tracing_subscriber::EnvFilter::try_new(with_clients_quieted(f));
    let filter = std::env::var(tracing_subscriber::EnvFilter::DEFAULT_ENV)
        .map_err(drop)
        .and_then(|env| parse(&env).map_err(drop))
        .or_else(|()| parse(filter))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let dispatch = match format {
        LogFormat::Text => tracing::Dispatch::new(
            builder
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .finish(),
        ),
        LogFormat::Json => tracing::Dispatch::new(builder.json().finish()),
    };
    // Set apart, so that the result says whether this subscriber is the global one (a program
    // embedding tessera may have set its own, or only a `log` logger).
    if tracing::dispatcher::set_global_default(dispatch).is_err() {
        return;
    }
    use tracing_log::AsLog as _;
    let _ = tracing_log::LogTracer::builder()
        .with_max_level(tracing::level_filters::LevelFilter::current().as_log())
        .init();
    if format == LogFormat::Json {
        crate::access_log::set_json(true);
        // A panic's report as a line of the log too (level ERROR, target `tessera::panic`),
        // with its thread and, when RUST_BACKTRACE or RUST_LIB_BACKTRACE asks, its backtrace
        // (short form).
        std::panic::set_hook(Box::new(|info| {
            let thread = std::thread::current();
            let name = thread.name().unwrap_or("<unnamed>");
            let trace = std::backtrace::Backtrace::capture();
            let trace = match trace.status() {
                std::backtrace::BacktraceStatus::Captured => format!("\n{trace}"),
                _ => String::new(),
            };
            fatal_line("tessera::panic", &format!("thread '{name}' {info}{trace}"));
        }));
    }
}

/// The libraries that log, at WARN, what any client can make them log once per connection or
/// per datagram: rustls (an alert, an unexpected message, an IP address as SNI) and
/// quinn-proto (an Initial with a bad token, an illegal packet). nginx logs such client errors
/// at `info`. (Not `quinn`: the directive would cover `quinn_udp`, whose socket warnings an
/// operator needs.)
const CLIENT_NOISE: [&str; 2] = ["rustls", "quinn_proto"];

/// `filter` with each of [`CLIENT_NOISE`] it does not cover held to ERROR, so that `warn` (the
/// level operators choose to silence per-request lines) is not flooded by one client; an
/// operator's own directive for one (`rustls=debug`) stands.
fn with_clients_quieted(filter: &str) -> String {
    let named = |target: &str| {
        filter.split(',').any(|directive| {
            // A directive covers the targets it is a prefix of (`quinn` covers `quinn_proto`),
            // as EnvFilter matches them; one for a part (`rustls::server`) is more specific
            // than the `rustls=error` added, so it still holds there.
            let name = directive.split(['=', '[']).next().unwrap_or("").trim();
            !name.is_empty() && target.starts_with(name)
        })
    };
    let mut quieted = filter.to_string();
    if filter.trim().eq_ignore_ascii_case("off") {
        return quieted;
    }
    for target in CLIENT_NOISE.into_iter().filter(|t| !named(t)) {
        quieted.push_str(&format!(",{target}=error"));
    }
    quieted
}

/// Writes `message` to stderr whatever the filter, for an error that ends the process: in the
/// log's format when it is JSON (level ERROR, target `tessera`), else as `tessera: message`.
pub fn fatal(message: &str) {
    if crate::access_log::json() {
        fatal_line("tessera", message);
    } else {
        eprintln!("tessera: {message}");
    }
}

/// One JSON line at level ERROR with `message` under `fields`, as tracing-subscriber's JSON
/// formatter writes an event.
fn fatal_line(target: &str, message: &str) {
    use std::io::Write as _;
    let mut line = format!(
        "{{\"timestamp\":\"{}\",\"level\":\"ERROR\",\"fields\":{{\"message\":",
        // (humantime panics on a time before 1970, and this may run in the panic hook.)
        humantime::format_rfc3339_micros(std::time::SystemTime::now().max(std::time::UNIX_EPOCH))
    )
    .into_bytes();
    crate::access_log::json_string(&mut line, Some(message));
    line.extend_from_slice(format!("}},\"target\":\"{target}\"}}\n").as_bytes());
    let _ = std::io::stderr().lock().write_all(&line);
}

#[cfg(test)]
mod tests {
    use super::with_clients_quieted;

    #[test]
    fn client_triggered_library_warnings_are_held_to_error_unless_named() {
        assert_eq!(
            with_clients_quieted("warn"),
            "warn,rustls=error,quinn_proto=error"
        );
        assert_eq!(
            with_clients_quieted("info,rustls::server=debug,quinn=trace"),
            "info,rustls::server=debug,quinn=trace,rustls=error"
        );
        assert_eq!(
            with_clients_quieted("debug,quinn_proto=info"),
            "debug,quinn_proto=info,rustls=error"
        );
        assert_eq!(with_clients_quieted("off"), "off");
    }
}
