//! MySQL / MariaDB backend (`mysql://USER:PASS@HOST:PORT/DB`, `mariadb://` alike): mysql_async's
//! pool (at most 16 connections), opened on first use so that tessera starts, and answers 503,
//! while the server is down.
//!
//! Layout (created on first use; InnoDB):
//! - `tessera_kv(key, value, expires_at)`: sessions, `expires_at` in Unix seconds of the
//!   server's clock (`UNIX_TIMESTAMP()`), one clock for every instance; expired rows are
//!   invisible, and purged on write.
//! - `tessera_kv_log(id, key, at)`: one row per change, written by tessera in the changing
//!   transaction (no trigger: creating one needs privileges a session store should not ask
//!   for); pruned after 5 minutes. Another writer must add its row too, or instances keep
//!   serving what it changed until their cache entry ends (`session.cache_ttl_seconds`).
//! - `tessera_counters(key, n, expires_at)`: failed-login counts.
//!
//! There is no NOTIFY: the change log is polled ([`poll`]).

use std::time::Duration;

use mysql_async::prelude::{Query, Queryable, WithParams};
use mysql_async::{Opts, OptsBuilder, Pool, PoolConstraints, PoolOpts, Row, TxOpts};
use tokio::sync::OnceCell;

use super::attempt::{paged, twice, Attempt, SCAN_PAGE};
use super::StoreError;

mod poll;
mod tls;

/// Connections in the pool: store calls are the cold path.
const POOL_SIZE: usize = 16;

/// Tables, created once per database (module docs); `IF NOT EXISTS` makes a race between
/// instances harmless.
const SCHEMA: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS tessera_kv (
       `key` VARBINARY(512) PRIMARY KEY, `value` LONGBLOB NOT NULL, expires_at BIGINT NOT NULL,
       KEY tessera_kv_expires (expires_at)) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS tessera_kv_log (
       id BIGINT AUTO_INCREMENT PRIMARY KEY, `key` VARBINARY(512) NOT NULL, at BIGINT NOT NULL,
       KEY tessera_kv_log_at (at)) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS tessera_counters (
       `key` VARBINARY(512) PRIMARY KEY, n BIGINT NOT NULL, expires_at BIGINT NOT NULL,
       KEY tessera_counters_expires (expires_at)) ENGINE=InnoDB",
];

/// How many of [`SCHEMA`]'s tables the connection's database has: made only when some are
/// missing, so that a user who may only read and write them serves (`CREATE TABLE IF NOT
/// EXISTS` asks for the `CREATE` privilege first).
const SCHEMA_PRESENT: &str = "SELECT COUNT(*) FROM information_schema.tables
  WHERE table_schema = DATABASE()
    AND table_name IN ('tessera_kv', 'tessera_kv_log', 'tessera_counters')";

/// The MySQL / MariaDB store.
pub struct MysqlStore {
    pool: Pool,
    timeout: Duration,
    /// How often the change log is read (`session.poll_interval_ms`; see `poll.rs`).
    poll: Duration,
    schema: OnceCell<()>,
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(format!("mysql: {e}"))
}

/// `row` as `T`. mysql_async's typed reads panic on a row that does not convert (a NULL, an id
/// past i64, a column of another type, in a table another tool made or altered): a request's
/// task would die (the client's connection reset instead of a 503), the poller's would end
/// the invalidation stream. Here it is a store error, reported as any other.
///
/// Errors: the row does not convert.
fn converted<T: mysql_async::prelude::FromRow>(row: Row) -> Result<T, StoreError> {
    mysql_async::from_row_opt(row)
        .map_err(|_| err("a row of another shape than tessera's tables have"))
}

type Conn = mysql_async::Conn;

