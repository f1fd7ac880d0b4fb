//! Logging setup and the Prometheus metrics endpoint. Access lines go to target
//! `tessera::access`; no module logs tokens or credentials (headers carrying them are marked
//! sensitive and never formatted).
//!
//! **Metrics** (`[metrics] listen`): `GET /metrics` on a listener of its own (keep it off the
//! public address), in the OpenMetrics 1.0 text format that Prometheus scrapes, encoded by
//! `prometheus-client`. The request path pays one relaxed increment per request, into a row of
//! counters owned by its serving thread, so two cores never write the same cache line; every
//! other value is read from counters the proxy keeps anyway, at scrape time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use tokio::net::TcpListener;

use crate::proxy::Proxy;

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

/// Status codes counted: 100..=999, every code `http::StatusCode` holds (an upstream's 600-999
/// are relayed as they are).
const FIRST_STATUS: u16 = 100;
const STATUSES: usize = 900;

/// One thread's request counters by status code, on cache lines of their own.
#[repr(align(128))]
struct Row([AtomicU64; STATUSES]);

/// Requests answered, by status code, counted per serving thread.
pub struct RequestCounts {
    /// One row per serving thread, and a last one for every other thread.
    rows: Box<[Row]>,
}

impl RequestCounts {
    /// Counters for `threads` serving threads (see [`crate::forward::set_serving_thread`]).
    pub fn new(threads: usize) -> Self {
        Self {
            rows: (0..threads.max(1) + 1)
                .map(|_| Row(std::array::from_fn(|_| AtomicU64::new(0))))
                .collect(),
        }
    }

