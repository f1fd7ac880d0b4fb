//! The operator's listener: `GET /metrics`, `/healthz` and `/readyz` over HTTP/1.1, at most
//! [`MAX_METRICS_CONNECTIONS`] at once. Must never: serve the proxied path.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use tokio::net::TcpListener;

use super::metrics::{render, Observed, CONTENT_TYPE};

/// Answers one request of the operator's listener: `/metrics`, and the probes `/healthz`
/// (live: 200 while the process's main runtime answers) and `/readyz` (see `readiness`).
pub(super) async fn answer(
    proxy: &dyn Observed,
    phase: &tokio::sync::watch::Receiver<Phase>,
    probe_timeout: Duration,
    req: &Request<hyper::body::Incoming>,
) -> Response<Full<Bytes>> {
    let known = matches!(req.uri().path(), "/metrics" | "/healthz" | "/readyz");
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        (&Method::GET | &Method::HEAD, "/metrics") => {
            (StatusCode::OK, CONTENT_TYPE, Bytes::from(render(proxy)))
        }
        (&Method::GET | &Method::HEAD, "/healthz") => {
            (StatusCode::OK, "text/plain", Bytes::from_static(b"ok\n"))
        }
        (&Method::GET | &Method::HEAD, "/readyz") => {
            let now = *phase.borrow();
            let (status, why) = readiness(proxy, now, probe_timeout).await;
            (status, "text/plain", Bytes::from_static(why))
        }
        _ if known => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            Bytes::from_static(b"GET or HEAD only\n"),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            Bytes::from_static(b"metrics are at /metrics; probes at /healthz and /readyz\n"),
        ),
    };
    // For HEAD, hyper sends the body's length and not the body.
    let mut resp = Response::new(Full::new(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    if status == StatusCode::METHOD_NOT_ALLOWED {
        resp.headers_mut()
            .insert(header::ALLOW, http::HeaderValue::from_static("GET, HEAD"));
    }
    resp
}

/// Where an instance is in its life, as `/readyz` sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Loading keys (the first JWKS fetch), starting the serving threads.
    Starting,
    /// Serving threads accept connections.
    Serving,
    /// Shutdown has begun, but connections are still served for `server.shutdown_delay_ms`
    /// while `/readyz` says 503 (balancers move away), before the drain.
    Leaving,
    /// Shutdown has begun: the listener is closed, busy connections drain.
    Draining,
}

/// Whether this instance should get traffic: 200 while `Serving` and the session store answers
/// a read within `timeout` (`session.timeout_ms`); else 503 with the reason (starting, shutting
/// down, or the store: every cold session would get 503).
pub(super) async fn readiness(
    proxy: &dyn Observed,
    phase: Phase,
    timeout: Duration,
) -> (StatusCode, &'static [u8]) {
    match phase {
        Phase::Starting => return (StatusCode::SERVICE_UNAVAILABLE, b"starting\n"),
        Phase::Leaving | Phase::Draining => {
            return (StatusCode::SERVICE_UNAVAILABLE, b"shutting down\n")
        }
        Phase::Serving => {}
    }
    let cause = match tokio::time::timeout(timeout, proxy.ping_store()).await {
        Ok(Ok(())) => return (StatusCode::OK, b"ready\n"),
        Ok(Err(e)) => e,
        Err(_) => format!("no answer within {timeout:?}"),
    };
    tracing::debug!(%cause, "readiness probe: session store unavailable");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        b"session store unavailable\n",
    )
}

/// Connections served at once on the metrics listener; more are closed at accept.
pub const MAX_METRICS_CONNECTIONS: usize = 16;

/// Serves `GET /metrics` and the probes `GET /healthz` and `GET /readyz` (HTTP/1.1; see
/// `answer`) on `listener` until this future is dropped, which also ends its connections.
/// `phase` says where the instance is (`/readyz` answers 200 only while `Serving` and the store
/// answers within `probe_timeout`). Other
/// paths get 404, other methods 405; at most
/// [`MAX_METRICS_CONNECTIONS`] at once (a scraper's idle keep-alive connection holds one), and a
/// request head must arrive within 10 s of its start (hyper's `header_read_timeout`). A failed
/// accept is logged and retried after 100 ms.
pub async fn serve_metrics(
    listener: TcpListener,
    proxy: Arc<dyn Observed>,
    phase: tokio::sync::watch::Receiver<Phase>,
    probe_timeout: Duration,
) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next() => continue,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(cause = %e, "metrics listener: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        if connections.len() >= MAX_METRICS_CONNECTIONS {
            tracing::warn!(
                max = MAX_METRICS_CONNECTIONS,
                "metrics listener: too many connections; closed a new one"
            );
            continue;
        }
        let (proxy, phase) = (proxy.clone(), phase.clone());
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let (proxy, phase) = (proxy.clone(), phase.clone());
                async move {
                    let resp = answer(&*proxy, &phase, probe_timeout, &req).await;
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10))
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            if let Err(e) = conn.await {
                tracing::debug!(cause = %e, "metrics connection ended with an error");
            }
        });
    }
}
