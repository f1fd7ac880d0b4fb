//! Exchanges whose requester went away, finished in the background.
//!
//! A request dropped while its response head is awaited
//! (the request written in full), or a response body dropped with a short rest (at most
//! [`Drain::max_bytes`], or chunked), less than [`Drain::wait`] after the request was sent,
//! leaves its connection to a background task on the runtime its socket is registered with (the
//! serving thread's), which reads the rest for at most [`Drain::wait`] and then keeps the
//! connection (or closes it). A zero wait turns this off. The connection keeps its slot
//! meanwhile: the cap counts it. An older exchange (a long poll, an event stream) is closed at
//! once: its answer is not about to end.
//! Without this, every client that leaves mid-request (a browser navigating away, a load
//! generator at its run's end) costs a new upstream connection.
//!
//! An exchange given up before its response head frees its slot, but keeps its shares (its
//! user's, its downstream connection's, its `upstream.max_event_streams` place) until the
//! upstream answers it or its response-head timeout would have ended it: the upstream works on
//! the request all the same (a closed connection does not stop a Cyrus child), so a client that
//! cancels its requests (HTTP/2 resets, closed connections) never has more of them at the
//! upstream than its share. A hung upstream does not hold the pool.

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::upstream::conn::Unfinished;
use crate::upstream::conn::{worth_finishing, DRAIN_BYTES};

use super::conn::Conn;

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

thread_local! {
    /// Set while [`abandoning`] runs on this thread.
    pub(super) static ABANDONING: Cell<bool> = const { Cell::new(false) };
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

/// Milliseconds since the first call, wrapping every 49.7 days: 4 bytes to stamp a request
/// with, precise enough for [`Drain::wait`]. (`Instant`, read through the vDSO; not rustix's
/// `CLOCK_MONOTONIC_COARSE` reader, whose vDSO lookup crashes callgrind, which
/// `bench/instructions.sh` runs tessera under.)
pub(crate) fn coarse_ms() -> u32 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    epoch.elapsed().as_millis() as u32
}

/// Reads the rest of an exchange whose requester went away ([`crate::upstream::conn::H1::finish`]) for at most
/// [`Drain::wait`], then releases the connection: kept when the response was read to its end,
/// else closed. (The rest was taken out of the connection, so releasing it here cannot start
/// another drain; a task dropped unrun closes it likewise.)
pub(super) async fn drain(mut conn: Conn, mut rest: Unfinished) {
    let Drain { wait, max_bytes } = conn.pool.drain;
    let finished = tokio::time::timeout(wait, conn.h1().finish(&mut rest, max_bytes)).await;
    if finished == Ok(true) {
        conn.pool.stats.drained.fetch_add(1, Ordering::Relaxed);
        conn.set_reusable();
    } else {
        if finished.is_err() {
            // Still unanswered (the head due) when the wait ran out.
            conn.keep_shares_while_due(rest);
        }
        conn.pool.stats.drain_failed.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            timed_out = finished.is_err(),
            "upstream exchange left by its requester not finished; connection closed"
        );
    }
}

impl Conn {
    /// Frees this exchange's slot but keeps its shares of the pool
    /// ([`crate::upstream::share::Held`]) until the upstream answers (a whole final response
    /// head, `rest`, or the connection's end) or its response-head timeout (counted
    /// from its send) would have ended it (module docs): a task on the current runtime holds
    /// the socket, outside the pool's count, until then, and closes it. Nothing is kept past
    /// that time, for an exchange whose head was read (`rest` a body), without a share, or
    /// outside a runtime.
    pub(super) fn keep_shares_while_due(&mut self, mut rest: Unfinished) {
        if let Unfinished::Body(_) = rest {
            return;
        }
        let age = Duration::from_millis(coarse_ms().wrapping_sub(self.sent_ms).into());
        let due = self.pool.header_timeout.saturating_sub(age);
        if due.is_zero() || self.held.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (Some(mut h1), held) = (self.h1.take(), std::mem::take(&mut self.held)) else {
            return;
        };
        // Closed here, not by the drop (which finds no socket left).
        self.pool.stats.count_closed(self.closing, 1);
        drop(runtime.spawn(async move {
            // A body budget of 0: done once the head is read.
            let _ = tokio::time::timeout(due, h1.finish(&mut rest, 0)).await;
            drop(held);
        }));
    }

    /// Releases a connection whose requester went away with `rest` of its exchange unread: a
    /// task on the current runtime (the one the socket is registered with) reads the rest and
    /// then keeps the connection or closes it (see [`drain`]); it holds the slot until then.
    /// Closed at once instead when the request was sent [`Drain::wait`] or more ago (a long poll
    /// or an event stream, not about to end; always, with a zero wait), when a body's rest is
    /// over [`Drain::max_bytes`] ([`worth_finishing`]), or outside a runtime. One closed before
    /// its head keeps its shares ([`Conn::keep_shares_while_due`]).
    pub fn finish_later(mut self, rest: Unfinished) {
        let Drain { wait, max_bytes } = self.pool.drain;
        let age_ms = coarse_ms().wrapping_sub(self.sent_ms);
        // Each early return closes the connection (counted `abandoned` by the drop).
        if u128::from(age_ms) >= wait.as_millis() {
            self.keep_shares_while_due(rest);
            tracing::debug!(
                age_ms,
                ?rest,
                "exchange left by its requester too old to finish"
            );
            return;
        }
        if let Unfinished::Body(framing) = rest {
            if !worth_finishing(framing, max_bytes) {
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
}
