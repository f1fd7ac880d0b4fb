//! The TLS listener as an operator runs it: plain HTTP sent to it answered 400 as nginx does,
//! handshakes that fail or time out counted, each certificate's expiry in `/metrics`, and a
//! reload that would swap a valid certificate for an expired one refused.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use support::tls::{leaf_der, tls_table, Client, Pki};
use support::*;

/// rcgen's `date_time_ymd(2020, 12, 31)`, the notAfter of [`Pki::expired_leaf`].
const EXPIRED_AT: u64 = 1_609_372_800;

fn wait_for(port: u16) {
    wait_for_port(port, "tessera TLS");
}

fn scrape(metrics: &str) -> String {
    let (status, text) = curl(&[metrics]);
    assert_eq!(status, 200, "{text}");
    text
}

fn failures(text: &str, reason: &str) -> u64 {
    sample(
        text,
        &format!("tessera_tls_handshake_failures_total{{reason=\"{reason}\"}}"),
    )
}

/// Reads what the server sends until it closes; panics if it keeps the connection past 10 s.
fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    all
}

#[test]
fn plain_http_on_the_tls_port_gets_400_and_failed_handshakes_are_counted() {
    let nginx = Nginx::start();
    let pki = Pki::new();
    let tls_port = free_port();
    // Served expired: the client that checks it refuses the handshake.
    let (cert, key) = pki.expired_leaf("localhost", &["localhost"]);
    let table = tls_table(tls_port, &cert, &key, "");
    let extra = [
        ("server", "header_read_timeout_ms = 400"),
        ("tables", table.as_str()),
    ];
    let (t, metrics) = with_metrics(&nginx.url(), &extra);
    wait_for(tls_port);

    let plain = format!("http://127.0.0.1:{tls_port}/x");
    let (status, answer) = curl(&["-i", &plain]);
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer.contains("plain HTTP sent to the HTTPS port"),
        "{answer}"
    );
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    let line = t.log_when(|l| l.contains("status=400"));
    assert!(line.contains("plain HTTP"), "{line}");
    // One hyper serves (a chunked body) is answered alike, and its connection closed too.
    let mut chunked = TcpStream::connect(("127.0.0.1", tls_port)).unwrap();
    let post = "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
    chunked.write_all(post.as_bytes()).unwrap();
    let answer = String::from_utf8_lossy(&read_to_close(&mut chunked)).to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 400"), "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    assert_eq!(nginx.uris().len(), 0, "plain HTTP reached the upstream");
    // A health check's connection, reset before its first byte, is no failed handshake.
    let probe = TcpStream::connect(("127.0.0.1", tls_port)).unwrap();
    socket2::SockRef::from(&probe)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(probe);

    // curl checks the certificate: its alert ends the handshake.
    let resolve = format!("localhost:{tls_port}:127.0.0.1");
    let url = format!("https://localhost:{tls_port}/x");
    let ca = pki.ca().display().to_string();
    let (status, _) = curl(&["--cacert", &ca, "--resolve", &resolve, &url]);
    assert_eq!(status, 0, "an expired certificate was accepted");
    // One that sends nothing is closed at the head-read timeout.
    let mut silent = TcpStream::connect(("127.0.0.1", tls_port)).unwrap();
    let started = Instant::now();
    assert!(read_to_close(&mut silent).is_empty());
    assert!(started.elapsed() >= Duration::from_millis(400));
    // Not checking it, a client completes a handshake.
    let (status, _) = curl(&["-k", "--resolve", &resolve, &url]);
    assert_eq!(status, 401);

    let text = scrape(&metrics);
    assert_eq!(failures(&text, "plain_http"), 2, "{text}");
    assert_eq!(failures(&text, "error"), 1, "{text}");
    assert_eq!(failures(&text, "timeout"), 1, "{text}");
    assert_eq!(
        sample(&text, "tessera_tls_handshakes_total{kind=\"full\"}"),
        1
    );
    let expiry = "tessera_tls_certificate_expiration_timestamp_seconds{key=\"tls.certificate\"}";
    assert_eq!(sample(&text, expiry), EXPIRED_AT);

    // Already expired when it ran: a reload (a key rotation, say) is not refused for it.
    t.signal("-HUP");
    t.log_when(|l| l.contains("configuration reloaded: keys and certificates in place"));
    // A renewed certificate shows its new expiry.
    pki.leaf("localhost", &["localhost"]);
    t.signal("-HUP");
    t.log_when(|l| l.matches("configuration reloaded").count() >= 2);
    let renewed = sample(&scrape(&metrics), expiry);
    let now = std::time::UNIX_EPOCH.elapsed().unwrap().as_secs();
    assert!(renewed > now + 365 * 86_400, "{renewed}");
}

#[test]
fn a_reload_refuses_an_expired_certificate_in_place_of_a_valid_one() {
    let nginx = Nginx::start();
    let pki = Pki::new();
    let tls_port = free_port();
    let (cert, key) = pki.leaf("localhost", &["localhost"]);
    let table = tls_table(tls_port, &cert, &key, "");
    let t = Tessera::start(|port, dir| {
        let store = format!("embedded:{}/sessions", dir.display());
        config(port, &nginx.url(), &store, &[("tables", &table)])
    });
    wait_for(tls_port);
    let valid = leaf_der(&cert);

    pki.expired_leaf("localhost", &["localhost"]);
    t.signal("-HUP");
    let log = t.log_when(|l| l.contains("configuration reload refused"));
    assert!(
        log.contains("tls.certificate") && log.contains("expired at 2020-12-31T00:00:00Z"),
        "{log}"
    );
    assert_eq!(
        Client::connect(tls_port, "localhost", &pki.ca()).leaf(),
        valid
    );

    // `[tls]` taken out: the listener keeps serving until the restart, and the log says so.
    let text = std::fs::read_to_string(t.config_path()).unwrap();
    let without = &text[..text.find("[tls]").unwrap()];
    std::fs::write(t.config_path(), without).unwrap();
    t.signal("-HUP");
    let log = t.log_when(|l| l.contains("configuration reloaded"));
    assert!(log.contains("[tls] removed"), "{log}");
    assert!(log.contains("reloaded: keys in place"), "{log}");
    let mut client = Client::connect(tls_port, "localhost", &pki.ca());
    assert_eq!(client.leaf(), valid);
    client
        .tls
        .write_all(b"GET /x HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .unwrap();
    let mut head = [0u8; 12];
    client.tls.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 401");
}
