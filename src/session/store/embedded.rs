//! Embedded backend: one SQLite file in WAL mode, so `tessera serve` and CLI commands
//! (`session create`, `session revoke`) can use the same store at once, across processes.
//!
//! Layout: `PATH/sessions.sqlite3`, table `kv(key TEXT PRIMARY KEY, value BLOB, expires_at INTEGER)`
//! with `expires_at` in seconds since the Unix epoch. Expired rows are invisible, purged on write
//! and every minute (`watch.rs`); the directory and files are private (`files.rs`).
//! `PATH/sessions.lock` is held (`flock`, exclusive) while a process opens the store: a new file
//! is turned to WAL and given its tables by one opener at a time (two at once made SQLite refuse
//! one with "database is locked", without waiting: each held a lock the other needed).
//! SQLite calls block, so they run on tokio's blocking pool over a small set of reused connections.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rusqlite::{params, Connection, OptionalExtension};

use super::StoreError;
use crate::unix_now;

mod files;
mod watch;

use files::{create_private, lock_for_open};

/// The embedded SQLite store.
#[derive(Clone)]
pub struct EmbeddedStore {
    inner: Arc<Inner>,
    /// How often [`EmbeddedStore::watch`] reads the change log (`session.poll_interval_ms`).
    poll: std::time::Duration,
}

/// The change log's poll interval unless set ([`EmbeddedStore::polling_every`]).
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_millis(25);
/// Change-log rows older than this are pruned, seconds.
const LOG_KEEP_SECONDS: i64 = 300;
/// How long an expired row stays in the file before it is deleted (it is never read once
/// expired): a wall clock set a day ahead by mistake and put back would otherwise have deleted
/// every session of that day for good.
const PURGE_GRACE_SECONDS: i64 = 86_400;
/// The lock file beside the database, held while the store is opened (module docs).
const OPEN_LOCK: &str = "sessions.lock";
/// The database file in the store's directory.
const DATABASE: &str = "sessions.sqlite3";
/// How long an open waits for another process's open to finish before it fails.
const OPEN_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

struct Inner {
    file: PathBuf,
    /// SQLite's busy timeout ([`EmbeddedStore::open_waiting`]).
    busy: std::time::Duration,
    /// Idle connections, reused; one is opened when none is free.
    idle: Mutex<Vec<Connection>>,
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(format!("embedded: {e}"))
}

