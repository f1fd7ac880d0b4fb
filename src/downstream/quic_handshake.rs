//! A QUIC connection's handshake as its requests see it: taken at once as 0-RTT when the
//! client resumes with early data, else awaited; then whether it is complete and the client's
//! address proven, which the 0-RTT policy ([`super::http3`]) asks of each request.

use tokio::sync::watch;

use super::quic::{Quic, H3_NO_ERROR};
use super::retry::Unvalidated;

/// Whether a connection's handshake is complete, asked when a request is taken.
#[derive(Clone)]
pub(super) struct Handshake {
    conn: quinn::Connection,
    /// Turns true when quinn reports the handshake complete (to wake held requests).
    done: watch::Receiver<bool>,
    /// The client's address was proven before the handshake (a Retry, or a token from an
    /// earlier connection): an early flight from it is no forged source's.
    address_validated: bool,
}

impl Handshake {
    pub(super) fn new(
        conn: quinn::Connection,
        done: watch::Receiver<bool>,
        address_validated: bool,
    ) -> Self {
        Self {
            conn,
            done,
            address_validated,
        }
    }

    /// Complete now: the TLS exporter (RFC 8446 section 7.5) answers only once the server has
    /// the client's Finished, read from the connection's own state, so a request that arrives
    /// in the same datagram as the Finished is not taken as early.
    pub(super) fn complete(&self) -> bool {
        *self.done.borrow() || handshake_complete(&self.conn)
    }

    /// Resolves once the handshake is complete (`true`) or the connection ended without
    /// completing it (`false`: a replayed or cut early flight, never to be forwarded).
    pub(super) async fn wait(&mut self) -> bool {
        self.done.wait_for(|done| *done).await.is_ok()
    }

    /// Whether the client's address is proven now: before the handshake by a Retry or a
    /// token, else by the completed handshake.
    pub(super) fn address_proven(&self) -> bool {
        self.address_validated || self.complete()
    }
}

/// Whether `conn`'s handshake is complete: the TLS exporter (RFC 8446 section 7.5) answers only
/// once the server has the client's Finished, and never for a connection that ended before it.
fn handshake_complete(conn: &quinn::Connection) -> bool {
    let mut probe = [0u8; 1];
    conn.export_keying_material(&mut probe, b"EXPORTER-tessera-handshake", b"")
        .is_ok()
}

/// A QUIC connection's handshake: taken at once as 0-RTT when the client resumes with early
/// data, else awaited; at most `server.header_read_timeout_ms` either way, as a TLS handshake
/// over TCP. Returns the connection and what turns true once the handshake is complete;
/// `None` when it failed. `unvalidated` is dropped when the handshake ends.
pub(super) async fn handshake(
    quic: &Quic,
    incoming: quinn::Incoming,
    unvalidated: Option<Unvalidated>,
) -> Option<(quinn::Connection, watch::Receiver<bool>)> {
    let connecting = match incoming.accept() {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(cause = %e, "QUIC connection refused");
            return None;
        }
    };
    // `true` once the handshake is complete: the moment a request that is not safe to replay
    // may go on (RFC 8470 section 5.1).
    let (done, handshake) = watch::channel(false);
    // Without 0-RTT the connection is taken only once the handshake is complete. With it, a
    // request seen before the completion reaches this task is taken as early: the safe side.
    let early = if quic.early_data {
        connecting.into_0rtt()
    } else {
        Err(connecting)
    };
    let limit = quic.header_read_timeout;
    let conn = match early {
        Ok((conn, accepted)) => {
            // quinn resolves `accepted` when the handshake completes or when the connection
            // ends before it (on a server its value tells neither apart): in the second case
            // `done` is dropped without turning true, and held requests are dropped with it.
            let probe = conn.clone();
            tokio::spawn(async move {
                let ended = tokio::time::timeout(limit, accepted).await;
                drop(unvalidated);
                if handshake_complete(&probe) {
                    let _ = done.send(true);
                } else if ended.is_err() {
                    probe.close(H3_NO_ERROR, b"handshake timeout");
                }
            });
            conn
        }
        Err(connecting) => {
            let ended = tokio::select! {
                ended = tokio::time::timeout(limit, connecting) => ended,
                // A handshake still in progress is not one of the connections the drain waits
                // for.
                () = quic.shutdown.cancelled() => return None,
            };
            drop(unvalidated);
            match ended {
                Ok(Ok(conn)) => {
                    let _ = done.send(true);
                    conn
                }
                Ok(Err(e)) => {
                    // `?`: a peer's close reason is its own bytes; Debug escapes line breaks.
                    tracing::debug!(cause = ?e, "QUIC handshake failed");
                    return None;
                }
                // Dropping `Connecting` closes the connection.
                Err(_) => {
                    tracing::debug!("QUIC handshake not done within server.header_read_timeout_ms");
                    return None;
                }
            }
        }
    };
    Some((conn, handshake))
}
