//! The idle connections: one list per serving thread (the thread whose I/O driver the socket is
//! registered with), taken from the caller's own list first and moved to its driver when taken
//! from another's; closed by the reaper once past their idle limit. Must never: hand out a
//! connection the upstream closed or one past its limit.

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, Weak};
use std::time::{Duration, Instant};

use crate::upstream::conn::H1;

use super::affinity::{AffinityKey, Binding};
use super::stats::Closed;
use super::{lock, Pool, THREAD};

pub(super) struct Idle {
    pub(super) h1: H1,
    /// When it went idle (one given back unsent: its previous request's first write, earlier).
    pub(super) since: Instant,
    /// When it may no longer be reused: `since` + [`H1::idle_limit`].
    pub(super) until: Instant,
    /// The credential this connection is bound to (affinity only).
    pub(super) key: Option<Binding>,
    /// When its last request's first bytes were written ([`super::drain::coarse_ms`]; for a new connection
    /// given back unsent, when it was): a bound on `since` that costs no clock read, for a
    /// request that gives it back unsent.
    pub(super) sent_ms: u32,
}

/// Closes idle connections past their limit ([`H1::idle_limit`]) and the longest idle past
/// `upstream.max_idle_connections` ([`Pool::close_surplus`]), and drops the users no connection
/// or request refers to any more (affinity), every half `idle_timeout` (at most 1 s), while the
/// pool lives.
pub(super) fn spawn_reaper(pool: Weak<Pool>, idle_timeout: Duration) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    handle.spawn(async move {
        // At most 1 s apart: an upstream's `Keep-Alive: timeout` can expire a connection well
        // before the pool's own limit, and a surplus one holds an upstream worker; neither
        // should wait long to be closed.
        let every = (idle_timeout / 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let Some(pool) = pool.upgrade() else { return };
            let now = Instant::now();
            for t in 0..pool.idle.len() {
                pool.idle(t).retain_mut(|i| {
                    let closing = Closed::of_idle(&mut i.h1, i.until, now);
                    if let Some(reason) = closing {
                        pool.stats.count_closed(reason, 1);
                    }
                    closing.is_none()
                });
            }
            pool.close_surplus();
            // Credentials no connection or request refers to any more leave memory.
            lock(&pool.owners).prune();
        }
    });
}

impl Pool {
    pub(super) fn idle(&self, thread: usize) -> MutexGuard<'_, Vec<Idle>> {
        lock(&self.idle[thread])
    }

    /// Closes the longest idle connections while more than `max_idle` are idle (each list is
    /// ordered by return, its front the longest idle).
    pub(super) fn close_surplus(&self) {
        let lens: Vec<usize> = (0..self.idle.len()).map(|t| self.idle(t).len()).collect();
        let surplus = lens.iter().sum::<usize>().saturating_sub(self.max_idle);
        for _ in 0..surplus {
            let oldest = (0..self.idle.len())
                .filter_map(|t| self.idle(t).first().map(|i| (i.since, t)))
                .min();
            let Some((_, t)) = oldest else { return };
            let mut idle = self.idle(t);
            if idle.is_empty() {
                continue;
            }
            drop(idle.remove(0));
            drop(idle);
            self.stats.count_closed(Closed::Surplus, 1);
        }
    }

    /// The calling thread's index into `idle`: its serving-thread index, or the last list for
    /// threads that are not serving threads.
    pub(super) fn this_thread(&self) -> usize {
        let others = self.idle.len() - 1;
        THREAD
            .with(Cell::get)
            .map_or(others, |index| index % others)
    }

    /// Takes an idle connection for `key` (any, without affinity): the calling thread's most
    /// recently idle one first, then the other threads'. Returns it with its list's index.
    pub(super) fn take_idle(&self, key: Option<&AffinityKey>) -> Option<(usize, Idle)> {
        let first = self.this_thread();
        (0..self.idle.len()).find_map(|offset| {
            let thread = (first + offset) % self.idle.len();
            let mut idle = self.idle(thread);
            let taken = match key {
                None => idle.pop(),
                Some(key) => idle
                    .iter()
                    .rposition(|i| i.key.as_ref().is_some_and(|b| Arc::ptr_eq(&b.0 .0, &key.0)))
                    .map(|at| idle.remove(at)),
            };
            taken.map(|i| (thread, i))
        })
    }

    /// Takes a live idle connection for `key` ([`Pool::take_idle`]; expired or closed ones met
    /// on the way are closed) and moves it to the calling thread's I/O driver if it was another
    /// thread's.
    pub(super) fn take_live(&self, key: Option<&AffinityKey>) -> Option<Idle> {
        loop {
            let (home, mut idle) = self.take_idle(key)?;
            if let Some(reason) = Closed::of_idle(&mut idle.h1, idle.until, Instant::now()) {
                self.stats.count_closed(reason, 1);
                tracing::debug!(
                    reason = reason.label(),
                    idle_ms = idle.since.elapsed().as_millis() as u64,
                    "idle upstream connection closed at checkout"
                );
                continue;
            }
            if let Some(h1) = self.bring_home(idle.h1, home) {
                return Some(Idle { h1, ..idle });
            }
        }
    }

    /// `h1`, registered with serving thread `home`'s I/O driver, moved to the calling thread's
    /// if that is another; `None` (the connection closed) if the move failed.
    pub(super) fn bring_home(&self, h1: H1, home: usize) -> Option<H1> {
        if home == self.this_thread() {
            return Some(h1);
        }
        match h1.rehome() {
            Ok(h1) => {
                self.stats.moved.fetch_add(1, Ordering::Relaxed);
                Some(h1)
            }
            Err(e) => {
                self.stats.count_closed(Closed::Error, 1);
                tracing::debug!(cause = %e, "could not move an idle upstream connection to this thread; closed it");
                None
            }
        }
    }

    /// Makes `idle`, registered with serving thread `home`'s driver, available again. Affinity:
    /// a waiting request of the same user takes it straight away, else it goes idle (under the
    /// waiters' lock: see `Owner::waiters`).
    #[inline]
    pub(super) fn put_back(&self, home: usize, mut idle: Idle) {
        let Some(owner) = idle.key.as_ref().map(|b| b.0 .0.clone()) else {
            self.idle(home).push(idle);
            return;
        };
        let mut waiters = lock(&owner.waiters);
        while let Some(waiter) = waiters.pop_front() {
            match waiter.send((home, idle)) {
                Ok(()) => {
                    // The waiter holds a connection now: no longer waiting (counted here,
                    // before the giver's slot is freed, so no request sees room that the
                    // connection in transit takes).
                    self.waiting.fetch_sub(1, Ordering::Relaxed);
                    return;
                }
                Err((_, back)) => idle = back,
            }
        }
        self.idle(home).push(idle);
    }
}
