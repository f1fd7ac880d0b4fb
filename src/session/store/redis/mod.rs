//! Redis backend: one multiplexed connection (`ConnectionManager`, reconnects by itself), opened
//! on first use so that tessera starts, and answers 503, while Redis is down. With Sentinel
//! (`redis+sentinel://`, [`sentinel`]) the master is found through the Sentinels, and the
//! connection is dropped and the master found again when it switches, answers `READONLY` (a
//! demoted master) or is lost, or once no Sentinel names it any more (`vouch.rs`); revocations
//! there wait for a replica (`WAIT 1`).

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::AsyncCommands;
use redis::AsyncConnectionConfig;

use super::{Invalidation, StoreError};

mod cluster;
mod cluster_track;
mod confirming;
mod conn;
mod keys;
mod sentinel;
mod tls;
mod track;
mod url;
mod vouch;

use conn::{Conn, Slot};

/// The Redis store.
pub struct RedisStore {
    target: Target,
    timeout: Duration,
    /// Commands.
    main: Slot,
    /// Revocations with Sentinel or a cluster: `DEL` then `WAIT`, which blocks the connection
    /// it runs on.
    revocations: Slot,
    /// New sessions' `SET` then `WAIT`, on a connection of their own, so that a revocation
    /// waiting for a replica does not hold logins up (and the other way round).
    confirmations: Slot,
    /// Whether a new session's confirmation may be waited for now ([`confirming::Confirming`]).
    confirming: confirming::Confirming,
    /// The invalidation stream's outage, for the log.
    outage: super::Outage,
}

/// Which server to talk to.
enum Target {
    /// `redis://`: one server.
    Direct(redis::Client),
    /// `redis+sentinel://`: the master the Sentinels name.
    Sentinel(sentinel::Sentinel),
    /// `redis+cluster://`: every primary of a cluster.
    Cluster(cluster::Cluster),
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(format!("redis: {e}"))
}

/// The connection may be to a server that is gone or no longer the master.
fn is_stale(e: &redis::RedisError) -> bool {
    e.is_connection_dropped()
        || e.is_io_error()
        || e.is_timeout()
        || e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
}

impl RedisStore {
    /// Prepares a client for `url` (`redis://`, `redis+sentinel://`, `redis+cluster://`, each
    /// also as `rediss` for TLS, [`tls`]); nothing connects yet.
    ///
    /// Errors: the URL does not parse, or its TLS files cannot be read.
    pub fn new(url: &str, timeout: Duration) -> Result<Self, StoreError> {
        let (url, tls) = tls::split(url)?;
        let url = url.as_str();
        let scheme = |names: [&str; 2]| names.iter().any(|n| url.starts_with(n));
        let target = if scheme(["redis+sentinel://", "rediss+sentinel://"]) {
            Target::Sentinel(sentinel::Sentinel::parse(url, tls)?)
        } else if scheme(["redis+cluster://", "rediss+cluster://"]) {
            Target::Cluster(cluster::Cluster::parse(url, tls)?)
        } else if let Some(certs) = tls {
            Target::Direct(redis::Client::build_with_tls(url, certs).map_err(err)?)
        } else {
            Target::Direct(redis::Client::open(url).map_err(err)?)
        };
        Ok(Self {
            target,
            timeout,
            main: Slot::default(),
            revocations: Slot::default(),
            confirmations: Slot::default(),
            confirming: confirming::Confirming::default(),
            outage: super::Outage::default(),
        })
    }

    /// A client for the server to use now, speaking `protocol`.
    async fn client(&self, protocol: redis::ProtocolVersion) -> Result<redis::Client, StoreError> {
        match &self.target {
            Target::Direct(client) => {
                let info = client.get_connection_info().clone();
                let settings = info.redis_settings().clone().set_protocol(protocol);
                redis::Client::open(info.set_redis_settings(settings)).map_err(err)
            }
            Target::Sentinel(s) => s.master(self.timeout, protocol).await,
            Target::Cluster(_) => Err(err("a cluster has no single server")),
        }
    }

    async fn conn_in(&self, slot: &Slot) -> Result<Conn, StoreError> {
        if let Target::Sentinel(s) = &self.target {
            // Every Sentinel gone (killed, refused): the invalidation stream fails before it
            // can notice, so the connections to a master no Sentinel names are dropped here.
            if !s.vouched_within(self.timeout + sentinel::TRUST) {
                self.forget();
            }
        }
        if let Some(c) = slot.current() {
            return Ok(c);
        }
        let mut pending = slot.connecting.lock().await;
        if let Some(c) = slot.current() {
            return Ok(c);
        }
        let generation = slot.generation();
        let c = match &self.target {
            Target::Cluster(cluster) => {
                if pending.is_none() {
                    let client = cluster.client(self.timeout)?;
                    *pending = Some(tokio::spawn(async move {
                        let c = client.get_async_connection().await;
                        Ok(Conn::Cluster(c.map_err(err)?))
                    }));
                }
                // Awaited by reference: a caller that gives up leaves the task running.
                let joined = pending.as_mut().expect("a connect in progress").await;
                *pending = None;
                joined.map_err(err)??
            }
            _ => self.connect().await?,
        };
        slot.set(c.clone(), generation);
        Ok(c)
    }

