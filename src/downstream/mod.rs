//! The accept phase: plain HTTP/1.1 and h2c (prior knowledge) on one TCP listener, TLS
//! (HTTP/1.1 or HTTP/2 by ALPN) on another, with graceful shutdown. Each HTTP/1.1 connection,
//! plain or TLS, starts on the fast path ([`conn`]), which hands anything else to hyper; h2 over
//! TLS goes to hyper at once. Must never: do request work here (that is `proxy`).

mod activation;
mod certs;
mod client_side;
mod conn;
mod expiry;
mod fastopen;
mod format;
mod h3_guard;
mod h3_uni;
mod handoff;
mod host_key;
mod http3;
mod io;
mod parse;
mod proxy_header;
mod quic;
mod quic_handshake;
mod retry;
mod session_cache;
mod settings;
mod tickets;
mod tls;
mod tracked;
mod write;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::proxy::Proxy;

pub use activation::Inherited;
pub use certs::{name_matches, CertError, CertSummary};
pub use client_side::client_side;
pub use conn::MAX_FAST_BODY;
pub use expiry::{RECHECK as CERT_RECHECK, WARN_BEFORE as CERT_WARN_BEFORE};
pub use fastopen::{adopt_tcp, bind_tcp};
pub use host_key::endpoint_config as quic_endpoint_config;
pub(crate) use parse::{Incoming, Taken};
pub use quic::{adopt_udp, bind_udp, serve_http3};
pub use settings::{Http3Config, Identity, Retry, Secret, ServerConfig, TlsConfig, TlsVersion};
pub use tickets::MIN_SECRET_BYTES as MIN_TICKET_SECRET_BYTES;
pub use tls::TlsServer;

/// What a listener speaks.
#[derive(Debug, Clone)]
pub enum Edge {
    /// Plain HTTP/1.1 and h2c (`server.listen`).
    Plain,
    /// TLS, then HTTP/1.1 or HTTP/2 by ALPN (`tls.listen`).
    Tls(Arc<TlsServer>),
}

/// Open-files limits below this many descriptors get a warning at start: each client connection,
/// upstream connection and WebSocket tunnel holds one or two.
const FEW_OPEN_FILES: u64 = 4096;

/// Raises the process's soft limit on open files (`RLIMIT_NOFILE`) to its hard limit, as Go's
/// runtime and nginx's `worker_rlimit_nofile` do: the soft limit many service managers start
/// a process with (1024 under systemd) runs out at a few hundred clients, and then every
/// `accept` and upstream `connect` fails with `EMFILE`. Logs the limit in force; warns, naming
/// the fix, when it stays below 4096. Call once, at start, before serving.
///
/// Returns the soft limit in force afterwards (`None`: unlimited, or the limit could not be
/// read). Errors: none; a failed raise is logged and the old limit kept.
pub fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let before = getrlimit(Resource::Nofile);
    let mut now = before.current;
    if let (Some(soft), Some(hard)) = (before.current, before.maximum) {
        if soft < hard {
            let raised = Rlimit {
                current: Some(hard),
                maximum: Some(hard),
            };
            match setrlimit(Resource::Nofile, raised) {
                Ok(()) => now = Some(hard),
                Err(e) => {
                    tracing::warn!(cause = %e, soft, hard, "cannot raise the open-files limit")
                }
            }
        }
    }
    match now {
        Some(n) if n < FEW_OPEN_FILES => tracing::warn!(
            open_files = n,
            "open-files limit is low: about {} clients can connect; raise the hard limit (systemd `LimitNOFILE=65536`, or `ulimit -Hn 65536` before starting)",
            n / 2
        ),
        _ => tracing::info!(
            open_files = now.map_or_else(|| "unlimited".to_string(), |n| n.to_string()),
            raised_from = before.current.filter(|&b| Some(b) != now).map(|b| b.to_string()),
            "open-files limit"
        ),
    }
    now
}

