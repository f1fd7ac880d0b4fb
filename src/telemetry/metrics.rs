//! The metrics as OpenMetrics text: one [`Scrape`] of the proxy's counters (read through
//! [`Observed`]), encoded by `prometheus-client`. No token, sid or user name appears in a metric.

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use super::counts::{RequestSnapshot, DURATION_BOUNDS_US};

use crate::upstream::Closed;

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
    /// Requests that waited because their user or HTTP/2 connection held its share of the pool.
    pub(crate) upstream_share_waits: u64,
    pub(crate) upstream_drained: u64,
    pub(crate) upstream_drain_failed: u64,
    /// Upstream connections closed, by reason (`Closed::ALL`'s order).
    pub(crate) upstream_closed: [u64; Closed::ALL.len()],
    /// TLS handshakes with an `https://` upstream, `(full, resumed)`.
    pub(crate) upstream_tls: Option<(u64, u64)>,
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
    /// Client connections: `(open now, accepts that waited for server.max_connections)`;
    /// `None` without a limit.
    pub(crate) client_connections: Option<(u64, u64)>,
    /// Configuration reloads: `(applied, refused, last one applied)`.
    pub(crate) reloads: (u64, u64, bool),
    /// QUIC handshakes: `(unvalidated now, retries, refused)`; `None` without `[http3]`.
    pub(crate) quic: Option<(u64, u64, u64)>,
    /// The TLS listener's handshakes and certificates; `None` without `[tls]`.
    pub(crate) tls: Option<super::TlsSnapshot>,
    /// Connections refused under `server.max_connections_per_ip`; `None` without it.
    pub(crate) over_ip_limit: Option<u64>,
}

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

/// A counter family of TLS handshakes by `kind`: `(full, resumed)`.
fn handshakes(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    (full, resumed): (u64, u64),
) -> std::fmt::Result {
    let mut family = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (kind, n) in [("full", full), ("resumed", resumed)] {
        ConstCounter::new(n).encode(family.encode_family(&[("kind", kind)])?)?;
    }
    Ok(())
}

/// The TLS listener's handshakes by outcome and its certificates' expiry.
fn encode_tls(e: &mut DescriptorEncoder, tls: &super::TlsSnapshot) -> std::fmt::Result {
    handshakes(
        e,
        "tls_handshakes",
        "TLS handshakes completed on the TLS listener: full, or resumed (a session ticket, shared by tls.session_ticket_keys or not, or a cached session).",
        tls.completed,
    )?;
    let (failed, timed_out, plain_http) = tls.failures;
    let mut family = e.encode_descriptor(
        "tls_handshake_failures",
        "Connections to the TLS listener that completed no handshake: error (an alert, a malformed record, the client gone), timeout (server.header_read_timeout_ms), plain_http (answered 400).",
        None,
        MetricType::Counter,
    )?;
    for (reason, n) in [
        ("error", failed),
        ("timeout", timed_out),
        ("plain_http", plain_http),
    ] {
        ConstCounter::new(n).encode(family.encode_family(&[("reason", reason)])?)?;
    }
    let mut family = e.encode_descriptor(
        "tls_certificate_expiration_timestamp_seconds",
        "The notAfter of each certificate in place on the TLS listener, seconds since the Unix epoch, by its config key.",
        None,
        MetricType::Gauge,
    )?;
    for (key, not_after) in &tls.certificates {
        ConstGauge::new(*not_after).encode(family.encode_family(&[("key", key.as_str())])?)?;
    }
    Ok(())
}

impl prometheus_client::collector::Collector for Scrape {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        self.encode_requests(&mut e)?;
        self.encode_upstream(&mut e)?;
        self.encode_sessions(&mut e)?;
        self.encode_runtime(&mut e)?;
        Ok(())
    }
}

impl Scrape {
    /// Requests by status, and their durations.
    fn encode_requests(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
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
        Ok(())
    }

