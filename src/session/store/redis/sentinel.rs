//! Redis Sentinel: which server is the master now, and when that changes.
//!
//! URL: `redis+sentinel://[USER:PASS@]HOST:PORT[,HOST:PORT...]/MASTER[/DB]` (`rediss+sentinel`
//! over TLS, the Sentinels and the master alike) with optional
//! `?sentinel_username=..&sentinel_password=..`: `USER:PASS` log in to the master (as in a
//! `redis://` URL), the `sentinel_*` parameters to the Sentinels (Redis deploys them with a
//! password of their own); port 26379 when left out. The master's address comes from
//! `SENTINEL get-master-addr-by-name`, asked of each Sentinel in turn, and is then checked with
//! `ROLE` (a Sentinel may not have seen a failover yet). Switches come from every Sentinel's
//! `+promoted-slave` (published by the Sentinel leading a failover the moment it starts naming
//! the promoted replica, so that instances move together with the writers that ask it) and
//! `+switch-master` (published by every Sentinel when the failover ends); the address they name
//! is tried first from then on, while a Sentinel's word for it is fresh ([`TRUST`]).

use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use futures_util::stream::{self, FuturesUnordered, SelectAll, Stream, StreamExt};
use redis::{ConnectionInfo, ProtocolVersion, RedisConnectionInfo};

use super::tls::{info, Tls};
use super::url::{credentials, decode, host_port};
use super::{err, StoreError};

/// Where the Sentinels are, which master they watch, how to log in to each.
#[derive(Debug)]
pub(super) struct Sentinel {
    /// Every Sentinel, each with the Sentinels' credentials.
    pub(super) sentinels: Vec<ConnectionInfo>,
    /// The name the Sentinels monitor (`sentinel monitor NAME ...`).
    pub(super) master: String,
    /// Database and the master's credentials.
    data: RedisConnectionInfo,
    /// The master's address a Sentinel named last (a switch heard, or a check that it still
    /// names it), and when: tried before asking the Sentinels while fresh ([`TRUST`]).
    hint: Mutex<Option<((String, u16), Instant)>>,
    /// TLS for the Sentinels and the master alike (`rediss+sentinel://`).
    tls: Tls,
}

/// Every answering Sentinel's switch messages; `None` when one of their connections ended.
pub(super) type Switches = SelectAll<Pin<Box<dyn Stream<Item = Option<redis::Msg>> + Send>>>;

const DEFAULT_PORT: u16 = 26379;

/// How long a master is used after a Sentinel last named it, beyond the store's timeout (that
/// long to ask them): past it, commands wait for the Sentinels (503 meanwhile), so that an
/// instance cut off from every Sentinel, but not from the old master, stops reading that
/// master before long (`vouch.rs`). Longer than the invalidation stream's longest backoff
/// (2 s), so that the address of a switch just heard is still tried first when it comes back.
pub(super) const TRUST: Duration = Duration::from_secs(3);

impl Sentinel {
    /// Parses a `redis+sentinel://` or `rediss+sentinel://` URL (module docs), its TLS
    /// parameters already taken out into `tls`.
    ///
    /// Errors: no host, a port that is no number, no master name, a database that is no
    /// number, an unknown query parameter.
    pub(super) fn parse(url: &str, tls: Tls) -> Result<Self, StoreError> {
        let bad = |why: &str| {
            err(format!(
                "{why}: expected redis+sentinel://[USER:PASS@]HOST:PORT[,HOST:PORT...]/MASTER[/DB]"
            ))
        };
        let rest = url
            .strip_prefix("redis+sentinel://")
            .or_else(|| url.strip_prefix("rediss+sentinel://"))
            .ok_or_else(|| bad("not a redis+sentinel:// URL"))?;
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (username, password) = credentials(userinfo);
        let mut data = RedisConnectionInfo::default();
        if let Some(u) = username {
            data = data.set_username(u);
        }
        if let Some(p) = password {
            data = data.set_password(p);
        }
        let (master, db) = path.split_once('/').unwrap_or((path, ""));
        if master.is_empty() {
            return Err(bad("no master name"));
        }
        if !db.is_empty() {
            let db = db
                .parse()
                .map_err(|_| bad("the database is not a number"))?;
            data = data.set_db(db);
        }
        let mut guard = RedisConnectionInfo::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = decode(v);
            match k {
                "sentinel_username" => guard = guard.set_username(v),
                "sentinel_password" => guard = guard.set_password(v),
                other => return Err(bad(&format!("unknown parameter `{other}`"))),
            }
        }
        let sentinels = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| {
                let (host, port) =
                    host_port(h, DEFAULT_PORT).ok_or_else(|| bad("a port is not a number"))?;
                Ok(info(host, port, &tls)?.set_redis_settings(guard.clone()))
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        if sentinels.is_empty() {
            return Err(bad("no Sentinel host"));
        }
        Ok(Self {
            sentinels,
            master: decode(master),
            data,
            hint: Mutex::new(None),
            tls,
        })
    }

