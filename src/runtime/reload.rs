//! What the runtime builds from the configuration and puts in place again on SIGHUP: the
//! keys and the TLS settings (certificates, version floor, ticket keys; for TCP and QUIC), and
//! the listeners as each serving thread's own copies.

use std::sync::Arc;

use tokio::net::TcpListener;

use crate::{config, downstream, telemetry, Config, Proxy};

use super::StartError;

/// The HTTP/3 endpoint on `socket`, with the QUIC server configuration of `cfg`.
///
/// Errors: the certificates cannot be served over QUIC ([`StartError::Tls`]), or the socket
/// cannot be registered ([`StartError::Listen`]).
pub(super) fn quic_endpoint(
    cfg: &Config,
    tls: Option<&downstream::TlsServer>,
    socket: Option<std::net::UdpSocket>,
) -> Result<Option<quinn::Endpoint>, StartError> {
    let (Some(tls), Some(tls_cfg), Some(h3), Some(socket)) = (tls, &cfg.tls, &cfg.http3, socket)
    else {
        return Ok(None);
    };
    let server = tls.quic_config(tls_cfg, h3)?;
    let runtime = Arc::new(quinn::TokioRuntime);
    quinn::Endpoint::new(
        downstream::quic_endpoint_config(h3),
        Some(server),
        socket,
        runtime,
    )
    .map(Some)
    .map_err(|source| StartError::Listen {
        key: "http3.listen",
        what: "QUIC",
        source,
    })
}

/// What a reload puts new certificates into.
pub(super) struct Edges {
    pub(super) tls: Option<Arc<downstream::TlsServer>>,
    /// The HTTP/3 endpoint, with the `[http3]` settings it started with (a reload changes only
    /// its certificates).
    pub(super) quic: Option<(quinn::Endpoint, downstream::Http3Config)>,
}

/// The listeners as std sockets, each with what it speaks.
pub(super) fn serving_edges(
    plain: Option<TcpListener>,
    tls: Option<(TcpListener, Arc<downstream::TlsServer>)>,
) -> Vec<(std::net::TcpListener, downstream::Edge)> {
    let std = |l: TcpListener| l.into_std().expect("a tokio listener has a socket");
    let plain = plain.map(|l| (std(l), downstream::Edge::Plain));
    let tls = tls.map(|(l, t)| (std(l), downstream::Edge::Tls(t)));
    plain.into_iter().chain(tls).collect()
}

/// A serving thread's own copy of every listener.
pub(super) fn clone_edges(
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
/// logs and counts the outcome. All or nothing: the keys are checked first, then the
/// certificates checked and put in place, then the keys; a refusal at any step changes nothing.
pub(super) async fn reload_keys(
    proxy: Arc<Proxy>,
    edges: Edges,
    mut reloads: tokio::sync::mpsc::Receiver<ConfigReload>,
    mut phase: tokio::sync::watch::Receiver<telemetry::Phase>,
) {
    let day = downstream::CERT_RECHECK;
    let mut recheck = tokio::time::interval_at(tokio::time::Instant::now() + day, day);
    loop {
        // From the shutdown's start (its delay included) on, as operations.md says.
        let draining = |p: &telemetry::Phase| {
            matches!(p, telemetry::Phase::Leaving | telemetry::Phase::Draining)
        };
        let reload = tokio::select! {
            biased;
            // From the drain on, nothing is put in place: the HTTP/3 endpoint has dropped its
            // server configuration to refuse new connections, which a reload would restore.
            _ = phase.wait_for(draining) => return,
            reload = reloads.recv() => reload,
            _ = recheck.tick() => {
                edges.tls.iter().for_each(|tls| tls.recheck_expiry());
                continue;
            }
        };
        let Some(reload) = reload else { return };
        if draining(&phase.borrow()) {
            return;
        }
        // Not while starting: systemd would take the READY=1 that follows for the start's end.
        let serving = *phase.borrow() == telemetry::Phase::Serving;
        if serving {
            super::systemd::reloading();
        }
        let certificates = edges.tls.is_some() && reload.as_ref().is_ok_and(|c| c.tls.is_some());
        let outcome = match reload {
            Ok(cfg) => proxy
                .check_keys(&cfg)
                .map_err(|e| e.to_string())
                .and_then(|ready| {
                    reload_tls(&edges, &cfg, &proxy).map(|()| proxy.install_keys(ready, &cfg))
                }),
            Err(e) => Err(e.to_string()),
        };
        proxy.reload_counts().record(outcome.is_ok());
        // Refused or not, the process serves on as before.
        if serving {
            super::systemd::ready();
        }
        let outcome = outcome.map(|(summary, jwks_ca)| {
            if jwks_ca {
                proxy.refetch_jwks();
            }
            summary
        });
        match outcome {
            Ok(summary) if certificates => tracing::info!(
                keys = %summary,
                "configuration reloaded: keys and certificates in place; other settings apply at the next restart"
            ),
            Ok(summary) => tracing::info!(
                keys = %summary,
                "configuration reloaded: keys in place; other settings apply at the next restart"
            ),
            Err(cause) => tracing::error!(
                %cause,
                "configuration reload refused; the running keys are kept"
            ),
        }
    }
}

/// The certificates of `cfg` in place for new TLS handshakes, over TCP and QUIC alike (QUIC
/// with the `[http3]` settings it runs with); both are checked before either is replaced.
fn reload_tls(edges: &Edges, cfg: &Config, proxy: &Proxy) -> Result<(), String> {
    let Some(server) = &edges.tls else {
        return Ok(());
    };
    let Some(t) = &cfg.tls else {
        tracing::warn!(
            "[tls] removed: the TLS listener serves its certificates until the next restart"
        );
        return Ok(());
    };
    let named = |e: downstream::CertError| format!("config key `{}`: {}", e.key, e.problem);
    let quic = match &edges.quic {
        Some((endpoint, h3)) => Some((endpoint, server.quic_config(t, h3).map_err(named)?)),
        None => None,
    };
    server.reload(t).map_err(named)?;
    if let Some((endpoint, quic)) = quic {
        endpoint.set_server_config(Some(quic));
    }
    show_certificates(server, proxy);
    Ok(())
}

/// The expiry of `server`'s certificates in place, for `/metrics`.
pub(super) fn show_certificates(server: &downstream::TlsServer, proxy: &Proxy) {
    if let Some(counts) = proxy.tls_counts() {
        let certificates = server.certificates().into_iter();
        counts.set_certificates(certificates.map(|c| (c.key, c.not_after)));
    }
}

/// The TLS server when `[tls]` is set and something serves it (the TCP listener, or HTTP/3,
/// which then is advertised in `Alt-Svc`).
pub(super) fn tls_server(
    cfg: &Config,
    tcp: bool,
    quic: bool,
) -> Result<Option<Arc<downstream::TlsServer>>, StartError> {
    let Some(t) = cfg.tls.as_ref().filter(|_| tcp || quic) else {
        return Ok(None);
    };
    let server = downstream::TlsServer::new(t)?;
    Ok(Some(Arc::new(match (&cfg.http3, quic) {
        (Some(h3), true) => server.with_alt_svc(h3.listen.port(), h3.alt_svc_max_age),
        _ => server,
    })))
}
