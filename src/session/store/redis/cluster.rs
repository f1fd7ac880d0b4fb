//! Redis Cluster: `redis+cluster://[USER:PASS@]HOST:PORT[,HOST:PORT...]` (`rediss+cluster`
//! over TLS; port 6379 when left out; database 0, the only one a cluster has). Commands go through redis-rs's cluster client
//! (one multiplexed connection per node, MOVED and ASK followed); the shard map and its
//! primaries, for tracking and for `scan`, come from `CLUSTER SLOTS` asked of the seed nodes in
//! turn. `USER:PASS` apply
//! to every node, discovered ones included.

use std::time::Duration;

use redis::cluster::ClusterClient;
use redis::{ConnectionInfo, ProtocolVersion, RedisConnectionInfo};

use super::tls::{info, Tls};
use super::url::{credentials, host_port};
use super::{err, StoreError};

const DEFAULT_PORT: u16 = 6379;

/// The seed nodes and the credentials for every node.
#[derive(Debug)]
pub(super) struct Cluster {
    seeds: Vec<ConnectionInfo>,
    login: RedisConnectionInfo,
    /// TLS for every node (`rediss+cluster://`).
    tls: Tls,
}

/// A primary's address, as `CLUSTER SLOTS` gives it.
pub(super) type Primary = (String, u16);

impl Cluster {
    /// Parses a `redis+cluster://` or `rediss+cluster://` URL (module docs), its TLS
    /// parameters already taken out into `tls`.
    ///
    /// Errors: no host, a port that is no number, a database other than 0, a query.
    pub(super) fn parse(url: &str, tls: Tls) -> Result<Self, StoreError> {
        let bad = |why: &str| {
            err(format!(
                "{why}: expected redis+cluster://[USER:PASS@]HOST:PORT[,HOST:PORT...]"
            ))
        };
        let rest = url
            .strip_prefix("redis+cluster://")
            .or_else(|| url.strip_prefix("rediss+cluster://"))
            .ok_or_else(|| bad("not a redis+cluster:// URL"))?;
        if let Some((_, query)) = rest.split_once('?') {
            // Names only: a value may be a password (`sentinel_password=` pasted from a
            // Sentinel URL).
            let names: Vec<&str> = query
                .split('&')
                .map(|p| p.split('=').next().unwrap_or(p))
                .collect();
            return Err(bad(&format!("unknown parameters `{}`", names.join("`, `"))));
        }
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        if !matches!(path, "" | "0") {
            return Err(bad("a cluster has only database 0"));
        }
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let mut login = RedisConnectionInfo::default();
        let (username, password) = credentials(userinfo);
        if let Some(u) = username {
            login = login.set_username(u);
        }
        if let Some(p) = password {
            login = login.set_password(p);
        }
        let seeds = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| {
                let (host, port) =
                    host_port(h, DEFAULT_PORT).ok_or_else(|| bad("a port is not a number"))?;
                Ok(info(host, port, &tls)?.set_redis_settings(login.clone()))
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        if seeds.is_empty() {
            return Err(bad("no host"));
        }
        Ok(Self { seeds, login, tls })
    }

    /// A cluster client for commands.
    pub(super) fn client(&self, timeout: Duration) -> Result<ClusterClient, StoreError> {
        let mut b = ClusterClient::builder(self.seeds.clone())
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(1);
        if let Some(u) = self.login.username() {
            b = b.username(u);
        }
        if let Some(p) = self.login.password() {
            b = b.password(p);
        }
        if let Some(certs) = &self.tls {
            b = b.tls(redis::TlsMode::Secure).certs(certs.clone());
        }
        b.build().map_err(err)
    }

    /// A client for one node, speaking `protocol`.
    pub(super) fn node(
        &self,
        (host, port): &Primary,
        protocol: ProtocolVersion,
    ) -> Result<redis::Client, StoreError> {
        let login = self.login.clone().set_protocol(protocol);
        redis::Client::open(info(host.clone(), *port, &self.tls)?.set_redis_settings(login))
            .map_err(err)
    }

    /// The shard map from the first seed that answers `CLUSTER SLOTS`.
    ///
    /// Errors: no seed answered.
    pub(super) async fn shard_map(&self, timeout: Duration) -> Result<ShardMap, StoreError> {
        let mut causes = Vec::new();
        for seed in &self.seeds {
            let asked = async {
                let cfg = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout));
                let mut c = redis::Client::open(seed.clone())
                    .map_err(err)?
                    .get_multiplexed_async_connection_with_config(&cfg)
                    .await
                    .map_err(err)?;
                shard_map(&mut c).await
            };
            match tokio::time::timeout(timeout, asked).await {
                Ok(Ok(map)) => return Ok(map),
                Ok(Err(e)) => causes.push(format!("{}: {e}", seed.addr())),
                Err(_) => causes.push(format!("{}: timed out", seed.addr())),
            }
        }
        Err(err(format!(
            "no cluster node answered: {}",
            causes.join("; ")
        )))
    }

    /// The primaries, sorted, each once ([`Cluster::shard_map`]).
    pub(super) async fn primaries(&self, timeout: Duration) -> Result<Vec<Primary>, StoreError> {
        Ok(primaries_of(&self.shard_map(timeout).await?))
    }
}

