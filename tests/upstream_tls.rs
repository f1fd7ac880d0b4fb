//! `https://` upstreams: nginx with a test CA's certificate behind tessera, the certificate
//! checked against `upstream.ca`, handshakes resumed on new connections (`$ssl_session_reused`
//! and tessera's metric agree), a client certificate for an upstream that asks for one (mTLS),
//! and a refused certificate answered 502.

mod support;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;

use support::tls::Pki;
use support::*;

/// What the upstream saw: whether the handshake resumed, the client certificate check, the
/// scheme tessera said the client used, the credential.
const SEEN: &str = r#"location = /tls { return 200 "reused=$ssl_session_reused client=$ssl_client_verify auth=$http_authorization"; }
    location = /moved { return 301 https://localhost:$server_port/jmap; }
    location = /away { return 301 https://elsewhere.example/jmap; }"#;

/// nginx over TLS with `pki`'s certificate for `localhost`, one request per connection (so each
/// request needs a new handshake), client certificates checked when `verify` is `on` or
/// `optional`.
fn nginx_tls(pki: &Pki, verify: &str) -> Nginx {
    let (cert, key) = pki.leaf("upstream", &["localhost"]);
    let server = format!(
        "ssl_certificate {}; ssl_certificate_key {}; ssl_session_cache shared:tls:1m; \
         ssl_session_tickets on; keepalive_requests 1; ssl_client_certificate {}; \
         ssl_verify_client {verify};",
        cert.display(),
        key.display(),
        pki.ca().display()
    );
    Nginx::start_server("ssl", &server, SEEN)
}

/// tessera in front of `https://localhost:port` with `upstream` lines, and a session token.
fn behind(port: u16, upstream: &str, metrics_port: u16) -> (Tessera, String) {
    let url = format!("https://localhost:{port}");
    let upstream = upstream.to_string();
    let metrics = format!("[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n");
    let t = Tessera::start(move |plain, dir| {
        let store = format!("embedded:{}/s", dir.display());
        let lines: Vec<(&str, &str)> = upstream.lines().map(|l| ("upstream", l)).collect();
        let mut extra = lines.clone();
        extra.push(("tables", &metrics));
        config(plain, &url, &store, &extra)
    });
    let (_, token) = t.create_session("alice", "pw");
    (t, token)
}

fn ca_line(ca: &Path) -> String {
    format!("ca = \"file:{}\"", ca.display())
}

#[test]
fn an_https_upstream_is_checked_and_its_sessions_resumed() {
    let pki = Pki::new();
    let nginx = nginx_tls(&pki, "off");
    let metrics_port = free_port();
    let (t, token) = behind(nginx.port, &ca_line(&pki.ca()), metrics_port);
    let mut reused = Vec::new();
    for _ in 0..3 {
        let (code, body) = curl(&["-H", &bearer(&token), &t.url("/tls")]);
        assert_eq!(code, 200, "{body}\n{}", t.log());
        assert!(body.contains("auth=Basic "), "{body}");
        reused.push(body.split_whitespace().next().unwrap().to_string());
    }
    // nginx closes after each request: the first handshake is full, the next ones resume.
    assert_eq!(reused, ["reused=.", "reused=r", "reused=r"]);
    let (_, metrics) = curl(&[&format!("http://127.0.0.1:{metrics_port}/metrics")]);
    assert_eq!(
        sample(
            &metrics,
            "tessera_upstream_tls_handshakes_total{kind=\"full\"}"
        ),
        1
    );
    assert_eq!(
        sample(
            &metrics,
            "tessera_upstream_tls_handshakes_total{kind=\"resumed\"}"
        ),
        2
    );
}

/// An https upstream's redirect to its own address is pointed at the client's side, as with an
/// http one (nginx `proxy_redirect default` follows `proxy_pass`'s scheme); another host's
/// passes as it is.
#[test]
fn an_https_upstreams_redirect_to_itself_points_at_the_client_side() {
    let pki = Pki::new();
    let nginx = nginx_tls(&pki, "off");
    let (t, token) = behind(nginx.port, &ca_line(&pki.ca()), free_port());
    let location = |path: &str| {
        let (code, head) = curl(&["-si", "-H", &bearer(&token), &t.url(path)]);
        assert_eq!(code, 301, "{head}\n{}", t.log());
        head.lines()
            .find_map(|l| {
                l.strip_prefix("Location: ")
                    .or(l.strip_prefix("location: "))
            })
            .map(|l| l.trim().to_string())
            .unwrap_or_else(|| panic!("no Location: {head}"))
    };
    assert_eq!(location("/moved"), t.url("/jmap"));
    assert_eq!(location("/away"), "https://elsewhere.example/jmap");
}

#[test]
fn a_client_certificate_is_presented_to_an_upstream_that_asks() {
    let pki = Pki::new();
    let nginx = nginx_tls(&pki, "on");
    // Without one, nginx refuses the request: the upstream's own 400, passed on.
    let (t, token) = behind(nginx.port, &ca_line(&pki.ca()), free_port());
    let (code, _) = curl(&["-H", &bearer(&token), &t.url("/tls")]);
    assert_eq!(code, 400);
    drop(t);
    let (cert, key) = pki.leaf("client", &["tessera-client"]);
    let lines = format!(
        "{}\nclient_certificate = \"file:{}\"\nclient_private_key = \"file:{}\"",
        ca_line(&pki.ca()),
        cert.display(),
        key.display()
    );
    let (t, token) = behind(nginx.port, &lines, free_port());
    let (code, body) = curl(&["-H", &bearer(&token), &t.url("/tls")]);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("client=SUCCESS"), "{body}");
}

/// The upstream's CA and client certificate files renewed at the same paths are used by new
/// connections after SIGHUP: first the CA that signed the upstream's certificate (502 becomes
/// nginx's 400 for a client certificate it does not trust), then a client certificate it does.
#[test]
fn renewed_upstream_tls_files_are_used_after_sighup() {
    let pki = Pki::new();
    let nginx = nginx_tls(&pki, "on");
    let other = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let [ca, cert, key] = ["ca.pem", "client.pem", "client.key"].map(|f| dir.path().join(f));
    let copy = |from: &Path, to: &Path| std::fs::copy(from, to).map(drop).unwrap();
    let (other_cert, other_key) = other.leaf("client", &["tessera-client"]);
    copy(&other.ca(), &ca);
    copy(&other_cert, &cert);
    copy(&other_key, &key);
    let lines = format!(
        "{}\nclient_certificate = \"file:{}\"\nclient_private_key = \"file:{}\"",
        ca_line(&ca),
        cert.display(),
        key.display()
    );
    let (t, token) = behind(nginx.port, &lines, free_port());
    let get = || curl(&["-H", &bearer(&token), &t.url("/tls")]);
    assert_eq!(get().0, 502, "{}", t.log());
    let reload = |nth: usize| {
        t.signal("-HUP");
        t.log_when(|log| log.matches("configuration reloaded").count() >= nth);
    };
    copy(&pki.ca(), &ca);
    reload(1);
    assert_eq!(
        get().0,
        400,
        "nginx refuses the client certificate: {}",
        t.log()
    );
    let (cert_new, key_new) = pki.leaf("client", &["tessera-client"]);
    copy(&cert_new, &cert);
    copy(&key_new, &key);
    reload(2);
    let (code, body) = get();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("client=SUCCESS"), "{body}");
}

