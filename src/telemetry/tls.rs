//! What `/metrics` shows of the TLS listener (over TCP): handshakes by outcome, and the expiry
//! of each certificate in place. Counted once per connection, never per request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Handshakes on the TLS listener and its certificates' expiry.
#[derive(Debug, Default)]
pub struct TlsCounts {
    /// Full handshakes completed (with a HelloRetryRequest or not).
    pub full: AtomicU64,
    /// Resumed handshakes completed (a session ticket, shared or not, or a cached session).
    pub resumed: AtomicU64,
    /// Handshakes that failed: an alert sent or received (no shared version, cipher suite or
    /// ALPN protocol; a certificate the client refused), a malformed record, the client gone.
    pub failed: AtomicU64,
    /// Handshakes not done within `server.header_read_timeout_ms`.
    pub timed_out: AtomicU64,
    /// Connections that sent plain HTTP to the TLS port (each answered 400).
    pub plain_http: AtomicU64,
    /// `(config key, notAfter in seconds since the Unix epoch)` of each certificate in place.
    certificates: Mutex<Vec<(String, i64)>>,
}

/// One reading of [`TlsCounts`].
#[derive(Debug, Clone, Default)]
pub struct TlsSnapshot {
    /// `(full, resumed)` handshakes completed.
    pub completed: (u64, u64),
    /// `(failed, timed out, plain HTTP)` connections that completed none.
    pub failures: (u64, u64, u64),
    /// As [`TlsCounts::set_certificates`] had them.
    pub certificates: Vec<(String, i64)>,
}

impl TlsCounts {
    /// Counts one more of `count` (one of this struct's counters).
    pub fn add(count: &AtomicU64) {
        count.fetch_add(1, Ordering::Relaxed);
    }

    /// Replaces the certificates in place: `(config key, notAfter)`, at start and each reload.
    pub fn set_certificates(&self, certificates: impl IntoIterator<Item = (String, i64)>) {
        let mut held = self.certificates.lock().unwrap_or_else(|p| p.into_inner());
        *held = certificates.into_iter().collect();
    }

    /// The counters and certificates now.
    pub fn snapshot(&self) -> TlsSnapshot {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let certificates = self.certificates.lock().unwrap_or_else(|p| p.into_inner());
        TlsSnapshot {
            completed: (load(&self.full), load(&self.resumed)),
            failures: (
                load(&self.failed),
                load(&self.timed_out),
                load(&self.plain_http),
            ),
            certificates: certificates.clone(),
        }
    }
}