/// Serves `proxy` on `listener` (speaking `edge`) until `shutdown` resolves, then drains open
/// connections: idle ones close at once, busy ones finish their request (answered with
/// `Connection: close`), WebSocket tunnels send both sides a Close frame 1001 and end; all
/// within 10 s.
///
/// Errors: none from accept (a failed accept is logged and retried after a short pause; a
/// failed TLS handshake at debug level).
pub async fn serve(
    listener: TcpListener,
    edge: Edge,
    proxy: Arc<Proxy>,
    cfg: &ServerConfig,
    shutdown: impl Future<Output = ()>,
) {
    let stop = CancellationToken::new();
    let serving = Arc::new(serving(proxy, cfg, stop.clone()));
    let connections = TaskTracker::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, addr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    tracing::warn!(cause = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Past server.max_connections this connection waits, unserved, and no other is accepted
        // meanwhile (new clients wait in the listen backlog).
        let slot = match serving.proxy.client_connections() {
            None => None,
            Some(limit) => tokio::select! {
                slot = connection_slot(limit) => Some(slot),
                () = &mut shutdown => break,
            },
        };
        let _ = stream.set_nodelay(true);
        let (serving, edge) = (serving.clone(), edge.clone());
        // Boxed: tokio moves a task's future several times as it spawns and ends it (about
        // 150,000 instructions a connection for this one inline); a box moves as a pointer.
        connections.spawn(Box::pin(async move {
            serve_connection(serving, edge, stream, addr).await;
            drop(slot);
        }));
    }
    drop(listener);
    stop.cancel();
    serving.proxy.close_websockets();
    connections.close();
    // Connections first: a handshake still being answered spawns its tunnel before its
    // connection ends.
    let drained = async {
        connections.wait().await;
        serving.proxy.tunnels_closed().await;
    };
    let drain = cfg.shutdown_timeout;
    if tokio::time::timeout(drain, drained).await.is_err() {
        tracing::warn!(
            "connections still open after {drain:?} (server.shutdown_timeout_ms); closing"
        );
    }
}

/// One connection from accept to close: the PROXY protocol header first with
/// `server.proxy_protocol`, then the TLS handshake on a TLS listener.
async fn serve_connection(
    serving: Arc<conn::Serving>,
    edge: Edge,
    mut stream: tokio::net::TcpStream,
    addr: SocketAddr,
) {
    let peer = match serving.proxy_protocol {
        false => serving.proxy.peer(addr),
        true => match behind_proxy(&serving, &mut stream, addr).await {
            Some(Some(client)) => serving.proxy.peer(client),
            // No client named (a health check, a UNIX-socket frontend): the balancer's own
            // address, but none of the forwarding fields it relays is believed.
            Some(None) => crate::proxy::Peer::new(addr),
            None => return,
        },
    };
    // Held for the connection's life (a WebSocket tunnel it hands its socket to is not
    // counted here: it holds places of its own under server.max_connections and this limit).
    let Ok(_ip_place) = serving.proxy.enter_per_ip(peer.addr.ip()) else {
        return;
    };
    let peer = match edge {
        Edge::Plain => peer.redirected_to_https(serving.redirect_to_https),
        Edge::Tls(ref tls) => peer.over_tls().advertising(tls.alt_svc().cloned()),
    };
    match edge {
        Edge::Plain => conn::serve(serving, stream, peer).await,
        // Boxed: a TLS connection's state is twice a plain one's, which would otherwise size
        // every connection's future.
        Edge::Tls(tls) => Box::pin(serve_tls(serving, tls, stream, peer)).await,
    }
}

/// A connection on a TLS listener from its handshake to its close.
async fn serve_tls(
    serving: Arc<conn::Serving>,
    tls: Arc<TlsServer>,
    stream: tokio::net::TcpStream,
    peer: crate::proxy::Peer,
) {
    let counts = serving.proxy.tls_counts();
    let handshake = tls::handshake(&tls, stream, serving.header_read_timeout, counts);
    let handshaken = tokio::select! {
        done = handshake => done,
        // A handshake not yet done is no connection the drain waits for.
        () = serving.shutdown.cancelled() => tls::Handshaken::Failed,
    };
    match handshaken {
        tls::Handshaken::Tls(stream, false) => conn::serve(serving, *stream, peer).await,
        tls::Handshaken::Tls(stream, true) => conn::serve_h2(serving, *stream, peer).await,
        tls::Handshaken::PlainHttp(tcp) => {
            let peer = crate::proxy::Peer::new(peer.addr).plain_on_tls_port();
            conn::serve(serving, tcp, peer).await
        }
        tls::Handshaken::Failed => {}
    }
}

