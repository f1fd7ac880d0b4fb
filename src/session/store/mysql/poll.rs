//! The invalidation stream of the MySQL store: the change log polled every
//! `session.poll_interval_ms` ([`EVERY`] by default).
//!
//! Auto-increment ids are handed out when a row is inserted, not when its transaction commits:
//! a change that took id 7 can become visible after id 8 was read. So every id skipped so far
//! (a gap) is asked for again at each poll, for [`TRAIL`] after it was noticed: a late commit
//! is then still seen, and a rolled-back id is given up. tessera's own writes last at most the
//! store timeout; a transaction held open longer than [`TRAIL`] by another writer may be missed.
//! More than [`MAX_GAPS`] open gaps at once (ids handed out in steps, a burst of rollbacks):
//! the cache is flushed instead of tracking them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use mysql_async::prelude::Queryable;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::super::{Invalidation, PollTicks};
use super::{MysqlStore, StoreError};

/// How often the change log is read unless `session.poll_interval_ms` says otherwise.
pub(super) const EVERY: Duration = Duration::from_millis(25);
/// How long a skipped id is asked for again.
const TRAIL: Duration = Duration::from_secs(10);
/// Open gaps tracked at most.
const MAX_GAPS: usize = 1000;
/// Rows read by one poll at most; the rest come with the next.
const BATCH: usize = 10_000;

/// Where reading the log stands: every id up to `max` was read, except the open `gaps` (each
/// with when it was noticed).
struct Cursor {
    max: i64,
    gaps: BTreeMap<i64, Instant>,
}

impl MysqlStore {
    /// Polls the change log until the receiver is dropped: `Live` once it is read, `Keys` per
    /// batch of changes under `prefix`, `Lost` when reading fails (then `Live` again).
    pub(in crate::session::store) async fn watch(
        self: Arc<Self>,
        prefix: String,
        tx: mpsc::Sender<Invalidation>,
    ) {
        let mut cursor: Option<Cursor> = None;
        let mut ticks = PollTicks::new(self.poll);
        while ticks.next(&tx).await {
            let step = match cursor.as_mut() {
                None => self.start().await.map(|c| {
                    cursor = Some(c);
                    vec![Invalidation::Live]
                }),
                Some(c) => self.read(c, &prefix).await,
            };
            let messages = match step {
                Ok(messages) => messages,
                Err(e) if cursor.is_some() => {
                    tracing::warn!(error = %e, "mysql change log unreadable; session cache off until it is back");
                    cursor = None;
                    vec![Invalidation::Lost]
                }
                Err(_) => continue,
            };
            for message in messages {
                if tx.send(message).await.is_err() {
                    return;
                }
            }
        }
    }

    /// A cursor at the end of the log.
    async fn start(&self) -> Result<Cursor, StoreError> {
        let max: Option<i64> = self
            .run(|mut c| async move {
                c.query_first("SELECT COALESCE(MAX(id), 0) FROM tessera_kv_log")
                    .await
            })
            .await?;
        Ok(Cursor {
            max: max.unwrap_or(0),
            gaps: BTreeMap::new(),
        })
    }

    /// One poll: rows past `max` and in open gaps; the keys under `prefix` that changed.
    async fn read(&self, c: &mut Cursor, prefix: &str) -> Result<Vec<Invalidation>, StoreError> {
        let now = Instant::now();
        c.gaps
            .retain(|_, noticed| now.duration_since(*noticed) < TRAIL);
        let mut sql = format!("SELECT id, `key` FROM tessera_kv_log WHERE id > {}", c.max);
        if !c.gaps.is_empty() {
            let ids: Vec<String> = c.gaps.keys().map(i64::to_string).collect();
            sql.push_str(&format!(" OR id IN ({})", ids.join(",")));
        }
        sql.push_str(&format!(" ORDER BY id LIMIT {BATCH}"));
        let rows: Vec<(i64, Vec<u8>)> = self
            .run(|mut conn| {
                let sql = sql.clone();
                async move { conn.query(sql).await }
            })
            .await?;
        let mut keys = Vec::new();
        for (id, key) in rows {
            if id > c.max {
                for gap in c.max + 1..id {
                    if c.gaps.len() >= MAX_GAPS {
                        c.gaps.clear();
                        c.max = id;
                        return Ok(vec![Invalidation::Lost, Invalidation::Live]);
                    }
                    c.gaps.insert(gap, now);
                }
                c.max = id;
            } else if c.gaps.remove(&id).is_none() {
                continue;
            }
            match String::from_utf8(key) {
                Ok(k) if k.starts_with(prefix) => keys.push(k),
                _ => {}
            }
        }
        Ok(if keys.is_empty() {
            Vec::new()
        } else {
            vec![Invalidation::Keys(keys)]
        })
    }
}
