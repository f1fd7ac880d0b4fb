//! PostgreSQL backend (`postgres://` or `postgresql://`, libpq's URL form): a small pool of
//! connections (deadpool), opened on first use so that tessera starts, and answers 503, while
//! the database is down.
//!
//! Layout (created on first use, under a transaction-scoped advisory lock so that instances
//! starting together do not race; PostgreSQL 14 or later):
//! - `tessera_kv(key text PRIMARY KEY, value bytea, expires_at timestamptz)`: sessions; expired
//!   rows are invisible and purged every minute.
//! - `tessera_kv_log(id bigserial, key text, at timestamptz)`: one row per change, written by a
//!   trigger on `tessera_kv` in the changing transaction, which also sends `pg_notify` on the
//!   channel `tessera_kv` with the key. Any writer (tessera, the CLI, an operator's `DELETE` in
//!   psql) therefore invalidates every instance's cache. Rows older than 5 minutes are pruned.
//! - `tessera_counters(key text PRIMARY KEY, n bigint, expires_at timestamptz)`: failed-login
//!   counts, outside the trigger (counters invalidate nothing).
//!
//! Times come from the database's `now()`, one clock for every instance.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::OnceCell;
use tokio_postgres::NoTls;

use super::attempt::{paged, twice, Attempt, SCAN_PAGE};
use super::StoreError;
use crate::session::SessionQuery;

mod errors;
mod listen;
mod loan;
mod own;
mod tls;

use errors::{bounded, causes, classify};
use loan::{lend, Conn, Lent};

/// The channel `pg_notify` rings on each change; its payload is the changed key.
const CHANNEL: &str = "tessera_kv";
/// Connections in the pool: store calls are the cold path (a cache miss, a login, a logout).
const POOL_SIZE: usize = 16;

/// Tables, trigger and function, created once per database (module docs). One implicit
/// transaction: the advisory lock is held until every statement ran.
const SCHEMA: &str = "
SELECT pg_advisory_xact_lock(7400361021);
CREATE TABLE IF NOT EXISTS tessera_kv (
  key text PRIMARY KEY, value bytea NOT NULL, expires_at timestamptz NOT NULL);
CREATE INDEX IF NOT EXISTS tessera_kv_expires ON tessera_kv (expires_at);
CREATE TABLE IF NOT EXISTS tessera_kv_log (
  id bigserial PRIMARY KEY, key text NOT NULL, at timestamptz NOT NULL DEFAULT now());
CREATE INDEX IF NOT EXISTS tessera_kv_log_at ON tessera_kv_log (at);
CREATE TABLE IF NOT EXISTS tessera_counters (
  key text PRIMARY KEY, n bigint NOT NULL, expires_at timestamptz NOT NULL);
CREATE OR REPLACE FUNCTION tessera_kv_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP <> 'INSERT' THEN
    INSERT INTO tessera_kv_log (key) VALUES (OLD.key);
    PERFORM pg_notify('tessera_kv', OLD.key);
  END IF;
  IF TG_OP <> 'DELETE' AND (TG_OP = 'INSERT' OR NEW.key <> OLD.key) THEN
    INSERT INTO tessera_kv_log (key) VALUES (NEW.key);
    PERFORM pg_notify('tessera_kv', NEW.key);
  END IF;
  RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER tessera_kv_changed AFTER INSERT OR UPDATE OR DELETE ON tessera_kv
  FOR EACH ROW EXECUTE FUNCTION tessera_kv_changed();
CREATE OR REPLACE FUNCTION tessera_kv_truncated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('tessera_kv', '');
  RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER tessera_kv_truncated AFTER TRUNCATE ON tessera_kv
  FOR EACH STATEMENT EXECUTE FUNCTION tessera_kv_truncated();
";

/// Whether [`SCHEMA`] is all there (its last trigger included): run then only when it is not,
/// so that a role without `CREATE` on the schema, or not owning the tables, serves once they
/// were made (`CREATE ... IF NOT EXISTS` checks the privilege first).
const SCHEMA_PRESENT: &str = "
SELECT to_regclass('tessera_kv') IS NOT NULL AND to_regclass('tessera_kv_log') IS NOT NULL
  AND to_regclass('tessera_counters') IS NOT NULL
  AND EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'tessera_kv_truncated'
    AND tgrelid = to_regclass('tessera_kv'))";

