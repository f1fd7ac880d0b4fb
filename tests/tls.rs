//! TLS termination with real clients: curl over HTTP/1.1 and HTTP/2 (ALPN), nghttp, openssl
//! `s_client` resuming sessions, h2spec over TLS, a rustls client watching certificates change
//! on SIGHUP and by SNI, and the plain listener that only redirects to https.

mod support;

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use support::tls::{leaf_der, tls_table, Client, Pki};
use support::*;

/// nginx as the upstream: `/proto` answers with the forwarding fields and the credential it got.
const ECHO: &str =
    r#"location = /proto { return 200 "proto=$http_x_forwarded_proto auth=$http_authorization"; }"#;

/// tessera with a plain listener, a TLS one on `tls_port` serving `localhost` from `pki`, and
/// `tls_extra` lines in `[tls]`; returns it with a session token.
fn tls_tessera(
    upstream: u16,
    pki: &Pki,
    tls_port: u16,
    tls_extra: &str,
    server: &'static str,
) -> (Tessera, String) {
    let (cert, key) = pki.leaf("localhost", &["localhost"]);
    let table = tls_table(tls_port, &cert, &key, tls_extra);
    let t = Tessera::start(move |port, dir| {
        let store = format!("embedded:{}/sessions", dir.display());
        let upstream = format!("http://127.0.0.1:{upstream}");
        config(
            port,
            &upstream,
            &store,
            &[("server", server), ("tables", &table)],
        )
    });
    wait_for_port(tls_port);
    let (_, token) = t.create_session("alice", "pw");
    (t, token)
}

fn wait_for_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// curl against `https://localhost:port/path` trusting `ca`, with `args`; (status, body, version).
fn curl_tls(port: u16, ca: &Path, path: &str, args: &[&str]) -> (u16, String, String) {
    let resolve = format!("localhost:{port}:127.0.0.1");
    let url = format!("https://localhost:{port}{path}");
    let ca = ca.display().to_string();
    let mut all = vec![
        "--cacert",
        &ca,
        "--resolve",
        &resolve,
        "-w",
        " %{http_version}\n%{http_code}",
    ];
    all.extend_from_slice(args);
    all.push(&url);
    let (status, out) = curl(&all);
    let (body, version) = out.rsplit_once(' ').unwrap();
    (status, body.to_string(), version.to_string())
}

#[test]
fn curl_and_nghttp_reach_the_upstream_over_tls_with_h1_and_h2_by_alpn() {
    require("nghttp");
    let nginx = Nginx::start_with(ECHO);
    let pki = Pki::new();
    let tls_port = free_port();
    let (t, token) = tls_tessera(nginx.port, &pki, tls_port, "", "");
    let bearer = format!("authorization: Bearer {token}");
    // `--http1.0`: Debian 12's curl (7.88) offers ALPN `http/1.0` alone.
    for (flag, version) in [("--http1.1", "1.1"), ("--http2", "2"), ("--http1.0", "1")] {
        let (status, body, v) = curl_tls(tls_port, &pki.ca(), "/proto", &[flag, "-H", &bearer]);
        assert_eq!((status, v.as_str()), (200, version), "{body}");
        assert!(body.starts_with("proto=https auth=Basic "), "{body}");
    }
    // HEAD over h2: a locally made answer's head, no DATA (a 401's text would be a protocol
    // error to the client).
    let (status, _, v) = curl_tls(tls_port, &pki.ca(), "/proto", &["-I", "--http2"]);
    assert_eq!((status, v.as_str()), (401, "2"));
    // Keep-alive over TLS on the fast path: two requests, one connection.
    let mut client = Client::connect(tls_port, "localhost", &pki.ca());
    for _ in 0..2 {
        let (status, body) = client.get("/proto", &token);
        assert_eq!(status, 200, "{body}");
        assert!(body.starts_with("proto=https"), "{body}");
    }
    // The plain listener still says http.
    let (status, body) = curl(&["-H", &bearer, &t.url("/proto")]);
    assert_eq!(
        (status, body.starts_with("proto=http ")),
        (200, true),
        "{body}"
    );
    let out = Command::new("nghttp")
        .args(["-v", "-H", &bearer])
        .arg(format!("https://localhost:{tls_port}/proto"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("The negotiated protocol: h2"), "{text}");
    assert!(text.contains(":status: 200"), "{text}");
    assert!(text.contains("proto=https"), "{text}");
}

/// openssl `s_client` connecting twice, the second time offering the first's session; whether
/// the server resumed it.
fn resumed(port: u16, version: &str, dir: &Path) -> bool {
    resumed_at(port, port, version, dir)
}

/// [`resumed`], the first connection to `first` and the second to `second`.
fn resumed_at(first: u16, second: u16, version: &str, dir: &Path) -> bool {
    let session = dir.join(format!("session-{version}.pem"));
    let run = |port: u16, io: &str| {
        // stdin held open a moment, so TLS 1.3 tickets (sent after the handshake) arrive.
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "sleep 0.3 | openssl s_client -connect 127.0.0.1:{port} -servername localhost \
                 {version} {io} {}",
                session.display()
            ))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let out = run(first, "-sess_out");
    assert!(out.contains("New, TLSv1."), "{out}");
    run(second, "-sess_in").contains("Reused, TLSv1.")
}

