//! The invalidation stream of the Redis store: RESP3 `CLIENT TRACKING ON BCAST PREFIX` on a
//! connection of its own to the master, pinged every second; with Sentinel, also the
//! Sentinels' `+switch-master`, after which everything is found and made again, and their
//! word that the master is still the one tracked (`vouch.rs`).

use std::time::Duration;

use redis::aio::MultiplexedConnection;

use super::{err, sentinel, Invalidation, RedisStore, StoreError, Target};

impl RedisStore {
    /// The tracking loop: (re)connect, enable tracking, forward invalidations; on any failure
    /// report `Lost` and retry with backoff (100 ms doubling to 2 s, back to 100 ms after a
    /// stream that held 10 s).
    pub(in crate::session::store) async fn watch(
        self: std::sync::Arc<Self>,
        prefix: String,
        tx: tokio::sync::mpsc::Sender<Invalidation>,
    ) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let began = tokio::time::Instant::now();
            let result = self.track(&prefix, &tx).await;
            // A stream that held for a while was not failing: retry soon again.
            if began.elapsed() >= Duration::from_secs(10) {
                backoff = Duration::from_millis(100);
            }
            if tx.is_closed() {
                return;
            }
            if let Err(e) = result {
                self.outage.lost("redis", &e);
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
        // Following switches starts first, so that none is missed while the master is found.
        let mut switches = match &self.target {
            Target::Direct(_) => None,
            Target::Sentinel(s) => Some((s, s.switches(self.timeout).await?)),
            Target::Cluster(c) => return self.track_cluster(c, prefix, tx).await,
        };
        let (mut conn, mut push_rx, tracked) = self.tracking_connection(prefix).await?;
        if switches.is_some() {
            // The master may have moved while no stream was followed (a switch missed during
            // the backoff): commands go to the master found from here on, as tracking does.
            self.forget();
        }
        if tx.send(Invalidation::Live).await.is_err() {
            return Ok(());
        }
        self.outage.back("redis");
        let vouching = vouching(&self.target, &tracked, self.timeout);
        tokio::pin!(vouching);
        let mut ping = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                push = push_rx.recv() => {
                    let push = push.ok_or_else(|| err("push channel closed"))?;
                    if !forward(push, tx).await? {
                        return Ok(());
                    }
                }
                switched = next_switch(&mut switches) => {
                    let to = switched?;
                    if to == tracked {
                        // Sentinels announcing the switch this connection already made.
                        continue;
                    }
                    self.forget();
                    return Err(err(format!("the master moved to {to}")));
                }
                unvouched = &mut vouching => {
                    self.forget();
                    return Err(unvouched);
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

    /// A RESP3 connection to the (master) server with `CLIENT TRACKING ON BCAST` for `prefix`,
    /// the receiver of its pushes, and the server's address (`HOST:PORT`).
    async fn tracking_connection(
        &self,
        prefix: &str,
    ) -> Result<(MultiplexedConnection, Pushes, String), StoreError> {
        let client = self.client(redis::ProtocolVersion::RESP3).await?;
        let addr = client.get_connection_info().addr().to_string();
        let (push_tx, push_rx) = tokio::sync::mpsc::unbounded_channel();
        let conn = self.tracking_on(&client, prefix, push_tx).await?;
        Ok((conn, push_rx, addr))
    }

    /// A connection by `client` (RESP3) with `CLIENT TRACKING ON BCAST` for `prefix`, its
    /// pushes sent to `pushes`.
    pub(super) async fn tracking_on(
        &self,
        client: &redis::Client,
        prefix: &str,
        pushes: tokio::sync::mpsc::UnboundedSender<redis::PushInfo>,
    ) -> Result<MultiplexedConnection, StoreError> {
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout))
            .set_push_sender(pushes);
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
        Ok(conn)
    }
}

pub(super) type Pushes = tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>;

/// Hands one push on as invalidations: `Ok(false)` when nobody listens any more. Errors: the
/// connection ended.
pub(super) async fn forward(
    push: redis::PushInfo,
    tx: &tokio::sync::mpsc::Sender<Invalidation>,
) -> Result<bool, StoreError> {
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
                    return Ok(tx.send(Invalidation::Lost).await.is_ok()
                        && tx.send(Invalidation::Live).await.is_ok())
                }
            };
            Ok(tx.send(Invalidation::Keys(keys)).await.is_ok())
        }
        redis::PushKind::Disconnection => Err(err("disconnected")),
        _ => Ok(true),
    }
}

/// The next switch of the master, never with one server.
async fn next_switch(
    switches: &mut Option<(&sentinel::Sentinel, sentinel::Switches)>,
) -> Result<String, StoreError> {
    match switches {
        None => std::future::pending().await,
        Some((s, stream)) => s.next_switch(stream).await,
    }
}

/// Ends once no Sentinel names `tracked` as the master any more ([`Sentinel::vouching`]);
/// never with one server.
///
/// [`Sentinel::vouching`]: sentinel::Sentinel::vouching
async fn vouching(target: &Target, tracked: &str, timeout: Duration) -> StoreError {
    match target {
        Target::Sentinel(s) => s.vouching(tracked, timeout).await,
        _ => std::future::pending().await,
    }
}