    /// A new command connection to one server ([`Conn`]).
    async fn connect(&self) -> Result<Conn, StoreError> {
        let client = self.client(redis::ProtocolVersion::RESP2).await?;
        Ok(match self.target {
            Target::Sentinel(_) => {
                let cfg = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout));
                let c = client
                    .get_multiplexed_async_connection_with_config(&cfg)
                    .await;
                Conn::Plain(c.map_err(err)?)
            }
            _ => {
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout))
                    .set_number_of_retries(1);
                let c = ConnectionManager::new_with_config(client, cfg).await;
                Conn::Managed(c.map_err(err)?)
            }
        })
    }

    async fn conn(&self) -> Result<Conn, StoreError> {
        self.conn_in(&self.main).await
    }

    /// `e` as a store error; with Sentinel or a cluster, a connection that may be to a former
    /// master, or hold a stale slot map, is dropped first, so that the next call finds the
    /// master or the map again.
    fn failed(&self, e: redis::RedisError) -> StoreError {
        if !matches!(self.target, Target::Direct(_)) && is_stale(&e) {
            self.forget();
        }
        err(e)
    }

    /// Drops the command connections (Sentinel or cluster: the server or the map changed).
    fn forget(&self) {
        self.main.forget();
        self.revocations.forget();
        self.confirmations.forget();
    }

    /// Runs an idempotent command (or a counter's, where running twice errs by one); if the
    /// multiplexed connection was found dead (server restart, CLIENT KILL, idle cut) or, with
    /// Sentinel, on a demoted master, it is made again and the command sent once more before
    /// the caller sees a store failure (503).
    async fn idempotent<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        match f(self.conn().await?).await {
            Err(e) if is_stale(&e) => {
                drop(self.failed(e));
                f(self.conn().await?).await.map_err(|e| self.failed(e))
            }
            other => other.map_err(|e| self.failed(e)),
        }
    }

    pub(super) async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.idempotent(|mut c| async move { c.get(key).await })
            .await
    }

    /// The value at `key` and when the key expires (Unix seconds, rounded down; `None`: no
    /// expiry): `GET` and `PTTL` in one script, one command, which a cluster routes and
    /// redirects (`ASK` mid-migration) by its key as it does a `GET` (a pipeline it does not).
    pub(super) async fn get_expiring(
        &self,
        key: &str,
    ) -> Result<Option<(Vec<u8>, Option<u64>)>, StoreError> {
        // Redis keeps the compiled script by its text's digest: sent again, it is not compiled
        // again.
        const SCRIPT: &str = "return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}";
        let read = |mut c: Conn| async move {
            let mut eval = redis::cmd("EVAL");
            eval.arg(SCRIPT).arg(1).arg(key);
            let (value, pttl): (Option<Vec<u8>>, i64) = eval.query_async(&mut c).await?;
            Ok::<_, redis::RedisError>((value, pttl))
        };
        let (value, pttl) = self.idempotent(read).await?;
        // -1: no expiry; -2: no key.
        let expires = u64::try_from(pttl).ok().map(|ms| {
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            (now_ms + ms) / 1000
        });
        Ok(value.map(|v| (v, expires)))
    }

    pub(super) async fn replace(
        &self,
        key: &str,
        old: &[u8],
        value: &[u8],
    ) -> Result<bool, StoreError> {
        // Compare-and-set in one atomic script; KEEPTTL keeps the session's expiry.
        const CAS: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
               return redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL') \
             else return false end";
        let reply: Option<String> = redis::cmd("EVAL")
            .arg(CAS)
            .arg(1)
            .arg(key)
            .arg(old)
            .arg(value)
            .query_async(&mut self.conn().await?)
            .await
            .map_err(|e| self.failed(e))?;
        Ok(reply.is_some())
    }

    pub(super) async fn increment(
        &self,
        key: &str,
        window_seconds: u64,
    ) -> Result<(u64, u64), StoreError> {
        // INCR and the expiry in one atomic script (EVAL, as `replace`): a counter found without
        // one (new, or written by someone else) gets the window, so none lasts for ever.
        const INCREMENT: &str = "local n = redis.call('INCR', KEYS[1]) \
             local ttl = redis.call('TTL', KEYS[1]) \
             if ttl < 0 then \
               redis.call('EXPIRE', KEYS[1], ARGV[1]) \
               ttl = tonumber(ARGV[1]) \
             end \
             return {n, ttl}";
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(INCREMENT)
            .arg(1)
            .arg(key)
            .arg(window_seconds.max(1));
        // Sent again on a connection found dead, as the idempotent commands are: had the first
        // one run, a failed-login count is one too high for its window, which is harmless; a 503
        // for every login after each reconnect would not be.
        let (n, ttl): (i64, i64) = self
            .idempotent(|mut c| {
                let cmd = cmd.clone();
                async move { cmd.query_async(&mut c).await }
            })
            .await?;
        Ok((n.max(0) as u64, ttl.max(1) as u64))
    }

    pub(super) async fn decrement(&self, key: &str) -> Result<(), StoreError> {
        // DECR keeps the key's expiry; a missing or spent counter is not created at -1.
        const DECREMENT: &str = "if (tonumber(redis.call('GET', KEYS[1])) or 0) > 0 then \
               redis.call('DECR', KEYS[1]) \
             end \
             return 0";
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(DECREMENT).arg(1).arg(key);
        // Sent again on a connection found dead (see `increment`): at worst one too low.
        self.idempotent(|mut c| {
            let cmd = cmd.clone();
            async move { cmd.query_async::<()>(&mut c).await }
        })
        .await
    }
}
