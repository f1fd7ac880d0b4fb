//! Test support: real processes (tessera binary, redis-server, nginx, Cyrus) on free loopback
//! ports ([`free_port`]), stopped by PID on drop, and small in-process upstreams for fault injection.
#![allow(dead_code)]

pub mod cluster;
pub mod cyrus;
pub mod events;
pub mod h2ws;
pub mod h3;
pub mod h3_raw;
pub mod mysql;
pub mod postgres;
pub mod sentinel;
pub mod stores;
pub mod tls;
pub mod upstream;

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const JWT_SECRET: &str = "test-secret-0123456789-0123456789-0123456789-0123456789-0123456789";
pub const CRED_KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

/// A free loopback port (bound then released; the caller binds it next). It is taken from the
/// lower half of the ports below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`),
/// from 10000 up (bench/lib.sh's `free_ports` takes the upper half), walking from an offset set
/// by the process id and the clock: a port from the ephemeral range can meanwhile become the
/// source port of an outgoing connection (the tests open thousands), and two threads asking the
/// kernel for port 0 can be handed the same port one after the other. Within one test process no
/// port is handed out twice (until the walk has gone round the whole range). Falls back to the
/// kernel's choice when the ephemeral range starts below 12000.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    if (12_000..=65_535).contains(&low) {
        let span = (low - 10_000) / 2;
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let start = (std::process::id().wrapping_mul(7919) ^ clock) % span;
        for _ in 0..span {
            let port = 10_000 + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
            if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
                return port as u16;
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn wait_for_port(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not listen on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn require(binary: &str) {
    assert!(
        Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {binary}"))
            .stdout(Stdio::null())
            .status()
            .unwrap()
            .success(),
        "{binary} is not installed: run ./scripts/test.sh, which installs it"
    );
}

/// Stops `child` with SIGTERM (nginx's master then stops its workers; a SIGKILL would leave them
/// running) and waits for it, at most 5 s, then SIGKILL.
pub fn terminate(child: &mut Child) {
    // Already reaped: its PID may belong to another process by now.
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A redis-server on a free port, no persistence; with [`Redis::start_tls`] on TLS only,
/// client certificates required.
pub struct Redis {
    pub port: u16,
    child: Child,
    pub tls: Option<tls::ServerTls>,
}

impl Redis {
    pub fn start() -> Self {
        Self::start_with(None)
    }

    pub fn start_tls() -> Self {
        Self::start_with(Some(tls::ServerTls::new()))
    }

    fn start_with(tls: Option<tls::ServerTls>) -> Self {
        require("redis-server");
        let port = free_port();
        Self {
            port,
            child: Self::spawn(port, tls.as_ref()),
            tls,
        }
    }

    /// Starts a new, empty redis-server on the same port after [`Redis::stop`].
    pub fn restart(&mut self) {
        terminate(&mut self.child);
        self.child = Self::spawn(self.port, self.tls.as_ref());
    }

    fn spawn(port: u16, tls: Option<&tls::ServerTls>) -> Child {
        let listen = match tls {
            Some(tls) => tls.redis_server(port, true),
            None => vec!["--port".into(), port.to_string()],
        };
        let child = Command::new("redis-server")
            .args(listen)
            .args([
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                // DEBUG SET-ACTIVE-EXPIRE: a key past its TTL stays until read, as one among
                // many does for minutes.
                "--enable-debug-command",
                "local",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        wait_for_port(port, "redis-server");
        child
    }

    /// `redis://` for database 0; `rediss://` with the CA and client certificate over TLS.
    pub fn url(&self) -> String {
        match &self.tls {
            Some(tls) => format!("rediss://127.0.0.1:{}/0?{}", self.port, tls.redis_query()),
            None => format!("redis://127.0.0.1:{}/0", self.port),
        }
    }

    pub fn cli(&self, args: &[&str]) -> String {
        let tls = self
            .tls
            .as_ref()
            .map(tls::ServerTls::redis_cli)
            .unwrap_or_default();
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(tls)
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    pub fn stop(&mut self) {
        terminate(&mut self.child);
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

/// nginx serving `/echo` (JSON of the request headers it saw), `/1k` (1 KiB JSON) and
/// `/nginx_status` (stub_status: connection counters).
pub struct Nginx {
    pub port: u16,
    status_queries: std::sync::atomic::AtomicU64,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Nginx {
    pub fn start() -> Self {
        Self::start_with("")
    }

    /// Like [`Nginx::start`], with `locations` added to its server block and the normalised
    /// path of every request (`$uri`: decoded, dot segments resolved) logged, read by
    /// [`Nginx::uris`].
    pub fn start_with(locations: &str) -> Self {
        Self::start_server("", "", locations)
    }

    /// Like [`Nginx::start_with`], with `listen` parameters (`ssl`) and `server` directives
    /// (certificates, session cache, client checks) added to its server block.
    pub fn start_server(listen: &str, server: &str, locations: &str) -> Self {
        Self::start_in_http("", listen, server, locations)
    }

    /// Like [`Nginx::start_server`], with `http` directives (a `proxy_cache_path`) added to its
    /// `http` block; `{dir}` in them is its temporary directory.
    pub fn start_in_http(http: &str, listen: &str, server: &str, locations: &str) -> Self {
        require("nginx");
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let d = dir.path().display();
        std::fs::create_dir_all(dir.path().join("tmp")).unwrap();
        std::fs::write(dir.path().join("1k.json"), one_kib_json()).unwrap();
        let http = http.replace("{dir}", &d.to_string());
        let conf = format!(
            r#"worker_processes 1;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {d}/tmp; proxy_temp_path {d}/tmp; fastcgi_temp_path {d}/tmp;
  uwsgi_temp_path {d}/tmp; scgi_temp_path {d}/tmp;
  keepalive_requests 100000;
  log_format uris '$uri';
  {http}
  server {{
    listen 127.0.0.1:{port} {listen};
    access_log {d}/uris.log uris;
    {server}
    {locations}
    location /echo {{
      default_type application/json;
      return 200 '{{"authorization":"$http_authorization","cookie":"$http_cookie","xff":"$http_x_forwarded_for","xfh":"$http_x_forwarded_host","xfp":"$http_x_forwarded_proto","host":"$http_host","x_secret":"$http_x_secret","connection":"$http_connection","uri":"$request_uri"}}';
    }}
    location = /1k {{ default_type application/json; alias {d}/1k.json; }}
    location = /nginx_status {{ stub_status; }}
  }}
}}
"#
        );
        let conf_path = dir.path().join("nginx.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let child = Command::new("nginx")
            .args(["-p", &d.to_string(), "-c", &conf_path.display().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nginx");
        wait_for_port(port, "nginx");
        Self {
            port,
            status_queries: Default::default(),
            child,
            _dir: dir,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// [`Nginx::uris`] once it lists at least `n` (nginx logs a request after answering it, so
    /// a client can have its answer first), or as it is after 10 s.
    pub fn uris_at_least(&self, n: usize) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let uris = self.uris();
            if uris.len() >= n || Instant::now() >= deadline {
                return uris;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The normalised paths (`$uri`) of the requests nginx served so far, in order.
    pub fn uris(&self) -> Vec<String> {
        std::fs::read_to_string(self._dir.path().join("uris.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Connections nginx has accepted so far (stub_status `accepts`), not counting the
    /// connections of these status queries themselves.
    pub fn accepted(&self) -> u64 {
        let own = self
            .status_queries
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        let (_, body) = curl(&[&format!("{}/nginx_status", self.url())]);
        let line = body.lines().nth(2).expect("stub_status line 3");
        line.split_whitespace()
            .next()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            - own
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

pub fn one_kib_json() -> String {
    let mut s = String::from("{\"items\":[");
    while s.len() < 1000 {
        s.push_str("\"lorem-ipsum\",");
    }
    s.push_str("\"end\"]}");
    format!("{s:<1023}\n")
}

/// The config text for a tessera under test; `extra` adds `(section, line)` pairs.
pub fn config(listen_port: u16, upstream: &str, store: &str, extra: &[(&str, &str)]) -> String {
    let add = |section: &str| -> String {
        extra
            .iter()
            .filter(|(s, _)| *s == section)
            .map(|(_, l)| format!("{l}\n"))
            .collect()
    };
    format!(
        "[server]\nlisten = \"127.0.0.1:{listen_port}\"\n{}[upstream]\nurl = \"{upstream}\"\n{}[token]\nsecret = \"{JWT_SECRET}\"\n{}\
         [session]\nstore = \"{store}\"\n{}[credentials]\n{}[log]\n{}{}{}",
        add("server"),
        add("upstream"),
        add("token"),
        add("session"),
        {
            // [credentials] extras may replace the default key set.
            let c = add("credentials");
            if c.contains("keys") {
                c
            } else {
                format!("keys = {{ k1 = \"{CRED_KEY}\" }}\n{c}")
            }
        },
        {
            // A `("log", "level = ...")` extra replaces the default level.
            let l = add("log");
            if l.lines().any(|l| l.trim_start().starts_with("level")) {
                l
            } else {
                format!("level = \"info\"\n{l}")
            }
        },
        {
            let l = add("login");
            if l.is_empty() {
                String::new()
            } else {
                format!("[login]\n{l}")
            }
        },
        // tables that must come last ([[token.keys]] entries are given whole)
        add("tables"),
    )
}

/// A `tessera serve` process.
pub struct Tessera {
    pub port: u16,
    pub dir: tempfile::TempDir,
    child: Child,
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_tessera")
}

impl Tessera {
    /// Starts `tessera serve` with `config_for(port, store_dir)`.
    pub fn start(config_for: impl FnOnce(u16, &Path) -> String) -> Self {
        Self::start_via(&[], config_for)
    }

    /// Like [`Tessera::start`], through a launcher: `via` is a command line the tessera command
    /// line is appended to (e.g. `sh -c '...; exec "$@"' sh`); empty: none.
    pub fn start_via(via: &[&str], config_for: impl FnOnce(u16, &Path) -> String) -> Self {
        Self::start_via_on(free_port(), via, config_for)
    }

    /// Like [`Tessera::start_via`], with `port` for the plain listener (known to `via`).
    pub fn start_via_on(
        port: u16,
        via: &[&str],
        config_for: impl FnOnce(u16, &Path) -> String,
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config_for(port, dir.path());
        // Only its user may read it, as a configuration with secrets inline should be.
        std::fs::write(dir.path().join("tessera.toml"), cfg).unwrap();
        let private = std::os::unix::fs::PermissionsExt::from_mode(0o600);
        std::fs::set_permissions(dir.path().join("tessera.toml"), private).unwrap();
        let log = std::fs::File::create(dir.path().join("tessera.log")).unwrap();
        let mut cmd = match via.split_first() {
            None => Command::new(bin()),
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(bin());
                c
            }
        };
        let child = cmd
            .args(["serve", "--config"])
            .arg(dir.path().join("tessera.toml"))
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn tessera");
        let mut t = Self { port, dir, child };
        let deadline = Instant::now() + Duration::from_secs(15);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = t.child.try_wait() {
                panic!("tessera exited early ({status}): {}", t.log());
            }
            assert!(
                Instant::now() < deadline,
                "tessera did not listen: {}",
                t.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        t
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("tessera.toml")
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("tessera.log")).unwrap_or_default()
    }

    /// The log once `ready` holds for it (a serving thread writes its access lines out when it
    /// next idles, microseconds after the response), or as it is after 10 s.
    pub fn log_when(&self, ready: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.log();
            if ready(&log) || Instant::now() >= deadline {
                return log;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the process with SIGTERM (a graceful shutdown) and waits for it (at most 5 s,
    /// then SIGKILL).
    pub fn stop(&mut self) {
        terminate(&mut self.child);
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How the process ended, if it did within `limit` (reaped then).
    pub fn exit_status(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Whether the process ended within `limit` (reaped if so).
    pub fn wait_exit(&mut self, limit: Duration) -> bool {
        self.exit_status(limit).is_some()
    }

    /// Sends the process signal `name` (`-HUP`, `-TERM`) with kill(1).
    pub fn signal(&self, name: &str) {
        let sent = Command::new("kill")
            .args([name, &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill {name} failed");
    }

    /// `tessera session create` against this instance's config; returns (sid, token).
    pub fn create_session(&self, user: &str, password: &str) -> (String, String) {
        create_session(&self.config_path(), user, password, None)
    }

    pub fn revoke(&self, sid: &str) {
        let out = Command::new(bin())
            .args(["session", "revoke", "--config"])
            .arg(self.config_path())
            .args(["--sid", sid])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "revoke failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Tessera {
    /// Stops the process; when a test is failing, prints the end of its log beside the panic, so
    /// that a failure seen once in CI says what tessera saw.
    fn drop(&mut self) {
        terminate(&mut self.child);
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(40)..].join("\n");
            eprintln!("tessera on port {} logged:\n{tail}", self.port);
        }
    }
}

pub fn create_session(
    config: &Path,
    user: &str,
    password: &str,
    ttl: Option<&str>,
) -> (String, String) {
    let mut cmd = Command::new(bin());
    cmd.args(["session", "create", "--config"])
        .arg(config)
        .args(["--user", user, "--password-stdin"]);
    if let Some(ttl) = ttl {
        cmd.args(["--ttl", ttl]);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{password}\n").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "session create failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON line");
    assert!(v["expires_at"].as_u64().unwrap() > 0);
    (
        v["sid"].as_str().unwrap().to_string(),
        v["token"].as_str().unwrap().to_string(),
    )
}

/// The value of the sample `name` (with its labels, e.g. `x_total{code="200"}`) in the metrics
/// text `text`; panics when it is missing.
pub fn sample(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name}: {text}"))
}

/// Runs curl with `args` (`-s` added); returns (HTTP status, body). Headers are included in the
/// body when `-i` is passed.
pub fn curl(args: &[&str]) -> (u16, String) {
    require("curl");
    let out = Command::new("curl")
        .args(["-sS", "-o", "-", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl");
    if !out.status.success() {
        // No HTTP answer (code 0): curl's own reason goes beside the test's failure.
        eprintln!(
            "curl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// An HTTP/2 client (prior knowledge) on tessera's plain `port`, its connection driven by a task
/// on the current runtime.
pub async fn h2c_client(port: u16) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    client
}

pub fn bearer(token: &str) -> String {
    format!("Authorization: Bearer {token}")
}

pub fn basic(user: &str, password: &str) -> String {
    use base64::Engine;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
    )
}

/// Peak resident set (VmHWM) of `pid`, KiB.
pub fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

pub fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A tessera (embedded store) in front of `upstream`, with `extra` config lines and `[metrics]`
/// on a free port, listening; returns it and its `/metrics` URL.
pub fn with_metrics(upstream: &str, extra: &[(&str, &str)]) -> (Tessera, String) {
    let metrics_port = free_port();
    let t = Tessera::start(|port, dir| {
        format!(
            "{}[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n",
            config(
                port,
                upstream,
                &format!("embedded:{}/sessions", dir.display()),
                extra
            )
        )
    });
    wait_for_port(metrics_port, "tessera metrics");
    (t, format!("http://127.0.0.1:{metrics_port}/metrics"))
}