    /// A client for the master: the Sentinels asked all at once (one that hangs, stopped or
    /// its host gone, must not spend a request's whole deadline before the next is asked), and
    /// each address named checked with `ROLE` as it comes, the first that is a master taken. A
    /// Sentinel that has not yet heard of a failover names the old master, dead or demoted;
    /// another may already name the new one.
    ///
    /// Errors: no Sentinel named a master that says it is one (each cause listed).
    async fn master_by_sentinels(
        &self,
        timeout: Duration,
        protocol: ProtocolVersion,
    ) -> Result<redis::Client, StoreError> {
        let at = Instant::now();
        let mut asked: FuturesUnordered<_> = (self.sentinels.iter())
            .map(|sentinel| async move {
                let answer =
                    tokio::time::timeout(timeout, self.ask(&mut None, sentinel, timeout)).await;
                (sentinel.addr(), answer)
            })
            .collect();
        let mut causes = Vec::new();
        let mut tried = Vec::new();
        while let Some((sentinel, answer)) = asked.next().await {
            match answer {
                Ok(Ok(addr)) if tried.contains(&addr) => {}
                Ok(Ok(addr)) => {
                    tried.push(addr.clone());
                    match self.checked(addr.clone(), timeout, protocol).await {
                        Ok(client) => {
                            self.named(addr.0, addr.1, at);
                            return Ok(client);
                        }
                        Err(e) => causes.push(format!("{sentinel} named {e}")),
                    }
                }
                Ok(Err(e)) => causes.push(format!("{sentinel}: {e}")),
                Err(_) => causes.push(format!("{sentinel}: timed out")),
            }
        }
        Err(err(format!(
            "no Sentinel gave the master: {}",
            causes.join("; ")
        )))
    }

    /// The master's address as `sentinel` gives it, asked on `conn` (made first if `None`).
    pub(super) async fn ask(
        &self,
        conn: &mut Option<redis::aio::MultiplexedConnection>,
        sentinel: &ConnectionInfo,
        timeout: Duration,
    ) -> Result<(String, u16), StoreError> {
        if conn.is_none() {
            *conn = Some(connect(sentinel.clone(), timeout).await?);
        }
        let c = conn.as_mut().expect("a connection made above");
        let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.master)
            .query_async(c)
            .await
            .map_err(err)?;
        addr.ok_or_else(|| err(format!("no master named `{}`", self.master)))
    }

    /// A client for the current master, speaking `protocol`, its `ROLE` checked: the address
    /// of the last switch heard first, else the Sentinels'.
    ///
    /// Errors: [`Sentinel::master_by_sentinels`]'s.
    pub(super) async fn master(
        &self,
        timeout: Duration,
        protocol: ProtocolVersion,
    ) -> Result<redis::Client, StoreError> {
        let hint = self.hint.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let fresh = hint.filter(|(_, at)| at.elapsed() <= timeout + TRUST);
        if let Some((addr, _)) = fresh {
            match self.checked(addr.clone(), timeout, protocol).await {
                Ok(client) => return Ok(client),
                Err(_) => {
                    let mut hint = self.hint.lock().unwrap_or_else(|p| p.into_inner());
                    if hint.as_ref().is_some_and(|(a, _)| *a == addr) {
                        *hint = None;
                    }
                }
            }
        }
        self.master_by_sentinels(timeout, protocol).await
    }

    /// A client for the server at `addr` if `ROLE` says it is a master.
    async fn checked(
        &self,
        (host, port): (String, u16),
        timeout: Duration,
        protocol: ProtocolVersion,
    ) -> Result<redis::Client, StoreError> {
        let info = info(host, port, &self.tls)?.set_redis_settings(self.data.clone());
        let role = async {
            let mut c = connect(info.clone(), timeout).await?;
            let role: redis::Value = redis::cmd("ROLE").query_async(&mut c).await.map_err(err)?;
            Ok::<_, StoreError>(role)
        };
        let role = tokio::time::timeout(timeout, role)
            .await
            .map_err(|_| err(format!("{}: ROLE timed out", info.addr())))??;
        if !is_master(&role) {
            return Err(err(format!(
                "{} is not a master (Sentinel `{}` named it)",
                info.addr(),
                self.master
            )));
        }
        let settings = info.redis_settings().clone().set_protocol(protocol);
        redis::Client::open(info.set_redis_settings(settings)).map_err(err)
    }

    /// Subscribes to `+promoted-slave` and `+switch-master` on every Sentinel that answers, all
    /// at once (one that hangs costs the invalidation stream no more than the timeout).
    ///
    /// Errors: none answered.
    pub(super) async fn switches(&self, timeout: Duration) -> Result<Switches, StoreError> {
        let subscribing: FuturesUnordered<_> = (self.sentinels.iter())
            .map(|sentinel| async move {
                let subscribed = async {
                    let client = redis::Client::open(sentinel.clone()).map_err(err)?;
                    let mut pubsub = client.get_async_pubsub().await.map_err(err)?;
                    pubsub
                        .subscribe(&["+promoted-slave", "+switch-master"])
                        .await
                        .map_err(err)?;
                    Ok::<_, StoreError>(pubsub.into_on_message())
                };
                (
                    sentinel.addr(),
                    tokio::time::timeout(timeout, subscribed).await,
                )
            })
            .collect();
        let mut causes = Vec::new();
        let mut all = Switches::new();
        for (sentinel, subscribed) in subscribing.collect::<Vec<_>>().await {
            match subscribed {
                Ok(Ok(messages)) => {
                    let ended = stream::once(async { None });
                    all.push(Box::pin(messages.map(Some).chain(ended)));
                }
                Ok(Err(e)) => causes.push(format!("{sentinel}: {e}")),
                Err(_) => causes.push(format!("{sentinel}: timed out")),
            }
        }
        if all.is_empty() {
            return Err(err(format!(
                "no Sentinel to follow failovers on: {}",
                causes.join("; ")
            )));
        }
        Ok(all)
    }

    /// The next switch of this master: its new address, also kept as the first to try.
    /// Errors: a Sentinel's connection ended (switches could be missed from now on).
    pub(super) async fn next_switch(&self, switches: &mut Switches) -> Result<String, StoreError> {
        loop {
            let msg = switches
                .next()
                .await
                .flatten()
                .ok_or_else(|| err("a Sentinel's connection ended"))?;
            let payload: String = msg.get_payload().unwrap_or_default();
            let words: Vec<&str> = payload.split(' ').collect();
            let named = match (msg.get_channel_name(), &words[..]) {
                // "NAME OLD-IP OLD-PORT NEW-IP NEW-PORT"
                ("+switch-master", [name, _, _, ip, port]) => Some((*name, *ip, *port)),
                // "slave IP:PORT IP PORT @ NAME MASTER-IP MASTER-PORT"
                ("+promoted-slave", ["slave", _, ip, port, "@", name, _, _]) => {
                    Some((*name, *ip, *port))
                }
                _ => None,
            };
            let Some((name, ip, port)) = named else {
                continue;
            };
            let Ok(port) = port.parse::<u16>() else {
                continue;
            };
            if name == self.master {
                self.named(ip.to_owned(), port, Instant::now());
                return Ok(format!("{ip}:{port}"));
            }
        }
    }

    /// Whether a Sentinel named the master in use within `bound`: else its connections are not
    /// to be used, whether or not the invalidation stream runs to notice (`mod.rs`).
    pub(super) fn vouched_within(&self, bound: Duration) -> bool {
        let hint = self.hint.lock().unwrap_or_else(|p| p.into_inner());
        hint.as_ref().is_some_and(|(_, at)| at.elapsed() <= bound)
    }

    /// Keeps `HOST:PORT` as the master a Sentinel named at `at`.
    pub(super) fn named(&self, host: String, port: u16, at: Instant) {
        *self.hint.lock().unwrap_or_else(|p| p.into_inner()) = Some(((host, port), at));
    }
}