/// `tls.session_ticket_keys`: instances that list the same key resume each other's sessions
/// (TLS 1.3 and 1.2), one without it does not; rotated by SIGHUP as docs/operations.md says, a
/// key listed second opens tickets but seals none, and once first it seals.
#[test]
fn instances_sharing_ticket_keys_resume_each_others_sessions() {
    require("openssl");
    let nginx = Nginx::start_with(ECHO);
    let pki = Pki::new();
    let old = "session_ticket_keys = [\"old-ticket-key-0123456789-0123456789-abcdef\"]";
    let added = "session_ticket_keys = [\"old-ticket-key-0123456789-0123456789-abcdef\", \
                 \"new-ticket-key-0123456789-0123456789-abcdef\"]";
    let rotated = "session_ticket_keys = [\"new-ticket-key-0123456789-0123456789-abcdef\", \
                   \"old-ticket-key-0123456789-0123456789-abcdef\"]";
    let (a, b, own) = (free_port(), free_port(), free_port());
    let (ta, _) = tls_tessera(nginx.port, &pki, a, old, "");
    let (tb, _) = tls_tessera(nginx.port, &pki, b, old, "");
    let _own = tls_tessera(nginx.port, &pki, own, "", "");
    let dir = pki.dir.path();
    let both = |first: u16, second: u16, resumes: bool, what: &str| {
        for version in ["-tls1_3", "-tls1_2"] {
            let got = resumed_at(first, second, version, dir);
            assert_eq!(got, resumes, "{version}: {what}");
        }
    };
    both(a, b, true, "a to b");
    both(b, a, true, "b to a");
    both(a, own, false, "a to an instance of its own keys");
    // The keys of `t` from `from` to `to`, by SIGHUP, its `nth` reload.
    let reload = |t: &Tessera, from: &str, to: &str, nth: usize| {
        let text = std::fs::read_to_string(t.config_path()).unwrap();
        std::fs::write(t.config_path(), text.replace(from, to)).unwrap();
        Command::new("kill")
            .args(["-HUP", &t.pid().to_string()])
            .status()
            .unwrap();
        t.log_when(|log| log.matches("configuration reloaded").count() >= nth);
    };
    // 1. The new key second on b: b still seals under the old one, which a opens.
    reload(&tb, old, added, 1);
    both(b, a, true, "b with the new key second, to a");
    // 2. Second on a too, then first on b: b seals under it, a opens it listed second.
    reload(&ta, old, added, 1);
    reload(&tb, added, rotated, 2);
    both(b, a, true, "rotated b to a with the new key second");
    both(a, b, true, "a to rotated b");
    // 3. Without the new key, a opens none of b's tickets: b sealed them under it.
    reload(&ta, added, old, 2);
    both(b, a, false, "rotated b to a without the new key");
}

/// Resumption by ticket and by the session cache (tickets off), TLS 1.3 and 1.2; the metrics
/// count each handshake as full or resumed.
#[test]
fn sessions_resume_by_ticket_and_by_the_session_cache() {
    require("openssl");
    let nginx = Nginx::start_with(ECHO);
    let pki = Pki::new();
    let (tickets, plain, metrics) = (free_port(), free_port(), free_port());
    let with_metrics = format!("[metrics]\nlisten = \"127.0.0.1:{metrics}\"");
    let _with = tls_tessera(nginx.port, &pki, tickets, &with_metrics, "");
    let _without = tls_tessera(nginx.port, &pki, plain, "session_tickets = false", "");
    for port in [tickets, plain] {
        for version in ["-tls1_3", "-tls1_2"] {
            assert!(
                resumed(port, version, pki.dir.path()),
                "{version} on {port} not resumed"
            );
        }
    }
    let text = curl(&[&format!("http://127.0.0.1:{metrics}/metrics")]).1;
    let count = |kind: &str| {
        sample(
            &text,
            &format!("tessera_tls_handshakes_total{{kind=\"{kind}\"}}"),
        )
    };
    // Each version: one full handshake, then one resumed.
    assert_eq!((count("full"), count("resumed")), (2, 2), "{text}");
}