/// The client named by the PROXY protocol header that starts the connection from `addr`
/// (`Some(None)` when the header names none); `None` when the connection is closed instead:
/// `addr` is not in `server.trusted_proxies`, the header is missing, malformed or late (the
/// reason logged at debug level), or the server is shutting down.
async fn behind_proxy(
    serving: &conn::Serving,
    stream: &mut tokio::net::TcpStream,
    addr: SocketAddr,
) -> Option<Option<SocketAddr>> {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !serving.proxy.trusts(addr.ip()) {
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                peer = %addr.ip(),
                "a connection from outside server.trusted_proxies on a PROXY protocol listener; \
                 closed (such connections are closed without a word from now on)"
            );
        }
        return None;
    }
    let read = tokio::select! {
        read = proxy_header::read(stream, serving.header_read_timeout) => read,
        () = serving.shutdown.cancelled() => return None,
    };
    match read {
        Ok(client) => Some(client),
        Err(why) => {
            tracing::debug!(peer = %addr.ip(), why, "connection closed");
            None
        }
    }
}

/// What every connection of one accept loop shares: hyper's servers built with `cfg`'s limits.
fn serving(proxy: Arc<Proxy>, cfg: &ServerConfig, shutdown: CancellationToken) -> conn::Serving {
    let max_head = (cfg.max_header_bytes + cfg.max_uri_bytes + 1024).max(8192);
    let mut hyper = auto::Builder::new(TokioExecutor::new());
    hyper
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout)
        .max_buf_size(max_head);
    hyper
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(cfg.http2_max_concurrent_streams)
        .max_header_list_size((cfg.max_header_bytes + cfg.max_uri_bytes) as u32);
    // HTTP/1 only, hyper's own builder with the same limits: the auto builder's connection with
    // upgrades ignores `http1_only` and would take an h2 preface as a switch to h2.
    let mut hyper_h1 = hyper::server::conn::http1::Builder::new();
    hyper_h1
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout)
        .max_buf_size(max_head);
    let mut hyper_h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    hyper_h2
        .timer(TokioTimer::new())
        .max_concurrent_streams(cfg.http2_max_concurrent_streams)
        .max_header_list_size((cfg.max_header_bytes + cfg.max_uri_bytes) as u32);
    if proxy.websockets().is_some() {
        // WebSockets over HTTP/2 (RFC 8441): SETTINGS_ENABLE_CONNECT_PROTOCOL tells browsers
        // they may open one on a stream of the connection they have.
        hyper.http2().enable_connect_protocol();
        hyper_h2.enable_connect_protocol();
    }
    conn::Serving {
        proxy,
        hyper_h1,
        hyper_h2,
        hyper,
        header_read_timeout: cfg.header_read_timeout,
        send_timeout: cfg.send_timeout,
        max_head,
        proxy_protocol: cfg.proxy_protocol,
        redirect_to_https: cfg.redirect_to_https,
        max_body: match cfg.max_body_bytes {
            0 => MAX_FAST_BODY,
            cap => cap.min(MAX_FAST_BODY),
        },
        shutdown,
    }
}

/// A place under `server.max_connections` for a connection just accepted; waits while every
/// place is taken, and says so once in the log.
async fn connection_slot(limit: &Arc<crate::share::Share>) -> crate::share::SharePermit {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if let Some(slot) = limit.try_acquire() {
        return slot;
    }
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            max = limit.limit(),
            "server.max_connections client connections are open; new ones wait until one closes \
             (counted in tessera_client_connection_waits_total)"
        );
    }
    limit.acquire().await
}
