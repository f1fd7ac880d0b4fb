//! A checked-out connection ([`Conn`]) and what its drop decides: back to the pool (idle, or
//! straight to a waiting request of its user), to a background drain, or closed with its reason.
//! Must never: put back a connection whose exchange did not end cleanly.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::Request;
use tokio::sync::OwnedSemaphorePermit;

use crate::upstream::conn::{Head, SendError, Sending, Unfinished, H1};
use crate::upstream::share::Held;
use crate::upstream::UpBody;

use super::affinity::Binding;
use super::drain::{coarse_ms, ABANDONING};
use super::stats::Closed;
use super::{Idle, Pool};

/// A checked-out connection. Dropping it returns the connection to the pool only when
/// [`Conn::set_reusable`] was called (the response was read to the end), or when its request's
/// sending was dropped before any of it was written ([`Sending::Unsent`]; its idle time counted
/// from its previous request's send, so it may come back past its deadline, to be closed as
/// `expired` by whoever takes it or the reaper); the permit is released
/// after the connection is back, so a waiter finds it idle instead of opening another.
pub struct Conn {
    pub(super) h1: Option<H1>,
    /// The serving thread whose runtime the socket is registered with (its idle list).
    pub(super) home: usize,
    pub(super) key: Option<Binding>,
    pub(super) pool: Arc<Pool>,
    /// Whether this connection served a request before this one.
    pub reused: bool,
    pub(super) reusable: bool,
    /// See [`H1::send`]: at [`Sending::Unsent`] a drop keeps the connection as it is, at
    /// [`Sending::HeadDue`] it leaves the exchange to [`Conn::finish_later`].
    pub(super) sending: Sending,
    /// When the last request's first bytes were written ([`coarse_ms`], set by [`H1::send`]):
    /// how old an exchange left by its requester is. Until then, for a reused connection, its
    /// previous request's: its idle time is counted from then if nothing is written
    /// ([`Sending::Unsent`]). (In what was padding of this struct: a wider time made every
    /// request's moves of it slower.)
    pub(super) sent_ms: u32,
    /// Why it is closed if it is not kept ([`Conn::close_as`]; by default
    /// [`Closed::Abandoned`]: the exchange was left before its end).
    pub(super) closing: Closed,
    /// `None` only in the drop: after it hands the connection to a background task, or frees
    /// the slot of a closed one before waking a waiter ([`Conn::wake_a_waiter`]).
    pub(super) permit: Option<OwnedSemaphorePermit>,
    /// The request's shares of the pool ([`super::share`]), released with the slot.
    pub(super) held: Held,
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

    /// Affinity, after this connection was closed (its socket already): frees its slot, then
    /// wakes a request of its user waiting for one of its connections ([`Pool::closed_one_of`]),
    /// which finds the room left. Off the hot path: a kept connection has no key left here.
    #[cold]
    #[inline(never)]
    pub(super) fn wake_a_waiter(&mut self) {
        if let Some(key) = self.key.take() {
            drop(self.permit.take());
            self.pool.closed_one_of(key);
        }
    }
}