#[test]
fn min_version_1_3_refuses_a_tls_1_2_client() {
    require("openssl");
    let nginx = Nginx::start_with(ECHO);
    let pki = Pki::new();
    let port = free_port();
    let _t = tls_tessera(nginx.port, &pki, port, "min_version = \"1.3\"", "");
    let handshake = |version: &str| {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "openssl s_client -connect 127.0.0.1:{port} {version} </dev/null"
            ))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(handshake("-tls1_3").contains("New, TLSv1.3"));
    assert!(!handshake("-tls1_2").contains("New, TLSv1.2"));
    // A client that offers HTTP/1.0 alone (`curl --http1.0` 7.88 to 8.4) is served, not
    // refused with `no_application_protocol`.
    assert!(
        handshake("-alpn http/1.0").contains("ALPN protocol: http/1.0"),
        "{}",
        handshake("-alpn http/1.0")
    );
}

#[test]
fn sni_picks_each_names_certificate_and_others_get_the_default() {
    let nginx = Nginx::start_with(ECHO);
    let pki = Pki::new();
    let (mail, mail_key) = pki.leaf("mail", &["mail.test"]);
    let (wild, wild_key) = pki.leaf("wild", &["*.cal.test"]);
    let sni = format!(
        "[[tls.sni]]\nserver_names = [\"mail.test\"]\ncertificate = \"file:{}\"\nprivate_key = \"file:{}\"\n\
         [[tls.sni]]\nserver_names = [\"*.cal.test\"]\ncertificate = \"file:{}\"\nprivate_key = \"file:{}\"",
        mail.display(),
        mail_key.display(),
        wild.display(),
        wild_key.display()
    );
    let port = free_port();
    let _t = tls_tessera(nginx.port, &pki, port, &sni, "");
    let ca = pki.ca();
    assert_eq!(
        Client::connect(port, "mail.test", &ca).leaf(),
        leaf_der(&mail)
    );
    assert_eq!(
        Client::connect(port, "a.cal.test", &ca).leaf(),
        leaf_der(&wild)
    );
    let default = leaf_der(&pki.path("localhost.pem"));
    assert_eq!(Client::connect(port, "localhost", &ca).leaf(), default);
}

#[test]
fn sighup_swaps_the_certificate_for_new_handshakes_and_open_connections_go_on() {
    let nginx = Nginx::start_with(ECHO);
    let pki = Pki::new();
    let port = free_port();
    let (t, token) = tls_tessera(nginx.port, &pki, port, "", "");
    let cert = pki.path("localhost.pem");
    let old = leaf_der(&cert);
    let mut open = Client::connect(port, "localhost", &pki.ca());
    assert_eq!(open.get("/proto", &token).0, 200);
    let hangup = |expect: &str, times: usize| {
        Command::new("kill")
            .args(["-HUP", &t.pid().to_string()])
            .status()
            .unwrap();
        t.log_when(|log| log.matches(expect).count() >= times);
    };
    pki.leaf("localhost", &["localhost"]);
    let new = leaf_der(&cert);
    assert_ne!(old, new);
    hangup("configuration reloaded", 1);
    assert_eq!(
        open.get("/proto", &token).0,
        200,
        "the open connection broke"
    );
    assert_eq!(open.leaf(), old);
    assert_eq!(Client::connect(port, "localhost", &pki.ca()).leaf(), new);
    // A broken file is refused, logged, and the running certificate stays.
    std::fs::write(&cert, "not a certificate").unwrap();
    hangup("configuration reload refused", 1);
    assert!(t.log().contains("tls.certificate"), "{}", t.log());
    assert_eq!(Client::connect(port, "localhost", &pki.ca()).leaf(), new);
    // A good certificate in a file whose keys are refused (the pinned algorithms changed): all
    // or nothing, so the running certificate stays too.
    pki.leaf("localhost", &["localhost"]);
    let refused = leaf_der(&cert);
    let text = std::fs::read_to_string(t.config_path()).unwrap();
    let text = text.replace("[token]\n", "[token]\nalgorithms = [\"HS256\"]\n");
    std::fs::write(t.config_path(), text).unwrap();
    hangup("configuration reload refused", 2);
    assert!(t.log().contains("token.algorithms"), "{}", t.log());
    let served = Client::connect(port, "localhost", &pki.ca()).leaf();
    assert_ne!(
        served, refused,
        "the certificate of a refused reload is served"
    );
    assert_eq!(served, new);
}

