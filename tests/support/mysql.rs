//! A real MariaDB server for one test: a fresh data directory (`mariadb-install-db`, `root`
//! without a password), a database `tessera`, on a free loopback port; stopped by PID on drop.
//! With [`Mariadb::start_tls`] it also speaks TLS, and has an account `x509` that it admits only
//! over TLS with a client certificate (`REQUIRE X509`).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::tls::ServerTls;
use super::{free_port, require, terminate};

pub struct Mariadb {
    pub port: u16,
    child: Child,
    dir: tempfile::TempDir,
    pub tls: Option<ServerTls>,
}

impl Mariadb {
    pub fn start() -> Self {
        Self::start_with(None)
    }

    pub fn start_tls() -> Self {
        let m = Self::start_with(Some(ServerTls::new()));
        m.sql(
            "CREATE USER x509@'%' REQUIRE X509; \
             GRANT ALL ON tessera.* TO x509@'%'",
        );
        m
    }

    fn start_with(tls: Option<ServerTls>) -> Self {
        require("mariadbd");
        let dir = tempfile::tempdir().unwrap();
        // A temporary directory each: servers bootstrapping at once in a shared /tmp removed
        // each other's temporary tables ("Unknown table 'mysql.tmp_user_sys'").
        std::fs::create_dir(dir.path().join("tmp")).unwrap();
        let out = Command::new("mariadb-install-db")
            .args(["--no-defaults", "--auth-root-authentication-method=normal"])
            .args(["--skip-test-db", "--user=root"])
            .arg(format!("--datadir={}", dir.path().join("data").display()))
            .arg(format!("--tmpdir={}", dir.path().join("tmp").display()))
            .output()
            .expect("mariadb-install-db");
        assert!(
            out.status.success(),
            "mariadb-install-db: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = free_port();
        let child = spawn(dir.path(), port, tls.as_ref());
        let m = Self {
            port,
            child,
            dir,
            tls,
        };
        m.sql("CREATE DATABASE tessera");
        m
    }

    /// SIGKILL of the server (a crash).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port and data, after [`Mariadb::kill`].
    pub fn start_again(&mut self) {
        self.child = spawn(self.dir.path(), self.port, self.tls.as_ref());
    }

    /// `root` without TLS; with [`Mariadb::start_tls`], `x509` with the CA and the client
    /// certificate.
    pub fn url(&self) -> String {
        match &self.tls {
            Some(tls) => format!(
                "mysql://x509@127.0.0.1:{}/tessera?ssl-mode=VERIFY_IDENTITY&ssl-ca={}\
                 &ssl-cert={}&ssl-key={}",
                self.port,
                tls.pki.ca().display(),
                tls.cert.display(),
                tls.key.display()
            ),
            None => format!("mysql://root@127.0.0.1:{}/tessera", self.port),
        }
    }

    /// Statements through the `mariadb` client, in database `tessera` once it exists; rows as
    /// tab-separated lines.
    pub fn sql(&self, statements: &str) -> String {
        let out = self
            .client()
            .args(["-e", statements])
            .output()
            .expect("mariadb");
        assert!(
            out.status.success(),
            "mariadb {statements}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// A `mariadb` client command line (batch mode, no column names) to run or feed.
    pub fn client(&self) -> Command {
        let mut c = Command::new("mariadb");
        c.args(["--no-defaults", "-h", "127.0.0.1", "-u", "root", "-N", "-B"])
            .args(["-P", &self.port.to_string()]);
        if self.dir.path().join("data/tessera").exists() {
            c.arg("tessera");
        }
        c
    }

    /// Prepared statements executed by the server so far (`Com_stmt_execute`): every store
    /// call of tessera is one or more; the change-log poller's reads are plain queries and do
    /// not count.
    pub fn statements(&self) -> u64 {
        let n = self.sql("SHOW GLOBAL STATUS LIKE 'Com_stmt_execute'");
        let n = n.split_whitespace().nth(1).unwrap_or_default();
        n.parse()
            .unwrap_or_else(|_| panic!("Com_stmt_execute: {n}"))
    }
}

fn spawn(dir: &std::path::Path, port: u16, tls: Option<&ServerTls>) -> Child {
    let log = std::fs::File::create(dir.join("server.log")).unwrap();
    let tls: Vec<String> = match tls {
        Some(tls) => vec![
            format!("--ssl-ca={}", tls.pki.ca().display()),
            format!("--ssl-cert={}", tls.cert.display()),
            format!("--ssl-key={}", tls.key.display()),
        ],
        None => Vec::new(),
    };
    let child = Command::new("mariadbd")
        .arg("--no-defaults")
        .args(tls)
        .arg(format!("--datadir={}", dir.join("data").display()))
        .arg(format!("--socket={}", dir.join("sock").display()))
        .arg(format!("--pid-file={}", dir.join("pid").display()))
        .arg(format!("--tmpdir={}", dir.join("tmp").display()))
        .args([
            &format!("--port={port}"),
            "--bind-address=127.0.0.1",
            "--user=root",
        ])
        // 2: each commit reaches the OS at once, so a killed server loses none (not fsynced:
        // only a machine crash could).
        .args(["--skip-log-bin", "--innodb-flush-log-at-trx-commit=2"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn mariadbd");
    let mut child = child;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let up = Command::new("mariadb")
            .args(["--no-defaults", "-h", "127.0.0.1", "-u", "root"])
            .args(["-P", &port.to_string(), "-e", "SELECT 1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if up {
            return child;
        }
        if Instant::now() >= deadline {
            terminate(&mut child);
            panic!(
                "mariadbd did not start: {}",
                std::fs::read_to_string(dir.join("server.log")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for Mariadb {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}