    /// The upstream pool: connections opened, reused, moved, drained, closed by reason, open now.
    fn encode_upstream(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        counter(
            e,
            "upstream_connections_opened",
            "Connections opened to the upstream.",
            self.upstream_opened,
        )?;
        counter(
            e,
            "upstream_requests_reused",
            "Requests sent on an upstream connection that had served an earlier request.",
            self.upstream_reused,
        )?;
        counter(e, "upstream_retries", "Requests retried on a fresh upstream connection after a reused one failed before the request was sent.", self.upstream_retried)?;
        counter(
            e,
            "upstream_connections_moved",
            "Idle upstream connections moved to the serving thread that took them.",
            self.upstream_moved,
        )?;
        counter(e, "upstream_affinity_handovers", "With upstream.affinity = \"session\" at the connection cap: connections handed from a finished request straight to a waiting request of the same user.", self.upstream_handed_over)?;
        counter(e, "upstream_share_waits", "Requests that waited for a connection because their user (upstream credential) or HTTP/2 connection held upstream.max_connections_per_user.", self.upstream_share_waits)?;
        counter(e, "upstream_affinity_waits_expired", "With upstream.affinity = \"session\" at the connection cap: requests of a user already holding its share that got no connection of their own (the wait, upstream.affinity_wait_ms, ran out or is 0), so another user's idle connection, if one was still idle, was closed for a new one.", self.upstream_wait_expired)?;
        counter(e, "upstream_exchanges_drained", "Upstream exchanges whose client went away less than upstream.drain_wait_ms (default 250 ms) after the request was sent (before the response head, or with at most upstream.drain_max_bytes (default 64 KiB) or a chunked rest of the body left) that were read to their end in the background, their connection kept.", self.upstream_drained)?;
        counter(e, "upstream_exchanges_drain_failed", "Upstream exchanges whose client went away that were read in the background but could not be finished so (no response end within upstream.drain_wait_ms or upstream.drain_max_bytes, a response that ends its connection, an error, or the upstream closing): their connection was closed.", self.upstream_drain_failed)?;
        let mut family = e.encode_descriptor(
            "upstream_connections_closed",
            "Upstream connections closed, by reason: upstream (it said Connection: close, or closed or reset the connection), expired (idle past upstream.idle_timeout_ms or the upstream's Keep-Alive timeout), surplus (the longest idle while more than upstream.max_idle_connections were idle), unserved (new, and not answering the upstream.probe_timeout_ms probe), evicted (idle, closed to make room under upstream.max_connections for another user's connection with affinity, or an idle peer of a reused connection that failed, before the retry), abandoned (an exchange left before its end, by its client, an oversized request body, a timeout or its session's end, and not finished in the background), error (an I/O error, a malformed response, bytes after a response's end, a reset while a request was partly written), tunnel (a WebSocket tunnel ended).",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in Closed::ALL.iter().zip(self.upstream_closed) {
            ConstCounter::new(n).encode(family.encode_family(&[("reason", reason.label())])?)?;
        }
        if let Some(counts) = self.upstream_tls {
            handshakes(
                e,
                "upstream_tls_handshakes",
                "TLS handshakes with an https:// upstream: full, or resumed (a session ticket or id the upstream accepted).",
                counts,
            )?;
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
        Ok(())
    }

    /// The session cache, responses that end with their session, WebSocket tunnels.
    fn encode_sessions(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        counter(e, "session_store_reads", "Session records read from the store on the request path (cache fills, or every request while the cache is bypassed).", self.store_reads)?;
        if let Some((entries, live)) = self.session_cache {
            gauge(
                e,
                "session_cache_entries",
                "Sessions in the cache, found and unknown (negative) entries.",
                entries,
            )?;
            gauge(e, "session_cache_live", "1 while the store's invalidation channel is live and the cache is used; 0 while it is bypassed.", u64::from(live))?;
        }
        if let Some((open, ended)) = self.streams {
            gauge(e, "session_streams_open", "Responses open now whose body waited for the upstream (server-sent events, long downloads) and WebSocket connections: each ends when its session is revoked or expires.", open)?;
            counter(
                e,
                "session_streams_ended",
                "Open responses and WebSocket connections ended because their session was revoked or expired.",
                ended,
            )?;
        }
        if let Some((open, opened)) = self.websockets {
            gauge(e, "websockets_open", "WebSocket connections open now, handshakes being forwarded included (each open one holds one upstream connection, counted as busy).", open)?;
            counter(
                e,
                "websockets_opened",
                "WebSocket upgrades the upstream accepted (101) since start.",
                opened,
            )?;
        }
        Ok(())
    }

    /// Busy polling, configuration reloads, the verified-token cache.
    fn encode_runtime(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        if let Some((open, waits)) = self.client_connections {
            gauge(
                e,
                "client_connections",
                "Client connections open now (bounded by server.max_connections).",
                open,
            )?;
            counter(e, "client_connection_waits", "Times the accept loop waited because server.max_connections client connections were open.", waits)?;
        }
        if let Some(n) = self.over_ip_limit {
            counter(e, "client_connections_over_ip_limit", "Client connections closed (QUIC: refused) because their address held server.max_connections_per_ip.", n)?;
        }
        if let Some(tls) = &self.tls {
            encode_tls(e, tls)?;
        }
        if let Some((unvalidated, retries, refused)) = self.quic {
            gauge(e, "http3_unvalidated_handshakes", "QUIC handshakes in progress whose client has not proved it receives at its address (no Retry or NEW_TOKEN token).", unvalidated)?;
            counter(
                e,
                "http3_retries",
                "QUIC handshakes answered with a Retry (http3.retry; RFC 9000 section 8.1.2).",
                retries,
            )?;
            counter(e, "http3_refused", "QUIC connections refused because server.max_connections client connections were open.", refused)?;
        }
        let poll = self.busy_poll;
        counter(
            e,
            "busy_polls",
            "Busy polls run by serving threads before parking (server.busy_poll_us; 0 while off).",
            poll.polls,
        )?;
        counter(e, "busy_polls_answered", "Busy polls ended by a readable socket or a task woken from another thread (a sleep and wake-up saved).", poll.answered)?;
        counter(
            e,
            "busy_poll_backoffs",
            "Times a serving thread stopped polling for 20 ms because its CPU was contended.",
            poll.backoffs,
        )?;
        let (applied, refused, last_ok) = self.reloads;
        let mut family = e.encode_descriptor(
            "config_reloads",
            "Configuration reloads asked for by SIGHUP, by result: applied (the file's keys and TLS settings put in place) or refused (the file did not load, or its keys or certificates could not be put in place; nothing changed).",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [("applied", applied), ("refused", refused)] {
            ConstCounter::new(n).encode(family.encode_family(&[("result", result)])?)?;
        }
        gauge(e, "config_last_reload_successful", "1 when the last configuration reload was applied (or none was asked for since start), 0 when it was refused.", u64::from(last_ok))?;
        if let Some(entries) = self.token_cache {
            gauge(
                e,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::telemetry::RequestCounts;

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
            upstream_share_waits: 4,
            upstream_drained: 0,
            upstream_drain_failed: 0,
            upstream_closed: [0, 0, 2, 0, 0, 3, 0, 1],
            upstream_open: (0, 0),
            upstream_tls: Some((1, 2)),
            store_reads: 0,
            session_cache: None,
            token_cache: None,
            streams: None,
            websockets: None,
            busy_poll: Default::default(),
            reloads: (2, 1, false),
            client_connections: Some((3, 1)),
            quic: Some((5, 7, 2)),
            tls: Some(crate::telemetry::TlsSnapshot {
                completed: (6, 9),
                failures: (3, 2, 1),
                certificates: vec![("tls.sni[0].certificate".into(), 1_800_000_000)],
            }),
            over_ip_limit: Some(4),
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
            "tessera_upstream_connections_closed_total{reason=\"surplus\"} 2",
            "tessera_upstream_connections_closed_total{reason=\"abandoned\"} 3",
            "tessera_upstream_connections_closed_total{reason=\"tunnel\"} 1",
            "tessera_config_reloads_total{result=\"applied\"} 2",
            "tessera_upstream_share_waits_total 4",
            "tessera_tls_handshakes_total{kind=\"full\"} 6",
            "tessera_tls_handshakes_total{kind=\"resumed\"} 9",
            "tessera_tls_handshake_failures_total{reason=\"error\"} 3",
            "tessera_tls_handshake_failures_total{reason=\"timeout\"} 2",
            "tessera_tls_handshake_failures_total{reason=\"plain_http\"} 1",
            "tessera_tls_certificate_expiration_timestamp_seconds{key=\"tls.sni[0].certificate\"} 1800000000",
            "tessera_client_connections 3",
            "tessera_client_connection_waits_total 1",
            "tessera_config_reloads_total{result=\"refused\"} 1",
            "tessera_config_last_reload_successful 0",
            "tessera_http3_unvalidated_handshakes 5",
            "tessera_http3_retries_total 7",
            "tessera_http3_refused_total 2",
            "tessera_client_connections_over_ip_limit_total 4",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} not in:\n{text}");
        }
    }
}
