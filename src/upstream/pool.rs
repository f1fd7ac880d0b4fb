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
//! **Exchanges whose requester went away.** A request dropped while its response head is awaited
//! (the request written in full), or a response body dropped with a short rest (at most
//! [`Drain::max_bytes`], or chunked), less than [`Drain::wait`] after the request was sent,
//! leaves its connection to a background task on the runtime its socket is registered with (the
//! serving thread's), which reads the rest for at most [`Drain::wait`] and then keeps the
//! connection (or closes it). A zero wait turns this off. The connection keeps its slot
//! meanwhile: the cap counts it. An older exchange (a long poll, an event stream) is closed at
//! once, as before: its answer is not about to end.
//! Without this, every client that leaves mid-request (a browser navigating away, a load
//! generator at its run's end) cost a new upstream connection (BENCHMARKS.md, "Exchanges
//! finished in the background").
//!
//! **Affinity.** With [`Affinity::Session`] every connection is bound to the first request's
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
//! its share, and each one over it closed another user's connection (BENCHMARKS.md, "Affinity
//! without churn").
//!
//! **Serving threads.** tessera serves on several single-threaded runtimes (`server.threads`).
//! A connection's socket is registered with the I/O driver of the thread that opened it, so the
//! idle connections are kept in one list per thread and a request takes one from its own thread's
//! list first: then the socket's readiness wakes the request without crossing threads. Only when
//! its own list has none does it take another thread's idle connection, and it first moves the
//! socket to its own thread's I/O driver (two `epoll_ctl` calls, once per move): left registered
//! where it was, every readiness event of that connection would wake the other thread, which
//! then wakes this one (measured in BENCHMARKS.md, "Pooled connections moved to the thread that
//! uses them"). A new connection is opened only when no thread has an idle one (the cap counts
//! them all). Callers outside the serving threads (login, the CLI, tests) share one more list.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use http::{HeaderValue, Request};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

pub use super::conn::DRAIN_BYTES;
use super::conn::{Head, SendError, Sending, Unfinished, H1};
use super::share::Held;
use super::ForwardError;
use super::UpBody;

/// Counters of pool activity (monotonic since start).
#[derive(Debug, Default)]
pub struct PoolStats {
    /// Connections opened to the upstream.
    pub opened: AtomicU64,
    /// Requests that took an idle connection (one that had served an earlier request, or that
    /// a request dropped before writing anything gave back), counted at checkout.
    pub reused: AtomicU64,
    /// Requests retried on a fresh connection after a reused one failed.
    pub retried: AtomicU64,
    /// Idle connections moved to the I/O driver of another serving thread that took them.
    pub moved: AtomicU64,
    /// Affinity: connections handed straight from a finished request to a waiting request of the
    /// same user (see [`Affinity::Session`]); these are counted in `reused` too.
    pub handed_over: AtomicU64,
    /// Affinity: requests of a user already holding its share of the full pool that got no
    /// connection of their own (the wait ran out, or `wait` is zero) and so closed another
    /// user's idle one, if one was still idle, to open their own.
    pub wait_expired: AtomicU64,
    /// Exchanges whose requester went away, read to their end in the background and their
    /// connection kept (see the module docs).
    pub drained: AtomicU64,
    /// Exchanges whose requester went away that were read in the background but could not be
    /// finished so (no response end within [`Drain::wait`] or [`Drain::max_bytes`], a response that
    /// ends its connection, bytes after its end, an error, or the upstream closing): closed.
    /// Exchanges closed without a drain (too old, a longer rest, a request not sent in full)
    /// are counted in neither.
    pub drain_failed: AtomicU64,
    /// Connections closed, by [`Closed`] reason (indexed by `Closed as usize`; read with
    /// [`PoolStats::closed`]). Every connection counted in `opened` is counted here once, when
    /// it closes while the pool lives, so `opened` minus their sum is the connections open now.
    closed: [AtomicU64; Closed::ALL.len()],
}

