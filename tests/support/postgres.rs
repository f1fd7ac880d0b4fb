//! A real PostgreSQL server for one test: a fresh cluster (`initdb`, trust authentication,
//! superuser `tessera`) in a temporary directory, on a free loopback port, `fsync` off,
//! `pg_stat_statements` loaded (to count tessera's statements, [`Postgres::calls`]); stopped
//! by `pg_ctl -m immediate` and, failing that, SIGKILL of its postmaster PID on drop.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{free_port, require};

pub struct Postgres {
    pub port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// Server options added to every start (`-c ssl=on ...` for TLS).
    extra: String,
}

/// Debian's versioned binaries directory (`/usr/lib/postgresql/N/bin`), newest first.
fn pg_bin() -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.filter_map(|e| Some(e.ok()?.path().join("bin"))).collect())
        .unwrap_or_default();
    found.retain(|b| b.join("initdb").exists());
    found.sort();
    found
        .pop()
        .unwrap_or_else(|| panic!("no /usr/lib/postgresql/*/bin/initdb: install postgresql"))
}

/// `program` from `bin`, run as the `postgres` user when we are root (the server refuses root).
fn as_owner(bin: &Path, program: &str) -> Command {
    if rustix::process::getuid().is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin.join(program));
        c
    } else {
        Command::new(bin.join(program))
    }
}

impl Postgres {
    pub fn start() -> Self {
        Self::start_with(|_| String::new())
    }

    /// A server that also takes TLS, with `cert` and `key` (PEM files, copied into its
    /// directory with the mode PostgreSQL demands); the role `certuser` (a superuser) logs in
    /// only over TLS with a client certificate for its name that `client_ca` signed.
    pub fn start_tls(cert: &Path, key: &Path, client_ca: &Path) -> Self {
        let pg = Self::start_with(|dir| {
            let (c, k, ca) = (
                dir.join("server.crt"),
                dir.join("server.key"),
                dir.join("client-ca.crt"),
            );
            std::fs::copy(cert, &c).unwrap();
            std::fs::copy(key, &k).unwrap();
            std::fs::copy(client_ca, &ca).unwrap();
            // First match wins: certuser's lines before initdb's `trust` for everyone.
            let hba = dir.join("data/pg_hba.conf");
            let rest = std::fs::read_to_string(&hba).unwrap();
            std::fs::write(
                &hba,
                format!(
                    "hostssl all certuser 127.0.0.1/32 cert\nhostssl all certuser ::1/128 cert\n\
                     host all certuser all reject\n{rest}"
                ),
            )
            .unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600)).unwrap();
            if rustix::process::getuid().is_root() {
                let ok = Command::new("chown")
                    .arg("postgres:postgres")
                    .args([&c, &k, &ca])
                    .status()
                    .unwrap();
                assert!(ok.success(), "chown postgres");
            }
            format!(
                " -c ssl=on -c ssl_cert_file={} -c ssl_key_file={} -c ssl_ca_file={}",
                c.display(),
                k.display(),
                ca.display()
            )
        });
        pg.sql("CREATE ROLE certuser LOGIN SUPERUSER");
        pg
    }

    /// A server with the options `extra` gives for its directory.
    fn start_with(extra: impl FnOnce(&Path) -> String) -> Self {
        require("runuser");
        let bin = pg_bin();
        let dir = tempfile::tempdir().unwrap();
        if rustix::process::getuid().is_root() {
            let ok = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(ok.success(), "chown postgres");
        }
        let out = as_owner(&bin, "initdb")
            .args(["-A", "trust", "-U", "tessera", "--no-sync", "-D"])
            .arg(dir.path().join("data"))
            .output()
            .expect("initdb");
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let extra = extra(dir.path());
        let pg = Self {
            port: free_port(),
            dir,
            bin,
            extra,
        };
        pg.start_again();
        pg
    }

    /// Starts the server (after [`Postgres::crash`]) on the same port and data.
    pub fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off \
             -c shared_preload_libraries=pg_stat_statements{}",
            self.port,
            self.dir.path().display(),
            self.extra
        );
        let out = as_owner(&self.bin, "pg_ctl")
            .args(["-w", "-t", "30", "-o", &options, "-l"])
            .arg(self.dir.path().join("server.log"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .arg("start")
            .output()
            .expect("pg_ctl start");
        assert!(
            out.status.success(),
            "pg_ctl start: {} {}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
        );
    }

    /// `pg_ctl stop -m immediate`: every backend ends at once, nothing is flushed (a crash, as
    /// far as clients can tell).
    pub fn crash(&self) {
        let _ = as_owner(&self.bin, "pg_ctl")
            .args(["-m", "immediate", "-D"])
            .arg(self.dir.path().join("data"))
            .arg("stop")
            .output();
    }

    pub fn url(&self) -> String {
        format!("postgres://tessera@127.0.0.1:{}/postgres", self.port)
    }

    /// One statement (or several, `;`-separated) through `psql`; rows as `|`-separated lines.
    pub fn sql(&self, statement: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
            ])
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                "tessera",
                "-d",
                "postgres",
            ])
            .args(["-c", statement])
            .output()
            .expect("psql");
        assert!(
            out.status.success(),
            "psql {statement}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// How many times statements starting with `start` ran, from `pg_stat_statements`
    /// (counted when each ends, so exact at once).
    pub fn calls(&self, start: &str) -> u64 {
        self.sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements");
        let n = self.sql(&format!(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE query LIKE '{start}%'"
        ));
        n.parse().unwrap_or_else(|_| panic!("calls: {n}"))
    }

    /// Sends `signal` to the postmaster and every process it started (this cluster only):
    /// `STOP` freezes the server as a hung host would, `CONT` thaws it.
    pub fn signal_all(&self, signal: rustix::process::Signal) {
        let postmaster = self.postmaster_pid().expect("postmaster.pid");
        let children = Command::new("pgrep")
            .args(["-P", &postmaster.to_string()])
            .output()
            .expect("pgrep");
        let pids = String::from_utf8_lossy(&children.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .chain([postmaster])
            .collect::<Vec<i32>>();
        for pid in pids.into_iter().filter_map(rustix::process::Pid::from_raw) {
            let _ = rustix::process::kill_process(pid, signal);
        }
    }

    fn postmaster_pid(&self) -> Option<i32> {
        let text = std::fs::read_to_string(self.dir.path().join("data/postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let pid = self.postmaster_pid();
        if pid.is_some() {
            self.signal_all(rustix::process::Signal::CONT);
        }
        self.crash();
        if let Some(pid) = pid.and_then(rustix::process::Pid::from_raw) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}
