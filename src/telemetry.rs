//! Logging setup. Access lines go to target `tessera::access`; no module logs tokens or
//! credentials (headers carrying them are marked sensitive and never formatted).

/// Installs a `tracing` subscriber writing to stderr with `filter` (e.g. `info`,
/// `tessera=debug`); `RUST_LOG` overrides it. Colours (ANSI escapes) only when stderr is a
/// terminal, so a log file or journald gets plain `key=value` text. Safe to call twice (the
/// second call is a no-op).
pub fn init(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