impl PoolStats {
    /// Connections closed so far for `reason`.
    pub fn closed(&self, reason: Closed) -> u64 {
        self.closed[reason as usize].load(Ordering::Relaxed)
    }

    fn count_closed(&self, reason: Closed, n: usize) {
        self.closed[reason as usize].fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Why an upstream connection was closed: the `reason` label of
/// `tessera_upstream_connections_closed_total`, so that an operator can tell why connections are
/// being opened (each one closed while requests still come is one opened later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Closed {
    /// The upstream ended it: its response said `Connection: close` (or was HTTP/1.0 without
    /// keep-alive, framed its body both ways, or came before the request was sent in full); it
    /// closed the connection (or sent bytes unasked) while idle; or, as a request was sent, it
    /// closed or reset the connection before any of the request was written, or after all of
    /// it and before any response byte (a reset while the request was partly written counts as
    /// [`Closed::Error`]).
    Upstream,
    /// Idle past `upstream.idle_timeout_ms`, or past the upstream's own `Keep-Alive: timeout`
    /// (also counted from before a checkout whose request went away before any of it was
    /// written).
    Expired,
    /// Closed while idle to make room under `upstream.max_connections` for another user's
    /// connection (`upstream.affinity = "session"`), or, still alive, closed with a reused
    /// connection that failed (its idle peer is suspect too) before the retry's fresh one.
    Evicted,
    /// Its exchange was left before its end (the client went away, or its request body broke
    /// off or grew over `server.max_body_bytes`; a response-head timeout; the session ended
    /// during a response) and was not finished in the background: too old, too long a rest,
    /// the request still being sent, or the background read failed (`PoolStats::drain_failed`).
    Abandoned,
    /// An I/O error, a malformed response, bytes after a response's end, or a failed move to
    /// another serving thread's I/O driver.
    Error,
    /// It switched protocols (101) and was closed when its WebSocket tunnel ended, or when the
    /// tunnel never started.
    Tunnel,
}

impl Closed {
    /// Every reason, in the order the metric lists them (`upstream` first, `tunnel` last).
    pub const ALL: [Closed; 6] = [
        Closed::Upstream,
        Closed::Expired,
        Closed::Evicted,
        Closed::Abandoned,
        Closed::Error,
        Closed::Tunnel,
    ];

    /// The metric label value: `upstream`, `expired`, `evicted`, `abandoned`, `error` or
    /// `tunnel`.
    pub fn label(self) -> &'static str {
        match self {
            Closed::Upstream => "upstream",
            Closed::Expired => "expired",
            Closed::Evicted => "evicted",
            Closed::Abandoned => "abandoned",
            Closed::Error => "error",
            Closed::Tunnel => "tunnel",
        }
    }

    /// Why an idle connection reusable until `until` is not reusable at `now`: expired, or
    /// closed (or written to unasked) by the upstream; `None` when it is.
    fn of_idle(h1: &mut H1, until: Instant, now: Instant) -> Option<Self> {
        if now >= until {
            Some(Closed::Expired)
        } else if !h1.is_alive() {
            Some(Closed::Upstream)
        } else {
            None
        }
    }
}

/// The default of `upstream.drain_wait_ms`: the longest time a background task reads the rest
/// of an exchange whose requester went away before it closes the connection, 250 ms. It holds a
/// slot meanwhile, so it is kept short; an answer still due after this is a slow one, and a new
/// connection costs less than the wait.
pub const DRAIN_WAIT: Duration = Duration::from_millis(250);

/// How exchanges whose requester went away are finished in the background (module docs):
/// `upstream.drain_wait_ms` and `upstream.drain_max_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drain {
    /// Only exchanges whose request was sent less than this long ago are finished, and each is
    /// read for at most this long (then closed). Zero: none is; each is closed at once.
    pub wait: Duration,
    /// Most response-body bytes read to finish one, bytes: a `Content-Length` rest over this is
    /// closed at once (or as soon as its head announces it), a chunked rest when it passes it.
    pub max_bytes: u64,
}

