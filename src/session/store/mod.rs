//! The session store: a key-value map with per-key TTL, behind one type with four backends.
//!
//! Owns: connections to the backend. Must never: open a connection per request, or interpret
//! values (that is `session::Sessions`).

use std::sync::Arc;
use std::time::Duration;

use super::StoreSpec;

mod attempt;
mod embedded;
mod mysql;
mod postgres;
mod redis;

pub use self::embedded::EmbeddedStore;
pub use self::mysql::MysqlStore;
pub use self::postgres::PostgresStore;
pub use self::redis::RedisStore;

/// A change notice from the store's invalidation stream ([`Store::watch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invalidation {
    /// These keys were written, deleted or expired.
    Keys(Vec<String>),
    /// The stream is (again) live and complete from now on; anything cached before may be stale.
    Live,
    /// The stream was lost: nothing cached can be trusted until the next `Live`.
    Lost,
}

/// An invalidation stream's outage as the log tells it: one warning when it is lost, its
/// retries (every 0.1 to 2 s) at debug level, where they would fill the log, and one line when
/// it is back.
#[derive(Default)]
pub(super) struct Outage(std::sync::atomic::AtomicBool);

impl Outage {
    /// `store`'s stream failed with `e` (its first failure, or a retry's).
    pub(super) fn lost(&self, store: &str, e: &StoreError) {
        if self.0.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::debug!(error = %e, "{store} invalidation stream still lost; retrying");
        } else {
            tracing::warn!(error = %e, "{store} invalidation stream lost; session cache off until it is back");
        }
    }

    /// `store`'s stream is live (again).
    pub(super) fn back(&self, store: &str) {
        if self.0.swap(false, std::sync::atomic::Ordering::Relaxed) {
            tracing::info!("{store} invalidation stream back; session cache on");
        }
    }
}

/// The polls of a change log (the embedded and MySQL stores): one every `every`, a late one
/// delayed rather than bunched.
pub(super) struct PollTicks(tokio::time::Interval);

impl PollTicks {
    pub(super) fn new(every: Duration) -> Self {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self(tick)
    }

    /// Waits for the next poll; false once nobody reads `tx` (the watch then ends).
    pub(super) async fn next(&mut self, tx: &tokio::sync::mpsc::Sender<Invalidation>) -> bool {
        self.0.tick().await;
        !tx.is_closed()
    }
}

/// A store's background task (a listener's driver, a purge), stopped when this is dropped.
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs `purge` on the store `store` names every `every` while it lives (a `Weak`: this keeps
/// nothing alive); a failure is logged at debug level, `what` naming it, and waits for the next
/// round (a row not yet purged has expired: it is only kept, never read as live).
pub(super) async fn purge_every<S, F, Fut>(
    store: std::sync::Weak<S>,
    every: Duration,
    what: &'static str,
    purge: F,
) where
    F: Fn(Arc<S>) -> Fut,
    Fut: std::future::Future<Output = Result<(), StoreError>>,
{
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let Some(store) = store.upgrade() else {
            return;
        };
        if let Err(e) = purge(store).await {
            tracing::debug!(error = %e, what, "purge failed; next round retries");
        }
    }
}

/// The store could not answer (down, timed out, I/O error). Maps to 503.
#[derive(Debug, Clone, thiserror::Error)]
#[error("session store unavailable: {0}")]
pub struct StoreError(pub String);

/// One of the supported backends; cheap to clone (shared handles).
#[derive(Clone)]
pub enum Store {
    /// SQLite file in WAL mode (`embedded:PATH`).
    Embedded(Arc<EmbeddedStore>),
    /// Redis over one multiplexed, self-reconnecting connection (`redis://`).
    Redis(Arc<RedisStore>),
    /// PostgreSQL over a small pool, `LISTEN`/`NOTIFY` for invalidation (`postgres://`).
    Postgres(Arc<PostgresStore>),
    /// MySQL or MariaDB over a small pool, its change log polled (`mysql://`).
    Mysql(Arc<MysqlStore>),
}

impl Store {
    /// Opens the backend named by `spec`. Redis and the SQL servers connect lazily (a down server
    /// gives 503s, not a failed start); the embedded file is created if missing.
    ///
    /// Errors: the embedded path cannot be created/opened, or a URL is invalid.
    pub fn open(spec: &StoreSpec, timeout: Duration) -> Result<Self, StoreError> {
        Self::open_polling(spec, timeout, Duration::from_millis(25))
    }

    /// [`Store::open`], the embedded and MySQL stores reading their change log every `poll`
    /// (`session.poll_interval_ms`).
    pub fn open_polling(
        spec: &StoreSpec,
        timeout: Duration,
        poll: Duration,
    ) -> Result<Self, StoreError> {
        Ok(match spec {
            StoreSpec::Embedded(path) => {
                let store = EmbeddedStore::open_waiting(path, timeout)?;
                Self::Embedded(Arc::new(store.polling_every(poll)))
            }
            StoreSpec::Redis(url) => Self::Redis(Arc::new(RedisStore::new(url, timeout)?)),
            StoreSpec::Postgres(url, query) => {
                Self::Postgres(Arc::new(PostgresStore::new(url, timeout, query.clone())?))
            }
            StoreSpec::Mysql(url) => {
                Self::Mysql(Arc::new(MysqlStore::new(url, timeout)?.polling_every(poll)))
            }
        })
    }

