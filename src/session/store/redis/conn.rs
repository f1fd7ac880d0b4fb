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
#[derive(Default)]
pub(super) struct Slot {
    conn: Mutex<Option<Conn>>,
    /// One connect at a time; others wait for it and take its connection. Holds a cluster's
    /// connect in progress ([`Pending`]).
    pub(super) connecting: tokio::sync::Mutex<Option<Pending>>,
}

impl Slot {
    pub(super) fn current(&self) -> Option<Conn> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(super) fn set(&self, conn: Conn) {
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn);
    }

    pub(super) fn forget(&self) {
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}