impl Default for Drain {
    /// [`DRAIN_WAIT`] and [`DRAIN_BYTES`].
    fn default() -> Self {
        Self {
            wait: DRAIN_WAIT,
            max_bytes: DRAIN_BYTES,
        }
    }
}

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

thread_local! {
    /// Set while [`abandoning`] runs on this thread.
    static ABANDONING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `drop_requests` (which drops requests in progress) with their exchanges marked as not
/// worth finishing: their connections are closed instead of reading the rest in the background
/// (a response-head timeout: an upstream already slower than the timeout). A flag of the
/// thread, because the connections are dropped deep inside the requests' futures; cleared
/// after, also on a panic.
pub(crate) fn abandoning(drop_requests: impl FnOnce()) {
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            ABANDONING.set(false);
        }
    }
    ABANDONING.set(true);
    let _clear = Clear;
    drop_requests();
}

/// The serving-thread index given to [`set_serving_thread`] on the calling thread, if any.
pub(crate) fn serving_thread() -> Option<usize> {
    THREAD.with(Cell::get)
}

/// A request's affinity key ([`Pool::affinity_key`]): its upstream credential's entry in the
/// pool's table of users. Cheap to clone (one reference count).
#[derive(Clone)]
pub struct AffinityKey(Arc<Owner>);

/// One upstream credential's state in the pool (affinity only).
struct Owner {
    /// Connections open with this credential (busy + idle), counted by [`Binding`].
    open: AtomicUsize,
    /// Requests of this credential waiting for one of its connections (see [`Affinity::Session`]),
    /// oldest first. Held while a connection of this credential goes idle or, once closed, wakes
    /// a waiter ([`Pool::closed_one_of`]), so that a request registering here misses neither.
    waiters: Mutex<VecDeque<oneshot::Sender<(usize, Idle)>>>,
}

/// A connection's binding to its credential's [`Owner`]: counted in `open` while it lives.
struct Binding(AffinityKey);

impl Binding {
    fn new(key: AffinityKey) -> Self {
        key.0.open.fetch_add(1, Ordering::Relaxed);
        Self(key)
    }

    fn open(&self) -> usize {
        self.0 .0.open.load(Ordering::Relaxed)
    }
}

