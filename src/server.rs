//! The accept phase: plain HTTP/1.1 and h2c (prior knowledge) on one TCP listener, with graceful
//! shutdown. Must never: do request work here (that is `proxy`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::config::ServerConfig;
use crate::proxy::{Peer, Proxy};

/// How long open connections get to finish after shutdown is signalled.
const DRAIN: Duration = Duration::from_secs(10);

/// Serves `proxy` on `listener` until `shutdown` resolves, then drains open connections.
///
/// Errors: none from accept (a failed accept is logged and retried after a short pause).
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    cfg: &ServerConfig,
    shutdown: impl Future<Output = ()>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout)
        .max_buf_size((cfg.max_header_bytes + cfg.max_uri_bytes + 1024).max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size((cfg.max_header_bytes + cfg.max_uri_bytes) as u32);
    let graceful = GracefulShutdown::new();
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
        let proxy = proxy.clone();
        let peer = Arc::new(Peer::new(peer));
        let service = service_fn(move |req| {
            let (proxy, peer) = (proxy.clone(), peer.clone());
            async move { Ok::<_, std::convert::Infallible>(proxy.handle(req, &peer).await) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(cause = %e, "downstream connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after {DRAIN:?}; closing");
    }
}
