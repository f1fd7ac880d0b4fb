//! The local session cache: sid -> ready upstream credential header, so a warm request touches no
//! store and runs no AES.
//!
//! Bounded by entries (`session.cache_max_entries`) and by bytes (`session.cache_max_bytes`,
//! counted by [`entry_bytes`]); each entry expires at the earliest of `session.cache_ttl_seconds`
//! and the session's own expiry; unknown sids are remembered for `session.negative_cache_ms` so a
//! flood of random sids cannot hammer the store. Concurrent misses of one sid share one store
//! read (quick_cache's placeholder guard), and that read's store failure is handed to every
//! request that waited on it instead of each retrying in turn.
//!
//! Entries are evicted by the store's invalidation stream ([`super::store::Store::watch`]): a
//! write or delete of a session on any instance evicts it here; when that stream is lost the whole
//! cache is flushed (correctness first).
//! Must never: cache a store failure, or keep an entry that a concurrent invalidation raced.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
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
///
/// `Err` is a failed store read handed to the requests waiting on it: it is put through the
/// placeholder already expired and removed at once, so no later request is answered with it.
#[derive(Clone)]
struct Entry {
    cached: Result<Cached, StoreError>,
    until: Instant,
}

/// Longest life of any entry: keeps `Instant` arithmetic far from overflow whatever the config.
const MAX_LIFE: Duration = Duration::from_secs(365 * 24 * 3600);

/// Least bytes and entries per shard: quick_cache splits both bounds evenly over its shards and
/// refuses an entry heavier than 97% of one shard's share, so shards must not be too small.
const SHARD_MIN_BYTES: u64 = 64 << 10;
const SHARD_MIN_ENTRIES: u64 = 64;

/// Fixed bytes counted per entry on top of its variable parts: the cache slot (with the slab's
/// growth slack), the hash index, the sid's `Arc<str>` (shared with the verified-token cache when
/// that is on) and the `Arc<Session>` allocations and allocator rounding. Chosen so the count matches RSS: 100,000 cached sessions measured 34.4 MiB over the
/// empty process (about 0.35 KiB each; `SECTIONS=memory bench/suite.sh`, docs/benchmarks.md).
const ENTRY_OVERHEAD: u64 = 288;

