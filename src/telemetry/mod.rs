//! Logging setup and the Prometheus metrics endpoint. Access lines are written by
//! `access_log` (src/access_log.rs) in this log's format, as target `tessera::access` (the filter set up here
//! decides whether they are written); no module logs tokens or credentials (headers carrying them
//! are marked sensitive and never formatted).
//!
//! **Metrics** (`[metrics] listen`): `GET /metrics` on a listener of its own (keep it off the
//! public address), in the OpenMetrics 1.0 text format that Prometheus scrapes, encoded by
//! `prometheus-client`. The request path pays three relaxed increments per request (its status,
//! its duration bucket, the duration sum), into a row of counters owned by its serving thread, so
//! two cores never write the same cache line; every other value is read from counters the proxy
//! keeps anyway, at scrape time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use tokio::net::TcpListener;

mod settings;
use crate::upstream::Closed;
pub use settings::{LogConfig, MetricsConfig};

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

/// Upper bounds of the request-duration histogram's buckets, µs (Prometheus `le`, inclusive); a
/// last bucket, `+Inf`, holds the rest. From 50 µs (a warm request through tessera to a loopback
/// upstream) to 10 s (a slow upstream).
pub const DURATION_BOUNDS_US: [u64; 17] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000,
];
const BUCKETS: usize = DURATION_BOUNDS_US.len() + 1;

/// One thread's request counters, on cache lines of their own.
#[repr(align(128))]
struct Row {
    /// Requests by status code (index: status - 100).
    statuses: [AtomicU64; STATUSES],
    /// Requests by duration bucket (not cumulative; index as [`DURATION_BOUNDS_US`], then +Inf).
    durations: [AtomicU64; BUCKETS],
    /// Sum of the durations, µs.
    duration_sum_us: AtomicU64,
}

/// What [`RequestCounts::snapshot`] read: every thread's rows summed.
#[derive(Debug, PartialEq)]
pub struct RequestSnapshot {
    /// `(status, requests)` for every status seen, in ascending order of status.
    pub statuses: Vec<(u16, u64)>,
    /// Requests per duration bucket, not cumulative: one per [`DURATION_BOUNDS_US`] entry, then
    /// the `+Inf` bucket.
    pub durations: [u64; BUCKETS],
    /// Sum of the durations, µs.
    pub duration_sum_us: u64,
}

/// Outcomes of configuration reloads (SIGHUP), for `/metrics`.
#[derive(Debug)]
pub struct ReloadCounts {
    applied: AtomicU64,
    refused: AtomicU64,
    /// The last reload put its keys in place (true at start, as the start's own load did).
    last_ok: std::sync::atomic::AtomicBool,
}

impl Default for ReloadCounts {
    fn default() -> Self {
        Self {
            applied: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            last_ok: std::sync::atomic::AtomicBool::new(true),
        }
    }
}

impl ReloadCounts {
    /// Counts one reload: its keys put in place (`ok`) or refused.
    pub fn record(&self, ok: bool) {
        let n = if ok { &self.applied } else { &self.refused };
        n.fetch_add(1, Ordering::Relaxed);
        self.last_ok.store(ok, Ordering::Relaxed);
    }

    /// `(applied, refused, last one applied)`.
    pub fn snapshot(&self) -> (u64, u64, bool) {
        (
            self.applied.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
            self.last_ok.load(Ordering::Relaxed),
        )
    }
}

/// Requests answered, by status code and by duration, counted per serving thread.
pub struct RequestCounts {
    /// One row per serving thread, and a last one for every other thread.
    rows: Box<[Row]>,
}

impl RequestCounts {
    /// Counters for `threads` serving threads (see [`crate::upstream::set_serving_thread`]).
    pub fn new(threads: usize) -> Self {
        Self {
            rows: (0..threads.max(1) + 1)
                .map(|_| Row {
                    statuses: std::array::from_fn(|_| AtomicU64::new(0)),
                    durations: std::array::from_fn(|_| AtomicU64::new(0)),
                    duration_sum_us: AtomicU64::new(0),
                })
                .collect(),
        }
    }

