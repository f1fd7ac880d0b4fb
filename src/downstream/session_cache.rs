//! The server-side TLS session cache (TLS 1.2 session ids, TLS 1.3 stateful tickets, QUIC's
//! 0-RTT sessions): rustls's bounded memory cache with each entry aged out after
//! [`SESSION_LIFETIME`], as its tickets are. rustls checks no age on a cached session (TLS 1.2
//! advertises none), so without this an entry resumes until 20,000 newer ones push it out:
//! for days on a quiet server, its master secret kept in memory all that time.

use rustls::server::{ServerSessionMemoryCache, StoresServerSessions};
use std::sync::Arc;

/// How long a cached session resumes after it was stored, seconds: the lifetime of a ticket
/// (rustls's own keys rotate every 6 hours and open the last two periods' tickets; shared keys
/// give 12 hours too, [`super::tickets`]). nginx's `ssl_session_timeout` is the same knob.
const SESSION_LIFETIME: u64 = 12 * 60 * 60;

/// rustls's memory cache whose entries carry the second they were stored in their first 8
/// bytes (big-endian) and are refused, and dropped, once older than `lifetime`.
pub(super) struct AgingCache {
    inner: Arc<ServerSessionMemoryCache>,
    lifetime: u64,
    now: Box<dyn Fn() -> u64 + Send + Sync>,
}

impl std::fmt::Debug for AgingCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgingCache")
            .field("lifetime", &self.lifetime)
            .finish_non_exhaustive()
    }
}

impl AgingCache {
    /// A cache of at most `size` sessions, each good for [`SESSION_LIFETIME`] by the wall clock.
    pub(super) fn new(size: usize) -> Arc<Self> {
        Self::with_clock(size, SESSION_LIFETIME, crate::unix_now)
    }

    fn with_clock(
        size: usize,
        lifetime: u64,
        now: impl Fn() -> u64 + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            inner: ServerSessionMemoryCache::new(size),
            lifetime,
            now: Box::new(now),
        })
    }

    /// The session of a stored entry while it is young enough; `None` when it aged out (or is
    /// too short to be one of ours).
    fn fresh(&self, stored: Vec<u8>) -> Option<Vec<u8>> {
        let (at, session) = stored.split_at_checked(8)?;
        let at = u64::from_be_bytes(at.try_into().ok()?);
        // A clock set back counts as no time passed; one set forward ages entries early.
        ((self.now)().saturating_sub(at) < self.lifetime).then(|| session.to_vec())
    }
}

impl StoresServerSessions for AgingCache {
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        let mut stored = Vec::with_capacity(8 + value.len());
        stored.extend_from_slice(&(self.now)().to_be_bytes());
        stored.extend_from_slice(&value);
        self.inner.put(key, stored)
    }

    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        let stored = self.inner.get(key)?;
        let fresh = self.fresh(stored);
        if fresh.is_none() {
            self.inner.take(key);
        }
        fresh
    }

    fn take(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.fresh(self.inner.take(key)?)
    }

    fn can_cache(&self) -> bool {
        self.inner.can_cache()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn clocked() -> (Arc<AgingCache>, Arc<AtomicU64>) {
        let clock = Arc::new(AtomicU64::new(1_000_000));
        let reads = clock.clone();
        let cache = AgingCache::with_clock(16, 100, move || reads.load(Ordering::Relaxed));
        (cache, clock)
    }

    #[test]
    fn a_session_resumes_within_its_lifetime_and_not_after() {
        let (cache, clock) = clocked();
        assert!(cache.put(b"id".to_vec(), b"secret".to_vec()));
        clock.fetch_add(99, Ordering::Relaxed);
        assert_eq!(cache.get(b"id").as_deref(), Some(&b"secret"[..]));
        clock.fetch_add(1, Ordering::Relaxed);
        assert_eq!(cache.get(b"id"), None);
        // Dropped when found aged: the clock set back does not bring it back.
        clock.fetch_sub(50, Ordering::Relaxed);
        assert_eq!(cache.get(b"id"), None);
    }

    #[test]
    fn a_take_is_single_use_and_aged_too() {
        let (cache, clock) = clocked();
        cache.put(b"a".to_vec(), b"one".to_vec());
        cache.put(b"b".to_vec(), b"two".to_vec());
        assert_eq!(cache.take(b"a").as_deref(), Some(&b"one"[..]));
        assert_eq!(cache.take(b"a"), None);
        clock.fetch_add(100, Ordering::Relaxed);
        assert_eq!(cache.take(b"b"), None);
    }

    #[test]
    fn a_clock_set_back_keeps_an_entry() {
        let (cache, clock) = clocked();
        cache.put(b"id".to_vec(), b"s".to_vec());
        clock.fetch_sub(1_000, Ordering::Relaxed);
        assert_eq!(cache.get(b"id").as_deref(), Some(&b"s"[..]));
    }
}
