//! The proxy as the operator's listener sees it ([`Observed`]): its counters read at a scrape,
//! and a store ping for `/readyz`. Must never: take a lock a request holds, or name a session.

use std::sync::atomic::Ordering;

use crate::telemetry::{Observed, RequestCounts, Scrape};
use crate::upstream::Closed;

use super::Proxy;

impl Observed for Proxy {
    fn scrape(&self) -> Scrape {
        let proxy = self;
        let pool = proxy.upstream().stats();
        let sessions = proxy.sessions();
        Scrape {
            requests: proxy.request_counts().map(RequestCounts::snapshot),
            upstream_opened: pool.opened.load(Ordering::Relaxed),
            upstream_reused: pool.reused.load(Ordering::Relaxed),
            upstream_retried: pool.retried.load(Ordering::Relaxed),
            upstream_moved: pool.moved.load(Ordering::Relaxed),
            upstream_handed_over: pool.handed_over.load(Ordering::Relaxed),
            upstream_wait_expired: pool.wait_expired.load(Ordering::Relaxed),
            upstream_share_waits: proxy.upstream().share_waits(),
            upstream_drained: pool.drained.load(Ordering::Relaxed),
            upstream_drain_failed: pool.drain_failed.load(Ordering::Relaxed),
            upstream_closed: Closed::ALL.map(|reason| pool.closed(reason)),
            upstream_open: proxy.upstream().connections(),
            upstream_tls: proxy.upstream().tls_handshakes(),
            store_reads: sessions.store_reads(),
            session_cache: sessions.cache_entries().map(|n| (n, sessions.cache_live())),
            token_cache: proxy.verifier().cache_entries(),
            streams: sessions.streams(),
            websockets: proxy.websockets(),
            busy_poll: crate::busy_poll::stats(),
            reloads: proxy.reload_counts().snapshot(),
            quic: proxy.quic_counts().map(|q| q.snapshot()),
            tls: proxy.tls_counts().map(|t| t.snapshot()),
            over_ip_limit: proxy.per_ip_refused(),
            client_connections: proxy
                .client_connections()
                .map(|c| (c.in_use() as u64, c.waits())),
        }
    }

    fn ping_store(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send + '_>> {
        Box::pin(async move {
            self.sessions()
                .store()
                .ping()
                .await
                .map_err(|e| e.to_string())
        })
    }
}