impl EmbeddedStore {
    /// Opens (creating if needed) the store directory `dir`. Blocks the calling thread while
    /// another process opens it (module docs), for at most [`OPEN_LOCK_WAIT`] (then SQLite's
    /// statements wait up to their 5 s busy timeout each, as every store call does).
    ///
    /// Errors (each naming the file): the directory, the lock file or the database cannot be
    /// created or opened; another process's open held the lock for [`OPEN_LOCK_WAIT`].
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        Self::open_waiting(dir, std::time::Duration::from_secs(5))
    }

    /// [`EmbeddedStore::open`], each statement waiting at most `busy` for another process's
    /// write (SQLite's busy timeout): no longer than the deadline of the call that waits on it
    /// (`session.timeout_ms`), or a write given up for late would still commit after it.
    ///
    /// Errors: as [`EmbeddedStore::open`].
    pub fn open_waiting(dir: &Path, busy: std::time::Duration) -> Result<Self, StoreError> {
        let file = dir.join(DATABASE);
        create_private(dir, &file)?;
        let inner = Arc::new(Inner {
            file,
            busy,
            idle: Mutex::new(Vec::new()),
        });
        // Held until the tables exist (dropped at the end of this function).
        let _opening = lock_for_open(&dir.join(OPEN_LOCK))?;
        let conn = inner.connect()?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value BLOB NOT NULL, expires_at INTEGER NOT NULL);
             CREATE INDEX IF NOT EXISTS kv_expires ON kv(expires_at);
             CREATE TABLE IF NOT EXISTS kv_log (seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, at INTEGER NOT NULL);
             CREATE INDEX IF NOT EXISTS kv_log_at ON kv_log(at);",
        )
        .map_err(|e| inner.error(e))?;
        inner.release(conn);
        Ok(Self {
            inner,
            poll: WATCH_EVERY,
        })
    }

    /// Whether a store has been made in `dir` (by a first [`EmbeddedStore::open`]).
    ///
    /// Errors: whether it has cannot be told (`dir` not searchable by this user: EACCES).
    pub fn exists(dir: &Path) -> std::io::Result<bool> {
        dir.join(DATABASE).try_exists()
    }

    /// Reads the change log every `poll` (`session.poll_interval_ms`) instead of 25 ms.
    pub fn polling_every(mut self, poll: std::time::Duration) -> Self {
        self.poll = poll;
        self
    }

    async fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<R> + Send + 'static,
    ) -> Result<R, StoreError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            let conn = inner.acquire()?;
            let out = f(&conn).map_err(|e| inner.error(e));
            inner.release(conn);
            out
        })
        .await
        .map_err(err)?
    }

    /// [`EmbeddedStore::run`] in one `BEGIN IMMEDIATE` transaction: a change and its change-log
    /// row are written together or not at all (a row changed without its log entry would leave
    /// other processes' caches stale), and the write lock is taken, within the busy timeout,
    /// before anything is read.
    async fn run_write<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<R> + Send + 'static,
    ) -> Result<R, StoreError> {
        self.run(move |c| {
            let tx =
                rusqlite::Transaction::new_unchecked(c, rusqlite::TransactionBehavior::Immediate)?;
            let out = f(&tx)?;
            tx.commit()?;
            Ok(out)
        })
        .await
    }

    pub(super) async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let key = key.to_owned();
        self.run(move |c| {
            c.prepare_cached("SELECT value FROM kv WHERE key = ?1 AND expires_at > ?2")?
                .query_row(params![key, unix_now() as i64], |r| r.get(0))
                .optional()
        })
        .await
    }

    pub(super) async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl_seconds: u64,
    ) -> Result<(), StoreError> {
        let (key, value) = (key.to_owned(), value.to_vec());
        self.run_write(move |c| {
            let now = unix_now() as i64;
            c.prepare_cached("DELETE FROM kv WHERE expires_at <= ?1")?
                .execute(params![now - PURGE_GRACE_SECONDS])?;
            c.prepare_cached(
                "INSERT OR REPLACE INTO kv (key, value, expires_at) VALUES (?1, ?2, ?3)",
            )?
            .execute(params![key, value, now.saturating_add(ttl_seconds as i64)])?;
            c.prepare_cached("DELETE FROM kv_log WHERE at < ?1")?
                .execute(params![now - LOG_KEEP_SECONDS])?;
            log_change(c, &key)
        })
        .await
    }

    pub(super) async fn increment(
        &self,
        key: &str,
        window_seconds: u64,
    ) -> Result<(u64, u64), StoreError> {
        let key = key.to_owned();
        self.run(move |c| {
            let now = unix_now() as i64;
            // One statement: a counter past its window starts again at 1 (the SET expressions
            // see the row as it was). Not in the change log: counters invalidate nothing.
            let (n, until): (i64, i64) = c
                .prepare_cached(
                    "INSERT INTO kv (key, value, expires_at) VALUES (?1, 1, ?2)
                     ON CONFLICT(key) DO UPDATE SET
                       value = CASE WHEN expires_at <= ?3 THEN 1 ELSE CAST(value AS INTEGER) + 1 END,
                       expires_at = CASE WHEN expires_at <= ?3 THEN ?2 ELSE expires_at END
                     RETURNING CAST(value AS INTEGER), expires_at",
                )?
                .query_row(
                    params![key, now.saturating_add(window_seconds.max(1) as i64), now],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )?;
            Ok((n.max(0) as u64, (until - now).max(1) as u64))
        })
        .await
    }

    pub(super) async fn decrement(&self, key: &str) -> Result<(), StoreError> {
        let key = key.to_owned();
        self.run(move |c| {
            c.prepare_cached(
                "UPDATE kv SET value = CAST(value AS INTEGER) - 1
                 WHERE key = ?1 AND expires_at > ?2 AND CAST(value AS INTEGER) > 0",
            )?
            .execute(params![key, unix_now() as i64])
            .map(|_| ())
        })
        .await
    }

    pub(super) async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let key = key.to_owned();
        self.run_write(move |c| {
            let existed = c
                .prepare_cached("DELETE FROM kv WHERE key = ?1")?
                .execute(params![key])?
                > 0;
            // A key that was not there is in no cache as live: nothing to tell, and a logout
            // loop with an old token must not grow the log.
            if existed {
                log_change(c, &key)?;
            }
            Ok(existed)
        })
        .await
    }
}

