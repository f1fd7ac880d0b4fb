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
//! **Affinity.** With [`Affinity::Session`] every connection is bound to the first request's
//! upstream credential (its `Authorization` value) and is reused only for requests carrying the
//! same one, so one upstream connection never carries two users' requests (an upstream that keeps
//! per-connection auth state cannot mix them up). A request whose credential has no idle
//! connection opens one; at the cap it first closes the longest-idle connection of another user.
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use http::HeaderValue;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::h1::H1;
use super::ForwardError;

/// Counters of pool activity (monotonic since start).
#[derive(Debug, Default)]
pub struct PoolStats {
    /// Connections opened to the upstream.
    pub opened: AtomicU64,
    /// Requests sent on a connection that had served an earlier request.
    pub reused: AtomicU64,
    /// Requests retried on a fresh connection after a reused one failed.
    pub retried: AtomicU64,
    /// Idle connections moved to the I/O driver of another serving thread that took them.
    pub moved: AtomicU64,
}

/// Which requests may share an upstream connection (`upstream.affinity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Affinity {
    /// Any request may reuse any idle connection (`"none"`, the default).
    #[default]
    None,
    /// A connection carries only requests with the same upstream credential (`"session"`).
    Session,
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

/// The serving-thread index given to [`set_serving_thread`] on the calling thread, if any.
pub(crate) fn serving_thread() -> Option<usize> {
    THREAD.with(Cell::get)
}

/// The pool for one upstream address.
pub struct Pool {
    addr: String,
    max_connections: usize,
    permits: Arc<Semaphore>,
    /// Idle connections, one list per serving thread (the thread whose runtime the socket is
    /// registered with) and a last one for every other thread, most recently idle last.
    idle: Vec<Mutex<Vec<Idle>>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    affinity: Affinity,
    /// Activity counters, read by tests, benchmarks and (later) metrics.
    pub stats: PoolStats,
}

struct Idle {
    h1: H1,
    /// When it went idle.
    since: Instant,
    /// When it may no longer be reused: `since` + [`H1::idle_limit`].
    until: Instant,
    /// The credential this connection is bound to (affinity only).
    key: Option<HeaderValue>,
}

/// A checked-out connection. Dropping it returns the connection to the pool only when
/// [`Conn::set_reusable`] was called (the response was read to the end); the permit is released
/// after the connection is back, so a waiter finds it idle instead of opening another.
pub struct Conn {
    h1: Option<H1>,
    /// The serving thread whose runtime the socket is registered with (its idle list).
    home: usize,
    key: Option<HeaderValue>,
    pool: Arc<Pool>,
    /// Whether this connection served a request before this one.
    pub reused: bool,
    reusable: bool,
    _permit: OwnedSemaphorePermit,
}

