//! tessera: an authenticating reverse proxy. A client's JWT names a session; the session's sealed
//! upstream credentials are unsealed and injected as `Authorization: Basic`; the request goes on
//! over a pooled keep-alive connection. See `proxy` for the request path, phase by phase.
#![forbid(unsafe_code)]
#![warn(clippy::too_many_lines)]
// The serving future (TLS handshake, then the fast path or hyper) nests past the default 128.
#![recursion_limit = "256"]

mod access_log;
pub mod admin;
mod busy_poll;
pub mod config;
pub mod cors;
pub mod demo;
pub mod downstream;
pub mod error;
pub mod fields;
#[doc(hidden)]
pub mod fuzz;
pub mod jmap;
pub mod login;
pub mod per_ip;
pub mod proxy;
mod runtime;
pub mod screen;
pub mod seal;
pub mod session;
pub mod share;
mod stall;
pub mod telemetry;
pub mod token;
pub mod upstream;

use std::sync::Arc;

pub use proxy::Proxy;
pub use runtime::{open_listeners, run, ConfigReload, Listeners, StartError};

/// The validated configuration ([`Config::load`] builds it from the TOML file), one settings
/// value per domain. Every field is ready to use; secrets are resolved.
#[derive(Debug, Clone)]
pub struct Config {
    /// Downstream listener settings and request limits.
    pub server: downstream::ServerConfig,
    /// Where requests go and how the pool behaves.
    pub upstream: upstream::UpstreamConfig,
    /// How tokens are found and verified.
    pub token: token::TokenConfig,
    /// Which session store, which record format.
    pub session: session::SessionConfig,
    /// Sealing keys for stored credentials.
    pub credentials: seal::CredentialsConfig,
    /// Login/logout/session endpoints; `None` when `[login]` is absent or `enabled = false`.
    pub login: Option<login::LoginConfig>,
    /// Logging.
    pub log: telemetry::LogConfig,
    /// The Prometheus endpoint; `None` when `[metrics]` is absent.
    pub metrics: Option<telemetry::MetricsConfig>,
    /// WebSocket upgrades passed to the upstream.
    pub websocket: proxy::WebSocketConfig,
    /// The JMAP mode; `None` unless `[jmap] session_urls = "absolute"`.
    pub jmap: Option<jmap::JmapConfig>,
    /// CORS for pages of other origins; `None` when `[cors]` is absent.
    pub cors: Option<cors::Cors>,
    /// The TLS listener; `None` when `[tls]` is absent.
    pub tls: Option<downstream::TlsConfig>,
    /// HTTP/3 on UDP; `None` when `[http3]` is absent.
    pub http3: Option<downstream::Http3Config>,
}

/// Seconds since the Unix epoch (wall clock).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether a log line rate-limited by `last` (its site's own static, the Unix second of its
/// last line) may be written now: at most one a second per site, for warnings a client or a
/// steady fault could otherwise repeat per request.
pub fn once_a_second(last: &std::sync::atomic::AtomicU64) -> bool {
    let now = unix_now();
    last.swap(now, std::sync::atomic::Ordering::Relaxed) != now
}

/// Opens the configured store and builds the session layer.
///
/// Errors: the store cannot be opened (embedded path unusable, Redis URL invalid).
pub fn sessions_from_config(cfg: &Config) -> Result<session::Sessions, session::StoreError> {
    let s = &cfg.session;
    let store = session::Store::open_polling(&s.store, s.timeout, s.poll_interval)?;
    let sealer = Arc::new(seal::Sealer::new(&cfg.credentials));
    Ok(session::Sessions::new(
        store,
        sealer,
        &cfg.session,
        cfg.credentials.allow_plaintext_legacy,
    ))
}

/// The session layer `serve` uses: [`sessions_from_config`] plus the local cache and the
/// registry of open responses, following the store's invalidation stream
/// ([`session::Sessions::serving`]; needs a tokio runtime).
///
/// Errors: as [`sessions_from_config`].
pub fn serving_sessions(cfg: &Config) -> Result<session::Sessions, session::StoreError> {
    Ok(sessions_from_config(cfg)?.serving(cfg.session.cache))
}