impl EmbeddedStore {
    pub(super) async fn scan(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let prefix = prefix.to_owned();
        self.run(move |c| {
            // substr comparison, not LIKE: a prefix with `%` or `_` must match literally. Records
            // are blobs; login counters in the same table are integers, and an empty or short
            // prefix (`session.key_prefix = ""`) would take them in too.
            let mut stmt = c.prepare_cached(
                "SELECT key, value FROM kv WHERE substr(key, 1, ?1) = ?2 AND expires_at > ?3 \
                 AND typeof(value) = 'blob' ORDER BY key",
            )?;
            let rows = stmt.query_map(
                params![prefix.chars().count() as i64, prefix, unix_now() as i64],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            rows.collect()
        })
        .await
    }

    pub(super) async fn replace(
        &self,
        key: &str,
        old: &[u8],
        value: &[u8],
    ) -> Result<bool, StoreError> {
        let (key, old, value) = (key.to_owned(), old.to_vec(), value.to_vec());
        self.run_write(move |c| {
            let replaced = c
                .prepare_cached(
                    "UPDATE kv SET value = ?1 WHERE key = ?2 AND value = ?3 AND expires_at > ?4",
                )?
                .execute(params![value, key, old, unix_now() as i64])?
                > 0;
            if replaced {
                log_change(c, &key)?;
            }
            Ok(replaced)
        })
        .await
    }
}

fn log_change(c: &Connection, key: &str) -> rusqlite::Result<()> {
    c.prepare_cached("INSERT INTO kv_log (key, at) VALUES (?1, ?2)")?
        .execute(params![key, unix_now() as i64])?;
    Ok(())
}

impl Inner {
    fn connect(&self) -> Result<Connection, StoreError> {
        let connect = || {
            let conn = Connection::open(&self.file)?;
            conn.pragma_update(None, "journal_mode", "WAL")?;
            // FULL: a revocation acknowledged must survive a power loss (NORMAL may lose the
            // last commits until a checkpoint); writes are the cold path.
            conn.pragma_update(None, "synchronous", "FULL")?;
            conn.busy_timeout(self.busy)?;
            Ok::<_, rusqlite::Error>(conn)
        };
        connect().map_err(|e| self.error(e))
    }

    /// Deletes rows expired more than [`PURGE_GRACE_SECONDS`] ago (sessions and failed-login
    /// counts) and change-log rows past [`LOG_KEEP_SECONDS`]: a write does so too, but a store
    /// with no write for hours (or only logouts and failed logins) would otherwise keep them
    /// all.
    fn purge(&self) -> Result<(), StoreError> {
        let conn = self.acquire()?;
        let now = unix_now() as i64;
        let out = conn
            .execute(
                "DELETE FROM kv WHERE expires_at <= ?1",
                params![now - PURGE_GRACE_SECONDS],
            )
            .and_then(|_| {
                conn.execute(
                    "DELETE FROM kv_log WHERE at < ?1",
                    params![now - LOG_KEEP_SECONDS],
                )
            })
            .map_err(|e| self.error(e));
        self.release(conn);
        out.map(|_| ())
    }

    /// A store error naming the database file.
    fn error(&self, e: impl std::fmt::Display) -> StoreError {
        err(format!("{}: {e}", self.file.display()))
    }

    fn acquire(&self) -> Result<Connection, StoreError> {
        let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match pooled {
            Some(c) => Ok(c),
            None => self.connect(),
        }
    }

