//! The embedded store's invalidation stream: its change log, polled.

use std::sync::Arc;
use std::time::Duration;

use rusqlite::{params, Connection, ErrorCode, OpenFlags};

use super::super::{purge_every, AbortOnDrop, Invalidation, PollTicks};
use super::EmbeddedStore;

/// How often expired rows and old change-log rows are deleted besides on writes.
const PURGE_EVERY: Duration = Duration::from_secs(60);

/// Change-log rows after a sequence number: `(seq, key)`, in order.
type Rows = Vec<(i64, String)>;

impl EmbeddedStore {
    /// Polls the change log every `poll` (25 ms unless set); every process writing this store
    /// (serve and the CLI) appends the keys it changed there.
    ///
    /// The poll reads on a connection of its own, in this task rather than on the blocking pool:
    /// in WAL mode a read never waits for a writer, and an indexed read of a few rows takes
    /// microseconds, where a hop to the pool and back wakes three threads per poll (a third of
    /// an idle server's CPU on a 2-core VM: 12 against 8 ms per second). The connection's busy
    /// timeout is zero: a read SQLite cannot start at once (another process recovering the WAL)
    /// is retried at the next poll instead of stalling the runtime.
    pub(in crate::session::store) async fn watch(
        self,
        prefix: String,
        tx: tokio::sync::mpsc::Sender<Invalidation>,
    ) {
        let mut last: Option<i64> = None;
        let mut conn: Option<Connection> = None;
        let mut ticks = PollTicks::new(self.poll);
        // Said once per loss: a log that stays unreadable is tried again at every poll.
        let mut lost = false;
        let _purger = AbortOnDrop(tokio::spawn(purge_every(
            Arc::downgrade(&self.inner),
            PURGE_EVERY,
            "embedded expired rows",
            |inner| async move {
                let purged = tokio::task::spawn_blocking(move || inner.purge()).await;
                purged.unwrap_or_else(|e| Err(super::err(e)))
            },
        )));
        while ticks.next(&tx).await {
            let msg = match (self.read_log(&mut conn, last), last) {
                (Err(e), _) if is_busy(&e) => continue,
                (Err(_), _) if lost => {
                    conn = None;
                    continue;
                }
                (Err(e), _) => {
                    tracing::warn!(error = %self.inner.error(e), "embedded change log unreadable; session cache off");
                    conn = None;
                    last = None;
                    lost = true;
                    Invalidation::Lost
                }
                (Ok(rows), None) => {
                    last = rows.first().map(|r| r.0);
                    lost = false;
                    Invalidation::Live
                }
                (Ok(rows), Some(_)) if rows.is_empty() => continue,
                (Ok(rows), Some(prev)) => {
                    let gap = rows[0].0 != prev + 1;
                    last = rows.last().map(|r| r.0);
                    if gap {
                        // Rows were pruned before we read them: we cannot know what changed.
                        if tx.send(Invalidation::Lost).await.is_err() {
                            return;
                        }
                        Invalidation::Live
                    } else {
                        Invalidation::Keys(
                            rows.into_iter()
                                .map(|(_, k)| k)
                                .filter(|k| k.starts_with(&prefix))
                                .collect(),
                        )
                    }
                }
            };
            if tx.send(msg).await.is_err() {
                return;
            }
        }
    }

    /// The change-log rows after `after`, or (with `None`) the last sequence number as one row;
    /// opens the watch's connection into `conn` when there is none.
    fn read_log(
        &self,
        conn: &mut Option<Connection>,
        after: Option<i64>,
    ) -> rusqlite::Result<Rows> {
        let c = match conn {
            Some(c) => c,
            None => {
                // Not created here: a store whose file is gone is lost, not made anew empty.
                let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
                let c = Connection::open_with_flags(&self.inner.file, flags)?;
                c.busy_timeout(std::time::Duration::ZERO)?;
                conn.insert(c)
            }
        };
        match after {
            None => c
                .query_row("SELECT COALESCE(MAX(seq), 0) FROM kv_log", [], |r| r.get(0))
                .map(|max: i64| vec![(max, String::new())]),
            Some(after) => {
                let mut stmt = c.prepare_cached(
                    "SELECT seq, key FROM kv_log WHERE seq > ?1 ORDER BY seq LIMIT 10000",
                )?;
                let rows = stmt.query_map(params![after], |r| Ok((r.get(0)?, r.get(1)?)))?;
                rows.collect()
            }
        }
    }
}

/// SQLite could not take its read lock at once (`SQLITE_BUSY` / `SQLITE_LOCKED`).
fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}
