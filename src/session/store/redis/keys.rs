//! The Redis store's writes and deletions (confirmed by a replica where the deployment has
//! replicas) and its scans (every primary of a cluster).

use std::collections::HashSet;

use redis::aio::ConnectionLike;
use redis::AsyncCommands;

use super::confirming::{confirmed, holding, warn_unconfirmed};
use super::{err, is_stale, Conn, RedisStore, StoreError, Target};

impl RedisStore {
    /// With Sentinel or a cluster, the deletion is confirmed only once a replica has it (`WAIT
    /// 1`, within the store timeout, on the primary that took it): a primary that dies right
    /// after cannot bring the session back through a replica promoted without it. Unconfirmed,
    /// the call fails (the caller answers 503 and the client may retry: a second `DEL` is
    /// harmless).
    pub(in crate::session::store) async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        if matches!(self.target, Target::Direct(_)) {
            let n: u64 = self
                .idempotent(|mut c| async move { c.del(key).await })
                .await?;
            return Ok(n > 0);
        }
        let mut del = redis::cmd("DEL");
        del.arg(key);
        // Half the store timeout, so that an unconfirmed revocation is told as such before the
        // request's deadline cuts it.
        let wait_ms = (self.timeout.as_millis() / 2).max(1) as u64;
        let c = self.conn_in(&self.revocations).await?;
        let (n, replicas): (u64, u64) = confirmed(c, key, &del, wait_ms)
            .await
            .map_err(|e| self.failed(e))?;
        if replicas == 0 {
            return Err(err(format!(
                "no replica confirmed the revocation within {wait_ms} ms"
            )));
        }
        Ok(n > 0)
    }

    /// With Sentinel or a cluster, a new session is acknowledged once a replica has it too
    /// (`SET`, then `WAIT 1`, as [`RedisStore::delete`]): a primary that fails right after a
    /// login cannot take the session with it, leaving its user a 401. The wait is bounded by a
    /// quarter of the store timeout, so that an unconfirmed write (no replica up) stands on the
    /// primary alone, with a warning, well before the request's deadline: refusing logins
    /// while a replica is down would cost more than the rare lost session. One confirmation
    /// is waited for at a time, and none for a second after one found no replica
    /// ([`super::confirming::Confirming`]): `WAIT`s queued on one connection would add up past the deadline, so
    /// those writes stand on the primary alone too. A connection found dead is made again and
    /// the write sent once more (it is idempotent).
    pub(in crate::session::store) async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl_seconds: u64,
    ) -> Result<(), StoreError> {
        let turn = match self.target {
            Target::Direct(_) => None,
            _ => self.confirming.turn(),
        };
        let Some(turn) = turn else {
            self.idempotent(
                |mut c| async move { c.set_ex::<_, _, ()>(key, value, ttl_seconds).await },
            )
            .await?;
            if self.confirming.without_replica() {
                warn_unconfirmed(0);
            }
            return Ok(());
        };
        let mut set = redis::cmd("SET");
        set.arg(key).arg(value).arg("EX").arg(ttl_seconds);
        let wait_ms = (self.timeout.as_millis() / 4).max(1) as u64;
        // The turn is held by the write's own task (`holding`): a caller that gives up must not
        // free it while its `WAIT` still blocks the connection.
        let turn = std::sync::Arc::new(turn);
        let c = self.conn_in(&self.confirmations).await?;
        let ((), replicas): ((), u64) = match holding(&turn, c, key, &set, wait_ms).await {
            Err(e) if is_stale(&e) => {
                drop(self.failed(e));
                let c = self.conn_in(&self.confirmations).await?;
                holding(&turn, c, key, &set, wait_ms).await
            }
            other => other,
        }
        .map_err(|e| self.failed(e))?;
        if replicas == 0 {
            self.confirming.found_no_replica();
            warn_unconfirmed(wait_ms);
        }
        Ok(())
    }

    /// Every live key under `prefix` with its value: `SCAN` on the server, or on each primary
    /// of a cluster (values read through the cluster connection).
    pub(in crate::session::store) async fn scan(
        &self,
        prefix: &str,
    ) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let mut conn = self.conn().await?;
        let pattern = format!("{}*", glob_escape(prefix));
        let mut out = Vec::new();
        // SCAN may return a key more than once.
        let mut seen = HashSet::new();
        let Target::Cluster(cluster) = &self.target else {
            let mut on = conn.clone();
            self.scan_on(&mut on, &mut conn, &pattern, &mut seen, &mut out)
                .await?;
            return Ok(out);
        };
        for primary in cluster.primaries(self.timeout).await? {
            let client = cluster.node(&primary, redis::ProtocolVersion::RESP2)?;
            let mut node = client
                .get_multiplexed_async_connection()
                .await
                .map_err(err)?;
            self.scan_on(&mut node, &mut conn, &pattern, &mut seen, &mut out)
                .await?;
        }
        Ok(out)
    }

    /// `SCAN` over `on`, values by `MGET` on `values`, new keys added to `out`.
    async fn scan_on(
        &self,
        on: &mut impl ConnectionLike,
        values: &mut Conn,
        pattern: &str,
        seen: &mut HashSet<String>,
        out: &mut Vec<(String, Vec<u8>)>,
    ) -> Result<(), StoreError> {
        let mut cursor: u64 = 0;
        loop {
            let (next, mut keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(on)
                .await
                .map_err(|e| self.failed(e))?;
            keys.retain(|k| seen.insert(k.clone()));
            if !keys.is_empty() {
                let got: Vec<Option<Vec<u8>>> =
                    values.mget(&keys).await.map_err(|e| self.failed(e))?;
                out.extend(
                    keys.into_iter()
                        .zip(got)
                        .filter_map(|(k, v)| v.map(|v| (k, v))),
                );
            }
            if next == 0 {
                return Ok(());
            }
            cursor = next;
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
