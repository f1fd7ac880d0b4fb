//! The real Cyrus JMAP server behind tessera's TLS listener, as https-only clients reach it:
//! curl following Cyrus's own redirect, and jmapc 0.4.0 (Python), which speaks only https.

mod support;

use std::process::Command;

use support::cyrus::{client_saw_everything, login_at, token_of, Cyrus};
use support::tls::{tls_table, Pki};
use support::*;

/// tessera in front of Cyrus's JMAP at `cyrus` with a TLS listener on `tls_port` for
/// `localhost`, `[login]` checked at `/jmap/`, the JMAP mode on.
fn over_tls(cyrus: u16, pki: &Pki, tls_port: u16) -> Tessera {
    let (cert, key) = pki.leaf("localhost", &["localhost"]);
    let table = tls_table(tls_port, &cert, &key, "[jmap]\nsession_urls = \"absolute\"");
    let t = Tessera::start(move |port, dir| {
        config(
            port,
            &format!("http://127.0.0.1:{cyrus}"),
            &format!("embedded:{}/s", dir.display()),
            &[
                ("upstream", "max_connections = 4"),
                ("login", "verify_path = \"/jmap/\""),
                ("tables", &table),
            ],
        )
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", tls_port)).is_err() {
        assert!(std::time::Instant::now() < deadline, "no TLS listener");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    t
}

/// Cyrus answers `/.well-known/jmap` with `301 Location: http://HOST/jmap/`; behind TLS the
/// client is sent to https instead, and ends on the session resource with https URLs.
#[test]
fn curl_follows_cyrus_redirect_to_an_https_session() {
    let cyrus = Cyrus::start();
    let pki = Pki::new();
    let tls_port = free_port();
    let t = over_tls(cyrus.http_port, &pki, tls_port);
    let token = token_of(login_at(&t, "alice", "alice-secret-1"));
    let ca = pki.ca().display().to_string();
    let resolve = format!("localhost:{tls_port}:127.0.0.1");
    let url = format!("https://localhost:{tls_port}/.well-known/jmap");
    let (code, out) = curl(&[
        "-L",
        "--cacert",
        &ca,
        "--resolve",
        &resolve,
        "-H",
        &bearer(&token),
        "-w",
        "\n%{url_effective}\n%{http_code}",
        &url,
    ]);
    let (body, effective) = out.rsplit_once('\n').unwrap();
    assert_eq!(code, 200, "{out}");
    let origin = format!("https://localhost:{tls_port}");
    assert!(
        effective.starts_with(&format!("{origin}/jmap")),
        "{effective}"
    );
    let session: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(session["apiUrl"], format!("{origin}/jmap/"), "{session}");
}

/// jmapc 0.4.0 over tessera's TLS (trusting the test CA through `REQUESTS_CA_BUNDLE`): session,
/// Mailbox/get, Email/query + Email/get, Email/set, and a 30 MiB blob up and down, unchanged.
#[test]
fn jmapc_works_through_tls_and_the_jmap_mode() {
    let python = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/jmap/.venv/bin/python");
    assert!(
        std::path::Path::new(python).exists(),
        "{python} missing: scripts/test.sh installs tests/jmap/requirements.txt there"
    );
    let cyrus = Cyrus::start();
    let pki = Pki::new();
    let tls_port = free_port();
    let t = over_tls(cyrus.http_port, &pki, tls_port);
    let token = token_of(login_at(&t, "alice", "alice-secret-1"));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/jmap/jmapc_check.py");
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .env("JMAP_HOST", format!("localhost:{tls_port}"))
        .env("TOKEN", &token)
        .env("BLOB_MIB", "30")
        .env("REQUESTS_CA_BUNDLE", pki.ca());
    let api_url = format!("https://localhost:{tls_port}/jmap/");
    client_saw_everything(cmd, "jmapc_check.py", &t, &api_url);
}
