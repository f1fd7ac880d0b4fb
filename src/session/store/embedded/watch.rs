//! The embedded store's invalidation stream: its change log, polled.

use rusqlite::params;

use super::super::{Invalidation, PollTicks};
use super::EmbeddedStore;

impl EmbeddedStore {
    /// Polls the change log every `poll` (25 ms unless set); every process writing this store
    /// (serve and the CLI) appends the keys it changed there.
    pub(in crate::session::store) async fn watch(
        self,
        prefix: String,
        tx: tokio::sync::mpsc::Sender<Invalidation>,
    ) {
        let mut last: Option<i64> = None;
        let mut ticks = PollTicks::new(self.poll);
        while ticks.next(&tx).await {
            let after = last;
            let rows = self
                .run(move |c| match after {
                    None => c
                        .query_row("SELECT COALESCE(MAX(seq), 0) FROM kv_log", [], |r| r.get(0))
                        .map(|max: i64| vec![(max, String::new())]),
                    Some(after) => {
                        let mut stmt = c.prepare_cached(
                            "SELECT seq, key FROM kv_log WHERE seq > ?1 ORDER BY seq LIMIT 10000",
                        )?;
                        let rows =
                            stmt.query_map(params![after], |r| Ok((r.get(0)?, r.get(1)?)))?;
                        rows.collect()
                    }
                })
                .await;
            let msg = match (rows, last) {
                (Err(e), _) => {
                    tracing::warn!(error = %e, "embedded change log unreadable; session cache off");
                    last = None;
                    Invalidation::Lost
                }
                (Ok(rows), None) => {
                    last = rows.first().map(|r| r.0);
                    Invalidation::Live
                }
                (Ok(rows), Some(prev)) if rows.is_empty() => {
                    last = Some(prev);
                    continue;
                }
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
}