#[test]
fn h2spec_finds_no_fault_over_tls() {
    require("h2spec");
    let nginx = Nginx::start_with(ECHO);
    let pki = Pki::new();
    let port = free_port();
    let _t = tls_tessera(nginx.port, &pki, port, "", "");
    let out = Command::new("h2spec")
        .args(["-t", "-k", "-h", "127.0.0.1", "-p", &port.to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let summary = text.lines().last().unwrap_or_default();
    assert!(
        summary.contains("145 passed, 0 skipped, 0 failed"),
        "{summary}\n{text}"
    );
}

#[test]
fn the_plain_listener_can_redirect_everything_to_https() {
    let nginx = Nginx::start_with(ECHO);
    let pki = Pki::new();
    let tls_port = free_port();
    let (t, token) = tls_tessera(nginx.port, &pki, tls_port, "", "redirect_to_https = true");
    let bearer = format!("authorization: Bearer {token}");
    let plain = format!("http://localhost:{}/proto?x=1", t.port);
    let (status, out) = curl(&["-D", "-", "-o", "/dev/null", &plain]);
    assert_eq!(status, 308, "{out}");
    let location = format!("location: https://localhost:{tls_port}/proto?x=1");
    assert!(out.to_ascii_lowercase().contains(&location), "{out}");
    // HTTP/1.0 without Host: `https:///evil.example/x` would send a browser to evil.example.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    s.write_all(b"GET /evil.example/x HTTP/1.0\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.0 400"), "{answer}");
    // Followed with the bearer (curl sends it across a port change only when trusted).
    let resolve = format!("localhost:{tls_port}:127.0.0.1");
    let ca = pki.ca().display().to_string();
    let follow = ["--location-trusted", "--cacert", &ca, "--resolve", &resolve];
    let (status, body) = curl(&[&follow[..], &["-H", &bearer, &plain]].concat());
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("proto=https"), "{body}");
}

/// What any client can make rustls log at WARN (here a warning alert before its ClientHello)
/// stays out of the log: one line per connection or per record would let a client fill it.
#[test]
fn client_triggered_tls_library_warnings_are_not_logged() {
    let nginx = Nginx::start_with(ECHO);
    let pki = Pki::new();
    let tls_port = free_port();
    let (t, _) = tls_tessera(nginx.port, &pki, tls_port, "", "");
    let mut s = std::net::TcpStream::connect(("127.0.0.1", tls_port)).unwrap();
    // An alert record (level warning, close_notify), then a record of no known type, which
    // ends the connection: once it has ended, the alert has been read.
    s.write_all(&[0x15, 0x03, 0x03, 0x00, 0x02, 0x01, 0x00])
        .unwrap();
    s.write_all(&[0x99, 0x03, 0x03, 0x00, 0x01, 0x00]).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    let log = t.log();
    assert!(!log.contains("rustls"), "{log}");
}

/// A TLS handshake not yet done when shutdown begins (a client that connected and sent
/// nothing) is no connection the drain waits for.
#[test]
fn shutdown_does_not_wait_for_a_handshake_in_progress() {
    let nginx = Nginx::start_with(ECHO);
    let pki = Pki::new();
    let tls_port = free_port();
    let (mut t, _) = tls_tessera(nginx.port, &pki, tls_port, "", "");
    let _silent = std::net::TcpStream::connect(("127.0.0.1", tls_port)).unwrap();
    // Accepted by then; its handshake waits for a ClientHello that never comes.
    std::thread::sleep(Duration::from_millis(500));
    let termed = Command::new("kill")
        .args(["-TERM", &t.pid().to_string()])
        .status()
        .unwrap();
    assert!(termed.success());
    assert!(t.wait_exit(Duration::from_secs(30)), "{}", t.log());
    let log = t.log();
    assert!(!log.contains("connections still open after"), "{log}");
}

#[test]
fn check_config_reports_the_certificate_and_refuses_a_foreign_key() {
    let pki = Pki::new();
    let (cert, key) = pki.leaf("localhost", &["localhost", "mail.test"]);
    let dir = tempfile::tempdir().unwrap();
    let write = |key: &Path| {
        let text = config(
            free_port(),
            "http://127.0.0.1:9",
            &format!("embedded:{}/sessions", dir.path().display()),
            &[("tables", &tls_table(free_port(), &cert, key, ""))],
        );
        let path = dir.path().join("tessera.toml");
        std::fs::write(&path, text).unwrap();
        Command::new(bin())
            .args(["check-config", "--config"])
            .arg(&path)
            .output()
            .unwrap()
    };
    let ok = write(&key);
    let text = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{text}");
    assert!(
        text.contains("tls.certificate: key matches; names localhost, mail.test; valid until"),
        "{text}"
    );
    // An expired certificate: serve would start with it, and every client refuse it.
    let (old_cert, old_key) = pki.expired_leaf("old", &["localhost"]);
    let text = config(
        free_port(),
        "http://127.0.0.1:9",
        &format!("embedded:{}/sessions", dir.path().display()),
        &[("tables", &tls_table(free_port(), &old_cert, &old_key, ""))],
    );
    let path = dir.path().join("expired.toml");
    std::fs::write(&path, text).unwrap();
    let expired = Command::new(bin())
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&expired.stderr);
    assert_eq!(expired.status.code(), Some(2), "{err}");
    assert!(
        err.contains("tls.certificate") && err.contains("EXPIRED"),
        "{err}"
    );
    let (_, other_key) = pki.leaf("other", &["other.test"]);
    let bad = write(&other_key);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{err}");
    assert!(
        err.contains("config key `tls.private_key`: does not match the first certificate"),
        "{err}"
    );
}

