//! Failed-login limits in this process: GCRA per key (client address or /64, user name), one
//! failure forgiven every `window / max_failures`. Must never: grow without bound (entries are
//! pruned).

use std::collections::HashMap;
use std::hash::Hash;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use governor::clock::{Clock, MonotonicClock};
use governor::middleware::StateInformationMiddleware;
use governor::state::keyed::HashMapStateStore;
use governor::{Quota, RateLimiter};

pub(super) type Gcra<K> =
    RateLimiter<K, HashMapStateStore<K>, MonotonicClock, StateInformationMiddleware>;

/// Counts failed attempts per key with GCRA (`burst` failures, refilled one per
/// `window / burst`), and remembers which keys used their last one, so that the next attempt is
/// refused before the upstream is asked.
pub(super) struct FailureLimit<K: Hash + Eq + Clone> {
    gcra: Gcra<K>,
    clock: MonotonicClock,
    blocked: Mutex<HashMap<K, Instant>>,
    failures: std::sync::atomic::AtomicU64,
}

impl<K: Hash + Eq + Clone> FailureLimit<K> {
    pub(super) fn new(burst: u32, window: Duration) -> Self {
        let burst = NonZeroU32::new(burst).expect("validated > 0");
        let period = (window / burst.get()).max(Duration::from_millis(1));
        let quota = Quota::with_period(period)
            .expect("non-zero period")
            .allow_burst(burst);
        let clock = MonotonicClock;
        Self {
            gcra: RateLimiter::<K, HashMapStateStore<K>, MonotonicClock>::new(
                quota,
                HashMapStateStore::default(),
                clock.clone(),
            )
            .with_middleware::<StateInformationMiddleware>(),
            clock,
            blocked: Mutex::new(HashMap::new()),
            failures: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Remaining wait when `key` is blocked.
    pub(super) fn blocked_for(&self, key: &K) -> Option<Duration> {
        let blocked = self.blocked.lock().unwrap_or_else(|p| p.into_inner());
        let until = *blocked.get(key)?;
        until.checked_duration_since(Instant::now())
    }

    /// Blocks `key` for `wait` from now (or longer, if it is blocked longer already): the count
    /// every instance shares (in the store) said it is over its cap, for that long.
    pub(super) fn block(&self, key: K, wait: Duration) {
        self.prune_now_and_then();
        let until = Instant::now() + wait;
        let mut blocked = self.blocked.lock().unwrap_or_else(|p| p.into_inner());
        let at = blocked.entry(key).or_insert(until);
        *at = (*at).max(until);
    }

    /// Forgets, once every 1,024 calls, the keys whose counts have refilled and whose blocks
    /// ended, so memory follows the attackers of the last window, not every name ever tried.
    fn prune_now_and_then(&self) {
        if self
            .failures
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % 1024
            == 1023
        {
            self.gcra.retain_recent();
            self.gcra.shrink_to_fit();
            let now = Instant::now();
            self.blocked
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|_, t| *t > now);
        }
    }

    pub(super) fn record_failure(&self, key: K) {
        self.prune_now_and_then();
        let until = match self.gcra.check_key(&key) {
            Ok(snapshot) if snapshot.remaining_burst_capacity() == 0 => {
                Instant::now() + snapshot.quota().replenish_interval()
            }
            Ok(_) => return,
            Err(not_until) => Instant::now() + not_until.wait_time_from(self.clock.now()),
        };
        self.blocked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, until);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_limit_blocks_after_burst_and_only_that_key() {
        let l = FailureLimit::new(3, Duration::from_secs(300));
        for _ in 0..2 {
            l.record_failure("a".to_string());
            assert!(l.blocked_for(&"a".to_string()).is_none());
        }
        l.record_failure("a".to_string());
        let wait = l
            .blocked_for(&"a".to_string())
            .expect("blocked after 3 failures");
        assert!(
            wait <= Duration::from_secs(100) && wait > Duration::from_secs(90),
            "{wait:?}"
        );
        assert!(l.blocked_for(&"b".to_string()).is_none());
    }
}