impl Pool {
    /// A pool for `addr` (`host:port`) with at most `max_connections` open connections, used
    /// from `threads` serving threads (see [`set_serving_thread`]).
    pub fn new(
        addr: String,
        max_connections: usize,
        connect_timeout: Duration,
        idle_timeout: Duration,
        affinity: Affinity,
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
            stats: PoolStats::default(),
        });
        spawn_reaper(Arc::downgrade(&pool), idle_timeout);
        pool
    }

    /// Connections open now, as `(busy, idle)`: busy ones are checked out by a request (one being
    /// opened included: each holds one of the `max_connections` slots), idle ones wait for reuse
    /// (some may have been closed by the upstream and not noticed yet). `busy + idle` stays
    /// within `max_connections`, except that a connection being put back or taken out is counted
    /// in both for an instant (it is idle before its slot is freed, and a request takes a slot
    /// before it takes an idle connection).
    pub fn connections(&self) -> (usize, usize) {
        let busy = self
            .max_connections
            .saturating_sub(self.permits.available_permits());
        let idle = (0..self.idle.len()).map(|t| self.idle(t).len()).sum();
        (busy, idle)
    }

    fn idle(&self, thread: usize) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.idle[thread].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The calling thread's index into `idle`: its serving-thread index, or the last list for
    /// threads that are not serving threads.
    fn this_thread(&self) -> usize {
        let others = self.idle.len() - 1;
        THREAD
            .with(Cell::get)
            .map_or(others, |index| index % others)
    }

    /// The affinity key of a request with these (injected) headers: its `Authorization` value
    /// with [`Affinity::Session`] (a refcounted clone), else `None`.
    pub fn affinity_key(&self, headers: &http::HeaderMap) -> Option<HeaderValue> {
        match self.affinity {
            Affinity::None => None,
            Affinity::Session => headers.get(http::header::AUTHORIZATION).cloned(),
        }
    }

    /// Takes an idle connection for `key` (any, without affinity): the calling thread's most
    /// recently idle one first, then the other threads'. Returns it with its list's index.
    fn take_idle(&self, key: &Option<HeaderValue>) -> Option<(usize, Idle)> {
        let first = self.this_thread();
        (0..self.idle.len()).find_map(|offset| {
            let thread = (first + offset) % self.idle.len();
            let mut idle = self.idle(thread);
            let taken = match self.affinity {
                Affinity::None => idle.pop(),
                Affinity::Session => idle
                    .iter()
                    .rposition(|i| i.key == *key)
                    .map(|at| idle.remove(at)),
            };
            taken.map(|i| (thread, i))
        })
    }

    /// Waits (FIFO) for a slot, then reuses the most recently idle live connection or opens one.
    /// `key` is the request's [`Pool::affinity_key`]: with [`Affinity::Session`] only a
    /// connection bound to the same key is reused.
    ///
    /// Errors: [`ForwardError::Connect`] / [`ForwardError::ConnectTimeout`] when a new connection
    /// is needed and cannot be made.
    pub async fn checkout(
        self: &Arc<Self>,
        key: Option<HeaderValue>,
    ) -> Result<Conn, ForwardError> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ForwardError::Closed)?;
        let here = self.this_thread();
        loop {
            let Some((
                home,
                Idle {
                    mut h1,
                    since,
                    until,
                    key,
                },
            )) = self.take_idle(&key)
            else {
                break;
            };
            let expired = Instant::now() >= until;
            if expired || !h1.is_alive() {
                tracing::debug!(
                    expired,
                    idle_ms = since.elapsed().as_millis() as u64,
                    "idle upstream connection closed at checkout"
                );
                continue;
            }
            if home != here {
                h1 = match h1.rehome() {
                    Ok(h1) => h1,
                    Err(e) => {
                        tracing::debug!(cause = %e, "could not move an idle upstream connection to this thread; closed it");
                        continue;
                    }
                };
                self.stats.moved.fetch_add(1, Ordering::Relaxed);
            }
            self.stats.reused.fetch_add(1, Ordering::Relaxed);
            return Ok(Conn {
                h1: Some(h1),
                home: here,
                key,
                pool: self.clone(),
                reused: true,
                reusable: false,
                _permit: permit,
            });
        }
        if self.affinity == Affinity::Session {
            self.make_room();
        }
        // Boxed: connecting is rare once the pool is warm, and inline it would enlarge every
        // request's future.
        Box::pin(self.connect(permit, key)).await
    }

    /// Before opening a connection while idle ones exist (affinity: bound to other credentials;
    /// the retry), closes the longest-idle connections until busy + idle stays within the cap
    /// (the sockets are closed before this returns).
    fn make_room(&self) {
        // Busy connections, this request's included, hold the permits not available.
        let idle_now: usize = (0..self.idle.len()).map(|t| self.idle(t).len()).sum();
        let excess = idle_now.saturating_sub(self.permits.available_permits());
        let mut evicted = Vec::with_capacity(excess);
        for _ in 0..excess {
            // The longest-idle connection of all threads (each list's first is its oldest).
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
        key: Option<HeaderValue>,
    ) -> Result<Conn, ForwardError> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ForwardError::Closed)?;
        drop(self.idle(self.this_thread()).pop());
        self.make_room();
        self.stats.retried.fetch_add(1, Ordering::Relaxed);
        self.connect(permit, key).await
    }

    async fn connect(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
        key: Option<HeaderValue>,
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
            key,
            pool: self.clone(),
            reused: false,
            reusable: false,
            _permit: permit,
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

    /// Marks the exchange complete (the response read to its end, and the request written to its
    /// end, which the upstream client's `keep_alive` includes): on drop the connection goes back
    /// to the pool.
    pub fn set_reusable(&mut self) {
        self.reusable = true;
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(h1) = self.h1.take() {
            if self.reusable && !h1.has_leftover() {
                let since = Instant::now();
                let until = since + h1.idle_limit(self.pool.idle_timeout);
                self.pool.idle(self.home).push(Idle {
                    h1,
                    since,
                    until,
                    key: self.key.take(),
                });
            } else {
                tracing::debug!(
                    exchange_complete = self.reusable,
                    leftover = h1.has_leftover(),
                    "upstream connection closed after its request"
                );
            }
        }
        // `_permit` is released after this body runs: the connection is already idle.
    }
}

/// Closes idle connections past their limit ([`H1::idle_limit`]), every half `idle_timeout` (at
/// most 5 s), while the pool lives.
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
                pool.idle(t)
                    .retain_mut(|i| now < i.until && i.h1.is_alive());
            }
        }
    });
}