    /// Counts one answered request with `status` (100..=999; other values are not counted by
    /// status) whose response head was ready `took` after its request head was read.
    pub fn record(&self, status: u16, took: Duration) {
        let row = self.row();
        Self::count_in(row, status);
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let bucket = DURATION_BOUNDS_US.partition_point(|&bound| bound < us);
        row.durations[bucket].fetch_add(1, Ordering::Relaxed);
        row.duration_sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Counts a request answered before it reached the proxy (the 408 for a head that did not
    /// arrive in time, hyper's own 400/414/431 for a head it could not take) by `status` only:
    /// it is not in the duration histogram.
    pub fn count_status(&self, status: u16) {
        Self::count_in(self.row(), status);
    }

    /// The calling thread's row: serving threads are numbered below `threads`, and any other
    /// thread counts in the last row.
    fn row(&self) -> &Row {
        let others = self.rows.len() - 1;
        &self.rows[crate::upstream::serving_thread()
            .filter(|&i| i < others)
            .unwrap_or(others)]
    }

    fn count_in(row: &Row, status: u16) {
        if let Some(c) = status
            .checked_sub(FIRST_STATUS)
            .and_then(|i| row.statuses.get(usize::from(i)))
        {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Every thread's counters summed (each read with a relaxed load: a request recorded
    /// during the read may be in one sum and not yet in another).
    pub fn snapshot(&self) -> RequestSnapshot {
        let sum = |read: &dyn Fn(&Row) -> &AtomicU64| -> u64 {
            self.rows
                .iter()
                .map(|r| read(r).load(Ordering::Relaxed))
                .sum()
        };
        RequestSnapshot {
            statuses: (0..STATUSES)
                .filter_map(|i| {
                    let n = sum(&|r| &r.statuses[i]);
                    (n > 0).then(|| (FIRST_STATUS + i as u16, n))
                })
                .collect(),
            durations: std::array::from_fn(|i| sum(&|r| &r.durations[i])),
            duration_sum_us: sum(&|r| &r.duration_sum_us),
        }
    }
}

/// The values of one scrape, read from the proxy's counters.
#[derive(Debug)]
pub struct Scrape {
    /// `None` when request counts are not kept (no `[metrics]`).
    pub(crate) requests: Option<RequestSnapshot>,
    pub(crate) upstream_opened: u64,
    pub(crate) upstream_reused: u64,
    pub(crate) upstream_retried: u64,
    pub(crate) upstream_moved: u64,
    pub(crate) upstream_handed_over: u64,
    pub(crate) upstream_wait_expired: u64,
    pub(crate) upstream_drained: u64,
    pub(crate) upstream_drain_failed: u64,
    /// Upstream connections closed, by reason (`Closed::ALL`'s order).
    pub(crate) upstream_closed: [u64; Closed::ALL.len()],
    /// Upstream connections open at the scrape, `(busy, idle)`.
    pub(crate) upstream_open: (usize, usize),
    pub(crate) store_reads: u64,
    pub(crate) session_cache: Option<(u64, bool)>,
    pub(crate) token_cache: Option<u64>,
    /// Responses that end with their session: `(open now, ended by revocation or expiry)`.
    pub(crate) streams: Option<(u64, u64)>,
    /// WebSocket tunnels: `(open now, opened since start)`.
    pub(crate) websockets: Option<(u64, u64)>,
    pub(crate) busy_poll: crate::busy_poll::PollStats,
    /// Configuration reloads: `(applied, refused, last one applied)`.
    pub(crate) reloads: (u64, u64, bool),
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
        for (status, n) in self.requests.iter().flat_map(|r| &r.statuses) {
            let code = status.to_string();
            ConstCounter::new(*n).encode(family.encode_family(&[("code", code.as_str())])?)?;
        }
        if let Some(r) = &self.requests {
            let buckets: Vec<(f64, u64)> = DURATION_BOUNDS_US
                .iter()
                .map(|&us| us as f64 / 1e6)
                // written as `+Inf`
                .chain([f64::INFINITY])
                .zip(r.durations)
                .collect();
            e.encode_descriptor(
                "request_duration_seconds",
                "Time from a request's head being read to its response head being ready (the body streams after), seconds.",
                None,
                MetricType::Histogram,
            )?
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                r.duration_sum_us as f64 / 1e6,
                r.durations.iter().sum(),
                &buckets,
                None,
            )?;
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
        counter(&mut e, "upstream_affinity_handovers", "With upstream.affinity = \"session\" at the connection cap: connections handed from a finished request straight to a waiting request of the same user.", self.upstream_handed_over)?;
        counter(&mut e, "upstream_affinity_waits_expired", "With upstream.affinity = \"session\" at the connection cap: requests of a user already holding its share that got no connection of their own (the wait, upstream.affinity_wait_ms, ran out or is 0), so another user's idle connection, if one was still idle, was closed for a new one.", self.upstream_wait_expired)?;
        counter(&mut e, "upstream_exchanges_drained", "Upstream exchanges whose client went away less than upstream.drain_wait_ms (default 250 ms) after the request was sent (before the response head, or with at most upstream.drain_max_bytes (default 64 KiB) or a chunked rest of the body left) that were read to their end in the background, their connection kept.", self.upstream_drained)?;
        counter(&mut e, "upstream_exchanges_drain_failed", "Upstream exchanges whose client went away that were read in the background but could not be finished so (no response end within upstream.drain_wait_ms or upstream.drain_max_bytes, a response that ends its connection, an error, or the upstream closing): their connection was closed.", self.upstream_drain_failed)?;
        let mut family = e.encode_descriptor(
            "upstream_connections_closed",
            "Upstream connections closed, by reason: upstream (it said Connection: close, or closed or reset the connection), expired (idle past upstream.idle_timeout_ms or the upstream's Keep-Alive timeout), evicted (idle, closed to make room under upstream.max_connections for another user's connection with affinity, or an idle peer of a reused connection that failed, before the retry), abandoned (an exchange left before its end, by its client, an oversized request body, a timeout or its session's end, and not finished in the background), error (an I/O error, a malformed response, bytes after a response's end, a reset while a request was partly written), tunnel (a WebSocket tunnel ended).",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in Closed::ALL.iter().zip(self.upstream_closed) {
            ConstCounter::new(n).encode(family.encode_family(&[("reason", reason.label())])?)?;
        }
        let (busy, idle) = self.upstream_open;
        let mut family = e.encode_descriptor(
            "upstream_connections",
            "Upstream connections open now: busy (a request's, being opened or finishing an exchange its client left included; not a request waiting for its own user's connection with affinity) and idle (kept for reuse).",
            None,
            MetricType::Gauge,
        )?;
        for (state, n) in [("busy", busy), ("idle", idle)] {
            ConstGauge::new(n as u64).encode(family.encode_family(&[("state", state)])?)?;
        }
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
        if let Some((open, ended)) = self.streams {
            gauge(&mut e, "session_streams_open", "Responses open now whose body waited for the upstream (server-sent events, long downloads) and WebSocket connections: each ends when its session is revoked or expires.", open)?;
            counter(
                &mut e,
                "session_streams_ended",
                "Open responses and WebSocket connections ended because their session was revoked or expired.",
                ended,
            )?;
        }
        if let Some((open, opened)) = self.websockets {
            gauge(&mut e, "websockets_open", "WebSocket connections open now, handshakes being forwarded included (each open one holds one upstream connection, counted as busy).", open)?;
            counter(
                &mut e,
                "websockets_opened",
                "WebSocket upgrades the upstream accepted (101) since start.",
                opened,
            )?;
        }
        let poll = self.busy_poll;
        counter(
            &mut e,
            "busy_polls",
            "Busy polls run by serving threads before parking (server.busy_poll_us; 0 while off).",
            poll.polls,
        )?;
        counter(&mut e, "busy_polls_answered", "Busy polls ended by a readable socket or a task woken from another thread (a sleep and wake-up saved).", poll.answered)?;
        counter(
            &mut e,
            "busy_poll_backoffs",
            "Times a serving thread stopped polling for 20 ms because its CPU was contended.",
            poll.backoffs,
        )?;
        let (applied, refused, last_ok) = self.reloads;
        let mut family = e.encode_descriptor(
            "config_reloads",
            "Configuration reloads asked for by SIGHUP, by result: applied (the keys in the file put in place) or refused (the file did not load, or its keys could not be put in place; nothing changed).",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [("applied", applied), ("refused", refused)] {
            ConstCounter::new(n).encode(family.encode_family(&[("result", result)])?)?;
        }
        gauge(&mut e, "config_last_reload_successful", "1 when the last configuration reload was applied (or none was asked for since start), 0 when it was refused.", u64::from(last_ok))?;
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

/// What the operator's listener reads from the running proxy (implemented by `proxy::Proxy`):
/// telemetry reads this, never the proxy itself.
pub trait Observed: Send + Sync + 'static {
    /// The counters at this instant.
    fn scrape(&self) -> Scrape;
    /// One read of the session store, for `/readyz`; the error says why it failed.
    fn ping_store(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send + '_>>;
}

/// The OpenMetrics text of `source`'s metrics, every name prefixed `tessera_`.
pub fn render(source: &dyn Observed) -> String {
    let mut registry = prometheus_client::registry::Registry::with_prefix("tessera");
    registry.register_collector(Box::new(source.scrape()));
    let mut text = String::with_capacity(2048);
    // Encoding into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text
}

/// `Content-Type` of [`render`]'s text (OpenMetrics 1.0, which Prometheus negotiates).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Answers one request of the operator's listener: `/metrics`, and the probes `/healthz`
/// (live: 200 while the process's main runtime answers) and `/readyz` (see `readiness`).
async fn answer(
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
    /// Shutdown has begun: the listener is closed, busy connections drain.
    Draining,
}

/// Whether this instance should get traffic: 200 while `Serving` and the session store answers
/// a read within `timeout` (`session.timeout_ms`); else 503 with the reason (starting, shutting
/// down, or the store: every cold session would get 503).
async fn readiness(
    proxy: &dyn Observed,
    phase: Phase,
    timeout: Duration,
) -> (StatusCode, &'static [u8]) {
    match phase {
        Phase::Starting => return (StatusCode::SERVICE_UNAVAILABLE, b"starting\n"),
        Phase::Draining => return (StatusCode::SERVICE_UNAVAILABLE, b"shutting down\n"),
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
                        crate::upstream::set_serving_thread(i);
                    }
                    let ms = Duration::from_millis(1);
                    for _ in 0..1000 {
                        counts.record(200, ms);
                    }
                    counts.record(599, ms);
                    counts.record(999, ms);
                    counts.record(100, ms);
                    counts.record(99, ms);
                    counts.record(1000, ms);
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        counts.record(401, Duration::from_micros(40));
        let snapshot = counts.snapshot();
        assert_eq!(
            snapshot.statuses,
            vec![(100, 4), (200, 4000), (401, 1), (599, 4), (999, 4)]
        );
        // Every request, status counted or not, is in the histogram: 4 x 1005 of 1 ms (bound
        // 1,000 µs, index 4, inclusive) and one of 40 µs (the first bucket).
        let mut durations = [0; BUCKETS];
        durations[4] = 4020;
        durations[0] = 1;
        assert_eq!(snapshot.durations, durations);
        assert_eq!(snapshot.duration_sum_us, 4020 * 1000 + 40);
        // Each serving thread wrote its own row; a thread numbered beyond them (2) and an
        // unmarked one the last.
        let row =
            |r: usize, status: usize| counts.rows[r].statuses[status - 100].load(Ordering::Relaxed);
        assert_eq!((row(0, 200), row(1, 200), row(2, 200)), (1000, 1000, 2000));
    }

    #[test]
    fn durations_fall_in_the_first_bucket_whose_bound_they_do_not_exceed() {
        let counts = RequestCounts::new(1);
        for us in [0, 50, 51, 10_000_000, 10_000_001] {
            counts.record(200, Duration::from_micros(us));
        }
        counts.record(200, Duration::MAX);
        let d = counts.snapshot().durations;
        assert_eq!((d[0], d[1], d[BUCKETS - 2], d[BUCKETS - 1]), (2, 1, 1, 2));
        assert_eq!(d.iter().sum::<u64>(), 6);
    }

    #[test]
    fn the_histogram_is_cumulative_in_seconds_and_closes_and_reloads_are_counted() {
        let counts = RequestCounts::new(1);
        counts.record(200, Duration::from_micros(40));
        counts.record(200, Duration::from_micros(300));
        counts.record(502, Duration::from_secs(20));
        let scrape = Scrape {
            requests: Some(counts.snapshot()),
            upstream_opened: 0,
            upstream_reused: 0,
            upstream_retried: 0,
            upstream_moved: 0,
            upstream_handed_over: 0,
            upstream_wait_expired: 0,
            upstream_drained: 0,
            upstream_drain_failed: 0,
            upstream_closed: [0, 0, 0, 3, 0, 1],
            upstream_open: (0, 0),
            store_reads: 0,
            session_cache: None,
            token_cache: None,
            streams: None,
            websockets: None,
            busy_poll: Default::default(),
            reloads: (2, 1, false),
        };
        let mut registry = prometheus_client::registry::Registry::with_prefix("tessera");
        registry.register_collector(Box::new(scrape));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "# TYPE tessera_request_duration_seconds histogram",
            "tessera_request_duration_seconds_bucket{le=\"0.00005\"} 1",
            "tessera_request_duration_seconds_bucket{le=\"0.00025\"} 1",
            "tessera_request_duration_seconds_bucket{le=\"0.0005\"} 2",
            "tessera_request_duration_seconds_bucket{le=\"10.0\"} 2",
            "tessera_request_duration_seconds_bucket{le=\"+Inf\"} 3",
            "tessera_request_duration_seconds_count 3",
            "tessera_request_duration_seconds_sum 20.00034",
            "tessera_requests_total{code=\"502\"} 1",
            "# TYPE tessera_upstream_connections_closed counter",
            "tessera_upstream_connections_closed_total{reason=\"upstream\"} 0",
            "tessera_upstream_connections_closed_total{reason=\"abandoned\"} 3",
            "tessera_upstream_connections_closed_total{reason=\"tunnel\"} 1",
            "tessera_config_reloads_total{result=\"applied\"} 2",
            "tessera_config_reloads_total{result=\"refused\"} 1",
            "tessera_config_last_reload_successful 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} not in:\n{text}");
        }
    }
}
