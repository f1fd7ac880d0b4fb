//! The invalidation stream of the MySQL store: the change log polled every
//! `session.poll_interval_ms` ([`EVERY`] by default).
//!
//! Auto-increment ids are handed out when a row is inserted, not when its transaction commits:
//! a change that took id 7 can become visible after id 8 was read. So every id skipped so far
//! (a gap) is asked for again at each poll, for [`TRAIL`] after it was noticed: a late commit
//! is then still seen, and a rolled-back id is given up. When polling starts (and again after a
//! lost connection), the missing ids of the last [`TRAIL`] start as gaps: transactions open at
//! that moment are not skipped either. tessera's own writes last at most the
//! store timeout; a transaction held open longer than [`TRAIL`] by another writer may be missed.
//! More than [`MAX_GAPS`] open gaps at once per step of the server's ids (a burst of
//! rollbacks) flush the cache instead of being tracked. The step is read from the server
//! (`auto_increment_increment`, the number of nodes in a Galera or Group Replication
//! multi-primary cluster): a node's ids then leave the others' in between as gaps, kept like
//! any other, so the bound grows with it and a writer on one node does not flush the cache at
//! every poll.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use mysql_async::prelude::Queryable;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::super::{purge_every, AbortOnDrop, Invalidation, PollTicks};
use super::{converted, MysqlStore, StoreError};

/// How often expired failed-login counts are deleted ([`MysqlStore::purge_counters`]).
const PURGE_EVERY: Duration = Duration::from_secs(60);

/// How often the change log is read unless `session.poll_interval_ms` says otherwise.
pub(super) const EVERY: Duration = Duration::from_millis(25);
/// How long a skipped id is asked for again.
const TRAIL: Duration = Duration::from_secs(10);
/// Open gaps tracked at most, per step of the server's ids.
const MAX_GAPS: usize = 1000;
/// Largest step of the ids taken into account (a cluster of more nodes gets this bound).
const MAX_STEP: usize = 16;
/// Rows read by one poll at most; the rest come with the next.
const BATCH: usize = 10_000;

/// The ids in `from + 1 ..= max` not in `present`, the highest `max_gaps` of them, each
/// noticed at `now`.
fn missing(
    from: i64,
    max: i64,
    present: &[i64],
    max_gaps: usize,
    now: Instant,
) -> BTreeMap<i64, Instant> {
    let present: std::collections::HashSet<i64> = present.iter().copied().collect();
    (from.saturating_add(1)..=max)
        .rev()
        .filter(|id| !present.contains(id))
        .take(max_gaps)
        .map(|id| (id, now))
        .collect()
}

/// Where reading the log stands: every id up to `max` was read, except the open `gaps` (each
/// with when it was noticed), at most `max_gaps` of them.
struct Cursor {
    max: i64,
    gaps: BTreeMap<i64, Instant>,
    max_gaps: usize,
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
        // A task of its own: a slow purge must not hold back the change log's reads.
        let purger = AbortOnDrop(tokio::spawn(purge_every(
            Arc::downgrade(&self),
            PURGE_EVERY,
            "mysql expired login counts",
            |store: Arc<Self>| async move { store.purge_counters().await },
        )));
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
        drop(purger);
    }

    /// A cursor at the end of the log. The ids below the end that are missing and newer than
    /// [`TRAIL`] (at most [`BATCH`] ids back) may be transactions still open: they start as
    /// gaps, as if just skipped, so a change committed after the start is not missed.
    async fn start(&self) -> Result<Cursor, StoreError> {
        let sql = format!(
            "SELECT COALESCE(MAX(id), 0), (SELECT COALESCE(MAX(id), 0) FROM tessera_kv_log \
             WHERE at < UNIX_TIMESTAMP() - {}), @@auto_increment_increment FROM tessera_kv_log",
            TRAIL.as_secs()
        );
        let ends: Option<mysql_async::Row> = self
            .run(|mut c| {
                let sql = sql.clone();
                async move { c.query_first(sql).await }
            })
            .await?;
        let ends = ends.map(converted::<(i64, i64, u64)>).transpose()?;
        let (max, settled, step) = ends.unwrap_or((0, 0, 1));
        let step = usize::try_from(step).unwrap_or(1).clamp(1, MAX_STEP);
        let max_gaps = MAX_GAPS * step;
        let from = settled.max(max.saturating_sub(BATCH as i64));
        // A plain query, as every read of the poller: prepared statements are the store calls'
        // (the tests count them).
        let sql = format!("SELECT id FROM tessera_kv_log WHERE id > {from} AND id <= {max}");
        let present: Vec<mysql_async::Row> = self
            .run(|mut c| {
                let sql = sql.clone();
                async move { c.query(sql).await }
            })
            .await?;
        let present = present
            .into_iter()
            .map(converted::<i64>)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Cursor {
            max,
            gaps: missing(from, max, &present, max_gaps, Instant::now()),
            max_gaps,
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
        let rows: Vec<mysql_async::Row> = self
            .run(|mut conn| {
                let sql = sql.clone();
                async move { conn.query(sql).await }
            })
            .await?;
        let mut keys = Vec::new();
        for row in rows {
            let (id, key) = converted::<(i64, Vec<u8>)>(row)?;
            if id > c.max {
                for gap in c.max.saturating_add(1)..id {
                    if c.gaps.len() >= c.max_gaps {
                        // Flushed, and read again from the end as when starting.
                        *c = self.start().await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_missing_ids_start_as_gaps_the_highest_first() {
        let now = Instant::now();
        let gaps = missing(10, 16, &[11, 13, 16], MAX_GAPS, now);
        assert_eq!(gaps.keys().copied().collect::<Vec<_>>(), [12, 14, 15]);
        assert!(missing(5, 5, &[], MAX_GAPS, now).is_empty());
        let many = missing(0, 5000, &[], MAX_GAPS, now);
        assert_eq!(many.len(), MAX_GAPS);
        assert_eq!(many.keys().next(), Some(&(5001 - MAX_GAPS as i64)));
    }
}
