//! Redis backend: one multiplexed connection (`ConnectionManager`, reconnects by itself), opened
//! on first use so that tessera starts, and answers 503, while Redis is down.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::AsyncCommands;
use tokio::sync::OnceCell;

use super::{Invalidation, StoreError};

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

    /// Runs an idempotent command (or a counter's, where running twice errs by one); if the
    /// multiplexed connection was found dead (server restart, CLIENT KILL, idle cut), the manager
    /// reconnects and the command is sent once more before the caller sees a store failure (503).
    async fn idempotent<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        match f(self.conn().await?).await {
            Err(e) if e.is_connection_dropped() || e.is_io_error() => {
                f(self.conn().await?).await.map_err(err)
            }
            other => other.map_err(err),
        }
    }

    pub(super) async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.idempotent(|mut c| async move { c.get(key).await })
            .await
    }

    pub(super) async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl_seconds: u64,
    ) -> Result<(), StoreError> {
        self.idempotent(|mut c| async move { c.set_ex(key, value, ttl_seconds).await })
            .await
    }

    pub(super) async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let n: u64 = self
            .idempotent(|mut c| async move { c.del(key).await })
            .await?;
        Ok(n > 0)
    }

    pub(super) async fn scan(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let mut conn = self.conn().await?;
        let pattern = format!("{}*", glob_escape(prefix));
        let mut cursor: u64 = 0;
        let mut out = Vec::new();
        // SCAN may return a key more than once.
        let mut seen = std::collections::HashSet::new();
        loop {
            let (next, mut keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .map_err(err)?;
            keys.retain(|k| seen.insert(k.clone()));
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

    pub(super) async fn replace(
        &self,
        key: &str,
        old: &[u8],
        value: &[u8],
    ) -> Result<bool, StoreError> {
        // Compare-and-set in one atomic script; KEEPTTL keeps the session's expiry.
        const CAS: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
               return redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL') \
             else return false end";
        let reply: Option<String> = redis::cmd("EVAL")
            .arg(CAS)
            .arg(1)
            .arg(key)
            .arg(old)
            .arg(value)
            .query_async(&mut self.conn().await?)
            .await
            .map_err(err)?;
        Ok(reply.is_some())
    }

    pub(super) async fn increment(
        &self,
        key: &str,
        window_seconds: u64,
    ) -> Result<(u64, u64), StoreError> {
        // INCR and the expiry in one atomic script (EVAL, as `replace`): a counter found without
        // one (new, or written by someone else) gets the window, so none lasts for ever.
        const INCREMENT: &str = "local n = redis.call('INCR', KEYS[1]) \
             local ttl = redis.call('TTL', KEYS[1]) \
             if ttl < 0 then \
               redis.call('EXPIRE', KEYS[1], ARGV[1]) \
               ttl = tonumber(ARGV[1]) \
             end \
             return {n, ttl}";
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(INCREMENT)
            .arg(1)
            .arg(key)
            .arg(window_seconds.max(1));
        // Sent again on a connection found dead, as the idempotent commands are: had the first
        // one run, a failed-login count is one too high for its window, which is harmless; a 503
        // for every login after each reconnect would not be.
        let (n, ttl): (i64, i64) = self
            .idempotent(|mut c| {
                let cmd = cmd.clone();
                async move { cmd.query_async(&mut c).await }
            })
            .await?;
        Ok((n.max(0) as u64, ttl.max(1) as u64))
    }

    pub(super) async fn decrement(&self, key: &str) -> Result<(), StoreError> {
        // DECR keeps the key's expiry; a missing or spent counter is not created at -1.
        const DECREMENT: &str = "if (tonumber(redis.call('GET', KEYS[1])) or 0) > 0 then \
               redis.call('DECR', KEYS[1]) \
             end \
             return 0";
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(DECREMENT).arg(1).arg(key);
        // Sent again on a connection found dead (see `increment`): at worst one too low.
        self.idempotent(|mut c| {
            let cmd = cmd.clone();
            async move { cmd.query_async::<()>(&mut c).await }
        })
        .await
    }
}

impl RedisStore {
    /// The tracking loop: (re)connect, enable tracking, forward invalidations; on any failure
    /// report `Lost` and retry with backoff (100 ms doubling to 2 s).
    pub(super) async fn watch(
        self: std::sync::Arc<Self>,
        prefix: String,
        tx: tokio::sync::mpsc::Sender<Invalidation>,
    ) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let result = self.track(&prefix, &tx).await;
            if tx.is_closed() {
                return;
            }
            if let Err(e) = result {
                tracing::warn!(error = %e, "redis invalidation stream lost; session cache off until it is back");
            }
            if tx.send(Invalidation::Lost).await.is_err() {
                return;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    async fn track(
        &self,
        prefix: &str,
        tx: &tokio::sync::mpsc::Sender<Invalidation>,
    ) -> Result<(), StoreError> {
        let mut info = self.client.get_connection_info().clone();
        info.redis.protocol = redis::ProtocolVersion::RESP3;
        let client = redis::Client::open(info).map_err(err)?;
        let (push_tx, mut push_rx) = tokio::sync::mpsc::unbounded_channel();
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(self.timeout)
            .set_response_timeout(self.timeout)
            .set_push_sender(push_tx);
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await
            .map_err(err)?;
        let mut cmd = redis::cmd("CLIENT");
        cmd.arg("TRACKING").arg("ON").arg("BCAST");
        if !prefix.is_empty() {
            cmd.arg("PREFIX").arg(prefix);
        }
        cmd.query_async::<()>(&mut conn).await.map_err(err)?;
        if tx.send(Invalidation::Live).await.is_err() {
            return Ok(());
        }
        let mut ping = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                push = push_rx.recv() => {
                    let Some(push) = push else {
                        return Err(err("push channel closed"));
                    };
                    match push.kind {
                        redis::PushKind::Invalidate => {
                            let keys = match push.data.into_iter().next() {
                                Some(redis::Value::Array(keys)) => keys
                                    .into_iter()
                                    .filter_map(|k| match k {
                                        redis::Value::BulkString(b) => String::from_utf8(b).ok(),
                                        redis::Value::SimpleString(s) => Some(s),
                                        _ => None,
                                    })
                                    .collect(),
                                // Nil: FLUSHDB/FLUSHALL — everything is gone.
                                _ => {
                                    if tx.send(Invalidation::Lost).await.is_err()
                                        || tx.send(Invalidation::Live).await.is_err()
                                    {
                                        return Ok(());
                                    }
                                    continue;
                                }
                            };
                            if tx.send(Invalidation::Keys(keys)).await.is_err() {
                                return Ok(());
                            }
                        }
                        redis::PushKind::Disconnection => return Err(err("disconnected")),
                        _ => {}
                    }
                }
                _ = ping.tick() => {
                    if tx.is_closed() {
                        return Ok(());
                    }
                    let pong = tokio::time::timeout(
                        self.timeout,
                        redis::cmd("PING").query_async::<String>(&mut conn),
                    )
                    .await;
                    match pong {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return Err(err(e)),
                        Err(_) => return Err(err("ping timed out")),
                    }
                }
            }
        }
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