/// The payload [`SCHEMA`]'s TRUNCATE trigger sends: every session changed (no key is empty).
pub(super) const ALL_CHANGED: &str = "";

/// The PostgreSQL store.
pub struct PostgresStore {
    pool: Pool,
    config: tokio_postgres::Config,
    tls: tls::Tls,
    timeout: Duration,
    schema: OnceCell<()>,
    /// The application's own sessions, read-only ([`own`]); `None`: tessera's tables.
    own: Option<SessionQuery>,
    /// The invalidation stream's outage, for the log.
    outage: super::Outage,
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(format!("postgres: {e}"))
}

impl PostgresStore {
    /// Prepares a pool for `url` (libpq's URL form); nothing connects yet. Each connect, and
    /// each store call, is bounded by `timeout`. `sslmode=require` (or `verify-ca`,
    /// `verify-full`) connects over TLS, the server verified ([`tls`]). With `own`, sessions are
    /// read from the application's table and nothing is written ([`own`]).
    ///
    /// Errors: the URL does not parse; its `sslrootcert`, `sslcert` or `sslkey` file cannot be
    /// read or holds no certificate (or key).
    pub fn new(
        url: &str,
        timeout: Duration,
        own: Option<SessionQuery>,
    ) -> Result<Self, StoreError> {
        let (url, files) = tls::split_url(url);
        let mut config: tokio_postgres::Config = url.parse().map_err(err)?;
        config.connect_timeout(timeout);
        if config.get_application_name().is_none() {
            config.application_name("tessera");
        }
        let recycling = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        // The application's sessions: every pooled connection read-only, whatever the query
        // says (the listener only LISTENs).
        let mut pooled = config.clone();
        if own.is_some() {
            let read_only = "-c default_transaction_read_only=on";
            let options = match config.get_options() {
                Some(given) => format!("{given} {read_only}"),
                None => read_only.to_owned(),
            };
            pooled.options(&options);
        }
        let (manager, tls) = match config.get_ssl_mode() {
            tokio_postgres::config::SslMode::Require => {
                let connector = tls::connector(&files)?;
                let manager = Manager::from_config(pooled, connector.clone(), recycling);
                (manager, tls::Tls::On(connector))
            }
            _ if files != tls::Files::default() => {
                return Err(err(
                    "sslrootcert, sslcert and sslkey need TLS: add sslmode=verify-full",
                ))
            }
            _ => (
                Manager::from_config(pooled, NoTls, recycling),
                tls::Tls::Off,
            ),
        };
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout))
            .recycle_timeout(Some(timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(err)?;
        Ok(Self {
            pool,
            config,
            tls,
            timeout,
            schema: OnceCell::new(),
            own,
            outage: super::Outage::default(),
        })
    }

    /// A pooled connection, the schema created first if this process has not yet (never for
    /// the application's own sessions).
    async fn conn(&self) -> Result<Conn, StoreError> {
        let conn = self.pool.get().await.map_err(|e| err(causes(&e)))?;
        if self.own.is_some() {
            return Ok(conn);
        }
        self.schema
            .get_or_try_init(|| async {
                let present = bounded(self.timeout, conn.query_one(SCHEMA_PRESENT, &[])).await?;
                if !present.get::<_, bool>(0) {
                    bounded(self.timeout, conn.batch_execute(SCHEMA)).await?;
                }
                Ok::<_, Attempt>(())
            })
            .await?;
        Ok(conn)
    }

    /// Runs `f` on a pooled connection within the store timeout, once more on another when
    /// the connection was found closed ([`twice`]). A connection whose call the timeout
    /// dropped is closed, not pooled ([`loan`]).
    async fn run<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: Fn(Lent) -> Fut,
        Fut: std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    {
        twice("postgres", self.timeout, || async {
            let (loan, lent) = lend(self.conn().await?);
            let result = f(lent).await.map_err(classify);
            loan.end();
            result
        })
        .await
    }

    pub(super) async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(own) = &self.own {
            return self.get_own(own, key).await;
        }
        self.run(|c| async move {
            let stmt = c
                .prepare_cached(
                    "SELECT value FROM tessera_kv WHERE key = $1 AND expires_at > now()",
                )
                .await?;
            // try_get, not get: a table of another shape than tessera's (another tool's, or
            // altered) is a store error, not a panic of the request.
            c.query_opt(&stmt, &[&key])
                .await?
                .map(|r| r.try_get(0))
                .transpose()
        })
        .await
    }

    pub(super) async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl_seconds: u64,
    ) -> Result<(), StoreError> {
        self.writable()?;
        let ttl = ttl_seconds as f64;
        self.run(|c| async move {
            let stmt = c
                .prepare_cached(
                    "INSERT INTO tessera_kv (key, value, expires_at)
                     VALUES ($1, $2, now() + $3::float8 * interval '1 second')
                     ON CONFLICT (key) DO UPDATE
                     SET value = EXCLUDED.value, expires_at = EXCLUDED.expires_at",
                )
                .await?;
            c.execute(&stmt, &[&key, &value, &ttl]).await.map(drop)
        })
        .await
    }

    pub(super) async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.writable()?;
        self.run(|c| async move {
            let stmt = c
                .prepare_cached("DELETE FROM tessera_kv WHERE key = $1")
                .await?;
            Ok(c.execute(&stmt, &[&key]).await? > 0)
        })
        .await
    }

    pub(super) async fn scan(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        if self.own.is_some() {
            return Err(err(
                "no list: the sessions are the application's (session.query), in its own table",
            ));
        }
        paged(|after: String| {
            self.run(move |c| {
                let after = after.clone();
                async move {
                    // starts_with, not LIKE: a prefix with `%` or `_` must match literally.
                    let stmt = c
                        .prepare_cached(
                            "SELECT key, value FROM tessera_kv WHERE starts_with(key, $1)
                             AND key > $2 AND expires_at > now() ORDER BY key LIMIT $3",
                        )
                        .await?;
                    let page = SCAN_PAGE as i64;
                    let rows = c.query(&stmt, &[&prefix, &after, &page]).await?;
                    rows.into_iter()
                        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                        .collect()
                }
            })
        })
        .await
    }

    pub(super) async fn replace(
        &self,
        key: &str,
        old: &[u8],
        value: &[u8],
    ) -> Result<bool, StoreError> {
        self.writable()?;
        self.run(|c| async move {
            let stmt = c
                .prepare_cached(
                    "UPDATE tessera_kv SET value = $3
                     WHERE key = $1 AND value = $2 AND expires_at > now()",
                )
                .await?;
            Ok(c.execute(&stmt, &[&key, &old, &value]).await? > 0)
        })
        .await
    }

    pub(super) async fn increment(
        &self,
        key: &str,
        window_seconds: u64,
    ) -> Result<(u64, u64), StoreError> {
        self.writable()?;
        let window = window_seconds.max(1) as f64;
        // One statement: a counter past its window starts again at 1 (the SET expressions see
        // the row as it was).
        let (n, left): (i64, i64) = self
            .run(|c| async move {
                let stmt = c
                    .prepare_cached(
                        "INSERT INTO tessera_counters AS c (key, n, expires_at)
                         VALUES ($1, 1, now() + $2::float8 * interval '1 second')
                         ON CONFLICT (key) DO UPDATE SET
                           n = CASE WHEN c.expires_at <= now() THEN 1 ELSE c.n + 1 END,
                           expires_at = CASE WHEN c.expires_at <= now()
                                        THEN EXCLUDED.expires_at ELSE c.expires_at END
                         RETURNING n, ceil(extract(epoch FROM expires_at - now()))::bigint",
                    )
                    .await?;
                let row = c.query_one(&stmt, &[&key, &window]).await?;
                Ok((row.try_get(0)?, row.try_get(1)?))
            })
            .await?;
        Ok((n.max(0) as u64, left.max(1) as u64))
    }

    pub(super) async fn decrement(&self, key: &str) -> Result<(), StoreError> {
        self.writable()?;
        self.run(|c| async move {
            let stmt = c
                .prepare_cached(
                    "UPDATE tessera_counters SET n = n - 1
                     WHERE key = $1 AND expires_at > now() AND n > 0",
                )
                .await?;
            c.execute(&stmt, &[&key]).await.map(drop)
        })
        .await
    }

    /// Deletes expired sessions and counters, and change-log rows older than 5 minutes.
    async fn purge(&self) -> Result<(), StoreError> {
        self.run(|c| async move {
            c.batch_execute(
                "DELETE FROM tessera_kv WHERE expires_at <= now() - interval '1 minute';
                 DELETE FROM tessera_counters WHERE expires_at <= now();
                 DELETE FROM tessera_kv_log WHERE at < now() - interval '5 minutes';",
            )
            .await
        })
        .await
    }
}
