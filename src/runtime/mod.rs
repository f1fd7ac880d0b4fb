//! The serving runtime: the listeners bound by the caller, the serving threads (one
//! current-thread runtime each, accepting plain and TLS connections), HTTP/3 on a runtime of its
//! own (`http3.threads`), the metrics endpoint on the caller's runtime, reloads on SIGHUP, and
//! the drain at shutdown.

mod listen;
mod quic_thread;
mod reload;
mod serving;
mod systemd;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::{downstream, session, telemetry, Config, Proxy};
pub use listen::open_listeners;
pub use reload::ConfigReload;
use reload::{clone_edges, quic_endpoint, reload_keys, serving_edges, tls_server, Edges};

/// The sockets [`run`] serves, bound by the caller (tests bind port 0).
#[derive(Debug, Default)]
pub struct Listeners {
    /// `server.listen`: plain HTTP/1.1 and h2c.
    pub plain: Option<TcpListener>,
    /// `tls.listen`: TLS, then HTTP/1.1 or HTTP/2 by ALPN; served only with `[tls]`.
    pub tls: Option<TcpListener>,
    /// `http3.listen` (UDP, [`downstream::bind_udp`]): HTTP/3; served only with `[http3]`.
    pub quic: Option<std::net::UdpSocket>,
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
    /// The threads a config key asks for cannot be started (out of memory or threads).
    #[error("config key `{key}`: cannot start its threads: {source}")]
    Threads {
        /// The key, e.g. `http3.threads`.
        key: &'static str,
        /// What the OS or tokio answered.
        source: std::io::Error,
    },
    /// A bound socket cannot serve what its key asks for (QUIC on `http3.listen`).
    #[error("config key `{key}`: cannot serve {what} on it: {source}")]
    Listen {
        /// The key, e.g. `http3.listen`.
        key: &'static str,
        /// The protocol, e.g. `QUIC`.
        what: &'static str,
        /// What the OS or the protocol stack answered.
        source: std::io::Error,
    },
}

impl StartError {
    /// The process's exit code for it: 1 for what may pass by itself (the store cannot be
    /// opened: down, or locked by another process; threads cannot start), so that a service
    /// manager retries; 2 for what the configuration must change (a certificate, a socket).
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Store(_) | Self::Threads { .. } => 1,
            Self::Tls(_) | Self::Listen { .. } => 2,
        }
    }
}

/// Runs the proxy on already-bound `listeners` until `shutdown` resolves (tests bind port 0).
///
/// The proxy, its caches and the session store live on the caller's runtime, with the background
/// tasks (cache invalidation, JWKS refresh, pool reaper). Requests are served by
/// `server.threads` threads, each a single-threaded tokio runtime accepting from the same
/// listener: a connection, its requests and the upstream connections they use stay on one
/// thread, with no cross-thread wake-ups (docs/operations.md, "Tuning"). HTTP/3 has a runtime
/// of its own, one thread by default (`http3.threads`), for the same reason.
///
/// With a metrics listener (bound to `metrics.listen`), `GET /metrics` and the probes `/healthz` and
/// `/readyz` are served there on the caller's runtime ([`telemetry::serve_metrics`]) until the
/// drain ends; `/readyz` answers 200 only from when the serving threads run until shutdown
/// begins.
///
/// Each [`ConfigReload`] received on `reloads` (the binary sends one per SIGHUP) has its keys
/// and TLS certificates put in place ([`Proxy::check_keys`], [`downstream::TlsServer::reload`],
/// [`Proxy::install_keys`]), without dropping a connection; the outcome is logged and counted
/// (`tessera_config_reloads_total`).
///
/// Errors: the session store cannot be opened, the TLS server cannot be made, or no serving
/// thread could start.
pub async fn run(
    cfg: Config,
    listeners: Listeners,
    reloads: tokio::sync::mpsc::Receiver<ConfigReload>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    let tls = tls_server(&cfg, listeners.tls.is_some(), listeners.quic.is_some())?;
    let proxy = Arc::new(Proxy::from_config(&cfg)?.with_client_side(downstream::client_side));
    if let Some(tls) = &tls {
        reload::show_certificates(tls, &proxy);
    }
    let (quic_threads, quic) = quic_thread::start(&cfg, tls.as_deref(), listeners.quic)?;
    // `Serving` once the serving threads run; `Draining` when shutdown begins, which tells them
    // to drain. `/readyz` answers 200 only while `Serving`.
    let (phase, phase_rx) = tokio::sync::watch::channel(telemetry::Phase::Starting);
    // Ends when the drain begins (awaited there), or with `run`.
    let stop_reloads = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(reload_keys(
        proxy.clone(),
        Edges {
            tls: tls.clone(),
            quic: quic.clone().zip(cfg.http3.clone()),
        },
        reloads,
        phase_rx.clone(),
    )));
    let metrics = listeners.metrics;
    let metrics = metrics.map(|l| {
        tracing::info!(listen = %l.local_addr().map(|a| a.to_string()).unwrap_or_default(), "metrics at /metrics, probes at /healthz and /readyz");
        let probe_timeout = cfg.session.timeout;
        tokio::spawn(telemetry::serve_metrics(l, proxy.clone(), phase_rx.clone(), probe_timeout))
    });
    let _stop_metrics = metrics.map(tokio_util::task::AbortOnDropHandle::new);
    // Ends with `run`, like the metrics task.
    let _stop_jwks_refresh = refresh_jwks(&proxy).await;
    let addr = |l: &Option<TcpListener>| {
        l.as_ref()
            .and_then(|l| l.local_addr().ok())
            .map(|a| a.to_string())
    };
    let http3 = quic
        .as_ref()
        .and_then(|e| e.local_addr().ok())
        .map(|a| a.to_string());
    tracing::info!(listen = addr(&listeners.plain), tls = addr(&listeners.tls), http3, upstream = %cfg.upstream.url, store = %store_shown(&cfg.session.store), threads = cfg.server.threads, busy_poll_us = cfg.server.busy_poll.as_micros() as u64, proxy_protocol = cfg.server.proxy_protocol, "tessera serving");
    // The rest needs `[server]` only. The keys are in the proxy now, where a reload replaces
    // them; this copy of them is wiped here (their types zeroize on drop) rather than kept for
    // the process's life.
    let server_cfg = cfg.server.clone();
    let _stop_http3 =
        quic.zip(cfg.http3.clone())
            .zip(quic_threads.as_ref())
            .map(|((endpoint, h3), on)| {
                spawn_http3(
                    on.handle(),
                    endpoint,
                    proxy.clone(),
                    h3,
                    server_cfg.clone(),
                    phase_rx.clone(),
                )
            });
    drop(cfg);
    let edges = serving_edges(listeners.plain, listeners.tls.zip(tls));
    let threads = serving::start(edges, &proxy, &server_cfg, &phase_rx).await?;
    phase.send_replace(telemetry::Phase::Serving);
    systemd::ready();
    shutdown.await;
    systemd::stopping();
    if !server_cfg.shutdown_delay.is_zero() {
        phase.send_replace(telemetry::Phase::Leaving);
        tracing::info!(
            delay_ms = server_cfg.shutdown_delay.as_millis() as u64,
            "shutdown: /readyz says 503; serving on for server.shutdown_delay_ms before the drain"
        );
        tokio::time::sleep(server_cfg.shutdown_delay).await;
    }
    phase.send_replace(telemetry::Phase::Draining);
    // The reloads have ended (the task returns when the shutdown begins, its delay included),
    // so a SIGHUP from here on is told apart as ignored.
    let _ = stop_reloads.await;
    tracing::info!("shutdown: no new connections; finishing the requests in flight");
    // Each thread drains its connections (bounded by the server's drain time), then ends.
    let _ = tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await;
    if let Some(http3) = _stop_http3 {
        let wait = server_cfg.shutdown_timeout + std::time::Duration::from_secs(2);
        let _ = tokio::time::timeout(wait, http3).await;
    }
    tracing::info!("shutdown: done");
    Ok(())
}