    /// Gives `conn` back for reuse (at most 8 kept), unless it is still in a transaction (a
    /// rollback that failed): kept, it would hold the write lock for every process.
    fn release(&self, conn: Connection) {
        if !conn.is_autocommit() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < 8 {
            idle.push(conn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The directory and every file of the store are its user's alone (sids in clear, sealed
    /// credentials); commits are synced (`synchronous = FULL`: 2).
    #[test]
    fn the_store_is_private_and_synced() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("store");
        let store = EmbeddedStore::open(&path).expect("open");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(store.put("k", b"v", 60)).expect("put");
        let conn = store.inner.acquire().expect("connection");
        let sync: i64 = conn
            .query_row("PRAGMA synchronous", [], |r| r.get(0))
            .expect("pragma");
        assert_eq!(sync, 2);
        let mode = |name: &str| {
            let m = std::fs::metadata(path.join(name)).expect(name);
            m.permissions().mode() & 0o777
        };
        assert_eq!(mode(""), 0o700);
        for file in [
            "sessions.sqlite3",
            "sessions.sqlite3-wal",
            "sessions.sqlite3-shm",
            OPEN_LOCK,
        ] {
            assert_eq!(mode(file), 0o600, "{file}");
        }
    }

    /// A delete of a key that is not there writes no change-log row (a logout loop with an old
    /// token must not grow the log); a purge removes expired rows and old log rows without a
    /// write.
    #[test]
    fn the_change_log_grows_only_with_changes_and_is_purged() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = EmbeddedStore::open(dir.path()).expect("open");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let count = |table: &str| -> i64 {
            let c = Connection::open(dir.path().join("sessions.sqlite3")).expect("open");
            c.query_row(&format!("SELECT COUNT(*) FROM {table}"), [], |r| r.get(0))
                .expect("count")
        };
        rt.block_on(store.put("k", b"v", 60)).expect("put");
        assert_eq!(count("kv_log"), 1);
        for _ in 0..3 {
            assert!(!rt.block_on(store.delete("absent")).expect("delete"));
        }
        assert_eq!(count("kv_log"), 1, "absent keys logged");
        Connection::open(dir.path().join("sessions.sqlite3"))
            .and_then(|c| {
                c.execute_batch(
                    "INSERT INTO kv VALUES ('old', x'00', 1); INSERT INTO kv_log (key, at) VALUES ('x', 1);",
                )
            })
            .expect("old rows");
        store.inner.purge().expect("purge");
        assert_eq!((count("kv"), count("kv_log")), (1, 1));
    }

    /// A change is written with its change-log row or not at all: with the log unwritable (its
    /// table dropped by another connection), a put fails and leaves no row, and a delete fails
    /// and leaves its row (written alone, other processes' caches would never hear of it).
    #[test]
    fn a_change_whose_log_row_fails_is_not_written() {
        let dir = tempfile::tempdir().expect("temp dir");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let store = EmbeddedStore::open(dir.path()).expect("open");
        rt.block_on(store.put("kept", b"v", 60)).expect("put");
        Connection::open(dir.path().join("sessions.sqlite3"))
            .and_then(|c| c.execute_batch("DROP TABLE kv_log"))
            .expect("log dropped");
        assert!(rt.block_on(store.put("new", b"v", 60)).is_err());
        assert_eq!(rt.block_on(store.get("new")).expect("get"), None);
        assert!(rt.block_on(store.delete("kept")).is_err());
        assert_eq!(
            rt.block_on(store.get("kept")).expect("get"),
            Some(b"v".to_vec()),
            "the row stays when its deletion cannot be logged"
        );
    }

    /// A scan under a prefix that login counters share (an empty one) lists the records and
    /// skips the counters (integers, which a record's bytes cannot be read from).
    #[test]
    fn a_scan_skips_the_login_counters_under_its_prefix() {
        let dir = tempfile::tempdir().expect("temp dir");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let store = EmbeddedStore::open(dir.path()).expect("open");
        rt.block_on(store.put("sid-1", b"{}", 60)).expect("put");
        rt.block_on(store.increment("login-fails:alice", 60))
            .expect("increment");
        let listed = rt.block_on(store.scan("")).expect("scan");
        assert_eq!(listed, [("sid-1".to_string(), b"{}".to_vec())]);
    }

    /// A new store opened by several at once (`tessera serve` starting as the CLI creates a
    /// session, in a fresh directory) opens for each, and each can write: the first open turns
    /// the file to WAL and creates the tables, and two connections doing that together made
    /// SQLite refuse one at once ("database is locked", no busy wait: each held the lock the
    /// other needed). 20 fresh stores, 8 openers each, released together.
    #[test]
    fn a_new_store_opened_by_many_at_once_opens_for_each() {
        const OPENERS: usize = 8;
        for round in 0..20 {
            let dir = tempfile::tempdir().expect("temp dir");
            let barrier = Arc::new(std::sync::Barrier::new(OPENERS));
            let openers: Vec<_> = (0..OPENERS)
                .map(|i| {
                    let (path, barrier) = (dir.path().to_path_buf(), barrier.clone());
                    std::thread::spawn(move || {
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .build()
                            .expect("runtime");
                        barrier.wait();
                        let store = EmbeddedStore::open(&path)?;
                        rt.block_on(store.put(&format!("k{i}"), b"v", 60))
                    })
                })
                .collect();
            for (i, opener) in openers.into_iter().enumerate() {
                let opened = opener.join().expect("opener thread");
                assert!(opened.is_ok(), "round {round}, opener {i}: {opened:?}");
            }
        }
    }
}
