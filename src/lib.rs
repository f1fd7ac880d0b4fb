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
pub mod demo;
pub mod downstream;
pub mod error;
pub mod fields;
#[doc(hidden)]
pub mod fuzz;
pub mod jmap;
pub mod login;
pub mod proxy;
pub mod screen;
pub mod seal;
pub mod session;
pub mod share;
pub mod telemetry;
pub mod token;
pub mod upstream;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

pub use proxy::Proxy;

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
    /// The TLS listener; `None` when `[tls]` is absent.
    pub tls: Option<downstream::TlsConfig>,
}

/// Seconds since the Unix epoch (wall clock).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Opens the configured store and builds the session layer.
///
/// Errors: the store cannot be opened (embedded path unusable, Redis URL invalid).
pub fn sessions_from_config(cfg: &Config) -> Result<session::Sessions, session::StoreError> {
    let store = session::Store::open(&cfg.session.store, cfg.session.timeout)?;
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

/// The sockets [`run`] serves, bound by the caller (tests bind port 0).
#[derive(Debug, Default)]
pub struct Listeners {
    /// `server.listen`: plain HTTP/1.1 and h2c.
    pub plain: Option<TcpListener>,
    /// `tls.listen`: TLS, then HTTP/1.1 or HTTP/2 by ALPN; served only with `[tls]`.
    pub tls: Option<TcpListener>,
    /// `metrics.listen`.
    pub metrics: Option<TcpListener>,
}

/// Why [`run`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The session store cannot be opened.
    #[error("config key `session.store`: {0}")]
    Store(#[from] session::StoreError),
    /// A certificate or key cannot be served.
    #[error("config key `{}`: {}", .0.key, .0.problem)]
    Tls(#[from] downstream::CertError),
}

/// Runs the proxy on already-bound `listeners` until `shutdown` resolves (tests bind port 0).
///
/// The proxy, its caches and the session store live on the caller's runtime, with the background
/// tasks (cache invalidation, JWKS refresh, pool reaper). Requests are served by
/// `server.threads` threads, each a single-threaded tokio runtime accepting from the same
/// listener: a connection, its requests and the upstream connections they use stay on one
/// thread, with no cross-thread wake-ups (docs/operations.md, "Tuning").
///
/// With a metrics listener (bound to `metrics.listen`), `GET /metrics` and the probes `/healthz` and
/// `/readyz` are served there on the caller's runtime ([`telemetry::serve_metrics`]) until the
/// drain ends; `/readyz` answers 200 only from when the serving threads run until shutdown
/// begins.
///
/// Each [`ConfigReload`] received on `reloads` (the binary sends one per SIGHUP) has its keys
/// and TLS certificates put in place ([`Proxy::reload_keys`], [`downstream::TlsServer::reload`]),
/// without dropping a connection; the outcome is logged and counted
/// (`tessera_config_reloads_total`).
///
/// Errors: the session store cannot be opened, or the TLS server cannot be made.
pub async fn run(
    cfg: Config,
    listeners: Listeners,
    reloads: tokio::sync::mpsc::Receiver<ConfigReload>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    let tls = match (&cfg.tls, &listeners.tls) {
        (Some(t), Some(_)) => Some(Arc::new(downstream::TlsServer::new(t)?)),
        _ => None,
    };
    let proxy = Arc::new(Proxy::from_config(&cfg)?.with_client_side(downstream::client_side));
    // Ends with `run`, like the metrics task.
    let _stop_reloads = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(reload_keys(
        proxy.clone(),
        tls.clone(),
        reloads,
    )));
    let metrics = listeners.metrics;
    // `Serving` once the serving threads run; `Draining` when shutdown begins, which tells them
    // to drain. `/readyz` answers 200 only while `Serving`.
    let (phase, phase_rx) = tokio::sync::watch::channel(telemetry::Phase::Starting);
    let metrics = metrics.map(|l| {
        tracing::info!(listen = %l.local_addr().map(|a| a.to_string()).unwrap_or_default(), "metrics at /metrics, probes at /healthz and /readyz");
        let probe_timeout = cfg.session.timeout;
        tokio::spawn(telemetry::serve_metrics(l, proxy.clone(), phase_rx.clone(), probe_timeout))
    });
    let _stop_metrics = metrics.map(tokio_util::task::AbortOnDropHandle::new);
    // Ends with `run`, like the metrics task.
    let _stop_jwks_refresh = match proxy.verifier().keys().jwks_refresh_interval() {
        Some(every) => {
            proxy.verifier().keys().refresh_jwks().await;
            let p = proxy.clone();
            Some(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
                async move {
                    loop {
                        tokio::time::sleep(every).await;
                        if p.verifier().keys().refresh_jwks().await {
                            // a key may have been withdrawn: cached verifications must be redone
                            p.verifier().clear_cache();
                        }
                    }
                },
            )))
        }
        None => None,
    };
    let addr = |l: &Option<TcpListener>| {
        l.as_ref()
            .and_then(|l| l.local_addr().ok())
            .map(|a| a.to_string())
    };
    tracing::info!(listen = addr(&listeners.plain), tls = addr(&listeners.tls), upstream = %cfg.upstream.url, threads = cfg.server.threads, busy_poll_us = cfg.server.busy_poll.as_micros() as u64, "tessera serving");
    // The rest needs `[server]` only. The keys are in the proxy now, where a reload replaces
    // them; this copy of them is wiped here (their types zeroize on drop) rather than kept for
    // the process's life.
    let server_cfg = cfg.server.clone();
    drop(cfg);
    let edges = serving_edges(listeners.plain, listeners.tls.zip(tls));
    let mut threads = Vec::with_capacity(server_cfg.threads);
    for index in 0..server_cfg.threads {
        let spawned = clone_edges(&edges).and_then(|edges| {
            let (proxy, server, phase) = (proxy.clone(), server_cfg.clone(), phase_rx.clone());
            std::thread::Builder::new()
                .name(format!("tessera-serve-{index}"))
                .spawn(move || serving_thread(index, edges, proxy, server, phase))
        });
        match spawned {
            Ok(handle) => threads.push(handle),
            Err(e) => tracing::error!(cause = %e, index, "cannot start a serving thread"),
        }
    }
    // Each serving thread holds a copy of the sockets and closes it when shutdown begins; this
    // one would keep them listening (connections completed by the kernel, never served, reset
    // at exit) for the whole drain, instead of refusing them at once.
    drop(edges);
    if threads.is_empty() {
        tracing::error!("no serving thread could be started");
        return Ok(());
    }
    phase.send_replace(telemetry::Phase::Serving);
    shutdown.await;
    phase.send_replace(telemetry::Phase::Draining);
    // Each thread drains its connections (bounded by the server's drain time), then ends.
    let _ = tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await;
    Ok(())
}