/// Renewed files naming another server name are for the upstream a restart connects to: the
/// running trust is kept, and the reload's own line says so.
#[test]
fn a_reload_naming_another_upstream_server_keeps_the_running_trust_and_says_so() {
    let pki = Pki::new();
    let nginx = nginx_tls(&pki, "off");
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::copy(pki.ca(), &ca).unwrap();
    let (t, token) = behind(nginx.port, &ca_line(&ca), free_port());
    let get = || curl(&["-H", &bearer(&token), &t.url("/tls")]).0;
    assert_eq!(get(), 200, "{}", t.log());
    std::fs::copy(Pki::new().ca(), &ca).unwrap();
    let text = std::fs::read_to_string(t.config_path()).unwrap();
    let renamed = text.replacen(
        "[upstream]\n",
        "[upstream]\nserver_name = \"other.example\"\n",
        1,
    );
    assert_ne!(text, renamed);
    std::fs::write(t.config_path(), renamed).unwrap();
    t.signal("-HUP");
    let log = t.log_when(|log| log.contains("configuration reloaded"));
    let line = log
        .lines()
        .find(|l| l.contains("configuration reloaded"))
        .unwrap();
    assert!(
        line.contains("upstream CA and client certificate kept"),
        "{line}"
    );
    assert_eq!(get(), 200, "the running CA still checks: {}", t.log());
}