impl Drop for Binding {
    fn drop(&mut self) {
        self.0 .0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The users' table: one [`Owner`] per credential in use. An entry no key refers to any more
/// (no connection, no request) is removed by the reaper, or when the table outgrows `limit`.
struct Owners {
    map: HashMap<HeaderValue, Arc<Owner>>,
    /// Entries past which an insert first removes the unused ones (doubles when at least half
    /// are still in use after that).
    limit: usize,
}

impl Owners {
    fn prune(&mut self) {
        self.map.retain(|_, owner| Arc::strong_count(owner) > 1);
        // After a burst of many users, give the table's memory back.
        if self.map.capacity() > 4 * self.map.len().max(64) {
            self.map.shrink_to_fit();
        }
    }
}

/// The pool for one upstream address.
pub struct Pool {
    addr: String,
    max_connections: usize,
    permits: Arc<Semaphore>,
    /// Idle connections, one list per serving thread (the thread whose runtime the socket is
    /// registered with) and a last one for every other thread, most recently idle last (one given
    /// back unsent has an earlier `since`, so the order is by return, not strictly by `since`).
    idle: Vec<Mutex<Vec<Idle>>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    affinity: Affinity,
    drain: Drain,
    /// Affinity only: the credentials in use.
    owners: Mutex<Owners>,
    /// Affinity: requests holding a slot while they wait for their own user's connection (not
    /// counted as busy connections: they hold none yet).
    waiting: AtomicUsize,
    /// Activity counters, read by tests, benchmarks and the metrics.
    pub stats: PoolStats,
}

struct Idle {
    h1: H1,
    /// When it went idle (one given back unsent: its previous request's first write, earlier).
    since: Instant,
    /// When it may no longer be reused: `since` + [`H1::idle_limit`].
    until: Instant,
    /// The credential this connection is bound to (affinity only).
    key: Option<Binding>,
    /// When its last request's first bytes were written ([`coarse_ms`]; for a new connection
    /// given back unsent, when it was): a bound on `since` that costs no clock read, for a
    /// request that gives it back unsent.
    sent_ms: u32,
}

/// A checked-out connection. Dropping it returns the connection to the pool only when
/// [`Conn::set_reusable`] was called (the response was read to the end), or when its request's
/// sending was dropped before any of it was written ([`Sending::Unsent`]; its idle time counted
/// from its previous request's send, so it may come back past its deadline, to be closed as
/// `expired` by whoever takes it or the reaper); the permit is released
/// after the connection is back, so a waiter finds it idle instead of opening another.
pub struct Conn {
    h1: Option<H1>,
    /// The serving thread whose runtime the socket is registered with (its idle list).
    home: usize,
    key: Option<Binding>,
    pool: Arc<Pool>,
    /// Whether this connection served a request before this one.
    pub reused: bool,
    reusable: bool,
    /// See [`H1::send`]: at [`Sending::Unsent`] a drop keeps the connection as it is, at
    /// [`Sending::HeadDue`] it leaves the exchange to [`Conn::finish_later`].
    sending: Sending,
    /// When the last request's first bytes were written ([`coarse_ms`], set by [`H1::send`]):
    /// how old an exchange left by its requester is. Until then, for a reused connection, its
    /// previous request's: its idle time is counted from then if nothing is written
    /// ([`Sending::Unsent`]). (In what was padding of this struct: a wider time made every
    /// request's moves of it slower.)
    sent_ms: u32,
    /// Why it is closed if it is not kept ([`Conn::close_as`]; by default
    /// [`Closed::Abandoned`]: the exchange was left before its end).
    closing: Closed,
    /// `None` only in the drop: after it hands the connection to a background task, or frees
    /// the slot of a closed one before waking a waiter ([`Conn::wake_a_waiter`]).
    permit: Option<OwnedSemaphorePermit>,
    /// The request's shares of the pool ([`super::share`]), released with the slot.
    held: Held,
}

impl Pool {
    /// A pool for `addr` (`host:port`) with at most `max_connections` open connections, used
    /// from `threads` serving threads (see [`set_serving_thread`]), finishing exchanges left by
    /// their requesters as `drain` says.
    pub fn new(
        addr: String,
        max_connections: usize,
        connect_timeout: Duration,
        idle_timeout: Duration,
        affinity: Affinity,
        drain: Drain,
        threads: usize,
    ) -> Arc<Self> {
        let pool = Arc::new(Self {
            addr,
            max_connections,
            permits: Arc::new(Semaphore::new(max_connections)),
            idle: (0..threads.max(1) + 1)
                .map(|_| Mutex::new(Vec::new()))
                .collect(),
            connect_timeout,
            idle_timeout,
            affinity,
            drain,
            waiting: AtomicUsize::new(0),
            owners: Mutex::new(Owners {
                map: HashMap::new(),
                limit: (8 * max_connections).max(1024),
            }),
            stats: PoolStats::default(),
        });
        spawn_reaper(Arc::downgrade(&pool), idle_timeout);
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
            .saturating_sub(self.waiting.load(Ordering::Relaxed));
        let idle = (0..self.idle.len()).map(|t| self.idle(t).len()).sum();
        (busy, idle)
    }

    fn idle(&self, thread: usize) -> MutexGuard<'_, Vec<Idle>> {
        lock(&self.idle[thread])
    }

    /// The calling thread's index into `idle`: its serving-thread index, or the last list for
    /// threads that are not serving threads.
    fn this_thread(&self) -> usize {
        let others = self.idle.len() - 1;
        THREAD
            .with(Cell::get)
            .map_or(others, |index| index % others)
    }

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
        // Looked up by reference: the value is cloned only for a new entry.
        if let Some(owner) = owners.map.get(value) {
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
        owners.map.insert(value.clone(), owner.clone());
        Some(AffinityKey(owner))
    }

    /// Takes an idle connection for `key` (any, without affinity): the calling thread's most
    /// recently idle one first, then the other threads'. Returns it with its list's index.
    fn take_idle(&self, key: Option<&AffinityKey>) -> Option<(usize, Idle)> {
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
    fn take_live(&self, key: Option<&AffinityKey>) -> Option<Idle> {
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
    fn bring_home(&self, h1: H1, home: usize) -> Option<H1> {
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
    fn put_back(&self, home: usize, mut idle: Idle) {
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

    /// Affinity: a connection bound to `binding`'s user was closed (its slot already freed).
    /// The oldest request of that user still waiting for one of its connections is woken with
    /// none handed over, to open its own in the room left, instead of sleeping out its wait for
    /// a connection that will not come back. (Not from [`Binding`]'s drop: [`Pool::share`]
    /// closes expired connections while it holds the waiters' lock.)
    fn closed_one_of(&self, binding: Binding) {
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

    /// Affinity, when `key` has no idle connection: makes room for a new one at the cap by the
    /// rules in the module docs, or returns one of `key`'s own connections handed over within
    /// [`Affinity::Session`]'s `wait` (or gone idle just as it ran out), registered with this
    /// thread's driver.
    async fn share(&self, key: &AffinityKey) -> Option<Idle> {
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
    fn close_for(&self, mine: usize, stale: Duration) -> bool {
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

    async fn connect(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
        key: Option<AffinityKey>,
    ) -> Result<Conn, ForwardError> {
        let stream = tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.addr))
            .await
            .map_err(|_| ForwardError::ConnectTimeout)?
            .map_err(|e| ForwardError::Connect(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        self.stats.opened.fetch_add(1, Ordering::Relaxed);
        Ok(Conn {
            h1: Some(H1::new(stream)),
            home: self.this_thread(),
            key: key.map(Binding::new),
            pool: self.clone(),
            reused: false,
            reusable: false,
            sending: Sending::Idle,
            sent_ms: 0,
            closing: Closed::Abandoned,
            permit: Some(permit),
            held: Held::default(),
        })
    }
}

impl Conn {
    /// The connection; present until the `Conn` is dropped.
    pub fn h1(&mut self) -> &mut H1 {
        self.h1
            .as_mut()
            .expect("connection present while Conn lives")
    }

    /// Sends `req` on the connection ([`H1::send`]), so that dropping the sending while the
    /// response head is awaited leaves the exchange to be finished in the background.
    ///
    /// Errors: see [`H1::send`].
    pub async fn send(&mut self, req: Request<UpBody>) -> Result<Head, SendError> {
        let h1 = self
            .h1
            .as_mut()
            .expect("connection present while Conn lives");
        debug_assert!(self.sending == Sending::Idle, "a send dropped unfinished");
        h1.send(req, &mut self.sending, &mut self.sent_ms).await
    }

    /// Marks the exchange complete (the response read to its end, and the request written to its
    /// end, which the upstream client's `keep_alive` includes): on drop the connection goes back
    /// to the pool.
    pub fn set_reusable(&mut self) {
        self.reusable = true;
    }

    /// Keeps the request's shares of the pool until the connection is released.
    pub fn hold(&mut self, held: Held) {
        self.held = held;
    }

    /// Records why the connection is closed if it is dropped without [`Conn::set_reusable`]
    /// (counted in [`PoolStats::closed`] at the drop).
    pub fn close_as(&mut self, reason: Closed) {
        self.closing = reason;
    }

    /// Releases a connection whose requester went away with `rest` of its exchange unread: a
    /// task on the current runtime (the one the socket is registered with) reads the rest and
    /// then keeps the connection or closes it (see [`drain`]); it holds the slot until then.
    /// Closed at once instead when the request was sent [`Drain::wait`] or more ago (a long poll
    /// or an event stream, not about to end; always, with a zero wait), when a body's rest is
    /// over [`Drain::max_bytes`] ([`super::conn::worth_finishing`]), or outside a runtime.
    pub fn finish_later(self, rest: Unfinished) {
        let Drain { wait, max_bytes } = self.pool.drain;
        let age_ms = coarse_ms().wrapping_sub(self.sent_ms);
        // Each early return closes the connection (counted `abandoned` by the drop).
        if u128::from(age_ms) >= wait.as_millis() {
            tracing::debug!(
                age_ms,
                ?rest,
                "exchange left by its requester too old to finish"
            );
            return;
        }
        if let Unfinished::Body(framing) = rest {
            if !super::conn::worth_finishing(framing, max_bytes) {
                tracing::debug!(
                    ?framing,
                    "exchange left by its requester: body rest too long"
                );
                return;
            }
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(drain(self, rest))),
            Err(_) => tracing::debug!("exchange left by its requester outside a runtime"),
        }
    }

    /// Affinity, after this connection was closed (its socket already): frees its slot, then
    /// wakes a request of its user waiting for one of its connections ([`Pool::closed_one_of`]),
    /// which finds the room left. Off the hot path: a kept connection has no key left here.
    #[cold]
    #[inline(never)]
    fn wake_a_waiter(&mut self) {
        if let Some(key) = self.key.take() {
            drop(self.permit.take());
            self.pool.closed_one_of(key);
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.sending == Sending::Unsent && !ABANDONING.get() {
            // Its requester went away before any of the request was written (the socket was not
            // yet writable): nothing was sent, so the connection is as it was.
            self.reusable = true;
        }
        if let Some(h1) = self.h1.take() {
            if self.reusable && !h1.has_leftover() {
                let now = Instant::now();
                let mut since = now;
                let mut until = now + h1.idle_limit(self.pool.idle_timeout);
                if self.sending == Sending::Unsent {
                    if self.reused {
                        // Idle since before its checkout: counted from when its previous
                        // request was sent (`sent_ms`, to the millisecond). That is no later
                        // than when it went idle, so its deadline is no later than the one the
                        // upstream's keep-alive runs against (and earlier by that exchange's
                        // length: after a long one it may be past already, which is safe). One
                        // past its deadline goes back all the same: a waiter of its user, or
                        // the next checkout or the reaper, closes it (`expired`), so a waiter
                        // is woken rather than left to its wait's end.
                        let idle_ms = coarse_ms().wrapping_sub(self.sent_ms);
                        since = now
                            .checked_sub(Duration::from_millis(idle_ms.into()))
                            .unwrap_or(now);
                        until = since + h1.idle_limit(self.pool.idle_timeout);
                    } else {
                        // New, never written: idle from now.
                        self.sent_ms = coarse_ms();
                    }
                }
                let idle = Idle {
                    h1,
                    since,
                    until,
                    key: self.key.take(),
                    sent_ms: self.sent_ms,
                };
                self.pool.put_back(self.home, idle);
            } else if self.reusable {
                // Complete, yet bytes came after the response's end.
                self.pool.stats.count_closed(Closed::Error, 1);
                tracing::debug!("upstream connection closed: bytes after its response's end");
            } else {
                let rest = std::mem::take(&mut self.sending);
                if let (Sending::HeadDue { head_request }, false) = (rest, ABANDONING.get()) {
                    // The requester went away while the head was due.
                    Conn {
                        h1: Some(h1),
                        home: self.home,
                        key: self.key.take(),
                        pool: self.pool.clone(),
                        reused: self.reused,
                        reusable: false,
                        sending: Sending::Idle,
                        sent_ms: self.sent_ms,
                        closing: Closed::Abandoned,
                        permit: self.permit.take(),
                        held: std::mem::take(&mut self.held),
                    }
                    .finish_later(Unfinished::Head { head_request });
                } else {
                    self.pool.stats.count_closed(self.closing, 1);
                    tracing::debug!(
                        reason = self.closing.label(),
                        sending = ?rest,
                        reused = self.reused,
                        age_ms = coarse_ms().wrapping_sub(self.sent_ms),
                        "upstream connection closed after its request"
                    );
                }
            }
        }
        if self.key.is_some() {
            // Closed (a kept connection, or one handed to a drain, took its key along).
            self.wake_a_waiter();
        }
        // Otherwise the permit is released after this body runs: the connection is already idle
        // (or handed over), so a waiter finds it instead of opening another.
    }
}

/// Milliseconds since the first call, wrapping every 49.7 days: 4 bytes to stamp a request
/// with, precise enough for [`Drain::wait`]. (`Instant`, read through the vDSO. rustix's
/// `CLOCK_MONOTONIC_COARSE` reader was tried and not kept: its vDSO lookup crashes callgrind,
/// which `bench/instructions.sh` runs tessera under.)
pub(super) fn coarse_ms() -> u32 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    epoch.elapsed().as_millis() as u32
}

/// Reads the rest of an exchange whose requester went away ([`H1::finish`]) for at most
/// [`Drain::wait`], then releases the connection: kept when the response was read to its end,
/// else closed. (The rest was taken out of the connection, so releasing it here cannot start
/// another drain; a task dropped unrun closes it likewise.)
async fn drain(mut conn: Conn, rest: Unfinished) {
    let Drain { wait, max_bytes } = conn.pool.drain;
    let finished = tokio::time::timeout(wait, conn.h1().finish(rest, max_bytes)).await;
    if finished == Ok(true) {
        conn.pool.stats.drained.fetch_add(1, Ordering::Relaxed);
        conn.set_reusable();
    } else {
        conn.pool.stats.drain_failed.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            timed_out = finished.is_err(),
            "upstream exchange left by its requester not finished; connection closed"
        );
    }
}

/// Closes idle connections past their limit ([`H1::idle_limit`]) and drops the users no
/// connection or request refers to any more (affinity), every half `idle_timeout` (at most 5 s),
/// while the pool lives.
fn spawn_reaper(pool: Weak<Pool>, idle_timeout: Duration) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    handle.spawn(async move {
        // At most 5 s apart: an upstream's `Keep-Alive: timeout` can expire a connection well
        // before the pool's own limit, and its socket should not wait long to be closed.
        let every = (idle_timeout / 2).clamp(Duration::from_millis(10), Duration::from_secs(5));
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
            // Credentials no connection or request refers to any more leave memory.
            lock(&pool.owners).prune();
        }
    });
}

/// A request waiting for its own user's connection (affinity): counted in [`Pool`]'s `waiting`
/// until it ends. A connection handed over through `rx` is uncounted by its sender, at the
/// handover (see [`Pool::put_back`]); otherwise the wait's end (or its drop, the client gone)
/// uncounts it. Exactly one of the two: the receiver is closed before it is looked at a last
/// time, so no handover can come after.
struct Waiting<'a> {
    pool: &'a Pool,
    rx: oneshot::Receiver<(usize, Idle)>,
    ended: bool,
}

impl<'a> Waiting<'a> {
    fn new(pool: &'a Pool, rx: oneshot::Receiver<(usize, Idle)>) -> Self {
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
    fn end(
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
    fn last_look(&mut self) -> (Option<(usize, Idle)>, bool) {
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

/// Locks `m`, also after a panic elsewhere poisoned it (the pool's lists stay consistent: each
/// change is one push or remove).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