#[test]
fn tls_settings_are_checked_at_load_naming_the_key() {
    let pki = Pki::new();
    let (cert, key) = pki.leaf("localhost", &["localhost", "*.example.test"]);
    let (cert, key) = (cert.display(), key.display());
    let base = format!(
        "[upstream]\nurl = \"http://127.0.0.1:9\"\n[token]\nsecret = \"{JWT_SECRET}\"\n\
         [credentials]\nkeys = {{ k1 = \"{CRED_KEY}\" }}\n"
    );
    let load = |server: &str, tls: &str| {
        let text = format!("{base}[server]\n{server}\n[tls]\n{tls}\n");
        tessera::Config::from_toml(&text).map_err(|e| e.to_string())
    };
    let files = format!("certificate = \"file:{cert}\"\nprivate_key = \"file:{key}\"");
    let tls = format!("listen = \"127.0.0.1:8443\"\n{files}");
    // With [tls], the plain listener is there only when asked for.
    let c = load("", &tls).unwrap();
    assert_eq!(c.server.listen, None);
    let t = c.tls.unwrap();
    assert_eq!(
        (t.min_version, t.session_tickets),
        (tessera::downstream::TlsVersion::Tls12, true)
    );
    let sni = |names: &str| format!("{tls}\n[[tls.sni]]\nserver_names = {names}\n{files}");
    assert_eq!(
        load("", &sni("[\"a.example.test\"]"))
            .unwrap()
            .tls
            .unwrap()
            .sni
            .len(),
        1
    );
    let http3 = |lines: &str| format!("{tls}\n[http3]\n{lines}");
    assert_eq!(load("", &http3("")).unwrap().http3.unwrap().threads, 1);
    // Ticket and host keys are read, and never shown by a configuration printed whole.
    const SECRET: &str = "a-secret-of-forty-bytes-0123456789abcdef";
    let keyed = format!(
        "session_ticket_keys = [\"{SECRET}\"]\n{}",
        http3(&format!("host_key = \"{SECRET}\""))
    );
    let c = load("", &keyed).unwrap();
    let shown = format!("{c:?}");
    assert!(!shown.contains(SECRET), "{shown}");
    assert_eq!(c.tls.unwrap().session_ticket_keys.len(), 1);
    assert!(c.http3.unwrap().host_key.is_some());
    assert_eq!(
        load("", &http3("threads = 4"))
            .unwrap()
            .http3
            .unwrap()
            .threads,
        4
    );
    let refused = [
        (
            "",
            http3("threads = 0"),
            "http3.threads",
            "between 1 and 1024",
        ),
        (
            "",
            http3("host_key = \"short\""),
            "http3.host_key",
            "is 5 bytes; it needs at least 32",
        ),
        ("", files.clone(), "tls.listen", "is required"),
        (
            "",
            format!("{tls}\nmin_version = \"1.1\""),
            "tls.min_version",
            "\"1.3\"",
        ),
        (
            "",
            format!("listen = \"127.0.0.1:8443\"\ncertificate = \"file:{cert}\""),
            "tls.private_key",
            "is required",
        ),
        (
            "",
            sni("[\"other.test\"]"),
            "tls.sni[0].server_names",
            "`other.test` is not among",
        ),
        (
            "",
            sni("[]"),
            "tls.sni[0].server_names",
            "must list host names",
        ),
        (
            "",
            format!(
                "{}\n[[tls.sni]]\nserver_names = [\"b.example.test\", \"a.example.test\"]\n{files}",
                sni("[\"a.example.test\"]")
            ),
            "tls.sni[1].server_names",
            "`a.example.test` is named by tls.sni[0] too",
        ),
        (
            "",
            http3("idle_timeout_ms = 86400001"),
            "http3.idle_timeout_ms",
            "at most 86400000",
        ),
        (
            "listen = \"127.0.0.1:8443\"",
            tls.clone(),
            "server.listen",
            "same address as tls.listen",
        ),
        (
            "redirect_to_https = true",
            tls.clone(),
            "server.redirect_to_https",
            "server.listen",
        ),
        (
            "",
            format!(
                "{tls}\nsession_ticket_keys = [\"{}\", \"short\"]",
                "k".repeat(32)
            ),
            "tls.session_ticket_keys[1]",
            "is 5 bytes; a ticket key needs at least 32",
        ),
        (
            "",
            format!(
                "{tls}\nsession_tickets = false\nsession_ticket_keys = [\"{}\"]",
                "k".repeat(32)
            ),
            "tls.session_ticket_keys",
            "needs tls.session_tickets = true",
        ),
    ];
    for (server, tls, key, says) in refused {
        let err = load(server, &tls)
            .err()
            .unwrap_or_else(|| panic!("{tls}: accepted"));
        assert!(
            err.contains(&format!("`{key}`")) && err.contains(says),
            "{tls}: {err}"
        );
    }
    let text = format!("{base}[server]\nredirect_to_https = true\n");
    let err = tessera::Config::from_toml(&text).unwrap_err().to_string();
    assert!(err.contains("needs [tls]"), "{err}");
}

