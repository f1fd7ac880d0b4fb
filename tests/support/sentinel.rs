//! A real Redis Sentinel deployment for one test: a master and two replicas (password
//! [`DATA_PASS`]) and three Sentinels (password [`SENTINEL_PASS`], quorum 2, a master down
//! after 1 s), each a `redis-server` on a free loopback port, stopped by PID on drop; with
//! [`Sentinels::start_tls`], every one of them over TLS only ([`ServerTls`]).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::tls::ServerTls;
use super::{free_port, require, terminate, wait_for_port};

pub const MASTER: &str = "tessera-master";
pub const DATA_PASS: &str = "data-pass";
pub const SENTINEL_PASS: &str = "sentinel-pass";

pub struct Sentinels {
    /// Ports of the three data servers (the first started as master).
    pub data: Vec<u16>,
    /// Ports of the three Sentinels.
    pub sentinels: Vec<u16>,
    children: Vec<(u16, Child)>,
    tls: Option<ServerTls>,
    _dir: tempfile::TempDir,
}

impl Sentinels {
    /// Starts everything and waits until every Sentinel can authorize a failover and both
    /// replicas are in sync.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// [`Sentinels::start`] with every server and Sentinel on TLS only, client certificates
    /// required.
    pub fn start_tls() -> Self {
        Self::start_with(Some(ServerTls::new()))
    }

    fn start_with(tls: Option<ServerTls>) -> Self {
        require("redis-server");
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let sentinels: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let mut children = Vec::new();
        for (i, &port) in data.iter().enumerate() {
            // A directory each: a replica writes the master's snapshot there, and a server
            // started later in the same directory would load it.
            let own = dir.path().join(port.to_string());
            std::fs::create_dir(&own).unwrap();
            let mut args = vec![
                "--dir".to_string(),
                own.to_str().unwrap().to_string(),
                "--bind".into(),
                "127.0.0.1".into(),
                "--save".into(),
                String::new(),
                "--appendonly".into(),
                "no".into(),
                "--requirepass".into(),
                DATA_PASS.into(),
                "--masterauth".into(),
                DATA_PASS.into(),
                "--repl-diskless-sync-delay".into(),
                "0".into(),
            ];
            if i > 0 {
                args.extend([
                    "--replicaof".into(),
                    "127.0.0.1".into(),
                    data[0].to_string(),
                ]);
            }
            match &tls {
                Some(tls) => args.extend(tls.redis_server(port, true)),
                None => args.extend(["--port".into(), port.to_string()]),
            }
            children.push((port, spawn(port, &args)));
        }
        for &port in &sentinels {
            let file = dir.path().join(format!("sentinel-{port}.conf"));
            let listen = match &tls {
                Some(tls) => tls.redis_server(port, false).join("\n"),
                None => format!("port {port}"),
            };
            std::fs::write(
                &file,
                format!(
                    "{listen}\nbind 127.0.0.1\nrequirepass {SENTINEL_PASS}\n\
                     sentinel sentinel-pass {SENTINEL_PASS}\n\
                     sentinel monitor {MASTER} 127.0.0.1 {} 2\n\
                     sentinel auth-pass {MASTER} {DATA_PASS}\n\
                     sentinel down-after-milliseconds {MASTER} 1000\n\
                     sentinel failover-timeout {MASTER} 5000\n",
                    data[0]
                ),
            )
            .unwrap();
            let args = vec![
                file.to_str().unwrap().to_string(),
                "--sentinel".into(),
                "--dir".into(),
                dir.path().to_str().unwrap().to_string(),
            ];
            children.push((port, spawn(port, &args)));
        }
        let s = Self {
            data,
            sentinels,
            children,
            tls,
            _dir: dir,
        };
        s.wait_ready();
        s
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let answers: Vec<String> = (self.sentinels.iter())
                .map(|&p| self.sentinel_cli(p, &["SENTINEL", "CKQUORUM", MASTER]))
                .collect();
            let quorum = answers.iter().all(|a| a.starts_with("OK"));
            let replication = self.data_cli(self.data[0], &["INFO", "replication"]);
            if quorum && replication.contains("connected_slaves:2") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "Sentinels not ready after 30 s: CKQUORUM {answers:?}; primary: {replication}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis+sentinel://` with both passwords, for database 0 (`rediss+sentinel://` with the
    /// CA and client certificate over TLS).
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let (scheme, tls) = match &self.tls {
            Some(tls) => ("rediss", format!("&{}", tls.redis_query())),
            None => ("redis", String::new()),
        };
        format!(
            "{scheme}+sentinel://:{DATA_PASS}@{}/{MASTER}/0?sentinel_password={SENTINEL_PASS}{tls}",
            hosts.join(",")
        )
    }

    /// The master's port as the first Sentinel sees it.
    pub fn master_port(&self) -> u16 {
        let out = self.sentinel_cli(
            self.sentinels[0],
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER],
        );
        out.lines().nth(1).unwrap().trim().parse().unwrap()
    }

    /// `SENTINEL FAILOVER` and wait until a replica answers `ROLE` as master; its port.
    pub fn failover(&self) -> u16 {
        let old = self.master_port();
        let said = self.sentinel_cli(self.sentinels[0], &["SENTINEL", "FAILOVER", MASTER]);
        assert!(said.starts_with("OK"), "SENTINEL FAILOVER: {said}");
        self.wait_new_master(old)
    }

    /// Waits until the Sentinels name a master other than `old` that says it is one; its port.
    pub fn wait_new_master(&self, old: u16) -> u16 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let now = self.master_port();
            if now != old && self.data_cli(now, &["ROLE"]).starts_with("master") {
                return now;
            }
            assert!(Instant::now() < deadline, "no new master");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL of the server on `port`.
    pub fn kill(&mut self, port: u16) {
        let (_, child) = self
            .children
            .iter_mut()
            .find(|(p, _)| *p == port)
            .expect("a server on that port");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// SIGSTOP or SIGCONT of the server on `port`.
    pub fn signal(&self, port: u16, signal: rustix::process::Signal) {
        let (_, child) = self.children.iter().find(|(p, _)| *p == port).unwrap();
        let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
        rustix::process::kill_process(pid, signal).unwrap();
    }

    pub fn data_cli(&self, port: u16, args: &[&str]) -> String {
        self.cli(port, DATA_PASS, args)
    }

    pub fn sentinel_cli(&self, port: u16, args: &[&str]) -> String {
        self.cli(port, SENTINEL_PASS, args)
    }

    fn cli(&self, port: u16, pass: &str, args: &[&str]) -> String {
        let tls = self
            .tls
            .as_ref()
            .map(ServerTls::redis_cli)
            .unwrap_or_default();
        let out = Command::new("redis-cli")
            .args(["-p", &port.to_string(), "--no-auth-warning", "-a", pass])
            .args(tls)
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

/// A redis-server with `args` (a configuration file first for a Sentinel), listening on `port`.
fn spawn(port: u16, args: &[String]) -> Child {
    let child = Command::new("redis-server")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn redis-server");
    wait_for_port(port, "redis-server");
    child
}

impl Drop for Sentinels {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            terminate(child);
        }
    }
}