    /// Counts one answered request with `status` (100..=999; other values are ignored).
    pub fn count(&self, status: u16) {
        // Serving threads are numbered below `threads`; any other thread counts in the last row.
        let others = self.rows.len() - 1;
        let row = crate::forward::serving_thread()
            .filter(|&i| i < others)
            .unwrap_or(others);
        if let Some(c) = status
            .checked_sub(FIRST_STATUS)
            .and_then(|i| self.rows[row].0.get(usize::from(i)))
        {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `(status, requests)` for every status seen, in ascending order of status.
    pub fn snapshot(&self) -> Vec<(u16, u64)> {
        (0..STATUSES)
            .filter_map(|i| {
                let n: u64 = self
                    .rows
                    .iter()
                    .map(|r| r.0[i].load(Ordering::Relaxed))
                    .sum();
                (n > 0).then(|| (FIRST_STATUS + i as u16, n))
            })
            .collect()
    }
}

/// The values of one scrape, read from the proxy's counters.
#[derive(Debug)]
struct Scrape {
    requests: Vec<(u16, u64)>,
    upstream_opened: u64,
    upstream_reused: u64,
    upstream_retried: u64,
    upstream_moved: u64,
    store_reads: u64,
    session_cache: Option<(u64, bool)>,
    token_cache: Option<u64>,
}

impl Scrape {
    fn of(proxy: &Proxy) -> Self {
        let pool = proxy.upstream().stats();
        let sessions = proxy.sessions();
        Self {
            requests: proxy
                .request_counts()
                .map(RequestCounts::snapshot)
                .unwrap_or_default(),
            upstream_opened: pool.opened.load(Ordering::Relaxed),
            upstream_reused: pool.reused.load(Ordering::Relaxed),
            upstream_retried: pool.retried.load(Ordering::Relaxed),
            upstream_moved: pool.moved.load(Ordering::Relaxed),
            store_reads: sessions.store_reads(),
            session_cache: sessions.cache_entries().map(|n| (n, sessions.cache_live())),
            token_cache: proxy.verifier().cache_entries(),
        }
    }
}

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

impl prometheus_client::collector::Collector for Scrape {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let mut family = e.encode_descriptor(
            "requests",
            "Requests answered, by the status code sent downstream.",
            None,
            MetricType::Counter,
        )?;
        for (status, n) in &self.requests {
            let code = status.to_string();
            ConstCounter::new(*n).encode(family.encode_family(&[("code", code.as_str())])?)?;
        }
        counter(
            &mut e,
            "upstream_connections_opened",
            "Connections opened to the upstream.",
            self.upstream_opened,
        )?;
        counter(
            &mut e,
            "upstream_requests_reused",
            "Requests sent on an upstream connection that had served an earlier request.",
            self.upstream_reused,
        )?;
        counter(&mut e, "upstream_retries", "Requests retried on a fresh upstream connection after a reused one failed before the request was sent.", self.upstream_retried)?;
        counter(
            &mut e,
            "upstream_connections_moved",
            "Idle upstream connections moved to the serving thread that took them.",
            self.upstream_moved,
        )?;
        counter(&mut e, "session_store_reads", "Session records read from the store on the request path (cache fills, or every request while the cache is bypassed).", self.store_reads)?;
        if let Some((entries, live)) = self.session_cache {
            gauge(
                &mut e,
                "session_cache_entries",
                "Sessions in the cache, found and unknown (negative) entries.",
                entries,
            )?;
            gauge(&mut e, "session_cache_live", "1 while the store's invalidation channel is live and the cache is used; 0 while it is bypassed.", u64::from(live))?;
        }
        if let Some(entries) = self.token_cache {
            gauge(
                &mut e,
                "token_cache_entries",
                "Verified tokens in the cache.",
                entries,
            )?;
        }
        Ok(())
    }
}

/// The OpenMetrics text of `proxy`'s metrics, every name prefixed `tessera_`.
pub fn render(proxy: &Proxy) -> String {
    let mut registry = prometheus_client::registry::Registry::with_prefix("tessera");
    registry.register_collector(Box::new(Scrape::of(proxy)));
    let mut text = String::with_capacity(2048);
    // Encoding into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text
}

/// `Content-Type` of [`render`]'s text (OpenMetrics 1.0, which Prometheus negotiates).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

fn answer(proxy: &Proxy, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        (&Method::GET | &Method::HEAD, "/metrics") => {
            (StatusCode::OK, CONTENT_TYPE, Bytes::from(render(proxy)))
        }
        (_, "/metrics") => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            Bytes::from_static(b"GET or HEAD only\n"),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            Bytes::from_static(b"metrics are at /metrics\n"),
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

/// Connections served at once on the metrics listener; more are closed at accept.
pub const MAX_METRICS_CONNECTIONS: usize = 16;

/// Serves `GET /metrics` (HTTP/1.1) on `listener` until this future is dropped, which also ends
/// its connections. Other paths get 404, other methods 405; at most
/// [`MAX_METRICS_CONNECTIONS`] at once (a scraper's idle keep-alive connection holds one), and a
/// request head must arrive within 10 s of its start (hyper's `header_read_timeout`). A failed
/// accept is logged and retried after 100 ms.
pub async fn serve_metrics(listener: TcpListener, proxy: Arc<Proxy>) {
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
        let proxy = proxy.clone();
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let resp = answer(&proxy, &req);
                async move { Ok::<_, std::convert::Infallible>(resp) }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_counts_sum_every_threads_row_and_ignore_codes_out_of_range() {
        let counts = Arc::new(RequestCounts::new(2));
        let threads: Vec<_> = [Some(0), Some(1), Some(2), None]
            .into_iter()
            .map(|serving| {
                let counts = counts.clone();
                std::thread::spawn(move || {
                    if let Some(i) = serving {
                        crate::forward::set_serving_thread(i);
                    }
                    for _ in 0..1000 {
                        counts.count(200);
                    }
                    counts.count(599);
                    counts.count(999);
                    counts.count(100);
                    counts.count(99);
                    counts.count(1000);
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        counts.count(401);
        assert_eq!(
            counts.snapshot(),
            vec![(100, 4), (200, 4000), (401, 1), (599, 4), (999, 4)]
        );
        // Each serving thread wrote its own row; a thread numbered beyond them (2) and an
        // unmarked one the last.
        let row = |r: usize, status: usize| counts.rows[r].0[status - 100].load(Ordering::Relaxed);
        assert_eq!((row(0, 200), row(1, 200), row(2, 200)), (1000, 1000, 2000));
    }
}
