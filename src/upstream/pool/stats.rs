//! What the pool counts: connections opened, reused, moved, handed over, drained, and closed by
//! reason (the metrics' `reason` label).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::upstream::conn::H1;

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
    /// same user (see [`super::Affinity::Session`]); these are counted in `reused` too.
    pub handed_over: AtomicU64,
    /// Affinity: requests of a user already holding its share of the full pool that got no
    /// connection of their own (the wait ran out, or `wait` is zero) and so closed another
    /// user's idle one, if one was still idle, to open their own.
    pub wait_expired: AtomicU64,
    /// Exchanges whose requester went away, read to their end in the background and their
    /// connection kept (see the module docs).
    pub drained: AtomicU64,
    /// Exchanges whose requester went away that were read in the background but could not be
    /// finished so (no response end within [`super::Drain::wait`] or [`super::Drain::max_bytes`], a response that
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

    pub(super) fn count_closed(&self, reason: Closed, n: usize) {
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
    /// Idle while more than `upstream.max_idle_connections` were: the longest idle closed.
    Surplus,
    /// New, and not answering the probe (`upstream.probe_timeout_ms`): accepted by the upstream's
    /// kernel and not served (Cyrus past `maxchild`); the pool's cap was lowered for a minute.
    Unserved,
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
    pub const ALL: [Closed; 8] = [
        Closed::Upstream,
        Closed::Expired,
        Closed::Surplus,
        Closed::Unserved,
        Closed::Evicted,
        Closed::Abandoned,
        Closed::Error,
        Closed::Tunnel,
    ];

    /// The metric label value: `upstream`, `expired`, `surplus`, `unserved`, `evicted`,
    /// `abandoned`, `error` or `tunnel`.
    pub fn label(self) -> &'static str {
        match self {
            Closed::Upstream => "upstream",
            Closed::Expired => "expired",
            Closed::Surplus => "surplus",
            Closed::Unserved => "unserved",
            Closed::Evicted => "evicted",
            Closed::Abandoned => "abandoned",
            Closed::Error => "error",
            Closed::Tunnel => "tunnel",
        }
    }

    /// Why an idle connection reusable until `until` is not reusable at `now`: expired, or
    /// closed (or written to unasked) by the upstream; `None` when it is.
    pub(super) fn of_idle(h1: &mut H1, until: Instant, now: Instant) -> Option<Self> {
        if now >= until {
            Some(Closed::Expired)
        } else if !h1.is_alive() {
            Some(Closed::Upstream)
        } else {
            None
        }
    }
}
