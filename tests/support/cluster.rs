//! A real Redis Cluster for one test: three primaries and three replicas (`redis-cli --cluster
//! create`, password [`PASS`] on every node, node timeout 2 s), each a `redis-server` on a free
//! loopback port with a directory of its own, stopped by PID on drop; with
//! [`Cluster::start_tls`], every node on TLS only, the cluster bus too ([`ServerTls`]).

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::tls::ServerTls;
use super::{free_port, require, terminate};

pub const PASS: &str = "cluster-pass";

pub struct Cluster {
    pub ports: Vec<u16>,
    children: Vec<(u16, Child)>,
    tls: Option<Arc<ServerTls>>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts six nodes, makes the cluster and waits until every node says `cluster_state:ok`
    /// and every primary has its replica. A node that does not listen, a `--cluster create`
    /// that fails, or a cluster not ready within 30 s (each seen once in a full run; a port
    /// picked free can be taken meanwhile by a parallel test, whose nodes then meet these) is
    /// tried again from scratch on new ports, at most three times, and the cause reported.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// [`Cluster::start`] with every node on TLS only (clients, replication and the cluster
    /// bus), client certificates required.
    pub fn start_tls() -> Self {
        Self::start_with(Some(Arc::new(ServerTls::new())))
    }

    fn start_with(tls: Option<Arc<ServerTls>>) -> Self {
        require("redis-server");
        let mut why = String::new();
        for _ in 0..3 {
            match Self::try_start(tls.clone()).and_then(|c| c.ready().map(|()| c)) {
                Ok(c) => return c,
                Err(e) => why = e,
            }
        }
        panic!("cluster create failed three times; last: {why}");
    }

