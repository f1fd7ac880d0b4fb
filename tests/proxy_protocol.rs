//! `server.proxy_protocol` behind a real load balancer: HAProxy in TCP mode sends the PROXY
//! protocol header (v2 to the TLS listener, v1 to the plain one) and the client it names is the
//! one the upstream and the access log see; a connection without a header, or from a peer
//! outside `server.trusted_proxies`, is closed unanswered.

mod support;

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};

use support::tls::{tls_table, Pki};
use support::*;

/// HAProxy in TCP mode, `-db` (foreground), stopped on drop: a frontend on `v2_port` passing
/// connections to `tls_port` with a v2 header, one on `v1_port` to `plain_port` with a v1 one.
struct Haproxy {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Haproxy {
    fn start(v2_port: u16, tls_port: u16, v1_port: u16, plain_port: u16) -> Self {
        require("haproxy");
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("haproxy.cfg");
        std::fs::write(
            &conf,
            format!(
                "defaults\n  mode tcp\n  timeout connect 5s\n  timeout client 30s\n  \
                 timeout server 30s\n\
                 frontend v2\n  bind 127.0.0.1:{v2_port}\n  default_backend tls\n\
                 backend tls\n  server t 127.0.0.1:{tls_port} send-proxy-v2\n\
                 frontend v1\n  bind 127.0.0.1:{v1_port}\n  default_backend plain\n\
                 backend plain\n  server t 127.0.0.1:{plain_port} send-proxy\n"
            ),
        )
        .unwrap();
        let child = Command::new("haproxy")
            .arg("-db")
            .arg("-f")
            .arg(&conf)
            .stdout(Stdio::null())
            .spawn()
            .expect("haproxy");
        wait_for_port(v2_port, "haproxy");
        wait_for_port(v1_port, "haproxy");
        Self { child, _dir: dir }
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// tessera with `server.proxy_protocol` on both listeners, trusting HAProxy's address; with its
/// TLS port and a session token.
fn tessera(nginx: &Nginx, pki: &Pki) -> (Tessera, u16, String) {
    let tls_port = free_port();
    let (cert, key) = pki.leaf("localhost", &["localhost"]);
    let table = tls_table(tls_port, &cert, &key, "");
    let upstream = nginx.url();
    let t = Tessera::start(move |port, dir| {
        let store = format!("embedded:{}/sessions", dir.display());
        let server = "proxy_protocol = true\ntrusted_proxies = [\"127.0.0.1\"]";
        config(
            port,
            &upstream,
            &store,
            &[("server", server), ("tables", &table)],
        )
    });
    wait_for_port(tls_port, "tessera tls");
    let (_, token) = t.create_session("alice", "pw");
    (t, tls_port, token)
}

/// `X-Forwarded-For` as nginx got it (its `/echo`), for `args` to curl from `source`.
fn forwarded_for(source: &str, token: &str, args: &[&str]) -> (u16, String) {
    let auth = format!("Authorization: Bearer {token}");
    let mut all = vec!["--interface", source, "-H", &auth];
    all.extend_from_slice(args);
    let (code, body) = curl(&all);
    let xff = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["xff"].as_str().map(str::to_owned));
    (code, xff.unwrap_or(body))
}

#[test]
fn behind_haproxy_the_client_it_names_is_the_one_the_upstream_and_the_log_see() {
    let nginx = Nginx::start();
    let pki = Pki::new();
    let (t, tls_port, token) = tessera(&nginx, &pki);
    let (v2_port, v1_port) = (free_port(), free_port());
    let _haproxy = Haproxy::start(v2_port, tls_port, v1_port, t.port);
    let ca = pki.ca();
    let resolve = format!("localhost:{v2_port}:127.0.0.1");
    let over_tls = format!("https://localhost:{v2_port}/echo");
    for version in ["--http1.1", "--http2"] {
        let args = [
            version,
            "--cacert",
            ca.to_str().unwrap(),
            "--resolve",
            &resolve,
            &over_tls,
        ];
        assert_eq!(
            forwarded_for("127.0.0.5", &token, &args),
            (200, "127.0.0.5".to_string()),
            "v2 header, TLS, {version}"
        );
    }
    let plain = format!("http://127.0.0.1:{v1_port}/echo");
    assert_eq!(
        forwarded_for("127.0.0.6", &token, &[&plain]),
        (200, "127.0.0.6".to_string()),
        "v1 header, plain"
    );
    let log = t.log_when(|l| l.contains("tessera::access: peer=127.0.0.6 "));
    assert!(log.contains("tessera::access: peer=127.0.0.5 "), "{log}");
    assert!(
        log.contains(" proxy_protocol=true\n"),
        "the start line says so: {log}"
    );
}

#[test]
fn without_a_header_or_from_an_untrusted_peer_a_connection_is_closed_unanswered() {
    let nginx = Nginx::start();
    let pki = Pki::new();
    let (t, _, token) = tessera(&nginx, &pki);
    let direct = t.url("/echo");
    // HAProxy's own address, trusted, but no header: the request is not taken for one.
    assert_eq!(forwarded_for("127.0.0.1", &token, &[&direct]).0, 0);
    // A header (curl's v1, naming its own address) from a peer not in trusted_proxies.
    let untrusted = ["--haproxy-protocol", direct.as_str()];
    assert_eq!(forwarded_for("127.0.0.2", &token, &untrusted).0, 0);
    // The same header from a trusted peer is taken.
    assert_eq!(
        forwarded_for("127.0.0.1", &token, &["--haproxy-protocol", &direct]),
        (200, "127.0.0.1".to_string())
    );
    assert!(t
        .log()
        .contains("a connection from outside server.trusted_proxies on a PROXY protocol listener"));
    assert_eq!(nginx.uris_at_least(1).len(), 1, "{:?}", nginx.uris());

    // A header naming no client (v1 UNKNOWN) from the trusted balancer: served, but the
    // forwarding fields it relays are not believed (the client would name itself).
    let mut s = std::net::TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    write!(
        s,
        "PROXY UNKNOWN\r\nGET /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
         X-Forwarded-For: 6.6.6.6\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    assert!(answer.contains(r#""xff":"127.0.0.1""#), "{answer}");
}
