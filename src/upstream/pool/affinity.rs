//! Affinity: connections bound to one upstream credential.
//!
//! With [`Affinity::Session`] every connection is bound to the first request's
//! upstream credential (its `Authorization` value) and is reused only for requests carrying the
//! same one, so one upstream connection never carries two users' requests (an upstream that keeps
//! per-connection auth state cannot mix them up). A request whose credential has no idle
//! connection opens one. At the cap, a connection of another user must be closed first, and the
//! pool keeps the active users' shares even instead of churning. The first rule that applies:
//! - the longest-idle connection has been idle for `stale` ([`Affinity::Session`], always
//!   [`AFFINITY_STALE`] from the configuration: its user is between bursts): it is closed;
//! - some user with an idle connection holds at least two connections more than this request's
//!   user: the longest-idle connection of the user (with an idle one) holding the most is
//!   closed;
//! - this request's user holds none: the longest-idle connection is closed;
//! - otherwise this user already holds its share, and the request waits up to `wait`
//!   ([`Affinity::Session`], default [`AFFINITY_WAIT`]) for one of its user's busy connections
//!   to come back (handed over directly, first come, first served), and only then closes the
//!   longest-idle connection. If one of those connections is closed instead (its exchange
//!   abandoned or failed), the oldest waiter is woken at once and opens its own in the room
//!   left (closing another user's idle one only if a request queued for a slot took that room
//!   first).
//!
//! Without the wait, 16 users over 64 connections at 64 concurrent requests closed and opened
//! about one connection per seven requests, for good: a user's requests in flight vary around
//! its share, and each one over it closed another user's connection (docs/benchmarks.md,
//! "Upstream affinity").

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::HeaderValue;
use tokio::sync::oneshot;

use super::stats::Closed;
use super::{lock, Idle, Pool};

/// The default `wait` of [`Affinity::Session`] (`upstream.affinity_wait_ms`): 5 ms. A few
/// request times on a LAN, and less than a new upstream connection costs an upstream that
/// authenticates each one.
pub const AFFINITY_WAIT: Duration = Duration::from_millis(5);

/// The `stale` of [`Affinity::Session`] the configuration sets: 100 ms.
pub const AFFINITY_STALE: Duration = Duration::from_millis(100);

/// Which requests may share an upstream connection (`upstream.affinity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Affinity {
    /// Any request may reuse any idle connection (`"none"`, the default).
    #[default]
    None,
    /// A connection carries only requests with the same upstream credential (`"session"`).
    Session {
        /// At the connection cap, how long a request whose user already holds its share of the
        /// pool waits for one of that user's busy connections before it closes another user's
        /// idle one and opens its own (`upstream.affinity_wait_ms`; zero: never waits).
        wait: Duration,
        /// At the connection cap, an idle connection unused this long belongs to a user between
        /// bursts of requests: it is closed to make room before any request waits for its own
        /// ([`AFFINITY_STALE`]; not a configuration key).
        stale: Duration,
    },
}

/// A request's affinity key ([`Pool::affinity_key`]): its upstream credential's entry in the
/// pool's table of users. Cheap to clone (one reference count).
#[derive(Clone)]
pub struct AffinityKey(pub(super) Arc<Owner>);

/// One upstream credential's state in the pool (affinity only).
pub(super) struct Owner {
    /// Connections open with this credential (busy + idle), counted by [`Binding`].
    pub(super) open: AtomicUsize,
    /// Requests of this credential waiting for one of its connections (see [`Affinity::Session`]),
    /// oldest first. Held while a connection of this credential goes idle or, once closed, wakes
    /// a waiter ([`Pool::closed_one_of`]), so that a request registering here misses neither.
    pub(super) waiters: Mutex<VecDeque<oneshot::Sender<(usize, Idle)>>>,
}

/// A connection's binding to its credential's [`Owner`]: counted in `open` while it lives.
pub(super) struct Binding(pub(super) AffinityKey);

impl Binding {
    pub(super) fn new(key: AffinityKey) -> Self {
        key.0.open.fetch_add(1, Ordering::Relaxed);
        Self(key)
    }

    pub(super) fn open(&self) -> usize {
        self.0 .0.open.load(Ordering::Relaxed)
    }
}

