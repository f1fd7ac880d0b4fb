//! The upstream connection pool: HTTP/1.1 keep-alive connections with a **hard cap on open
//! connections** (idle + busy) and a FIFO queue beyond it.
//!
//! Why ours and not hyper-util's legacy client: that client caps only *idle* connections, and an
//! upstream like Cyrus (one process per connection, `maxchild`) leaves connections above its limit
//! accepted but never served. Invariant: every busy connection holds a permit, and a connection is
//! opened only by a permit holder that found no idle one, so busy + idle <= `max_connections`.
//! (A discarded connection's socket is closed before its permit is freed; the upstream may still
//! count it until it reads the close, and Cyrus serves the newcomer once it has.)
//! Must never: hand one connection to two requests at once, or keep a connection whose response
//! body was not read to the end.
//!
//!
//! **Serving threads.** tessera serves on several single-threaded runtimes (`server.threads`).
//! A connection's socket is registered with the I/O driver of the thread that opened it, so the
//! idle connections are kept in one list per thread and a request takes one from its own thread's
//! list first: then the socket's readiness wakes the request without crossing threads. Only when
//! its own list has none does it take another thread's idle connection, and it first moves the
//! socket to its own thread's I/O driver (two `epoll_ctl` calls, once per move): left registered
//! where it was, every readiness event of that connection would wake the other thread, which
//! then wakes this one (docs/protocols.md, "The upstream pool"). A new connection is opened only when no thread has an idle one (the cap counts
//! them all). Callers outside the serving threads (login, the CLI, tests) share one more list.
//!
//! The rooms: [`stats`] (counters, close reasons), [`conn`] (a checked-out connection and what
//! its drop decides), [`drain`] (exchanges left by their requester), [`affinity`] (connections
//! bound to one credential), [`open`] and [`probe`] (new connections, and whether they are
//! served).

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use crate::upstream::conn::DRAIN_BYTES;
use crate::upstream::conn::{Sending, H1};
use crate::upstream::share::Held;
use crate::upstream::ForwardError;

mod affinity;
mod conn;
mod drain;
mod stats;

pub use affinity::{Affinity, AffinityKey, AFFINITY_STALE, AFFINITY_WAIT};
use affinity::{Binding, Owners};
pub use conn::Conn;
pub(crate) use drain::abandoning;
pub(crate) use drain::coarse_ms;
pub use drain::{Drain, DRAIN_WAIT};
pub use stats::{Closed, PoolStats};

mod idle;
mod open;
mod probe;
use idle::{spawn_reaper, Idle};

