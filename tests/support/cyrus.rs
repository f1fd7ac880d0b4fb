//! A real Cyrus IMAP 3.6 JMAP server (Debian packages, set up by `scripts/cyrus.sh`) on free
//! ports, stopped on drop; logging in to it through tessera's `POST /auth/login`.

use std::process::Command;

use super::{curl, Tessera};

pub struct Cyrus {
    pub dir: tempfile::TempDir,
    pub http_port: u16,
}

impl Cyrus {
    pub fn start() -> Self {
        Self::start_with(8, false)
    }

    /// A Cyrus that compresses what a client asks to have compressed (`httpallowcompress`,
    /// Cyrus's default).
    pub fn start_compressing() -> Self {
        Self::start_with(8, true)
    }

    /// A Cyrus whose JMAP service forks at most `maxchild` children (one per connection).
    pub fn start_with_maxchild(maxchild: u32) -> Self {
        Self::start_with(maxchild, false)
    }

    fn start_with(maxchild: u32, compress: bool) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("cy")
            .tempdir_in("/tmp")
            .unwrap();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cyrus.sh");
        let out = Command::new("bash")
            .arg(script)
            .arg("start")
            .arg(dir.path())
            .env("CYRUS_MAXCHILD", maxchild.to_string())
            .env("CYRUS_COMPRESS", if compress { "yes" } else { "no" })
            .output()
            .expect("run cyrus.sh");
        assert!(
            out.status.success(),
            "cyrus.sh start failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let http_port = stdout
            .lines()
            .find_map(|l| l.strip_prefix("HTTP_PORT="))
            .and_then(|p| p.trim().parse().ok())
            .expect("HTTP_PORT line");
        Self { dir, http_port }
    }
}

impl Drop for Cyrus {
    fn drop(&mut self) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cyrus.sh");
        let _ = Command::new("bash")
            .arg(script)
            .arg("stop")
            .arg(self.dir.path())
            .status();
    }
}

/// `POST /auth/login` with JSON credentials: (status, body).
pub fn login_at(t: &Tessera, user: &str, password: &str) -> (u16, String) {
    let body = serde_json::json!({"username": user, "password": password}).to_string();
    curl(&[
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        &body,
        &t.url("/auth/login"),
    ])
}

/// The token of a login that must have succeeded.
pub fn token_of((code, body): (u16, String)) -> String {
    assert_eq!(code, 200, "login: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["token"].as_str().unwrap().to_string()
}

/// Runs a JMAP client script (`cmd`, its environment set) that prints one JSON object of what it
/// saw, and checks it: the session's `apiUrl` is `api_url`, alice's mailboxes and seeded message
/// were read, a draft was created, and a 30 MiB blob came back whole.
pub fn client_saw_everything(mut cmd: Command, what: &str, t: &Tessera, api_url: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{what} failed: {stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        t.log()
    );
    let seen: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(seen["apiUrl"], api_url);
    assert_eq!(seen["accountId"], "alice");
    let mailboxes = seen["mailboxes"].to_string().to_lowercase();
    assert!(mailboxes.contains("inbox"), "{mailboxes}");
    assert!(
        seen["subjects"].to_string().contains("tessera e2e alice"),
        "{seen}"
    );
    assert_eq!(seen["draftCreated"], true, "{seen}");
    assert_eq!(seen["blobBytes"], serde_json::json!([30 << 20, 30 << 20]));
    assert_eq!(seen["blobSame"], true);
}
