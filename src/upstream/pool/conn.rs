//! A checked-out connection ([`Conn`]) and what its drop decides: back to the pool (idle, or
//! straight to a waiting request of its user), to a background drain, or closed with its reason.
//! Must never: put back a connection whose exchange did not end cleanly.

use std::future::Future;
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
    /// The request's shares of the pool ([`crate::upstream::share`]), released with the slot.
    pub(super) held: Held,
}

/// What the drop of a [`Conn`] does with its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Back to the pool: the exchange ended cleanly, or nothing of the request was written.
    Keep,
    /// Closed: complete, yet bytes came after the response's end.
    CloseLeftover,
    /// To a background task that reads the response the requester left while its head was due
    /// ([`Conn::finish_later`]); `head_request`: the request was a `HEAD`.
    FinishLater { head_request: bool },
    /// Closed, counted under the `Conn`'s [`Closed`] reason.
    Close,
}

/// The keep/close decision of a drop: kept when the exchange is complete (`reusable`) or was
/// never written ([`Sending::Unsent`]) and has no bytes after its end (`leftover`); finished in
/// the background when the head was due; else closed. While the runtime shuts down
/// (`abandoning`), nothing unfinished is kept or finished.
fn fate(reusable: bool, sending: Sending, leftover: bool, abandoning: bool) -> Fate {
    let reusable = reusable || (sending == Sending::Unsent && !abandoning);
    match sending {
        _ if reusable && !leftover => Fate::Keep,
        _ if reusable => Fate::CloseLeftover,
        Sending::HeadDue { head_request } if !abandoning => Fate::FinishLater { head_request },
        _ => Fate::Close,
    }
}

/// When a kept connection's idle time starts and ends (`limit` long): now, or for a reused one
/// whose new request was never written, when its previous request was sent (`unsent_idle_ms`
/// ago), so its deadline is no later than the one the upstream's keep-alive runs against (and
/// may be past already, which is safe: whoever takes it, or the reaper, closes it as expired,
/// and a waiter is woken rather than left to its wait's end).
fn idle_window(now: Instant, limit: Duration, unsent_idle_ms: Option<u32>) -> (Instant, Instant) {
    let since = unsent_idle_ms.map_or(now, |ms| {
        now.checked_sub(Duration::from_millis(ms.into()))
            .unwrap_or(now)
    });
    (since, since + limit)
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(h1) = self.h1.take() {
            let sending = std::mem::take(&mut self.sending);
            match fate(self.reusable, sending, h1.has_leftover(), ABANDONING.get()) {
                Fate::Keep => self.keep(h1, sending),
                Fate::CloseLeftover => {
                    self.pool.stats.count_closed(Closed::Error, 1);
                    tracing::debug!("upstream connection closed: bytes after its response's end");
                }
                Fate::FinishLater { head_request } => Conn {
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
                .finish_later(Unfinished::Head { head_request }),
                Fate::Close => {
                    self.pool.stats.count_closed(self.closing, 1);
                    tracing::debug!(
                        reason = self.closing.label(),
                        ?sending,
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
    /// Puts the connection back in the pool, idle (see [`idle_window`]).
    fn keep(&mut self, h1: H1, sending: Sending) {
        let unsent_idle_ms = match sending {
            Sending::Unsent if self.reused => Some(coarse_ms().wrapping_sub(self.sent_ms)),
            Sending::Unsent => {
                // New, never written: idle from now.
                self.sent_ms = coarse_ms();
                None
            }
            _ => None,
        };
        let limit = h1.idle_limit(self.pool.idle_timeout);
        let (since, until) = idle_window(Instant::now(), limit, unsent_idle_ms);
        let idle = Idle {
            h1,
            since,
            until,
            key: self.key.take(),
            sent_ms: self.sent_ms,
        };
        self.pool.put_back(self.home, idle);
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
    /// Errors: see [`H1::send`]. `H1::send`'s own future, not one wrapping it: an async
    /// wrapper cost a 448-byte copy of it per request.
    pub fn send(
        &mut self,
        req: Request<UpBody>,
    ) -> impl Future<Output = Result<Head, SendError>> + Send + '_ {
        let h1 = self
            .h1
            .as_mut()
            .expect("connection present while Conn lives");
        debug_assert!(self.sending == Sending::Idle, "a send dropped unfinished");
        h1.send(req, &mut self.sending, &mut self.sent_ms)
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
    /// (counted in [`super::PoolStats::closed`] at the drop).
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

#[cfg(test)]
mod tests {
    use super::*;

    const HEAD_DUE: Sending = Sending::HeadDue {
        head_request: false,
    };

    #[test]
    fn a_complete_exchange_is_kept_unless_bytes_follow_it() {
        for sending in [Sending::Idle, Sending::Unsent, HEAD_DUE] {
            assert_eq!(fate(true, sending, false, false), Fate::Keep);
            assert_eq!(fate(true, sending, true, false), Fate::CloseLeftover);
        }
    }

    #[test]
    fn a_request_never_written_keeps_its_connection_except_at_shutdown() {
        assert_eq!(fate(false, Sending::Unsent, false, false), Fate::Keep);
        assert_eq!(fate(false, Sending::Unsent, false, true), Fate::Close);
    }

    #[test]
    fn a_head_left_due_is_finished_in_the_background_except_at_shutdown() {
        let head = Sending::HeadDue { head_request: true };
        assert_eq!(
            fate(false, head, false, false),
            Fate::FinishLater { head_request: true }
        );
        assert_eq!(fate(false, head, false, true), Fate::Close);
    }

    #[test]
    fn an_exchange_left_midway_is_closed() {
        assert_eq!(fate(false, Sending::Idle, false, false), Fate::Close);
        assert_eq!(fate(false, Sending::Idle, true, false), Fate::Close);
    }

    #[test]
    fn an_unsent_reuse_is_idle_from_its_previous_send() {
        let now = Instant::now();
        let limit = Duration::from_secs(4);
        assert_eq!(idle_window(now, limit, None), (now, now + limit));
        let since = now - Duration::from_millis(1500);
        assert_eq!(idle_window(now, limit, Some(1500)), (since, since + limit));
    }
}