thread_local! {
    static THREAD: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Marks the calling thread as serving thread `index` (0-based, below `server.threads`; the
/// thread must run its own current-thread runtime): its requests prefer the idle connections its
/// own thread opened, and move the ones they take from other threads to it. Threads never marked
/// share one list, apart from the serving threads'.
pub fn set_serving_thread(index: usize) {
    THREAD.with(|t| t.set(Some(index)));
}

/// The serving-thread index given to [`set_serving_thread`] on the calling thread, if any.
pub(crate) fn serving_thread() -> Option<usize> {
    THREAD.with(Cell::get)
}

/// How long a slot removed from the cap for an unserved connection stays removed: then the
/// pool may open one more connection again, probed like any new one.
pub const CAP_RESTORE: Duration = Duration::from_secs(60);

/// The pool for one upstream address.
pub struct Pool {
    addr: String,
    /// The TLS client of an `https://` upstream.
    tls: Option<Arc<crate::upstream::TlsClient>>,
    max_connections: usize,
    permits: Arc<Semaphore>,
    /// Idle connections, one list per serving thread (the thread whose runtime the socket is
    /// registered with) and a last one for every other thread, most recently idle last (one given
    /// back unsent has an earlier `since`, so the order is by return, not strictly by `since`).
    idle: Vec<Mutex<Vec<Idle>>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    /// `upstream.max_idle_connections`: the reaper closes the longest idle past it.
    max_idle: usize,
    /// `upstream.probe_timeout_ms` ([`probe`]), while the upstream can be probed (cleared when
    /// it answers the probe unusably).
    probe: Option<Duration>,
    probing: AtomicBool,
    /// An unserved connection was warned of (once per process).
    warned_unserved: AtomicBool,
    /// Slots taken off the cap for unserved connections, until [`CAP_RESTORE`] gives them back
    /// (not busy connections: [`Pool::connections`] leaves them out).
    removed: AtomicUsize,
    affinity: Affinity,
    drain: Drain,
    /// `upstream.response_header_timeout_ms`: until when an exchange closed before its response
    /// head keeps its shares ([`Conn::keep_shares_while_due`]).
    header_timeout: Duration,
    /// Affinity only: the credentials in use.
    owners: Mutex<Owners>,
    /// Affinity: requests holding a slot while they wait for their own user's connection (not
    /// counted as busy connections: they hold none yet).
    waiting: AtomicUsize,
    /// Activity counters, read by tests, benchmarks and the metrics.
    pub stats: PoolStats,
}

/// Locks `m`, also after a panic elsewhere poisoned it (the pool's lists stay consistent: each
/// change is one push or remove).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pool {
    /// A pool for `addr` (`host:port`) with `settings`' cap, timeouts, idle bound, affinity and
    /// drain (its `url` is not read), used from `threads` serving threads (see
    /// [`set_serving_thread`]).
    pub fn new(
        addr: String,
        settings: &crate::upstream::UpstreamConfig,
        threads: usize,
    ) -> Arc<Self> {
        let max_connections = settings.max_connections;
        let pool = Arc::new(Self {
            addr,
            max_connections,
            permits: Arc::new(Semaphore::new(max_connections)),
            idle: (0..threads.max(1) + 1)
                .map(|_| Mutex::new(Vec::new()))
                .collect(),
            connect_timeout: settings.connect_timeout,
            tls: settings.tls.clone(),
            idle_timeout: settings.idle_timeout,
            max_idle: settings.max_idle_connections,
            probe: settings.probe_timeout,
            probing: AtomicBool::new(settings.probe_timeout.is_some()),
            warned_unserved: AtomicBool::new(false),
            removed: AtomicUsize::new(0),
            affinity: settings.affinity,
            drain: settings.drain,
            header_timeout: settings.response_header_timeout,
            waiting: AtomicUsize::new(0),
            owners: Mutex::new(Owners {
                map: HashMap::new(),
                hash: crate::upstream::share::CredentialHash::new(),
                limit: (8 * max_connections).max(1024),
            }),
            stats: PoolStats::default(),
        });
        spawn_reaper(Arc::downgrade(&pool), settings.idle_timeout);
        pool
    }

    /// The cap on open connections (`upstream.max_connections`).
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    /// Connections open now, as `(busy, idle)`: busy ones are checked out by a request (one being
    /// opened, or finishing an exchange its requester left, included: each holds one of the
    /// `max_connections` slots; a request that holds a slot while it waits for its own user's
    /// connection, with affinity, holds no connection and is not counted), idle ones wait for
    /// reuse (some may have been closed by the upstream and not noticed yet). `busy + idle` stays
    /// within `max_connections`, except that a connection being put back or taken out is counted
    /// in both for an instant (it is idle before its slot is freed, and a request takes a slot
    /// before it takes an idle connection).
    pub fn connections(&self) -> (usize, usize) {
        let busy = self
            .max_connections
            .saturating_sub(self.permits.available_permits())
            .saturating_sub(self.waiting.load(Ordering::Relaxed))
            .saturating_sub(self.removed.load(Ordering::Relaxed));
        let idle = (0..self.idle.len()).map(|t| self.idle(t).len()).sum();
        (busy, idle)
    }

    /// A checked-out reused connection, `idle` now registered with this thread's driver.
    fn reused(self: &Arc<Self>, idle: Idle, permit: OwnedSemaphorePermit) -> Conn {
        self.stats.reused.fetch_add(1, Ordering::Relaxed);
        Conn {
            h1: Some(idle.h1),
            home: self.this_thread(),
            key: idle.key,
            pool: self.clone(),
            reused: true,
            reusable: false,
            sending: Sending::Idle,
            // Until the request is written: its previous one's, kept if nothing of it is.
            sent_ms: idle.sent_ms,
            closing: Closed::Abandoned,
            permit: Some(permit),
            held: Held::default(),
        }
    }

    /// Waits (FIFO) for a slot, then reuses the most recently idle live connection or opens one.
    /// `key` is the request's [`Pool::affinity_key`]: with [`Affinity::Session`] only a
    /// connection bound to the same key is reused, and at the cap the request may wait up to
    /// that variant's `wait` for one (module docs).
    ///
    /// Errors: [`ForwardError::Connect`] / [`ForwardError::ConnectTimeout`] when a new connection
    /// is needed and cannot be made.
    pub async fn checkout(
        self: &Arc<Self>,
        key: Option<AffinityKey>,
    ) -> Result<Conn, ForwardError> {
        let permit = self.slot().await?;
        if let Some(idle) = self.take_live(key.as_ref()) {
            return Ok(self.reused(idle, permit));
        }
        if let Some(key) = &key {
            // Boxed, like the connect below: rare once the shares have settled. If this is
            // dropped mid-wait, the wait is dropped before `permit` (declared earlier), so a
            // connection handed to it is put back before this slot is freed.
            if let Some(idle) = Box::pin(self.share(key)).await {
                return Ok(self.reused(idle, permit));
            }
        }
        // Boxed: connecting is rare once the pool is warm, and inline it would enlarge every
        // request's future.
        Box::pin(self.connect(permit, key)).await
    }

    /// Waits (FIFO) for one of the `max_connections` slots.
    async fn slot(&self) -> Result<OwnedSemaphorePermit, ForwardError> {
        self.permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ForwardError::Closed)
    }

    /// Idle connections beyond what the free slots allow (the checking-out request holds its
    /// slot): how many must be closed before a new connection may open.
    fn excess(&self) -> usize {
        // Busy connections, this request's included, hold the permits not available; so do the
        // requests waiting for their own user's connection (affinity), which hold none. Each of
        // those makes its own room if its wait runs out or a close wakes it (no longer counted as
        // waiting then).
        let idle_now: usize = (0..self.idle.len()).map(|t| self.idle(t).len()).sum();
        idle_now
            .saturating_sub(self.permits.available_permits() + self.waiting.load(Ordering::Relaxed))
    }

    /// Before opening a connection while idle ones exist (affinity: bound to other credentials;
    /// the retry), closes the longest-idle connections until busy + idle stays within the cap
    /// (the sockets are closed before this returns).
    fn make_room(&self) {
        let excess = self.excess();
        let mut evicted = Vec::with_capacity(excess);
        for _ in 0..excess {
            // The longest-idle connection of all threads (each list's first is its oldest, or
            // nearly: see `Pool::idle`).
            // Taking the first list's oldest instead closed busy users' connections while
            // another thread's stale ones stayed, and with affinity that churned for good.
            let oldest = (0..self.idle.len())
                .filter_map(|t| self.idle(t).first().map(|i| (i.since, t)))
                .min();
            let Some((_, t)) = oldest else { break };
            let mut idle = self.idle(t);
            if !idle.is_empty() {
                evicted.push(idle.remove(0));
            }
        }
        if !evicted.is_empty() {
            self.stats.count_closed(Closed::Evicted, evicted.len());
            tracing::debug!(
                closed = evicted.len(),
                "closed idle upstream connections to stay within max_connections"
            );
        }
    }

    /// Like [`Pool::checkout`] but never reuses: opens a new connection (closing one idle
    /// connection of this thread, if any: after one reused connection failed, its idle peers are
    /// suspect too; then as many more as the cap needs). Used for the single retry.
    pub async fn checkout_fresh(
        self: &Arc<Self>,
        key: Option<AffinityKey>,
    ) -> Result<Conn, ForwardError> {
        let permit = self.slot().await?;
        let suspect = self.idle(self.this_thread()).pop();
        if let Some(mut idle) = suspect {
            // Often closed by the upstream already, as the failed one was.
            let reason = Closed::of_idle(&mut idle.h1, idle.until, Instant::now());
            self.stats
                .count_closed(reason.unwrap_or(Closed::Evicted), 1);
        }
        self.make_room();
        self.stats.retried.fetch_add(1, Ordering::Relaxed);
        self.connect(permit, key).await
    }

    /// The TLS client, `None` for `http://`.
    pub fn tls(&self) -> Option<&crate::upstream::TlsClient> {
        self.tls.as_deref()
    }
}