impl Drop for Binding {
    fn drop(&mut self) {
        self.0 .0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The users' table: one [`Owner`] per credential in use, keyed by its keyed hash (the table
/// never holds a password: failed login attempts pass here too). An entry no key refers to any
/// more (no connection, no request) is removed by the reaper, or when the table outgrows
/// `limit`.
pub(super) struct Owners {
    pub(super) map: HashMap<u128, Arc<Owner>>,
    pub(super) hash: crate::upstream::share::CredentialHash,
    /// Entries past which an insert first removes the unused ones (doubles when at least half
    /// are still in use after that).
    pub(super) limit: usize,
}

impl Owners {
    pub(super) fn prune(&mut self) {
        self.map.retain(|_, owner| Arc::strong_count(owner) > 1);
        // After a burst of many users, give the table's memory back.
        if self.map.capacity() > 4 * self.map.len().max(64) {
            self.map.shrink_to_fit();
        }
    }
}

/// A request waiting for its own user's connection (affinity): counted in [`Pool`]'s `waiting`
/// until it ends. A connection handed over through `rx` is uncounted by its sender, at the
/// handover (see [`Pool::put_back`]); otherwise the wait's end (or its drop, the client gone)
/// uncounts it. Exactly one of the two: the receiver is closed before it is looked at a last
/// time, so no handover can come after.
pub(super) struct Waiting<'a> {
    pool: &'a Pool,
    rx: oneshot::Receiver<(usize, Idle)>,
    ended: bool,
}

impl<'a> Waiting<'a> {
    pub(super) fn new(pool: &'a Pool, rx: oneshot::Receiver<(usize, Idle)>) -> Self {
        pool.waiting.fetch_add(1, Ordering::Relaxed);
        Self {
            pool,
            rx,
            ended: false,
        }
    }

    /// Ends the wait, given what the receiver yielded (`None`: the wait ran out): the
    /// connection handed over (or handed over just before the receiver closed), if any, and
    /// whether it was woken with none ([`Pool::closed_one_of`]).
    pub(super) fn end(
        mut self,
        waited: Option<Result<(usize, Idle), oneshot::error::RecvError>>,
    ) -> (Option<(usize, Idle)>, bool) {
        self.ended = true;
        match waited {
            Some(Ok(got)) => (Some(got), false),
            _ => self.last_look(),
        }
    }

    /// Takes what was handed over, closing the receiver first if nothing was yet, so that no
    /// handover can come after; uncounts the wait if nothing was. Also tells whether the sender
    /// was dropped unsent (woken by a close, maybe just as the wait ran out).
    pub(super) fn last_look(&mut self) -> (Option<(usize, Idle)>, bool) {
        let (got, woken) = match self.rx.try_recv() {
            Ok(got) => (Some(got), false),
            Err(oneshot::error::TryRecvError::Closed) => (None, true),
            Err(oneshot::error::TryRecvError::Empty) => {
                self.rx.close();
                (self.rx.try_recv().ok(), false)
            }
        };
        if got.is_none() {
            self.pool.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        (got, woken)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.ended {
            // Dropped mid-wait (its client gone): a connection handed over meanwhile had
            // nothing sent on it, so it goes to the next waiter of its user, or idle.
            // Woken by a close instead, the wake is not passed on: this request's slot is
            // freed only after this drop, so a waiter woken now could find no room yet.
            if let (Some((home, idle)), _) = self.last_look() {
                self.pool.put_back(home, idle);
            }
        }
    }
}

impl Pool {
    /// The affinity key of a request with these (injected) headers: with [`Affinity::Session`],
    /// the entry of its `Authorization` value (requests without one share the entry of the empty
    /// value), else `None`.
    pub fn affinity_key(&self, headers: &http::HeaderMap) -> Option<AffinityKey> {
        if self.affinity == Affinity::None {
            return None;
        }
        let none = HeaderValue::from_static(""); // static bytes: no allocation
        let value = headers.get(http::header::AUTHORIZATION).unwrap_or(&none);
        let mut owners = lock(&self.owners);
        let key = owners.hash.of(value);
        if let Some(owner) = owners.map.get(&key) {
            return Some(AffinityKey(owner.clone()));
        }
        if owners.map.len() >= owners.limit {
            owners.prune();
            if owners.map.len() >= owners.limit / 2 {
                owners.limit *= 2;
            }
        }
        let owner = Arc::new(Owner {
            open: AtomicUsize::new(0),
            waiters: Mutex::new(VecDeque::new()),
        });
        owners.map.insert(key, owner.clone());
        Some(AffinityKey(owner))
    }

    /// Affinity: a connection bound to `binding`'s user was closed (its slot already freed).
    /// The oldest request of that user still waiting for one of its connections is woken with
    /// none handed over, to open its own in the room left, instead of sleeping out its wait for
    /// a connection that will not come back. (Not from [`Binding`]'s drop: [`Pool::share`]
    /// closes expired connections while it holds the waiters' lock.)
    pub(super) fn closed_one_of(&self, binding: Binding) {
        let owner = binding.0 .0.clone();
        drop(binding);
        let mut waiters = lock(&owner.waiters);
        while let Some(waiter) = waiters.pop_front() {
            if !waiter.is_closed() {
                // Dropping the sender wakes its receiver with `RecvError`.
                drop(waiter);
                return;
            }
        }
    }