    /// Value at `key`, `None` when absent or expired.
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        match self {
            Self::Embedded(s) => s.get(key).await,
            Self::Redis(s) => s.get(key).await,
            Self::Postgres(s) => s.get(key).await,
            Self::Mysql(s) => s.get(key).await,
        }
    }

    /// [`Store::get`], with the key's own expiry where the store keeps one apart from the
    /// record (Redis: `PTTL`, read in the same round trip), as Unix seconds rounded down: a
    /// record without `expires_at` (hyper-auth-proxy's) expires with its key, which Redis
    /// announces only once it deletes the key, maybe minutes later (active expiry samples).
    pub async fn get_expiring(
        &self,
        key: &str,
    ) -> Result<Option<(Vec<u8>, Option<u64>)>, StoreError> {
        match self {
            Self::Redis(s) => s.get_expiring(key).await,
            other => Ok(other.get(key).await?.map(|v| (v, None))),
        }
    }

    /// Stores `value` at `key` for `ttl_seconds`, replacing any previous value.
    pub async fn put(&self, key: &str, value: &[u8], ttl_seconds: u64) -> Result<(), StoreError> {
        match self {
            Self::Embedded(s) => s.put(key, value, ttl_seconds).await,
            Self::Redis(s) => s.put(key, value, ttl_seconds).await,
            Self::Postgres(s) => s.put(key, value, ttl_seconds).await,
            Self::Mysql(s) => s.put(key, value, ttl_seconds).await,
        }
    }

    /// Whether writes are refused: PostgreSQL with `session.query`, where the sessions are the
    /// application's and tessera only reads them.
    pub fn read_only(&self) -> bool {
        matches!(self, Self::Postgres(s) if s.read_only())
    }

    /// Deletes `key`; `true` if it existed.
    pub async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        match self {
            Self::Embedded(s) => s.delete(key).await,
            Self::Redis(s) => s.delete(key).await,
            Self::Postgres(s) => s.delete(key).await,
            Self::Mysql(s) => s.delete(key).await,
        }
    }

    /// Every live entry whose key starts with `prefix`, as (key, value), each key once. Walks
    /// the whole key space in batches (Redis `SCAN`, never `KEYS`): an operator command, not a
    /// request path.
    pub async fn scan(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        match self {
            Self::Embedded(s) => s.scan(prefix).await,
            Self::Redis(s) => s.scan(prefix).await,
            Self::Postgres(s) => s.scan(prefix).await,
            Self::Mysql(s) => s.scan(prefix).await,
        }
    }

    /// Replaces the value at `key` with `value` only if it is still `old` (compare-and-set),
    /// keeping its expiry. Returns whether it was replaced: a session revoked or rewritten
    /// meanwhile is left alone.
    pub async fn replace(&self, key: &str, old: &[u8], value: &[u8]) -> Result<bool, StoreError> {
        match self {
            Self::Embedded(s) => s.replace(key, old, value).await,
            Self::Redis(s) => s.replace(key, old, value).await,
            Self::Postgres(s) => s.replace(key, old, value).await,
            Self::Mysql(s) => s.replace(key, old, value).await,
        }
    }

    /// Adds one to the counter at `key`; returns the new count and the seconds left in its
    /// window (at least 1). A counter that is absent or has expired starts again at 1 and
    /// expires `window_seconds` (1..=604800) after that: a fixed window from its first count.
    /// Shared by every instance on the store (the failed-login counts); never sent to the
    /// invalidation stream, so keep such keys outside the session prefix.
    pub async fn increment(
        &self,
        key: &str,
        window_seconds: u64,
    ) -> Result<(u64, u64), StoreError> {
        match self {
            Self::Embedded(s) => s.increment(key, window_seconds).await,
            Self::Redis(s) => s.increment(key, window_seconds).await,
            Self::Postgres(s) => s.increment(key, window_seconds).await,
            Self::Mysql(s) => s.increment(key, window_seconds).await,
        }
    }

    /// Takes one back from the counter at `key` ([`Store::increment`]), keeping its window; a
    /// counter that is absent, expired or at 0 is left alone.
    pub async fn decrement(&self, key: &str) -> Result<(), StoreError> {
        match self {
            Self::Embedded(s) => s.decrement(key).await,
            Self::Redis(s) => s.decrement(key).await,
            Self::Postgres(s) => s.decrement(key).await,
            Self::Mysql(s) => s.decrement(key).await,
        }
    }

    /// Starts watching keys under `prefix` for changes by any process: Redis server-assisted
    /// client-side caching (RESP3 `CLIENT TRACKING ON BCAST PREFIX`, its own connection, pinged
    /// every second), PostgreSQL `LISTEN` (its own connection, pinged every second), or the
    /// embedded or MySQL store's change log (polled every 25 ms). The receiver
    /// gets `Live` once watching works, `Keys` per change, and `Lost` whenever the stream broke
    /// (it reconnects by itself). Dropping the receiver stops the watcher.
    pub fn watch(&self, prefix: &str) -> tokio::sync::mpsc::Receiver<Invalidation> {
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        let prefix = prefix.to_owned();
        match self {
            Self::Embedded(s) => {
                tokio::spawn(EmbeddedStore::clone(s).watch(prefix, tx));
            }
            Self::Redis(s) => {
                tokio::spawn(s.clone().watch(prefix, tx));
            }
            Self::Postgres(s) => {
                tokio::spawn(s.clone().watch(prefix, tx));
            }
            Self::Mysql(s) => {
                tokio::spawn(s.clone().watch(prefix, tx));
            }
        }
        rx
    }

    /// Checks the store answers (used by `check-config`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.get("tessera:ping").await.map(|_| ())
    }
}
