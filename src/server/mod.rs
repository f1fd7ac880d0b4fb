//! The accept phase: plain HTTP/1.1 and h2c (prior knowledge) on one TCP listener, with graceful
//! shutdown. Each connection starts on the HTTP/1.1 fast path ([`h1`]), which hands anything
//! else to hyper. Must never: do request work here (that is `proxy`).

mod h1;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::ServerConfig;
use crate::proxy::Proxy;

pub use h1::MAX_FAST_BODY;
pub(crate) use h1::{downstream, Incoming, Taken};

/// How long open connections get to finish after shutdown is signalled.
const DRAIN: Duration = Duration::from_secs(10);

/// Serves `proxy` on `listener` until `shutdown` resolves, then drains open connections: idle
/// ones close at once, busy ones finish their request (answered with `Connection: close`),
/// WebSocket tunnels send both sides a Close frame 1001 and end; all within 10 s.
///
/// Errors: none from accept (a failed accept is logged and retried after a short pause).
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    cfg: &ServerConfig,
    shutdown: impl Future<Output = ()>,
) {
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
        .max_header_list_size((cfg.max_header_bytes + cfg.max_uri_bytes) as u32);
    // HTTP/1 only, hyper's own builder with the same limits: the auto builder's connection with
    // upgrades ignores `http1_only` and would take an h2 preface as a switch to h2.
    let mut hyper_h1 = hyper::server::conn::http1::Builder::new();
    hyper_h1
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout)
        .max_buf_size(max_head);
    let stop = CancellationToken::new();
    let serving = Arc::new(h1::Serving {
        proxy,
        hyper_h1,
        hyper,
        header_read_timeout: cfg.header_read_timeout,
        max_head,
        max_body: match cfg.max_body_bytes {
            0 => MAX_FAST_BODY,
            cap => cap.min(MAX_FAST_BODY),
        },
        shutdown: stop.clone(),
    });
    let connections = TaskTracker::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
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
        let _ = stream.set_nodelay(true);
        let peer = serving.proxy.peer(peer);
        connections.spawn(h1::serve(serving.clone(), stream, peer));
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
    if tokio::time::timeout(DRAIN, drained).await.is_err() {
        tracing::warn!("connections still open after {DRAIN:?}; closing");
    }
}
