//! A new upstream connection: TCP, then TLS for an `https://` upstream, then, with
//! `upstream.probe_timeout_ms`, the probe ([`super::probe`]). A connection the upstream accepted
//! and does not serve is closed and its slot taken off the cap. Over TLS the handshake is the
//! first answer such a connection never gives (the upstream's worker does it), so while probing
//! the handshake is held to the probe's limit too, not to the whole connect timeout.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rustix::net::sockopt::set_socket_linger;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::either::Either;

use super::probe::{self, Probed};
use super::{AffinityKey, Binding, Closed, Conn, Held, Pool, Sending, CAP_RESTORE, H1};
use crate::upstream::{ForwardError, Transport, UpIo};

/// How opening a connection ended, short of an error.
enum Opened {
    Ready(UpIo),
    /// The TLS handshake did not end within the probe's limit (given): accepted, not served.
    Unserved(Duration),
}

impl Pool {
    /// A new connection for the holder of `permit`: opened, probed while probing is on, and
    /// handed out unused. An unserved one is closed and another slot waited for.
    ///
    /// Errors: [`ForwardError::Connect`] / [`ForwardError::ConnectTimeout`].
    pub(super) async fn connect(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
        key: Option<AffinityKey>,
    ) -> Result<Conn, ForwardError> {
        let probing = self.probe.filter(|_| self.probing.load(Ordering::Relaxed));
        let opened = self.open(probing).await?;
        self.stats.opened.fetch_add(1, Ordering::Relaxed);
        let mut stream = match opened {
            Opened::Ready(stream) => stream,
            Opened::Unserved(limit) => {
                self.unserved(None, permit, limit);
                return Box::pin(self.checkout(key)).await;
            }
        };
        if let Some(limit) = probing {
            match probe::probe(&mut stream, &self.addr, limit).await {
                Probed::Served => {}
                Probed::Unsupported => {
                    // Closed before the plain connect that replaces it.
                    drop(stream);
                    self.probing.store(false, Ordering::Relaxed);
                    self.stats.count_closed(Closed::Error, 1);
                    tracing::warn!(
                        "upstream answers OPTIONS * unusably; upstream.probe_timeout_ms turned off"
                    );
                    return Box::pin(self.connect(permit, key)).await;
                }
                Probed::Unserved => {
                    self.unserved(Some(stream), permit, limit);
                    return Box::pin(self.checkout(key)).await;
                }
            }
        }
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

    /// A new connection: TCP, then TLS for an `https://` upstream, both within
    /// `upstream.connect_timeout_ms`; with `probing` (the probe's limit), the TLS handshake
    /// within that limit, or the connection is [`Opened::Unserved`].
    async fn open(&self, probing: Option<Duration>) -> Result<Opened, ForwardError> {
        let deadline = Instant::now() + self.connect_timeout;
        let stream = tokio::time::timeout_at(deadline, TcpStream::connect(&self.addr))
            .await
            .map_err(|_| ForwardError::ConnectTimeout)?
            .map_err(|e| ForwardError::Connect(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        let Some(tls) = &self.tls else {
            return Ok(Opened::Ready(Either::Left(stream)));
        };
        let unserved = probing.filter(|limit| Instant::now() + *limit < deadline);
        if unserved.is_some() {
            // Reset, not closed, if left mid-handshake: the upstream's backlog drops it.
            let _ = set_socket_linger(&stream, Some(Duration::ZERO));
        }
        let until = unserved.map_or(deadline, |limit| Instant::now() + limit);
        let stream = match tokio::time::timeout_at(until, tls.handshake(stream)).await {
            Err(_) => {
                return match unserved {
                    Some(limit) => Ok(Opened::Unserved(limit)),
                    None => Err(ForwardError::ConnectTimeout),
                }
            }
            Ok(done) => done.map_err(|e| ForwardError::Connect(format!("TLS handshake: {e}")))?,
        };
        if unserved.is_some() {
            let _ = set_socket_linger(stream.get_ref().0, None);
        }
        Ok(Opened::Ready(Either::Right(Box::new(stream))))
    }

    /// A new connection the upstream did not serve within the probe's `limit`: closed with a
    /// reset (so the upstream's backlog drops it; `None`: already), its slot removed from the
    /// cap for [`CAP_RESTORE`], counted, and warned of once.
    fn unserved(
        self: &Arc<Self>,
        stream: Option<UpIo>,
        permit: OwnedSemaphorePermit,
        limit: Duration,
    ) {
        if let Some(stream) = stream {
            let _ = set_socket_linger(stream.tcp(), Some(Duration::ZERO));
        }
        self.stats.count_closed(Closed::Unserved, 1);
        permit.forget();
        self.removed.fetch_add(1, Ordering::Relaxed);
        let pool = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(CAP_RESTORE).await;
            if let Some(pool) = pool.upgrade() {
                pool.removed.fetch_sub(1, Ordering::Relaxed);
                pool.permits.add_permits(1);
            }
        });
        if !self.warned_unserved.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                probe_ms = limit.as_millis() as u64,
                max_connections = self.max_connections,
                "upstream accepted a connection and did not serve it: it serves fewer connections \
                 than upstream.max_connections; lower that below the upstream's own limit (Cyrus: \
                 maxchild). Connections past it are closed and the cap lowered meanwhile"
            );
        }
    }
}