impl MysqlStore {
    /// Prepares a pool for `url` (`mysql://` or `mariadb://`, over TLS with `ssl-mode`:
    /// [`tls`]); nothing connects yet. Each store call is bounded by `timeout`.
    ///
    /// Errors: the URL does not parse, or its TLS files cannot be read.
    pub fn new(url: &str, timeout: Duration) -> Result<Self, StoreError> {
        let url = match url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => url.to_owned(),
        };
        let (url, ssl) = tls::split(&url)?;
        let opts = Opts::from_url(&url).map_err(err)?;
        let constraints = PoolConstraints::new(0, POOL_SIZE).expect("0 <= POOL_SIZE");
        let opts = OptsBuilder::from_opts(opts)
            // `replace` asks whether its row matched, also when the value did not change.
            .client_found_rows(true)
            .ssl_opts(ssl)
            .pool_opts(PoolOpts::default().with_constraints(constraints));
        Ok(Self {
            pool: Pool::new(opts),
            timeout,
            poll: poll::EVERY,
            schema: OnceCell::new(),
        })
    }

    /// Reads the change log every `poll` (`session.poll_interval_ms`) instead of 25 ms.
    pub fn polling_every(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// A pooled connection, the schema created first if this process has not yet.
    async fn conn(&self) -> Result<Conn, StoreError> {
        let mut conn = self.pool.get_conn().await.map_err(err)?;
        self.schema
            .get_or_try_init(|| async {
                let present: Option<u64> = conn.query_first(SCHEMA_PRESENT).await.map_err(err)?;
                if present != Some(SCHEMA.len() as u64) {
                    for table in SCHEMA {
                        conn.query_drop(table).await.map_err(err)?;
                    }
                }
                Ok::<_, StoreError>(())
            })
            .await?;
        Ok(conn)
    }

    /// Runs `f` on a pooled connection within the store timeout, once more on another when
    /// the connection was found broken ([`twice`]).
    async fn run<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, mysql_async::Error>>,
    {
        twice("mysql", self.timeout, || async {
            f(self.conn().await?)
                .await
                .map_err(|e| match is_broken(&e) {
                    true => Attempt::Broken(err(e)),
                    false => Attempt::Failed(err(e)),
                })
        })
        .await
    }

    pub(super) async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let row: Option<Row> = self
            .run(|mut c| async move {
                "SELECT `value` FROM tessera_kv WHERE `key` = ? AND expires_at > UNIX_TIMESTAMP()"
                    .with((key,))
                    .first(&mut c)
                    .await
            })
            .await?;
        row.map(converted).transpose()
    }

    pub(super) async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl_seconds: u64,
    ) -> Result<(), StoreError> {
        self.run(|mut c| async move {
            let mut tx = c.start_transaction(TxOpts::default()).await?;
            tx.exec_drop(
                "DELETE FROM tessera_kv WHERE expires_at <= UNIX_TIMESTAMP() - 60 LIMIT 100",
                (),
            )
            .await?;
            tx.exec_drop(
                "INSERT INTO tessera_kv (`key`, `value`, expires_at)
                 VALUES (?, ?, UNIX_TIMESTAMP() + ?)
                 ON DUPLICATE KEY UPDATE `value` = VALUES(`value`), expires_at = VALUES(expires_at)",
                (key, value, ttl_seconds),
            )
            .await?;
            log_change(&mut tx, key).await?;
            tx.commit().await
        })
        .await
    }

    pub(super) async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.run(|mut c| async move {
            let mut tx = c.start_transaction(TxOpts::default()).await?;
            tx.exec_drop("DELETE FROM tessera_kv WHERE `key` = ?", (key,))
                .await?;
            let existed = tx.affected_rows() > 0;
            log_change(&mut tx, key).await?;
            tx.commit().await?;
            Ok(existed)
        })
        .await
    }

    pub(super) async fn scan(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let rows = paged(|after: Vec<u8>| async move {
            let rows: Vec<Row> = self
                .run(move |mut c| {
                    let after = after.clone();
                    async move {
                        // A byte comparison, not LIKE: a prefix with `%` or `_` must match
                        // literally.
                        "SELECT `key`, `value` FROM tessera_kv
                         WHERE LEFT(`key`, LENGTH(?)) = ? AND `key` > ?
                           AND expires_at > UNIX_TIMESTAMP()
                         ORDER BY `key` LIMIT ?"
                            .with((prefix, prefix, after, SCAN_PAGE as u64))
                            .fetch(&mut c)
                            .await
                    }
                })
                .await?;
            rows.into_iter()
                .map(converted::<(Vec<u8>, Vec<u8>)>)
                .collect()
        })
        .await?;
        // After the paging, which goes by the keys as stored: one that is not UTF-8 (another
        // tool's) names no session.
        Ok(rows
            .into_iter()
            .filter_map(|(k, v)| Some((String::from_utf8(k).ok()?, v)))
            .collect())
    }

    pub(super) async fn replace(
        &self,
        key: &str,
        old: &[u8],
        value: &[u8],
    ) -> Result<bool, StoreError> {
        self.run(|mut c| async move {
            let mut tx = c.start_transaction(TxOpts::default()).await?;
            tx.exec_drop(
                "UPDATE tessera_kv SET `value` = ?
                 WHERE `key` = ? AND `value` = ? AND expires_at > UNIX_TIMESTAMP()",
                (value, key, old),
            )
            .await?;
            let replaced = tx.affected_rows() > 0;
            if replaced {
                log_change(&mut tx, key).await?;
            }
            tx.commit().await?;
            Ok(replaced)
        })
        .await
    }

    pub(super) async fn increment(
        &self,
        key: &str,
        window_seconds: u64,
    ) -> Result<(u64, u64), StoreError> {
        let window = window_seconds.max(1);
        let (n, left): (i64, i64) = self
            .run(|mut c| async move {
                let mut tx = c.start_transaction(TxOpts::default()).await?;
                // `n` is assigned first, so both conditions see the old expiry.
                tx.exec_drop(
                    "INSERT INTO tessera_counters (`key`, n, expires_at)
                     VALUES (?, 1, UNIX_TIMESTAMP() + ?)
                     ON DUPLICATE KEY UPDATE
                       n = IF(expires_at <= UNIX_TIMESTAMP(), 1, n + 1),
                       expires_at = IF(expires_at <= UNIX_TIMESTAMP(),
                                       VALUES(expires_at), expires_at)",
                    (key, window),
                )
                .await?;
                let row: Option<Row> = tx
                    .exec_first(
                        "SELECT n, expires_at - UNIX_TIMESTAMP() FROM tessera_counters
                         WHERE `key` = ?",
                        (key,),
                    )
                    .await?;
                tx.commit().await?;
                Ok(row)
            })
            .await?
            .map(converted)
            .transpose()?
            .unwrap_or((1, window as i64));
        Ok((n.max(0) as u64, left.max(1) as u64))
    }

    /// Deletes expired failed-login counts (at most 1,000): every address and user name tried
    /// has a row, and without this the table would only grow (a spray of names, or a walk
    /// through IPv6 /64s, speeds that up). Its own statement, outside any login's transaction
    /// (tables made before the expiry index have none, and their scan holds rows briefly).
    pub(super) async fn purge_counters(&self) -> Result<(), StoreError> {
        self.run(|mut c| async move {
            c.query_drop(
                "DELETE FROM tessera_counters WHERE expires_at <= UNIX_TIMESTAMP() LIMIT 1000",
            )
            .await
        })
        .await
    }

    pub(super) async fn decrement(&self, key: &str) -> Result<(), StoreError> {
        self.run(|mut c| async move {
            c.exec_drop(
                "UPDATE tessera_counters SET n = n - 1
                 WHERE `key` = ? AND expires_at > UNIX_TIMESTAMP() AND n > 0",
                (key,),
            )
            .await
        })
        .await
    }
}

/// Appends `key`'s change-log row in `tx`, and prunes rows older than 5 minutes.
async fn log_change(
    tx: &mut mysql_async::Transaction<'_>,
    key: &str,
) -> Result<(), mysql_async::Error> {
    tx.exec_drop(
        "INSERT INTO tessera_kv_log (`key`, at) VALUES (?, UNIX_TIMESTAMP())",
        (key,),
    )
    .await?;
    tx.exec_drop(
        "DELETE FROM tessera_kv_log WHERE at < UNIX_TIMESTAMP() - 300 LIMIT 100",
        (),
    )
    .await
}

/// The connection failed under the call (server restarted, connection killed), rather than the
/// statement.
fn is_broken(e: &mysql_async::Error) -> bool {
    matches!(e, mysql_async::Error::Io(_))
        || matches!(
            e,
            mysql_async::Error::Driver(mysql_async::DriverError::ConnectionClosed)
        )
}