/// The listeners as std sockets, each with what it speaks.
fn serving_edges(
    plain: Option<TcpListener>,
    tls: Option<(TcpListener, Arc<downstream::TlsServer>)>,
) -> Vec<(std::net::TcpListener, downstream::Edge)> {
    let std = |l: TcpListener| l.into_std().expect("a tokio listener has a socket");
    let plain = plain.map(|l| (std(l), downstream::Edge::Plain));
    let tls = tls.map(|(l, t)| (std(l), downstream::Edge::Tls(t)));
    plain.into_iter().chain(tls).collect()
}

/// A serving thread's own copy of every listener.
fn clone_edges(
    edges: &[(std::net::TcpListener, downstream::Edge)],
) -> std::io::Result<Vec<(std::net::TcpListener, downstream::Edge)>> {
    edges
        .iter()
        .map(|(l, e)| Ok((l.try_clone()?, e.clone())))
        .collect()
}

/// A configuration reload asked for (SIGHUP): the configuration file as loaded and validated
/// again, or why it did not load ([`config::LoadError`], naming the key).
pub type ConfigReload = Result<Config, config::LoadError>;

/// Puts the keys and certificates of each configuration from `reloads` in place, in order;
/// logs and counts the outcome.
async fn reload_keys(
    proxy: Arc<Proxy>,
    tls: Option<Arc<downstream::TlsServer>>,
    mut reloads: tokio::sync::mpsc::Receiver<ConfigReload>,
) {
    while let Some(reload) = reloads.recv().await {
        let outcome = match reload {
            Ok(cfg) => reload_tls(tls.as_deref(), &cfg)
                .and_then(|()| proxy.reload_keys(&cfg).map_err(|e| e.to_string())),
            Err(e) => Err(e.to_string()),
        };
        proxy.reload_counts().record(outcome.is_ok());
        match outcome {
            Ok(summary) => tracing::info!(
                keys = %summary,
                "configuration reloaded: keys and certificates in place; other settings apply at the next restart"
            ),
            Err(cause) => tracing::error!(
                %cause,
                "configuration reload refused; the running keys are kept"
            ),
        }
    }
}

/// The certificates of `cfg` in place for new TLS handshakes (before the keys, so a refused
/// certificate leaves both as they were).
fn reload_tls(tls: Option<&downstream::TlsServer>, cfg: &Config) -> Result<(), String> {
    match (tls, &cfg.tls) {
        (Some(server), Some(t)) => server
            .reload(t)
            .map_err(|e| format!("config key `{}`: {}", e.key, e.problem)),
        _ => Ok(()),
    }
}

/// One serving thread: a current-thread runtime accepting from its clones of the listeners,
/// until `phase` says the drain began.
fn serving_thread(
    index: usize,
    edges: Vec<(std::net::TcpListener, downstream::Edge)>,
    proxy: Arc<Proxy>,
    cfg: downstream::ServerConfig,
    phase: tokio::sync::watch::Receiver<telemetry::Phase>,
) {
    upstream::set_serving_thread(index);
    access_log::batch_on_this_thread();
    busy_poll::enable(cfg.busy_poll);
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(|| {
            access_log::flush();
            busy_poll::before_park();
        })
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(cause = %e, index, "cannot start a serving thread's runtime");
            return;
        }
    };
    rt.block_on(async move {
        let accepting = edges.into_iter().map(|(listener, edge)| {
            let (proxy, cfg, mut phase) = (proxy.clone(), cfg.clone(), phase.clone());
            async move {
                let shutdown = async move {
                    let _ = phase.wait_for(|p| *p == telemetry::Phase::Draining).await;
                };
                match TcpListener::from_std(listener) {
                    Ok(listener) => {
                        // A new connection ends a busy poll too.
                        busy_poll::watch(&listener);
                        downstream::serve(listener, edge, proxy, &cfg, shutdown).await
                    }
                    Err(e) => tracing::error!(cause = %e, index, "cannot register a listener"),
                }
            }
        });
        // At most two: the plain and the TLS listener.
        let mut accepting = accepting;
        let (first, second) = (accepting.next(), accepting.next());
        tokio::join!(
            async move {
                if let Some(f) = first {
                    f.await
                }
            },
            async move {
                if let Some(f) = second {
                    f.await
                }
            }
        );
    });
    access_log::flush();
}
