//! Whether a new session's write waits for a replica (`SET`, then `WAIT 1`, on the store's
//! confirmations connection): one at a time, since a `WAIT` blocks its connection and those
//! queued behind it would add up past the request's deadline, and not for a second after one
//! found no replica. Must never: free the turn while its `WAIT` may still block the connection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};

use super::Conn;

/// Warns, at most once a second, that a new session stands on the primary alone; `wait_ms`:
/// how long a replica was waited for (0: not waited for, [`Confirming`]).
pub(super) fn warn_unconfirmed(wait_ms: u64) {
    static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    if crate::once_a_second(&LAST) {
        tracing::warn!(
            wait_ms,
            "no replica confirmed a new session; a failover now would lose it"
        );
    }
}

/// The confirmations' state, shared with the turns.
#[derive(Default)]
pub(super) struct Confirming(Arc<State>);

#[derive(Default)]
struct State {
    /// A confirmation is under way.
    busy: AtomicBool,
    /// When a confirmation last found no replica.
    no_replica: Mutex<Option<Instant>>,
}

/// The turn to wait for a confirmation, given back when dropped.
pub(super) struct Turn(Arc<State>);

impl Confirming {
    /// The turn to wait for a replica, or `None` (write without waiting).
    pub(super) fn turn(&self) -> Option<Turn> {
        if self.without_replica() {
            return None;
        }
        let free = !self.0.busy.swap(true, Ordering::Acquire);
        free.then(|| Turn(self.0.clone()))
    }

    /// Whether a confirmation found no replica within the last second.
    pub(super) fn without_replica(&self) -> bool {
        let since = *self.0.no_replica.lock().unwrap_or_else(|p| p.into_inner());
        since.is_some_and(|t| t.elapsed() < Duration::from_secs(1))
    }

    pub(super) fn found_no_replica(&self) {
        *self.0.no_replica.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

/// [`confirmed`] in a task of its own that holds `turn` until the reply is in, whether or not
/// the caller still waits for it.
pub(super) async fn holding(
    turn: &Arc<Turn>,
    c: Conn,
    key: &str,
    write: &redis::Cmd,
    wait_ms: u64,
) -> redis::RedisResult<((), u64)> {
    let (turn, key, write) = (turn.clone(), key.to_owned(), write.clone());
    let task = tokio::spawn(async move {
        let _turn = turn;
        confirmed(c, &key, &write, wait_ms).await
    });
    task.await.unwrap_or_else(|e| {
        Err(redis::RedisError::from(std::io::Error::other(format!(
            "confirmation task: {e}"
        ))))
    })
}

/// `write` (one command on `key`) on `c`, then `WAIT 1 wait_ms` on the primary that took
/// it: the write's reply, and how many replicas confirmed it. `WAIT` blocks the connection
/// it runs on, hence the store's connections of their own for these.
pub(super) async fn confirmed<T: redis::FromRedisValue>(
    c: Conn,
    key: &str,
    write: &redis::Cmd,
    wait_ms: u64,
) -> redis::RedisResult<(T, u64)> {
    let mut wait = redis::cmd("WAIT");
    wait.arg(1).arg(wait_ms);
    match c {
        Conn::Cluster(mut c) => {
            let reply: T = write.query_async(&mut c).await?;
            let owner = Route::with_slot(Slot::for_key(key), SlotAddr::Master);
            let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(owner));
            let replicas = c.route_command(wait, routing).await?;
            Ok((reply, redis::from_redis_value(replicas)?))
        }
        mut c => {
            redis::pipe()
                .add_command(write.clone())
                .add_command(wait)
                .query_async(&mut c)
                .await
        }
    }
}
