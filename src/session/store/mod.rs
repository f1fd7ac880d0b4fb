//! The session store: a key-value map with per-key TTL, behind one type with two backends.
//!
//! Owns: connections to the backend. Must never: open a connection per request, or interpret
//! values (that is `session::Sessions`).

use std::sync::Arc;
use std::time::Duration;

use crate::config::StoreSpec;

mod embedded;
mod redis;

pub use self::embedded::EmbeddedStore;
pub use self::redis::RedisStore;

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
}

impl Store {
    /// Opens the backend named by `spec`. Redis connects lazily (a down Redis gives 503s, not a
    /// failed start); the embedded file is created if missing.
    ///
    /// Errors: the embedded path cannot be created/opened, or the Redis URL is invalid.
    pub fn open(spec: &StoreSpec, timeout: Duration) -> Result<Self, StoreError> {
        Ok(match spec {
            StoreSpec::Embedded(path) => Self::Embedded(Arc::new(EmbeddedStore::open(path)?)),
            StoreSpec::Redis(url) => Self::Redis(Arc::new(RedisStore::new(url, timeout)?)),
        })
    }

    /// Value at `key`, `None` when absent or expired.
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        match self {
            Self::Embedded(s) => s.get(key).await,
            Self::Redis(s) => s.get(key).await,
        }
    }

    /// Stores `value` at `key` for `ttl_seconds`, replacing any previous value.
    pub async fn put(&self, key: &str, value: &[u8], ttl_seconds: u64) -> Result<(), StoreError> {
        match self {
            Self::Embedded(s) => s.put(key, value, ttl_seconds).await,
            Self::Redis(s) => s.put(key, value, ttl_seconds).await,
        }
    }

    /// Deletes `key`; `true` if it existed.
    pub async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        match self {
            Self::Embedded(s) => s.delete(key).await,
            Self::Redis(s) => s.delete(key).await,
        }
    }

    /// Every live entry whose key starts with `prefix`, as (key, value). Walks the whole key
    /// space in batches (Redis `SCAN`, never `KEYS`): an operator command, not a request path.
    pub async fn scan(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        match self {
            Self::Embedded(s) => s.scan(prefix).await,
            Self::Redis(s) => s.scan(prefix).await,
        }
    }

    /// Replaces the value at `key` only if the key still exists, keeping its expiry (Redis
    /// `SET .. XX KEEPTTL`). Returns whether it was replaced: a session revoked meanwhile stays
    /// revoked.
    pub async fn replace(&self, key: &str, value: &[u8]) -> Result<bool, StoreError> {
        match self {
            Self::Embedded(s) => s.replace(key, value).await,
            Self::Redis(s) => s.replace(key, value).await,
        }
    }

    /// Checks the store answers (used by `check-config`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.get("tessera:ping").await.map(|_| ())
    }
}