#[test]
fn an_upstream_certificate_from_another_ca_is_refused_with_502() {
    let pki = Pki::new();
    let nginx = nginx_tls(&pki, "off");
    let other = Pki::new();
    let (t, token) = behind(nginx.port, &ca_line(&other.ca()), free_port());
    let (code, _) = curl(&["-H", &bearer(&token), &t.url("/tls")]);
    assert_eq!(code, 502);
    let log = t.log_when(|l| l.contains("TLS handshake"));
    assert!(log.contains("TLS handshake"), "{log}");
}

#[test]
fn https_settings_are_checked_at_load() {
    let base = format!(
        "[token]\nsecret = \"{JWT_SECRET}\"\n[credentials]\nkeys = {{ k1 = \"{CRED_KEY}\" }}\n"
    );
    let load = |upstream: &str| {
        tessera::Config::from_toml(&format!("{base}[upstream]\n{upstream}\n"))
            .map_err(|e| e.to_string())
    };
    let c = load("url = \"https://mail.internal\"").unwrap();
    assert_eq!(c.upstream.addr(), "mail.internal:443");
    let refused = [
        (
            "url = \"http://a\"\nca = \"x\"",
            "upstream.ca",
            "https:// upstreams only",
        ),
        (
            "url = \"https://a\"\nca = \"not pem\"",
            "upstream.ca",
            "holds no PEM block",
        ),
        (
            "url = \"https://a\"\nca = \"/etc/hosts\"",
            "upstream.ca",
            "write \"file:/etc/hosts\"",
        ),
        (
            "url = \"https://a\"\nserver_name = \"a b\"",
            "upstream.server_name",
            "no DNS name",
        ),
        (
            "url = \"https://a\"\nclient_certificate = \"x\"",
            "upstream.client_certificate",
            "go together",
        ),
        (
            "url = \"ftp://a\"",
            "upstream.url",
            "use http:// or https://",
        ),
    ];
    for (upstream, key, says) in refused {
        let err = load(upstream)
            .err()
            .unwrap_or_else(|| panic!("{upstream}: accepted"));
        assert!(
            err.contains(&format!("`{key}`")) && err.contains(says),
            "{upstream}: {err}"
        );
    }
}

/// An https upstream that sends, with the first response of each connection, a second response
/// nobody asked for (`stale`); later requests on the connection get `fresh`. The first response
/// is 16 KiB, one TLS record that fills tessera's first read exactly, so the stray bytes are
/// left decrypted inside the TLS session, where the socket signals nothing more.
fn upstream_with_stray_bytes(pki: &Pki) -> u16 {
    let config = server_config(pki);
    let mut first = Vec::new();
    for length in 16_300..16_384 {
        first = format!("HTTP/1.1 200 OK\r\nContent-Length: {length}\r\n\r\n").into_bytes();
        first.resize(first.len() + length, b'a');
        if first.len() == 16_384 {
            break;
        }
    }
    first.extend_from_slice(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let (config, first) = (config.clone(), first.clone());
            std::thread::spawn(move || {
                let conn = rustls::ServerConnection::new(config).unwrap();
                let mut tls = rustls::StreamOwned::new(conn, tcp);
                let mut answer = first.as_slice();
                while read_head(&mut tls) {
                    // One write: both responses go out in one system call.
                    if tls.write_all(answer).and_then(|()| tls.flush()).is_err() {
                        return;
                    }
                    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh";
                }
            });
        }
    });
    port
}

