//! Invalidation on a Redis Cluster: one RESP3 tracking connection per primary (`CLIENT TRACKING
//! ON BCAST PREFIX`), since a write is announced only by the primary that owns its slot (and
//! that primary's replicas), never by the other shards. Every second each connection is pinged
//! and the shard map (`CLUSTER SLOTS`) read again; a ping without answer within the store
//! timeout (a stopped primary), a connection's end (a killed one), or a changed map (failover,
//! resharding, a slot migrated) ends tracking: the cache is flushed and bypassed until it runs
//! again on the new map.

use std::time::Duration;

use super::cluster::{shard_map, Cluster};
use super::track::forward;
use super::{err, Invalidation, RedisStore, StoreError};

/// How often every tracking connection is pinged and the shard map read.
const HEARTBEAT: Duration = Duration::from_secs(1);

impl RedisStore {
    /// Tracks every primary until one fails or the map changes; then the command connections
    /// are dropped too, so that the next call starts from the new map.
    pub(super) async fn track_cluster(
        &self,
        cluster: &Cluster,
        prefix: &str,
        tx: &tokio::sync::mpsc::Sender<Invalidation>,
    ) -> Result<(), StoreError> {
        let ended = self.track_primaries(cluster, prefix, tx).await;
        if ended.is_err() {
            self.forget();
        }
        ended
    }

    async fn track_primaries(
        &self,
        cluster: &Cluster,
        prefix: &str,
        tx: &tokio::sync::mpsc::Sender<Invalidation>,
    ) -> Result<(), StoreError> {
        let map = cluster.shard_map(self.timeout).await?;
        let (push_tx, mut pushes) = tokio::sync::mpsc::unbounded_channel();
        let mut conns = Vec::new();
        for primary in super::cluster::primaries_of(&map) {
            let client = cluster.node(&primary, redis::ProtocolVersion::RESP3)?;
            conns.push(self.tracking_on(&client, prefix, push_tx.clone()).await?);
        }
        drop(push_tx);
        if tx.send(Invalidation::Live).await.is_err() {
            return Ok(());
        }
        self.outage.back("redis");
        let mut heartbeat = tokio::time::interval(HEARTBEAT);
        loop {
            tokio::select! {
                push = pushes.recv() => {
                    let push = push.ok_or_else(|| err("a primary's tracking connection ended"))?;
                    if !forward(push, tx).await? {
                        return Ok(());
                    }
                }
                _ = heartbeat.tick() => {
                    if tx.is_closed() {
                        return Ok(());
                    }
                    let ping = redis::cmd("PING");
                    for conn in &mut conns {
                        let pong = ping.query_async::<String>(conn);
                        match tokio::time::timeout(self.timeout, pong).await {
                            Ok(Ok(_)) => {}
                            Ok(Err(e)) => return Err(err(e)),
                            Err(_) => return Err(err("a primary did not answer the heartbeat")),
                        }
                    }
                    let now = tokio::time::timeout(self.timeout, shard_map(&mut conns[0]))
                        .await
                        .map_err(|_| err("CLUSTER SLOTS timed out"))??;
                    if now != map {
                        return Err(err("the cluster's shard map changed"));
                    }
                }
            }
        }
    }
}
