//! Redis backend: one multiplexed connection (`ConnectionManager`, reconnects by itself), opened
//! on first use so that tessera starts, and answers 503, while Redis is down.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::AsyncCommands;
use tokio::sync::OnceCell;

use super::StoreError;

/// The Redis store.
pub struct RedisStore {
    client: redis::Client,
    timeout: Duration,
    conn: OnceCell<ConnectionManager>,
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(format!("redis: {e}"))
}

impl RedisStore {
    /// Prepares a client for `url`; nothing connects yet.
    ///
    /// Errors: the URL does not parse.
    pub fn new(url: &str, timeout: Duration) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(err)?;
        Ok(Self {
            client,
            timeout,
            conn: OnceCell::new(),
        })
    }

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        let cfg = ConnectionManagerConfig::new()
            .set_connection_timeout(self.timeout)
            .set_response_timeout(self.timeout)
            .set_number_of_retries(1);
        self.conn
            .get_or_try_init(|| ConnectionManager::new_with_config(self.client.clone(), cfg))
            .await
            .cloned()
            .map_err(err)
    }

    pub(super) async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.conn().await?.get(key).await.map_err(err)
    }

    pub(super) async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl_seconds: u64,
    ) -> Result<(), StoreError> {
        self.conn()
            .await?
            .set_ex(key, value, ttl_seconds)
            .await
            .map_err(err)
    }

    pub(super) async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let n: u64 = self.conn().await?.del(key).await.map_err(err)?;
        Ok(n > 0)
    }

    pub(super) async fn scan(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let mut conn = self.conn().await?;
        let pattern = format!("{}*", glob_escape(prefix));
        let mut cursor: u64 = 0;
        let mut out = Vec::new();
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .map_err(err)?;
            if !keys.is_empty() {
                let values: Vec<Option<Vec<u8>>> = conn.mget(&keys).await.map_err(err)?;
                out.extend(
                    keys.into_iter()
                        .zip(values)
                        .filter_map(|(k, v)| v.map(|v| (k, v))),
                );
            }
            if next == 0 {
                return Ok(out);
            }
            cursor = next;
        }
    }

    pub(super) async fn replace(&self, key: &str, value: &[u8]) -> Result<bool, StoreError> {
        let reply: Option<String> = redis::cmd("SET")
            .arg(key)
            .arg(value)
            .arg("XX")
            .arg("KEEPTTL")
            .query_async(&mut self.conn().await?)
            .await
            .map_err(err)?;
        Ok(reply.is_some())
    }
}

/// Escapes Redis glob metacharacters so a key prefix matches literally.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
