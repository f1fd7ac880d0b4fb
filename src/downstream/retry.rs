//! QUIC address validation (RFC 9000 section 8): which handshakes are answered with a Retry
//! (`http3.retry`), and the count of handshakes in progress from addresses not validated yet
//! that the automatic policy reads. Must never: let a flood of forged source addresses hold
//! more than its bound of handshakes (and of `server.max_connections` places).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::quic::Quic;
use super::settings::Retry;

/// Unvalidated handshakes in progress past which [`Retry::Auto`] answers new ones with a Retry:
/// 128, or an eighth of `server.max_connections` when that is fewer, so that a
/// flood of spoofed Initials holds few of the places TCP clients share.
pub(super) fn unvalidated_limit(max_connections: Option<usize>) -> u64 {
    match max_connections {
        Some(max) => (max as u64 / 8).clamp(1, 128),
        None => 128,
    }
}

impl Quic {
    /// Whether a handshake from an address not validated yet is answered with a Retry now.
    fn asks_retry(&self) -> bool {
        match self.retry {
            Retry::Always => true,
            Retry::Auto => {
                self.counts.unvalidated.load(Ordering::Relaxed) >= self.unvalidated_limit
            }
        }
    }

    /// The client at `incoming`'s address has not proved it receives there: `None` when it has,
    /// else a mark counted under [`crate::telemetry::QuicCounts::unvalidated`] until dropped
    /// (at the handshake's end).
    pub(super) fn unvalidated(self: &Arc<Self>, incoming: &quinn::Incoming) -> Option<Unvalidated> {
        if incoming.remote_address_validated() {
            return None;
        }
        self.counts.unvalidated.fetch_add(1, Ordering::Relaxed);
        Some(Unvalidated(self.clone()))
    }
}

/// A handshake in progress from an unvalidated address, counted until dropped.
pub(super) struct Unvalidated(Arc<Quic>);

impl Drop for Unvalidated {
    fn drop(&mut self) {
        self.0.counts.unvalidated.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Answers `incoming` with a Retry when its address is not validated and the policy asks for
/// one now (`None`: answered, the client comes back with a token as a new `Incoming`);
/// otherwise gives it back.
pub(super) fn retried(quic: &Quic, incoming: quinn::Incoming) -> Option<quinn::Incoming> {
    if incoming.remote_address_validated() || !quic.asks_retry() {
        return Some(incoming);
    }
    match incoming.retry() {
        Ok(()) => {
            let retries = quic.counts.retries.fetch_add(1, Ordering::Relaxed);
            if retries == 0 && quic.retry == Retry::Auto {
                tracing::warn!(
                    in_progress = quic.unvalidated_limit,
                    "HTTP/3: many handshakes from unvalidated addresses in progress (spoofed \
                     Initials?); new ones are answered with a Retry while that lasts"
                );
            }
            None
        }
        // Not reached: an unvalidated address may always be sent a Retry.
        Err(e) => Some(e.into_incoming()),
    }
}

#[cfg(test)]
mod tests {
    use super::unvalidated_limit;

    #[test]
    fn the_automatic_bound_is_128_or_an_eighth_of_max_connections() {
        assert_eq!(unvalidated_limit(None), 128);
        assert_eq!(unvalidated_limit(Some(10_000)), 128);
        assert_eq!(unvalidated_limit(Some(16)), 2);
        assert_eq!(unvalidated_limit(Some(3)), 1);
    }
}