#[test]
fn demo_with_tls_prints_a_working_https_curl_line() {
    let (port, tls_port) = (free_port(), free_port());
    let mut child = Command::new(bin())
        .args(["demo", "--tls", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--tls-listen", &format!("127.0.0.1:{tls_port}")])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    use std::io::BufRead;
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let https = lines
        .by_ref()
        .map(|l| l.unwrap())
        .find(|l| l.starts_with("curl -s --cacert"))
        .expect("an https curl line");
    let out = Command::new("sh").arg("-c").arg(&https).output().unwrap();
    let body = String::from_utf8_lossy(&out.stdout);
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    assert!(
        body.contains("\"authorization_seen\":\"Basic "),
        "{https}\n{body}"
    );
}

/// A WebSocket over TLS (`wss://`, as browsers open them): the handshake through the TLS
/// listener, frames both ways, the upstream told the client came over https.
#[test]
fn a_websocket_over_tls_carries_frames_both_ways() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;
    let up = support::upstream::start(support::upstream::Behavior::WebSocket);
    up.stats.set_password("alice", "alice-pw");
    let pki = Pki::new();
    let tls_port = free_port();
    let (cert, key) = pki.leaf("localhost", &["localhost"]);
    let table = tls_table(tls_port, &cert, &key, "");
    let up_url = up.url();
    let t = Tessera::start(move |port, dir| {
        let store = format!("embedded:{}/sessions", dir.display());
        config(port, &up_url, &store, &[("tables", &table)])
    });
    wait_for_port(tls_port);
    let (_, token) = t.create_session("alice", "alice-pw");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let tls = support::tls::tokio_client(tls_port, &pki.ca()).await;
        let mut req = format!("wss://localhost:{tls_port}/ws")
            .into_client_request()
            .unwrap();
        let origin = format!("https://localhost:{tls_port}");
        req.headers_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        req.headers_mut().insert("origin", origin.parse().unwrap());
        let (mut ws, _) = tokio_tungstenite::client_async(req, tls).await.unwrap();
        match ws.next().await {
            Some(Ok(Message::Text(t))) => assert_eq!(t.as_str(), "hello alice"),
            other => panic!("no greeting: {other:?}"),
        }
        ws.send(Message::text("hi")).await.unwrap();
        match ws.next().await {
            Some(Ok(Message::Text(t))) => assert_eq!(t.as_str(), "alice: hi"),
            other => panic!("no echo: {other:?}"),
        }
    });
    let head = up.stats.last_upgrade.lock().unwrap().clone();
    assert!(
        head.iter()
            .any(|l| l.eq_ignore_ascii_case("x-forwarded-proto: https")),
        "{head:?}"
    );
}

