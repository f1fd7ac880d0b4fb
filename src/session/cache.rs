//! The local session cache: sid -> ready upstream credential header, so a warm request touches no
//! store and runs no AES.
//!
//! Bounded by entries (`session.cache_max_entries`) and by bytes (`session.cache_max_bytes`,
//! counted by [`entry_bytes`]); each entry expires at the earliest of `session.cache_ttl_seconds`
//! and the session's own expiry; unknown sids are remembered for `session.negative_cache_ms` so a
//! flood of random sids cannot hammer the store. Concurrent misses of one sid share one store
//! read (quick_cache's placeholder guard), and a store failure is handed to every request that
//! waited on that read instead of each retrying in turn.
//!
//! Entries are evicted by the store's invalidation stream ([`super::store::Store::watch`]): a
//! write or delete of a session on any instance evicts it here; when that stream is lost the whole
//! cache is flushed (correctness first).
//! Must never: cache a store failure, or keep an entry that a concurrent invalidation raced.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quick_cache::sync::Cache;

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

/// One cached answer and the instant it stops being served.
#[derive(Clone)]
struct Entry {
    cached: Cached,
    until: Instant,
}

/// Fixed bytes counted per entry on top of its variable parts: the cache slot (with the slab's
/// growth slack), the hash index, the `Arc<str>` and `Arc<Session>` allocations and allocator
/// rounding. Chosen so the count matches RSS: 100,000 cached sessions measured 34.4 MiB over the
/// empty process (about 0.35 KiB each; `SECTIONS=memory bench/suite.sh`, BENCHMARKS.md).
const ENTRY_OVERHEAD: u64 = 288;

/// Bytes an entry is counted as: [`ENTRY_OVERHEAD`] + sid + credential header + user name.
fn entry_bytes(sid: &str, cached: &Cached) -> u64 {
    let variable = sid.len()
        + match cached {
            Cached::Found(s) => s.authorization.len() + s.sub.as_ref().map_or(0, String::len),
            Cached::Unknown | Cached::Corrupt(_) => 0,
        };
    ENTRY_OVERHEAD + variable as u64
}

/// Weighs an entry as its bytes, but never less than `max_bytes / max_entries`: a cache of total
/// weight `max_bytes` then holds at most `max_entries` entries and at most `max_bytes` bytes.
#[derive(Clone)]
struct Weigh {
    floor: u64,
}

impl quick_cache::Weighter<Arc<str>, Entry> for Weigh {
    fn weight(&self, sid: &Arc<str>, e: &Entry) -> u64 {
        entry_bytes(sid, &e.cached).max(self.floor)
    }
}

/// Cache settings (`[session]` keys).
#[derive(Debug, Clone, Copy)]
pub struct CacheConfig {
    /// Most entries kept (positive and negative). 0 disables the cache.
    pub max_entries: u64,
    /// Most bytes kept, as counted by [`entry_bytes`] (about 0.35 KiB per session, close to the
    /// RSS it costs). Must be > 0 when the cache is on.
    pub max_bytes: u64,
    /// Longest life of a positive entry.
    pub ttl: Duration,
    /// Life of a negative entry (unknown sid).
    pub negative_ttl: Duration,
}

/// The cache, shared by every request of one process.
pub(super) struct SessionCache {
    entries: Cache<Arc<str>, Entry, Weigh>,
    ttl: Duration,
    negative_ttl: Duration,
    /// Bumped by every invalidation; a load that saw it change may have read a stale value.
    epoch: AtomicU64,
    /// Bumped by every failed store read; a request that waited on a read which then failed
    /// answers with that failure instead of reading again.
    failures: AtomicU64,
    /// The newest store failure (shared with the requests that waited on it).
    last_failure: Mutex<Option<StoreError>>,
    /// Store reads done on behalf of the cache (misses), for tests and benchmarks.
    loads: AtomicU64,
    /// The invalidation stream is live; while false the cache is bypassed.
    live: AtomicBool,
}