    /// Affinity, when `key` has no idle connection: makes room for a new one at the cap by the
    /// rules in the module docs, or returns one of `key`'s own connections handed over within
    /// [`Affinity::Session`]'s `wait` (or gone idle just as it ran out), registered with this
    /// thread's driver.
    pub(super) async fn share(&self, key: &AffinityKey) -> Option<Idle> {
        if self.excess() == 0 {
            return None;
        }
        let Affinity::Session { wait, stale } = self.affinity else {
            return None;
        };
        let mine = key.0.open.load(Ordering::Relaxed);
        if self.close_for(mine, stale) || mine == 0 {
            self.make_room();
            return None;
        }
        if wait.is_zero() {
            self.stats.wait_expired.fetch_add(1, Ordering::Relaxed);
            self.make_room();
            return None;
        }
        // Counted as waiting until the wait ends (or this is dropped: its client gone).
        let waiting = {
            let mut waiters = lock(&key.0.waiters);
            // A connection of this user may have gone idle since `take_live` looked, or been
            // closed (on another thread) since `excess` and `mine` were read, waking nobody.
            // Neither can while the lock is held: a close frees its slot and lowers `open`
            // before it takes this lock to wake a waiter.
            if let Some(idle) = self.take_live(Some(key)) {
                return Some(idle);
            }
            if self.excess() == 0 {
                return None;
            }
            if key.0.open.load(Ordering::Relaxed) == 0 {
                // None of this user's can come back: room is made below, without a wait.
                None
            } else {
                waiters.retain(|tx| !tx.is_closed());
                let (tx, rx) = oneshot::channel();
                waiters.push_back(tx);
                Some(Waiting::new(self, rx))
            }
        };
        let Some(mut waiting) = waiting else {
            self.make_room();
            return None;
        };
        let waited = tokio::time::timeout(wait, &mut waiting.rx).await;
        // From here this request either has its connection or makes its own room. Woken with
        // nothing (`room_left`): one of this user's connections was closed (`closed_one_of`),
        // which left room for its own without its wait having run out.
        let (handed, room_left) = waiting.end(waited.ok());
        if let Some((home, mut idle)) = handed {
            match Closed::of_idle(&mut idle.h1, idle.until, Instant::now()) {
                Some(reason) => self.stats.count_closed(reason, 1),
                None => {
                    if let Some(h1) = self.bring_home(idle.h1, home) {
                        self.stats.handed_over.fetch_add(1, Ordering::Relaxed);
                        return Some(Idle { h1, ..idle });
                    }
                }
            }
        }
        // None handed over, or one not reusable after all (an upstream keep-alive of no time,
        // closed by the upstream, a failed move). One of this user's may have gone idle as the
        // receiver closed; else another user's is closed and one opened below.
        if let Some(idle) = self.take_live(Some(key)) {
            return Some(idle);
        }
        if !room_left {
            self.stats.wait_expired.fetch_add(1, Ordering::Relaxed);
        }
        self.make_room();
        None
    }

    /// Affinity, at the cap, for a request whose user holds `mine` connections (all busy):
    /// closes the longest-idle connection if it has been idle for `stale`, else the
    /// longest-idle one of the user holding the most connections if that is `mine + 2` or more.
    /// Returns whether one was closed.
    pub(super) fn close_for(&self, mine: usize, stale: Duration) -> bool {
        // (since, list, index) of the longest-idle connection, and (open, since, list, index) of
        // the longest-idle connection of the user holding the most.
        let mut oldest: Option<(Instant, usize, usize)> = None;
        let mut richest: Option<(std::cmp::Reverse<usize>, Instant, usize, usize)> = None;
        for t in 0..self.idle.len() {
            for (at, i) in self.idle(t).iter().enumerate() {
                let this = (i.since, t, at);
                if oldest.is_none_or(|o| this < o) {
                    oldest = Some(this);
                }
                let open = i.key.as_ref().map_or(0, Binding::open);
                let this = (std::cmp::Reverse(open), i.since, t, at);
                if richest.is_none_or(|r| this < r) {
                    richest = Some(this);
                }
            }
        }
        let victim = match (oldest, richest) {
            (Some((since, t, at)), _) if since.elapsed() >= stale => (since, t, at, "stale"),
            (_, Some((std::cmp::Reverse(open), since, t, at))) if open >= mine + 2 => {
                (since, t, at, "of the user holding the most")
            }
            _ => return false,
        };
        let (since, t, at, why) = victim;
        let closed = {
            let mut idle = self.idle(t);
            // Found again by when it went idle: entries before it may have been taken meanwhile.
            // Gone itself (taken or reaped), nothing is closed and this request goes on to wait.
            let at = if idle.get(at).is_some_and(|i| i.since == since) {
                Some(at)
            } else {
                idle.iter().position(|i| i.since == since)
            };
            at.map(|at| idle.remove(at))
        };
        if closed.is_some() {
            self.stats.count_closed(Closed::Evicted, 1);
            tracing::debug!(why, "closed an idle upstream connection of another user");
        }
        closed.is_some()
    }
}