/// Socket activation, as systemd does it (here `systemd-socket-activate`, which binds the
/// sockets, passes them in `LISTEN_FDS` and starts tessera at the first connection): the plain
/// and the TLS listener are the passed sockets (binding the same ports again would fail), and
/// the first client, who connected before tessera ran, is served.
#[test]
fn listening_sockets_passed_by_systemd_are_served() {
    require("systemd-socket-activate");
    let nginx = Nginx::start_with(ECHO);
    let pki = Pki::new();
    let (port, tls_port) = (free_port(), free_port());
    let (cert, key) = pki.leaf("localhost", &["localhost"]);
    let table = tls_table(tls_port, &cert, &key, "");
    let (plain, tls) = (format!("127.0.0.1:{port}"), format!("127.0.0.1:{tls_port}"));
    let via = ["systemd-socket-activate", "-l", &plain, "-l", &tls];
    let upstream = nginx.url();
    let t = Tessera::start_via_on(port, &via, move |port, dir| {
        let store = format!("embedded:{}/sessions", dir.display());
        config(port, &upstream, &store, &[("tables", &table)])
    });
    let (_, token) = t.create_session("alice", "pw");
    let auth = format!("Authorization: Bearer {token}");
    let (status, body) = curl(&["-H", &auth, &t.url("/proto")]);
    assert_eq!(
        (status, body.starts_with("proto=http ")),
        (200, true),
        "{body}"
    );
    let (status, body, _) = curl_tls(tls_port, &pki.ca(), "/proto", &["-H", &auth]);
    assert_eq!(
        (status, body.starts_with("proto=https ")),
        (200, true),
        "{body}"
    );
    let log = t.log();
    for key in ["server.listen", "tls.listen"] {
        let line = format!("listening socket passed by the service manager key=\"{key}\"");
        assert!(log.contains(&line), "{line}: {log}");
    }
}

/// A passed socket that no listen key names is a unit and a config that disagree: tessera
/// refuses to start, naming it, rather than leave it unserved; and a passed connection (an
/// `Accept=yes` unit) is refused, not taken for a listener.
#[test]
fn passed_sockets_tessera_cannot_serve_are_refused_at_start() {
    require("systemd-socket-activate");
    let (port, stray) = (free_port(), free_port());
    let err = activated(port, &["-l", &format!("127.0.0.1:{stray}")]);
    let named = format!("socket activation passed tcp 127.0.0.1:{stray}, which no listen key");
    assert!(err.contains(&named), "{err}");
    let err = activated(free_port(), &["--accept"]);
    assert!(
        err.contains("a connection, not a listening socket"),
        "{err}"
    );
}

/// Runs `systemd-socket-activate -l 127.0.0.1:PORT ARGS tessera serve` with a config listening
/// on `port`, makes the first connection (which starts tessera), and returns what tessera wrote
/// to stderr once it has said why it stopped.
fn activated(port: u16, args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tessera.toml");
    let store = format!("embedded:{}/sessions", dir.path().display());
    std::fs::write(&cfg, config(port, "http://127.0.0.1:9", &store, &[])).unwrap();
    let err_path = dir.path().join("stderr");
    let listen = format!("127.0.0.1:{port}");
    let mut launcher = Command::new("systemd-socket-activate")
        .args(["-l", &listen])
        .args(args)
        .args([support::bin(), "serve", "--config"])
        .arg(&cfg)
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    wait_for_port(port);
    let _first = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut err = String::new();
    while !err.contains("tessera: ") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        err = std::fs::read_to_string(&err_path).unwrap_or_default();
    }
    // With --accept the launcher stays, serving the next connection.
    let _ = launcher.kill();
    let _ = launcher.wait();
    err
}

/// A network namespace of the test's own (`ip netns`), deleted on drop: its own loopback, its
/// own `net.ipv4.tcp_fastopen` and its own TCP counters, so the host's stay as they are.
struct NetNs(String);

