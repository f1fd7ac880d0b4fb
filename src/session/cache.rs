//! The local session cache: sid -> ready upstream credential header, so a warm request touches no
//! store and runs no AES.
//!
//! Bounded (entries), each entry expiring at the earliest of `session.cache_ttl_seconds` and the
//! session's own expiry; unknown sids are remembered for `session.negative_cache_ms` so a flood
//! of random sids cannot hammer the store; concurrent misses of one sid share one store read
//! (moka's `try_get_with`). Entries are evicted by the store's invalidation stream
//! ([`super::store::Store::watch`]): a write or delete of a session on any instance evicts it
//! here; when that stream is lost the whole cache is flushed (correctness first).
//! Must never: cache a store failure, or keep an entry that a concurrent invalidation raced.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::future::Cache;

use super::{ResolveError, Session, StoreError};
use crate::unix_now;

/// What the cache remembers about a sid.
#[derive(Clone)]
pub(super) enum Cached {
    /// A usable session.
    Found(Arc<Session>),
    /// No session (never created, revoked, expired): 401 without asking the store.
    Unknown,
    /// A record that cannot be used (the reason): 401 without asking the store.
    Corrupt(&'static str),
}

struct Expiry {
    ttl: Duration,
    negative_ttl: Duration,
}

impl moka::Expiry<Arc<str>, Cached> for Expiry {
    fn expire_after_create(&self, _: &Arc<str>, value: &Cached, _: Instant) -> Option<Duration> {
        Some(match value {
            Cached::Found(s) => match s.expires_at {
                Some(at) => self
                    .ttl
                    .min(Duration::from_secs(at.saturating_sub(unix_now()))),
                None => self.ttl,
            },
            Cached::Unknown | Cached::Corrupt(_) => self.negative_ttl,
        })
    }
}

/// Cache settings (`[session]` keys).
#[derive(Debug, Clone, Copy)]
pub struct CacheConfig {
    /// Most entries kept (positive and negative). 0 disables the cache.
    pub max_entries: u64,
    /// Longest life of a positive entry.
    pub ttl: Duration,
    /// Life of a negative entry (unknown sid).
    pub negative_ttl: Duration,
}

/// The cache, shared by every request of one process.
pub(super) struct SessionCache {
    entries: Cache<Arc<str>, Cached>,
    /// Bumped by every invalidation; a load that saw it change may have read a stale value.
    epoch: AtomicU64,
    /// Store reads done on behalf of the cache (misses), for tests and benchmarks.
    loads: AtomicU64,
    /// The invalidation stream is live; while false the cache is bypassed.
    live: AtomicBool,
}

impl SessionCache {
    pub(super) fn new(cfg: CacheConfig) -> Self {
        Self {
            entries: Cache::builder()
                .max_capacity(cfg.max_entries)
                .expire_after(Expiry {
                    ttl: cfg.ttl,
                    negative_ttl: cfg.negative_ttl,
                })
                .build(),
            epoch: AtomicU64::new(0),
            loads: AtomicU64::new(0),
            live: AtomicBool::new(false),
        }
    }

    pub(super) fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    pub(super) fn set_live(&self, live: bool) {
        self.live.store(live, Ordering::Release);
    }

    /// The cached answer for `sid`, or `load`'s, shared by every concurrent caller.
    ///
    /// Errors: the store failure `load` returned (never cached).
    pub(super) async fn get_or_load<F>(&self, sid: &str, load: F) -> Result<Cached, StoreError>
    where
        F: std::future::Future<Output = Result<Session, ResolveError>>,
    {
        if let Some(hit) = self.entries.get(sid).await {
            return Ok(hit);
        }
        let key: Arc<str> = Arc::from(sid);
        let before = self.epoch.load(Ordering::Acquire);
        let out = self
            .entries
            .try_get_with(key.clone(), async {
                self.loads.fetch_add(1, Ordering::Relaxed);
                match load.await {
                    Ok(s) => Ok(Cached::Found(Arc::new(s))),
                    Err(ResolveError::Unknown) => Ok(Cached::Unknown),
                    Err(ResolveError::Corrupt(why)) => Ok(Cached::Corrupt(why)),
                    Err(ResolveError::Store(e)) => Err(e),
                }
            })
            .await
            .map_err(|e| (*e).clone());
        if self.epoch.load(Ordering::Acquire) != before {
            // An invalidation arrived while the store was read: the answer is good for this
            // request (it was true when read) but must not be served to the next one.
            self.entries.invalidate(&key).await;
        }
        out
    }

    /// Evicts `sid` (a local write, or the store said it changed).
    pub(super) async fn invalidate(&self, sid: &str) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.entries.invalidate(sid).await;
    }

    /// Drops every entry (the invalidation stream was lost or the store was flushed).
    pub(super) fn flush(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.entries.invalidate_all();
    }

    /// Store reads done for cache misses since start.
    pub(super) fn loads(&self) -> u64 {
        self.loads.load(Ordering::Relaxed)
    }
}