/// The session store as the start line names it: an embedded one's absolute path (a relative
/// one is taken from the working directory, which the session commands must share), any other
/// by its URL without its password.
fn store_shown(spec: &session::StoreSpec) -> String {
    match spec {
        session::StoreSpec::Embedded(dir) => crate::admin::shown_path(dir),
        session::StoreSpec::Redis(url)
        | session::StoreSpec::Postgres(url, _)
        | session::StoreSpec::Mysql(url) => session::redacted_url(url),
    }
}

type Task = tokio_util::task::AbortOnDropHandle<()>;

/// Fetches the JWKS now and every `token.jwks_refresh_seconds` in a task, when configured.
async fn refresh_jwks(proxy: &Arc<Proxy>) -> Option<Task> {
    let every = proxy.verifier().keys().jwks_refresh_interval()?;
    proxy.verifier().keys().refresh_jwks().await;
    let p = proxy.clone();
    Some(Task::new(tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            if p.verifier().keys().refresh_jwks().await {
                // a key may have been withdrawn: cached verifications must be redone
                p.verifier().clear_cache();
            }
        }
    })))
}

/// HTTP/3 on `on`, the HTTP/3 thread's runtime (quinn drives one UDP socket for every
/// connection), until `phase` says the drain began.
fn spawn_http3(
    on: &tokio::runtime::Handle,
    endpoint: quinn::Endpoint,
    proxy: Arc<Proxy>,
    h3: downstream::Http3Config,
    server: downstream::ServerConfig,
    mut phase: tokio::sync::watch::Receiver<telemetry::Phase>,
) -> Task {
    Task::new(on.spawn(async move {
        let shutdown = async move {
            let _ = phase.wait_for(|p| *p == telemetry::Phase::Draining).await;
        };
        downstream::serve_http3(endpoint, proxy, h3, &server, shutdown).await
    }))
}

#[cfg(test)]
mod tests {
    use super::StartError;

    #[test]
    fn start_errors_name_the_config_key() {
        let in_use = || std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let listen = StartError::Listen {
            key: "http3.listen",
            what: "QUIC",
            source: in_use(),
        };
        assert!(listen
            .to_string()
            .starts_with("config key `http3.listen`: cannot serve QUIC on it: "));
        let threads = StartError::Threads {
            key: "http3.threads",
            source: in_use(),
        };
        assert!(threads
            .to_string()
            .starts_with("config key `http3.threads`: cannot start its threads: "));
    }
}