impl NetNs {
    fn new(tcp_fastopen: u32) -> Self {
        require("ip");
        let ns = NetNs(format!(
            "tessera-tfo-{}-{}",
            std::process::id(),
            free_port()
        ));
        let made = Command::new("ip").args(["netns", "add", &ns.0]).status();
        assert!(
            made.unwrap().success(),
            "ip netns add {} (needs root)",
            ns.0
        );
        ns.run(&["ip", "link", "set", "lo", "up"]);
        let set = format!("echo {tcp_fastopen} > /proc/sys/net/ipv4/tcp_fastopen");
        ns.run(&["sh", "-c", &set]);
        ns
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0]).args(args);
        c
    }

    fn run(&self, args: &[&str]) -> String {
        let out = self.command(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `TcpExt: TCPFastOpenPassive`: connections whose SYN carried data a listener took.
    fn fast_open_passive(&self) -> u64 {
        let netstat = self.run(&["cat", "/proc/net/netstat"]);
        let mut tcp_ext = netstat.lines().filter(|l| l.starts_with("TcpExt:"));
        let (names, values) = (tcp_ext.next().unwrap(), tcp_ext.next().unwrap());
        let at = names.split(' ').position(|n| n == "TCPFastOpenPassive");
        values.split(' ').nth(at.unwrap()).unwrap().parse().unwrap()
    }

    /// Two curl runs with `--tcp-fastopen` (the first gets the cookie, the second sends its
    /// first bytes in the SYN) to `url`, each answered 401 (no token).
    fn curl_twice(&self, url: &str, ca: &Path) {
        for _ in 0..2 {
            let ca = ca.display().to_string();
            let args = [
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--cacert",
                &ca,
            ];
            let code = self.run(&[&args[..], &["--tcp-fastopen", url]].concat());
            assert_eq!(code, "401", "{url}");
        }
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// A child process stopped (SIGTERM, then SIGKILL) when dropped, also when a test fails.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        support::terminate(&mut self.0);
    }
}

/// tessera in `ns` with a plain listener and a TLS one, `server.fastopen = fastopen`; returns
/// the process, its directory (config, log) and the two URLs once both answer.
fn tessera_in(ns: &NetNs, pki: &Pki, fastopen: bool) -> (Running, tempfile::TempDir, [String; 2]) {
    let dir = tempfile::tempdir().unwrap();
    let (plain, tls) = (free_port(), free_port());
    let (cert, key) = pki.leaf("localhost", &["localhost", "127.0.0.1"]);
    let store = format!("embedded:{}/sessions", dir.path().display());
    let server = format!("fastopen = {fastopen}");
    let table = tls_table(tls, &cert, &key, "");
    let extra = [("server", server.as_str()), ("tables", &table)];
    let cfg = config(plain, "http://127.0.0.1:9", &store, &extra);
    std::fs::write(dir.path().join("tessera.toml"), cfg).unwrap();
    let log = std::fs::File::create(dir.path().join("tessera.log")).unwrap();
    let mut cmd = ns.command(&[bin(), "serve", "--config"]);
    let mut child = cmd
        .arg(dir.path().join("tessera.toml"))
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let urls = [
        format!("http://127.0.0.1:{plain}/"),
        format!("https://127.0.0.1:{tls}/"),
    ];
    let deadline = Instant::now() + Duration::from_secs(15);
    for url in &urls {
        let answers = || {
            let curl = ns
                .command(&["curl", "-sk", "-o", "/dev/null", url])
                .status();
            curl.is_ok_and(|s| s.success())
        };
        while !answers() {
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(dir.path().join("tessera.log"));
                panic!("tessera exited ({status}): {log:?}");
            }
            assert!(Instant::now() < deadline, "tessera did not answer on {url}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    (Running(child), dir, urls)
}

/// `server.fastopen = true`: a returning curl's request (plain) and ClientHello (TLS) ride in
/// its SYN, and the kernel counts the listener taking them; off, the same clients take the
/// round trip; on, with the kernel's server side off, the log names the sysctl to set.
#[test]
fn fastopen_takes_a_returning_clients_first_bytes_in_the_syn() {
    let pki = Pki::new();
    for fastopen in [true, false] {
        let ns = NetNs::new(3);
        let (child, _dir, urls) = tessera_in(&ns, &pki, fastopen);
        // Per URL: the kernel keeps one cookie per server address, so the TLS listener's first
        // connection may already carry data.
        let taken = urls.map(|url| {
            let before = ns.fast_open_passive();
            ns.curl_twice(&url, &pki.ca());
            ns.fast_open_passive() - before
        });
        drop(child);
        if fastopen {
            assert!(taken.iter().all(|&n| n >= 1), "taken in the SYN: {taken:?}");
        } else {
            assert_eq!(taken, [0, 0], "server.fastopen = false");
        }
    }
    let ns = NetNs::new(1);
    let (child, dir, _) = tessera_in(&ns, &pki, true);
    drop(child);
    let log = std::fs::read_to_string(dir.path().join("tessera.log")).unwrap();
    assert!(log.contains("sysctl -w net.ipv4.tcp_fastopen=3"), "{log}");
}
