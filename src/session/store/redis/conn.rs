//! The store's command connections: with one server, redis-rs's `ConnectionManager`, which
//! reconnects by itself; with Sentinel, a plain multiplexed connection that is never made again
//! to the same address behind our back (a demoted master would then serve stale reads), only
//! dropped ([`Slot::forget`]) so that the next call finds the master through the Sentinels; with
//! a cluster, redis-rs's cluster connection (one per node, MOVED and ASK followed).

use std::sync::Mutex;

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// One command connection, of either kind (module docs).
#[derive(Clone)]
pub(super) enum Conn {
    Managed(ConnectionManager),
    Plain(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Managed(c) => c.req_packed_command(cmd),
            Self::Plain(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Managed(c) => c.req_packed_commands(cmd, offset, count),
            Self::Plain(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Managed(c) => c.get_db(),
            Self::Plain(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// A connect running as a task of its own, so that it completes even when the request that
/// started it gave up (a cluster's first connect can outlast one request's timeout when a seed
/// node hangs).
pub(super) type Pending = tokio::task::JoinHandle<Result<Conn, crate::session::store::StoreError>>;

/// A connection made on first use and kept until [`Slot::forget`].
pub(super) struct Slot<C = Conn> {
    /// The connection, and how many times the slot was forgotten (its generation).
    conn: Mutex<(Option<C>, u64)>,
    /// One connect at a time; others wait for it and take its connection. Holds a cluster's
    /// connect in progress ([`Pending`]).
    pub(super) connecting: tokio::sync::Mutex<Option<Pending>>,
}

impl<C> Default for Slot<C> {
    fn default() -> Self {
        Self {
            conn: Mutex::new((None, 0)),
            connecting: tokio::sync::Mutex::default(),
        }
    }
}

impl<C: Clone> Slot<C> {
    pub(super) fn current(&self) -> Option<C> {
        self.lock().0.clone()
    }

    /// The generation to hand to [`Slot::set`] once a connect started now is done.
    pub(super) fn generation(&self) -> u64 {
        self.lock().1
    }

    /// Keeps `conn` unless the slot was forgotten since `generation`: a connect that began
    /// before a master switch must not outlive it (its server may be the demoted master).
    pub(super) fn set(&self, conn: C, generation: u64) {
        let mut slot = self.lock();
        if slot.1 == generation {
            slot.0 = Some(conn);
        }
    }

    pub(super) fn forget(&self) {
        let mut slot = self.lock();
        slot.0 = None;
        slot.1 += 1;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Option<C>, u64)> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connect_that_began_before_a_forget_is_not_kept() {
        let slot = Slot::<u32>::default();
        let before = slot.generation();
        slot.forget(); // a master switch while the connect ran
        slot.set(1, before);
        assert_eq!(slot.current(), None);
        let now = slot.generation();
        slot.set(2, now);
        assert_eq!(slot.current(), Some(2));
    }
}