    /// Six nodes and `--cluster create` over them; its output when that fails.
    fn try_start(tls: Option<Arc<ServerTls>>) -> Result<Self, String> {
        let dir = tempfile::tempdir().unwrap();
        let ports: Vec<u16> = (0..6).map(|_| free_port()).collect();
        // Made first, so that a failure below stops the nodes already started (on drop).
        let mut c = Self {
            ports: ports.clone(),
            children: Vec::new(),
            tls,
            _dir: dir,
        };
        for &port in &ports {
            let own = c._dir.path().join(port.to_string());
            std::fs::create_dir(&own).unwrap();
            // The cluster bus on a free port too (the default, port + 10000, may be taken).
            let bus = free_port().to_string();
            let listen = match &c.tls {
                Some(tls) => [
                    tls.redis_server(port, true),
                    vec!["--tls-cluster".into(), "yes".into()],
                ]
                .concat(),
                None => vec!["--port".into(), port.to_string()],
            };
            let child = Command::new("redis-server")
                .args(listen)
                .args(["--cluster-port", &bus])
                .args(["--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                .arg("--cluster-config-file")
                .arg(own.join("nodes.conf"))
                .arg("--dir")
                .arg(&own)
                .arg("--logfile")
                .arg(own.join("redis.log"))
                .args(["--requirepass", PASS, "--masterauth", PASS])
                .args([
                    "--repl-diskless-sync-delay",
                    "0",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn redis-server");
            c.children.push((port, child));
            // A port picked free can be taken before the node binds it (seen in a full run):
            // the node exits, and the cluster is made again on new ports.
            if !c.listening(port) {
                let log = std::fs::read_to_string(own.join("redis.log")).unwrap_or_default();
                return Err(format!("redis-server on {port} did not listen: {log}"));
            }
        }
        let nodes: Vec<String> = c.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .args(c.tls_args())
            .args(["--no-auth-warning", "-a", PASS, "--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        if !out.status.success() {
            return Err(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(c)
    }

    /// Whether the node on `port` listens within 15 s (false as soon as it exited).
    fn listening(&mut self, port: u16) -> bool {
        let deadline = Instant::now() + Duration::from_secs(15);
        let (_, child) = self.children.iter_mut().find(|(p, _)| *p == port).unwrap();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() >= deadline || !matches!(child.try_wait(), Ok(None)) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    /// Every node says `cluster_state:ok`, and every primary has a replica online, within
    /// 30 s; else each node's state.
    fn ready(&self) -> Result<(), String> {
        let ready = || {
            self.all_ok()
                && self.primaries().iter().all(|&p| {
                    self.cli(p, &["INFO", "replication"])
                        .contains("connected_slaves:1")
                })
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ready() {
            if Instant::now() >= deadline {
                let states: Vec<String> = self
                    .live_ports()
                    .iter()
                    .map(|&p| {
                        format!(
                            "{p}: {}",
                            self.cli(p, &["CLUSTER", "INFO"])
                                .lines()
                                .next()
                                .unwrap_or("")
                        )
                    })
                    .collect();
                return Err(format!("not ready within 30 s: {}", states.join("; ")));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Every live node says `cluster_state:ok` (after a node was killed: its replica took over).
    pub fn wait_ok(&self) {
        self.wait_until("cluster_state:ok", || self.all_ok());
    }

    fn all_ok(&self) -> bool {
        self.live_ports().iter().all(|&p| {
            self.cli(p, &["CLUSTER", "INFO"])
                .contains("cluster_state:ok")
        })
    }

    fn wait_until(&self, what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < deadline, "{what}: not within 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn live_ports(&self) -> Vec<u16> {
        self.children.iter().map(|(p, _)| *p).collect()
    }

    /// `redis+cluster://` with the password, two seeds (`rediss+cluster://` with the CA and
    /// client certificate over TLS).
    pub fn url(&self) -> String {
        let (scheme, tls) = match &self.tls {
            Some(tls) => ("rediss", format!("?{}", tls.redis_query())),
            None => ("redis", String::new()),
        };
        format!(
            "{scheme}+cluster://:{PASS}@127.0.0.1:{},127.0.0.1:{}{tls}",
            self.ports[0], self.ports[1]
        )
    }

    /// redis-cli's TLS arguments, none without TLS.
    fn tls_args(&self) -> Vec<String> {
        self.tls
            .as_deref()
            .map(ServerTls::redis_cli)
            .unwrap_or_default()
    }

    /// Ports of the nodes that are primaries now (asked of every live node's `ROLE`).
    pub fn primaries(&self) -> Vec<u16> {
        self.live_ports()
            .into_iter()
            .filter(|&p| self.cli(p, &["ROLE"]).starts_with("master"))
            .collect()
    }

    /// The port of the primary owning `key`'s slot (`CLUSTER NODES` of a live node).
    pub fn owner_of(&self, key: &str) -> u16 {
        let any = self.live_ports()[0];
        let slot: u16 = self.cli(any, &["CLUSTER", "KEYSLOT", key]).parse().unwrap();
        self.nodes(any)
            .into_iter()
            .find(|f| f[2].contains("master") && f[8..].iter().any(|r| in_range(r, slot)))
            .map(|f| port_of(&f[1]))
            .expect("an owner")
    }

    /// The port of the replica of the primary on `primary` (its `INFO replication`).
    pub fn replica_of(&self, primary: u16) -> u16 {
        let info = self.cli(primary, &["INFO", "replication"]);
        info.lines()
            .find_map(|l| {
                let fields = l.strip_prefix("slave0:")?;
                fields
                    .split(',')
                    .find_map(|f| f.strip_prefix("port=")?.parse().ok())
            })
            .unwrap_or_else(|| panic!("no replica: {info}"))
    }

    /// `CLUSTER NODES` of the node on `port`, split into fields.
    fn nodes(&self, port: u16) -> Vec<Vec<String>> {
        self.cli(port, &["CLUSTER", "NODES"])
            .lines()
            .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
            .filter(|f| f.len() >= 8)
            .collect()
    }

    /// Waits until the replica of `key`'s owner has caught up with it: replication is asynchronous, and a
    /// login is not held for it, so a session written just before its primary stops could be
    /// missing on the replica that takes over.
    pub fn wait_replicated(&self, key: &str) {
        // A replica answers MOVED for a key outside READONLY mode: compare offsets instead.
        let owner = self.owner_of(key);
        self.wait_until("the replica caught up", || {
            let info = self.cli(owner, &["INFO", "replication"]);
            let master = info.lines().find_map(|l| {
                l.trim()
                    .strip_prefix("master_repl_offset:")?
                    .parse::<u64>()
                    .ok()
            });
            let replica = info.lines().find_map(|l| {
                let fields = l.trim().strip_prefix("slave0:")?;
                fields
                    .split(',')
                    .find_map(|f| f.strip_prefix("offset=")?.parse::<u64>().ok())
            });
            matches!((master, replica), (Some(m), Some(r)) if r >= m)
        });
    }

    /// SIGKILL of the node on `port`.
    pub fn kill(&mut self, port: u16) {
        if let Some(i) = self.children.iter().position(|(p, _)| *p == port) {
            let (_, mut child) = self.children.remove(i);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGSTOP or SIGCONT of the node on `port`.
    pub fn signal(&self, port: u16, signal: rustix::process::Signal) {
        let (_, child) = self.children.iter().find(|(p, _)| *p == port).unwrap();
        let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
        rustix::process::kill_process(pid, signal).unwrap();
    }

    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &port.to_string(), "--no-auth-warning", "-a", PASS])
            .args(self.tls_args())
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Session keys on every primary.
    pub fn session_keys(&self) -> Vec<String> {
        self.primaries()
            .into_iter()
            .flat_map(|p| {
                self.cli(p, &["--scan", "--pattern", "tessera:session:*"])
                    .lines()
                    .filter(|l| !l.is_empty())
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// `GET` calls served by every live node so far (`INFO commandstats`).
    pub fn gets(&self) -> u64 {
        self.live_ports()
            .into_iter()
            .map(|p| {
                let stats = self.cli(p, &["INFO", "commandstats"]);
                stats
                    .lines()
                    .find_map(|l| l.strip_prefix("cmdstat_get:calls="))
                    .and_then(|v| v.split(',').next()?.parse().ok())
                    .unwrap_or(0)
            })
            .sum()
    }
}

/// The port of a `CLUSTER NODES` address (`IP:PORT@BUSPORT`).
fn port_of(addr: &str) -> u16 {
    let hostport = addr.split('@').next().unwrap();
    hostport.rsplit(':').next().unwrap().parse().unwrap()
}

/// Whether `range` (a `CLUSTER NODES` slot field: `N` or `A-B`) holds `slot`.
fn in_range(range: &str, slot: u16) -> bool {
    match range.split_once('-') {
        Some((a, b)) => match (a.parse::<u16>(), b.parse::<u16>()) {
            (Ok(a), Ok(b)) => (a..=b).contains(&slot),
            _ => false,
        },
        None => range.parse::<u16>() == Ok(slot),
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            if let Ok(pid) = i32::try_from(child.id()) {
                if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::CONT);
                }
            }
            terminate(child);
        }
    }
}