impl SessionCache {
    /// An empty cache; `cfg.max_entries` and `cfg.max_bytes` must be > 0.
    pub(super) fn new(cfg: CacheConfig) -> Self {
        let max_entries = cfg.max_entries.max(1);
        let max_bytes = cfg.max_bytes.max(1);
        let floor = max_bytes.div_ceil(max_entries).max(1);
        Self {
            entries: Cache::with_weighter(
                usize::try_from(max_entries).unwrap_or(usize::MAX),
                max_bytes,
                Weigh { floor },
            ),
            ttl: cfg.ttl,
            negative_ttl: cfg.negative_ttl,
            epoch: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            last_failure: Mutex::new(None),
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

    /// How long `cached` may be served from now.
    fn life(&self, cached: &Cached) -> Duration {
        match cached {
            Cached::Found(s) => match s.expires_at {
                Some(at) => self
                    .ttl
                    .min(Duration::from_secs(at.saturating_sub(unix_now()))),
                None => self.ttl,
            },
            Cached::Unknown | Cached::Corrupt(_) => self.negative_ttl,
        }
    }

    /// The cached answer for `sid`, or `load`'s, shared by every concurrent caller.
    ///
    /// Errors: the store failure `load` returned (never cached), also returned to the callers
    /// that were waiting for that same load.
    pub(super) async fn get_or_load<F>(&self, sid: &str, load: F) -> Result<Cached, StoreError>
    where
        F: std::future::Future<Output = Result<Session, ResolveError>>,
    {
        if let Some(hit) = self.entries.get(sid) {
            let now = Instant::now();
            if hit.until > now {
                return Ok(hit.cached);
            }
            self.entries.remove_if(sid, |e| e.until <= now);
        }
        let failures = self.failures.load(Ordering::Acquire);
        let key: Arc<str> = Arc::from(sid);
        let guard = match self.entries.get_value_or_guard_async(&key).await {
            // filled by the request that did the read: true when read, like that request's answer
            Ok(filled) => return Ok(filled.cached),
            Err(guard) => guard,
        };
        if self.failures.load(Ordering::Acquire) != failures {
            // The read this request waited on failed (the guard came to us because its holder
            // gave up): answer with that failure rather than queueing one more read per waiter.
            let shared = self.last_failure.lock().expect("not poisoned").clone();
            if let Some(e) = shared {
                return Err(e);
            }
        }
        let before = self.epoch.load(Ordering::Acquire);
        self.loads.fetch_add(1, Ordering::Relaxed);
        let cached = match load.await {
            Ok(s) => Cached::Found(Arc::new(s)),
            Err(ResolveError::Unknown) => Cached::Unknown,
            Err(ResolveError::Corrupt(why)) => Cached::Corrupt(why),
            Err(ResolveError::Store(e)) => {
                *self.last_failure.lock().expect("not poisoned") = Some(e.clone());
                self.failures.fetch_add(1, Ordering::AcqRel);
                return Err(e); // the guard drops uninserted: nothing is cached
            }
        };
        let until = Instant::now() + self.life(&cached);
        let _ = guard.insert(Entry {
            cached: cached.clone(),
            until,
        });
        if self.epoch.load(Ordering::Acquire) != before {
            // An invalidation arrived while the store was read: the answer is good for this
            // request (it was true when read) but must not be served to the next one.
            self.entries.remove(sid);
        }
        Ok(cached)
    }

    /// Evicts `sid` (a local write, or the store said it changed).
    pub(super) fn invalidate(&self, sid: &str) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.entries.remove(sid);
    }

    /// Drops every entry (the invalidation stream was lost or the store was flushed).
    pub(super) fn flush(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.entries.clear();
    }

    /// Store reads done for cache misses since start.
    pub(super) fn loads(&self) -> u64 {
        self.loads.load(Ordering::Relaxed)
    }

    /// Entries held now (tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn cache(max_entries: u64, max_bytes: u64) -> Arc<SessionCache> {
        let c = SessionCache::new(CacheConfig {
            max_entries,
            max_bytes,
            ttl: Duration::from_secs(60),
            negative_ttl: Duration::from_millis(200),
        });
        c.set_live(true);
        Arc::new(c)
    }

    fn session(user: &str) -> Session {
        Session {
            sub: Some(user.to_owned()),
            authorization: HeaderValue::from_static("Basic YWxpY2U6cHc="),
            expires_at: None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_read_is_shared_with_its_waiters_and_not_cached() {
        let c = cache(1000, 1 << 20);
        let tasks: Vec<_> = (0..100)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move {
                    c.get_or_load("sid", async {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        Err(ResolveError::Store(StoreError("down".into())))
                    })
                    .await
                    .map(|_| ())
                })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap_err().0, "down");
        }
        // Without sharing, 100 waiters would each have read in turn (10 s here).
        assert!(c.loads() <= 3, "{} store reads for one failure", c.loads());
        // Nothing was cached: the next request reads again and gets the session.
        let before = c.loads();
        let got = c.get_or_load("sid", async { Ok(session("alice")) }).await;
        assert!(matches!(got, Ok(Cached::Found(_))));
        assert_eq!(c.loads(), before + 1);
    }

    #[tokio::test]
    async fn negative_entries_expire() {
        let c = cache(1000, 1 << 20);
        let unknown = || async { Err(ResolveError::Unknown) };
        assert!(matches!(
            c.get_or_load("x", unknown()).await,
            Ok(Cached::Unknown)
        ));
        assert!(matches!(
            c.get_or_load("x", unknown()).await,
            Ok(Cached::Unknown)
        ));
        assert_eq!(c.loads(), 1, "remembered");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let found = c.get_or_load("x", async { Ok(session("bob")) }).await;
        assert!(
            matches!(found, Ok(Cached::Found(_))),
            "negative entry outlived its 200 ms"
        );
        assert_eq!(c.loads(), 2);
    }

    #[tokio::test]
    async fn bounded_by_entries_and_by_bytes() {
        // entries bind: 100 entries of about 0.35 KiB under a 1 MiB byte bound
        let c = cache(100, 1 << 20);
        for i in 0..1000 {
            let sid = format!("sid-{i:04}");
            c.get_or_load(&sid, async { Ok(session("alice")) })
                .await
                .unwrap();
        }
        assert!(
            c.len() <= 100 && c.len() >= 50,
            "{} entries, cap 100",
            c.len()
        );

        // bytes bind: 10,000 entries allowed, but 8 KiB hold only about 8 KiB / 0.35 KiB
        let c = cache(10_000, 8 * 1024);
        let per = entry_bytes("sid-0000", &Cached::Found(Arc::new(session("alice"))));
        for i in 0..1000 {
            let sid = format!("sid-{i:04}");
            c.get_or_load(&sid, async { Ok(session("alice")) })
                .await
                .unwrap();
        }
        let held = c.len() as u64;
        assert!(
            held * per <= 8 * 1024,
            "{held} entries of {per} bytes over 8 KiB"
        );
        assert!(held >= 8 * 1024 / per / 2, "only {held} entries held");
    }
}