/// Slot ranges and the primary serving each, sorted: `(first, last, primary)`.
pub(super) type ShardMap = Vec<(i64, i64, Primary)>;

/// The primaries of `map`, sorted, each once.
pub(super) fn primaries_of(map: &ShardMap) -> Vec<Primary> {
    let mut primaries: Vec<Primary> = map.iter().map(|(_, _, p)| p.clone()).collect();
    primaries.sort();
    primaries.dedup();
    primaries
}

/// The shard map by `CLUSTER SLOTS` on `c`.
///
/// Errors: the command failed or its answer names no primary.
pub(super) async fn shard_map(
    c: &mut impl redis::aio::ConnectionLike,
) -> Result<ShardMap, StoreError> {
    let slots: Vec<redis::Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(c)
        .await
        .map_err(err)?;
    let mut map: ShardMap = slots
        .iter()
        .filter_map(|range| {
            let redis::Value::Array(items) = range else {
                return None;
            };
            let first: i64 = redis::from_redis_value_ref(items.first()?).ok()?;
            let last: i64 = redis::from_redis_value_ref(items.get(1)?).ok()?;
            let redis::Value::Array(primary) = items.get(2)? else {
                return None;
            };
            let host: String = redis::from_redis_value_ref(primary.first()?).ok()?;
            let port: u16 = redis::from_redis_value_ref(primary.get(1)?).ok()?;
            Some((first, last, (host, port)))
        })
        .collect();
    map.sort();
    if map.is_empty() {
        return Err(err("CLUSTER SLOTS named no primary"));
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_url_gives_seeds_and_the_login_for_every_node() {
        let c = Cluster::parse("redis+cluster://app:p%40ss@10.0.0.1:7000,node-b", None).unwrap();
        let seeds: Vec<String> = c.seeds.iter().map(|i| i.addr().to_string()).collect();
        assert_eq!(seeds, ["10.0.0.1:7000", "node-b:6379"]);
        assert_eq!(c.seeds[1].redis_settings().password(), Some("p@ss"));
        assert_eq!(c.login.username(), Some("app"));
        for url in [
            "redis+cluster://",
            "redis+cluster://h:x",
            "redis+cluster://h/1",
            "redis+cluster://h?x=1",
        ] {
            assert!(Cluster::parse(url, None).is_err(), "{url}");
        }
        let e = Cluster::parse("redis+cluster://h?sentinel_password=s3cret&x", None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("`sentinel_password`, `x`") && !e.contains("s3cret"),
            "{e}"
        );
    }
}