/// Bytes an entry is counted as: [`ENTRY_OVERHEAD`] + sid + credential header + user name.
fn entry_bytes(sid: &str, cached: &Result<Cached, StoreError>) -> u64 {
    let variable = sid.len()
        + match cached {
            Ok(Cached::Found(s)) => s.authorization.len() + s.sub.as_ref().map_or(0, String::len),
            Ok(Cached::Unknown | Cached::Corrupt(_)) | Err(_) => 0,
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
    /// Most bytes kept. An entry counts as the larger of its size (about 0.35 KiB per session,
    /// close to the RSS it costs) and `max_bytes / max_entries`, so both bounds hold. Should be
    /// at least 64 KiB when the cache is on (config validation).
    pub max_bytes: u64,
    /// Longest life of a positive entry.
    pub ttl: Duration,
    /// Life of a negative entry (unknown sid).
    pub negative_ttl: Duration,
}

/// Buckets of [`SessionCache::epochs`].
const EPOCH_BUCKETS: usize = 1024;

/// `sid`'s bucket of [`SessionCache::epochs`].
fn bucket(sid: &str) -> usize {
    (spread(sid) % EPOCH_BUCKETS as u64) as usize
}

/// A hash of `sid` to pick its bucket by (FNV-1a: every byte counts, so sids of other formats
/// than tessera's random ones, hex UUIDs, spread too). Not keyed: a client choosing sids that
/// share a bucket only costs itself spare store reads.
pub(super) fn spread(sid: &str) -> u64 {
    sid.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The cache, shared by every request of one process.
pub(super) struct SessionCache {
    entries: Cache<Arc<str>, Entry, Weigh>,
    ttl: Duration,
    negative_ttl: Duration,
    /// Bumped by every invalidation of a sid of the bucket ([`bucket`]); a load that saw its
    /// sid's change may have read a stale value. Per bucket, not one for all: with one, any
    /// write anywhere (a shared Redis database's other keys, in the hyper-auth-proxy format)
    /// during a store read threw the read's answer away, and warm requests kept reading.
    epochs: Box<[AtomicU64]>,
    /// Bumped by every flush: every load in progress may have read a stale value.
    flushes: AtomicU64,
    /// Store reads done on behalf of the cache (misses), for tests and benchmarks.
    loads: AtomicU64,
    /// The invalidation stream is live; while false the cache is bypassed.
    live: AtomicBool,
}

impl SessionCache {
    /// An empty cache. A bound below 2 entries is raised to 2 (one entry weighing the whole
    /// capacity would never be admitted).
    pub(super) fn new(cfg: CacheConfig) -> Self {
        let max_entries = cfg.max_entries.max(2);
        let max_bytes = cfg.max_bytes.max(1);
        let floor = max_bytes.div_ceil(max_entries).max(1);
        let cores = std::thread::available_parallelism().map_or(1, usize::from) as u64;
        let shards = (cores * 4)
            .min(max_entries / SHARD_MIN_ENTRIES)
            .min(max_bytes / SHARD_MIN_BYTES)
            .max(1);
        let options = quick_cache::OptionsBuilder::new()
            .shards(usize::try_from(shards).unwrap_or(1))
            .estimated_items_capacity(usize::try_from(max_entries).unwrap_or(usize::MAX))
            .weight_capacity(max_bytes)
            .build()
            .expect("capacities are set");
        Self {
            entries: Cache::with_options(
                options,
                Weigh { floor },
                quick_cache::DefaultHashBuilder::default(),
                quick_cache::sync::DefaultLifecycle::default(),
            ),
            ttl: cfg.ttl.min(MAX_LIFE),
            negative_ttl: cfg.negative_ttl.min(MAX_LIFE),
            epochs: (0..EPOCH_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            flushes: AtomicU64::new(0),
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

    /// The cached answer for `sid` if there is one still within its lifetime (an expired one is
    /// dropped). Synchronous, so a hit builds no store-read future (measured: moving that future
    /// into `get_or_load` was 2% of the CPU of a warm request).
    ///
    /// A session is never served at or past its `expires_at` by the wall clock, whatever its
    /// entry's monotonic deadline says: that deadline was rounded to whole seconds, and the
    /// monotonic clock stands still while the machine sleeps and ignores a step of the wall
    /// clock, where the store's check and the open responses' cut read the wall clock.
    pub(super) fn get_fresh(&self, sid: &str) -> Option<Cached> {
        let hit = self.entries.get(sid)?;
        let now = Instant::now();
        let over = |e: &Entry| match &e.cached {
            Ok(Cached::Found(s)) => s.expires_at.is_some_and(|at| at <= unix_now()),
            Ok(_) => false,
            Err(_) => true,
        };
        if hit.until > now && !over(&hit) {
            if let Ok(cached) = hit.cached {
                return Some(cached);
            }
        }
        self.entries.remove_if(sid, |e| e.until <= now || over(e));
        None
    }

    /// The cached answer for `sid`, or `load`'s, shared by every concurrent caller.
    ///
    /// Errors: the store failure `load` returned (never cached), also returned to the callers
    /// that were waiting for that same load.
    /// The entry is keyed by `sid` itself (shared with the verified-token cache's entry, not a
    /// copy: about 48 bytes less per cached session).
    pub(super) async fn get_or_load<F>(&self, sid: &Arc<str>, load: F) -> Result<Cached, StoreError>
    where
        F: std::future::Future<Output = Result<Session, ResolveError>>,
    {
        if let Some(hit) = self.get_fresh(sid) {
            return Ok(hit);
        }
        let guard = match self.entries.get_value_or_guard_async(sid).await {
            // Filled by the request that did the read: its answer (true when read) or its
            // store failure, shared rather than read again by each waiter in turn.
            Ok(filled) => return filled.cached,
            Err(guard) => guard,
        };
        let before = self.changes(sid);
        self.loads.fetch_add(1, Ordering::Relaxed);
        let cached = match load.await {
            Ok(s) => Ok(Cached::Found(Arc::new(s))),
            Err(ResolveError::Unknown) => Ok(Cached::Unknown),
            Err(ResolveError::Corrupt(why)) => Ok(Cached::Corrupt(why)),
            Err(ResolveError::Store(e)) => Err(e),
        };
        if cached.is_ok() && self.changes(sid) != before {
            // An invalidation (of this sid, or another of its bucket) or a flush arrived while
            // the store was read: the answer is good for this request (it was true when read),
            // but neither kept nor handed to the requests waiting on it, which may have come
            // after a logout. The guard dropped unfilled, the next of them reads again.
            drop(guard);
            return cached;
        }
        let now = Instant::now();
        let until = match &cached {
            Ok(c) => now + self.life(c),
            Err(_) => now, // handed to the waiters, never served from the cache
        };
        let _ = guard.insert(Entry {
            cached: cached.clone(),
            until,
        });
        if cached.is_err() || self.changes(sid) != before {
            // A failure is not kept; nor an answer an invalidation overtook since the check
            // above.
            self.entries.remove(&**sid);
        }
        cached
    }

    /// Evicts `sid` (a local write, or the store said it changed).
    pub(super) fn invalidate(&self, sid: &str) {
        self.epochs[bucket(sid)].fetch_add(1, Ordering::AcqRel);
        self.entries.remove(sid);
    }

    /// The flushes and the invalidations of `sid`'s bucket so far.
    fn changes(&self, sid: &str) -> (u64, u64) {
        let flushes = self.flushes.load(Ordering::Acquire);
        (flushes, self.epochs[bucket(sid)].load(Ordering::Acquire))
    }

    /// Drops every entry (the invalidation stream was lost or the store was flushed).
    pub(super) fn flush(&self) {
        self.flushes.fetch_add(1, Ordering::AcqRel);
        self.entries.clear();
    }

    /// Store reads done for cache misses since start.
    pub(super) fn loads(&self) -> u64 {
        self.loads.load(Ordering::Relaxed)
    }

    /// Entries held now, found and unknown (negative) sids alike.
    pub(super) fn len(&self) -> usize {
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
            read_epoch: 0,
            upstream_share: Default::default(),
            sub: Some(user.to_owned()),
            authorization: HeaderValue::from_static("Basic YWxpY2U6cHc="),
            expires_at: None,
        }
    }

    /// A request that joins a read under way after the sid was invalidated (a logout landed
    /// while the store was read) does not get that read's answer: it reads again.
    #[tokio::test]
    async fn a_read_overtaken_by_an_invalidation_is_not_handed_to_its_waiters() {
        let c = cache(1000, 1 << 20);
        let sid: Arc<str> = "sid".into();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let leader = tokio::spawn({
            let (c, sid) = (c.clone(), sid.clone());
            async move {
                c.get_or_load(&sid, async {
                    let _ = released.await;
                    Ok(session("alice"))
                })
                .await
            }
        });
        tokio::task::yield_now().await; // the leader reads
        c.invalidate(&sid); // the logout
        let waiter = tokio::spawn({
            let (c, sid) = (c.clone(), sid.clone());
            async move {
                c.get_or_load(&sid, async { Err(ResolveError::Unknown) })
                    .await
            }
        });
        tokio::task::yield_now().await; // the waiter joins the read
        release.send(()).unwrap();
        assert!(matches!(leader.await.unwrap(), Ok(Cached::Found(_))));
        assert!(
            matches!(waiter.await.unwrap(), Ok(Cached::Unknown)),
            "the waiter got the overtaken read"
        );
        assert!(c
            .get_fresh(&sid)
            .is_some_and(|h| matches!(h, Cached::Unknown)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_read_is_shared_with_its_waiters_and_not_cached() {
        let c = cache(1000, 1 << 20);
        let tasks: Vec<_> = (0..100)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move {
                    c.get_or_load(&"sid".into(), async {
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
        let got = c
            .get_or_load(&"sid".into(), async { Ok(session("alice")) })
            .await;
        assert!(matches!(got, Ok(Cached::Found(_))));
        assert_eq!(c.loads(), before + 1);
    }

    #[test]
    fn a_session_past_its_expiry_is_not_served_whatever_its_deadline() {
        let c = cache(1000, 1 << 20);
        let until = Instant::now() + Duration::from_secs(60);
        let put = |sid: &str, expires_at| {
            let s = Session {
                expires_at,
                ..session("alice")
            };
            let cached = Ok(Cached::Found(Arc::new(s)));
            c.entries.insert(sid.into(), Entry { cached, until });
        };
        // As after a step of the wall clock, or a sleep of the machine, once the entry was made.
        put("past", Some(unix_now() - 1));
        put("now", Some(unix_now()));
        put("later", Some(unix_now() + 30));
        put("never", None);
        assert!(c.get_fresh("past").is_none());
        assert!(c.get_fresh("now").is_none());
        assert!(c.get_fresh("later").is_some());
        assert!(c.get_fresh("never").is_some());
        // The expired entry is gone, not kept for the next read to find.
        assert!(c.entries.get("past").is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_sids_failure_is_not_another_sids_answer() {
        let c = cache(1000, 1 << 20);
        // A read of "good" that never ends (its client will go away) ...
        let c1 = c.clone();
        let stuck = tokio::spawn(async move {
            let _ = c1
                .get_or_load(&"good".into(), std::future::pending::<Result<Session, _>>())
                .await;
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        // ... with requests for "good" waiting on it,
        let waiters: Vec<_> = (0..10)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move {
                    c.get_or_load(&"good".into(), async { Ok(session("alice")) })
                        .await
                        .is_ok()
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(20)).await;
        // while a read of "bad" fails.
        let bad = c
            .get_or_load(&"bad".into(), async {
                Err(ResolveError::Store(StoreError("down".into())))
            })
            .await;
        assert!(bad.is_err());
        // The stuck read is cancelled: a waiter takes over and reads "good" itself.
        stuck.abort();
        for w in waiters {
            assert!(w.await.unwrap(), "a waiter for good got bad's failure");
        }
    }

    #[tokio::test]
    async fn an_invalidation_during_a_read_is_not_kept() {
        let c = cache(1000, 1 << 20);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let c2 = c.clone();
        let read = tokio::spawn(async move {
            c2.get_or_load(&"sid".into(), async move {
                let _ = rx.await; // the store answers after the invalidation below
                Ok(session("old"))
            })
            .await
            .map(|_| ())
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        c.invalidate("sid"); // e.g. a DEL seen on the tracking connection meanwhile
        tx.send(()).unwrap();
        read.await.unwrap().unwrap();
        // The read's answer was not kept: the next request reads the store again.
        let again = c
            .get_or_load(&"sid".into(), async { Err(ResolveError::Unknown) })
            .await;
        assert!(matches!(again, Ok(Cached::Unknown)));
        assert_eq!(c.loads(), 2);
    }

    /// An invalidation of another sid's bucket during a read leaves the read's answer cached:
    /// the next request is served without a store read.
    #[tokio::test]
    async fn an_invalidation_of_another_sid_during_a_read_keeps_it() {
        let c = cache(1000, 1 << 20);
        assert_ne!(bucket("sid"), bucket("other"));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let c2 = c.clone();
        let read = tokio::spawn(async move {
            c2.get_or_load(&"sid".into(), async move {
                let _ = rx.await;
                Ok(session("old"))
            })
            .await
            .map(|_| ())
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        c.invalidate("other");
        tx.send(()).unwrap();
        read.await.unwrap().unwrap();
        let again = c
            .get_or_load(&"sid".into(), async { Err(ResolveError::Unknown) })
            .await;
        assert!(matches!(again, Ok(Cached::Found(_))));
        assert_eq!(c.loads(), 1);
    }

    #[tokio::test]
    async fn huge_lifetimes_do_not_overflow() {
        let c = SessionCache::new(CacheConfig {
            max_entries: 1000,
            max_bytes: 1 << 20,
            ttl: Duration::MAX,
            negative_ttl: Duration::MAX,
        });
        c.set_live(true);
        assert!(c
            .get_or_load(&"a".into(), async { Ok(session("alice")) })
            .await
            .is_ok());
        assert!(c
            .get_or_load(&"b".into(), async { Err(ResolveError::Unknown) })
            .await
            .is_ok());
        assert_eq!(c.loads(), 2);
    }

    #[tokio::test]
    async fn negative_entries_expire() {
        let c = cache(1000, 1 << 20);
        let unknown = || async { Err(ResolveError::Unknown) };
        assert!(matches!(
            c.get_or_load(&"x".into(), unknown()).await,
            Ok(Cached::Unknown)
        ));
        assert!(matches!(
            c.get_or_load(&"x".into(), unknown()).await,
            Ok(Cached::Unknown)
        ));
        assert_eq!(c.loads(), 1, "remembered");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let found = c
            .get_or_load(&"x".into(), async { Ok(session("bob")) })
            .await;
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
            c.get_or_load(&sid.as_str().into(), async { Ok(session("alice")) })
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
        let per = entry_bytes("sid-0000", &Ok(Cached::Found(Arc::new(session("alice")))));
        for i in 0..1000 {
            let sid = format!("sid-{i:04}");
            c.get_or_load(&sid.as_str().into(), async { Ok(session("alice")) })
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