/// A multiplexed connection for Sentinel queries and the `ROLE` check.
pub(super) async fn connect(
    info: ConnectionInfo,
    timeout: Duration,
) -> Result<redis::aio::MultiplexedConnection, StoreError> {
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    redis::Client::open(info)
        .map_err(err)?
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
        .map_err(err)
}

/// `ROLE`'s first element says `master`.
fn is_master(role: &redis::Value) -> bool {
    let redis::Value::Array(items) = role else {
        return false;
    };
    match items.first() {
        Some(redis::Value::BulkString(b)) => b == b"master",
        Some(redis::Value::SimpleString(s)) => s == "master",
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sentinel_url_gives_hosts_master_database_and_both_credentials() {
        let s = Sentinel::parse(
            "redis+sentinel://app:p%40ss@10.0.0.1:26380,sentinel-b,[::1]:5000/cache/3\
             ?sentinel_password=s3cret",
            None,
        )
        .unwrap();
        let addrs: Vec<String> = s.sentinels.iter().map(|i| i.addr().to_string()).collect();
        assert_eq!(addrs, ["10.0.0.1:26380", "sentinel-b:26379", "::1:5000"]);
        assert_eq!(s.master, "cache");
        assert_eq!(s.data.db(), 3);
        assert_eq!(s.data.username(), Some("app"));
        assert_eq!(s.data.password(), Some("p@ss"));
        assert_eq!(s.sentinels[0].redis_settings().password(), Some("s3cret"));
        assert_eq!(s.sentinels[0].redis_settings().username(), None);
    }

    #[test]
    fn a_sentinel_url_without_master_or_with_a_bad_port_is_refused() {
        for url in [
            "redis+sentinel://h:1",
            "redis+sentinel://h:1/",
            "redis+sentinel://h:x/m",
            "redis+sentinel:///m",
            "redis+sentinel://h/m/zero",
            "redis+sentinel://h/m?password=x",
        ] {
            assert!(Sentinel::parse(url, None).is_err(), "{url}");
        }
    }
}