/// A rustls server configuration with `pki`'s certificate for `localhost`.
fn server_config(pki: &Pki) -> Arc<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let (cert, key) = pki.leaf("upstream", &["localhost"]);
    let certs: Vec<_> = CertificateDer::pem_file_iter(&cert)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(&key).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    Arc::new(config)
}

/// An https upstream that, like a process-per-connection server at its limit, serves one
/// connection and leaves every later one in the listen backlog: accepted by the kernel, never
/// by the server, so no TLS handshake starts on it. `OPTIONS *` (the probe) is answered at
/// once, any other request after 2 s, so that requests overlap.
fn upstream_serving_one_connection(pki: &Pki) -> u16 {
    let config = server_config(pki);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (tcp, _) = listener.accept().unwrap();
        let conn = rustls::ServerConnection::new(config).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        let mut head = Vec::new();
        while read_head_into(&mut tls, &mut head) {
            if !head.starts_with(b"OPTIONS * ") {
                std::thread::sleep(std::time::Duration::from_secs(2));
            }
            let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
            if tls.write_all(ok).and_then(|()| tls.flush()).is_err() {
                return;
            }
        }
        drop(listener);
    });
    port
}

/// Reads one request head (tessera sends no body here); false at the connection's end.
fn read_head(r: &mut impl Read) -> bool {
    read_head_into(r, &mut Vec::new())
}

/// [`read_head`] into `head` (cleared first).
fn read_head_into(r: &mut impl Read, head: &mut Vec<u8>) -> bool {
    head.clear();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match r.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return false,
        }
    }
    true
}

/// Bytes an https upstream sent past its response's end are never read as the next request's
/// response, even when the TLS session holds them already decrypted: the connection is closed
/// at that response's end, not put back in the pool for a request to find it spoiled.
#[test]
fn stray_bytes_held_by_the_tls_session_close_the_connection() {
    let pki = Pki::new();
    let port = upstream_with_stray_bytes(&pki);
    let metrics_port = free_port();
    let (t, token) = behind(port, &ca_line(&pki.ca()), metrics_port);
    for _ in 0..10 {
        let (code, body) = curl(&["-H", &bearer(&token), &t.url("/")]);
        assert_eq!(code, 200, "{}", t.log());
        assert_ne!(body, "stale", "another request's response");
        assert!(body == "fresh" || body.bytes().all(|b| b == b'a'), "{body}");
    }
    let (_, metrics) = curl(&[&format!("http://127.0.0.1:{metrics_port}/metrics")]);
    let closed = |reason: &str| {
        let name = format!("tessera_upstream_connections_closed_total{{reason=\"{reason}\"}}");
        sample(&metrics, &name)
    };
    assert_eq!(closed("error"), 10, "{metrics}");
    assert_eq!(sample(&metrics, "tessera_upstream_retries_total"), 0);
}

/// With `upstream.probe_timeout_ms`, an https upstream's connection that is accepted and never
/// served (no TLS handshake on it) is found within the probe's limit, not after the connect
/// timeout: closed, counted as unserved, and the request waits for the served connection.
#[test]
fn an_unserved_https_connection_is_found_by_the_probe() {
    let pki = Pki::new();
    let port = upstream_serving_one_connection(&pki);
    let metrics_port = free_port();
    let lines = format!(
        "{}\nprobe_timeout_ms = 1000\nmax_connections = 2\nconnect_timeout_ms = 30000",
        ca_line(&pki.ca())
    );
    let (t, token) = behind(port, &lines, metrics_port);
    let codes: Vec<u16> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..2)
            .map(|_| s.spawn(|| curl(&["--max-time", "20", "-H", &bearer(&token), &t.url("/")]).0))
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    assert_eq!(codes, [200, 200], "{}", t.log());
    let (_, metrics) = curl(&[&format!("http://127.0.0.1:{metrics_port}/metrics")]);
    let unserved = "tessera_upstream_connections_closed_total{reason=\"unserved\"}";
    assert!(sample(&metrics, unserved) >= 1, "{metrics}");
    assert!(t.log().contains("did not serve it"), "{}", t.log());
}
