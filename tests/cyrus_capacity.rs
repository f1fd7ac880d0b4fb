//! Capacity the real Cyrus has: `maxchild = 4`, four slow 30 MiB downloads holding every child,
//! and 50 concurrent JMAP POSTs. With `upstream.max_connections = 8` the connections Cyrus
//! accepts and never serves are found by the probe, closed and named in a warning and a metric;
//! with 4 nothing changes. Either way every POST gets 200 within the documented bound (the
//! response-head timeout, which counts the wait for a connection).

mod support;

use std::time::{Duration, Instant};

use support::cyrus::{login_at, token_of, Cyrus};
use support::*;

const MAILBOX_GET: &str = r#"{"using":["urn:ietf:params:jmap:core","urn:ietf:params:jmap:mail"],"methodCalls":[["Mailbox/get",{"accountId":"alice"},"m"]]}"#;

/// What one run saw: the POSTs' statuses, the longest POST, the downloads' statuses and sizes,
/// the log, the metrics.
struct Seen {
    posts: Vec<u16>,
    longest: Duration,
    downloads: Vec<String>,
    log: String,
    metrics: String,
}

/// tessera in front of `cyrus` with `max_connections` and the probe (500 ms), `[login]` checked
/// at `/jmap/`, and metrics; with its metrics port.
fn probing(cyrus: &Cyrus, max_connections: usize) -> (Tessera, u16) {
    let metrics_port = free_port();
    let metrics = format!("[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n");
    let upstream = format!("http://127.0.0.1:{}", cyrus.http_port);
    let cap = format!("max_connections = {max_connections}");
    let t = Tessera::start(move |port, dir| {
        config(
            port,
            &upstream,
            &format!("embedded:{}/s", dir.display()),
            &[
                ("tables", &metrics),
                ("upstream", &cap),
                ("upstream", "probe_timeout_ms = 500"),
                ("login", "verify_path = \"/jmap/\""),
                ("login", "cookie_secure = false"),
            ],
        )
    });
    (t, metrics_port)
}

fn under_load(max_connections: usize) -> Seen {
    let cyrus = Cyrus::start_with_maxchild(4);
    let (t, metrics_port) = probing(&cyrus, max_connections);
    let token = token_of(login_at(&t, "alice", "alice-secret-1"));
    let blob = upload_30_mib(&t, &token);
    let download = t.url(&format!(
        "/jmap/download/alice/{blob}/b.bin?accept=application/octet-stream"
    ));
    let auth = bearer(&token);
    let (posts, longest, downloads) = std::thread::scope(|s| {
        // 10 MB/s each: about 3 s, every Cyrus child busy meanwhile.
        let slow: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let out = std::process::Command::new("curl")
                        .args(["-s", "--limit-rate", "10M", "-o", "/dev/null"])
                        .args([
                            "-w",
                            "%{http_code} %{size_download}",
                            "-H",
                            &auth,
                            &download,
                        ])
                        .output()
                        .unwrap();
                    String::from_utf8_lossy(&out.stdout).into_owned()
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let posts: Vec<_> = (0..50)
            .map(|_| {
                s.spawn(|| {
                    let started = Instant::now();
                    let json = [
                        "-H",
                        "Content-Type: application/json",
                        "--data-binary",
                        MAILBOX_GET,
                    ];
                    let url = t.url("/jmap/");
                    let args = [&["--max-time", "60", "-H", &auth][..], &json, &[&url]].concat();
                    (curl(&args).0, started.elapsed())
                })
            })
            .collect();
        let posts: Vec<(u16, Duration)> = posts.into_iter().map(|p| p.join().unwrap()).collect();
        let downloads = slow.into_iter().map(|d| d.join().unwrap()).collect();
        let longest = posts.iter().map(|p| p.1).max().unwrap();
        (posts.into_iter().map(|p| p.0).collect(), longest, downloads)
    });
    let (_, metrics) = curl(&[&format!("http://127.0.0.1:{metrics_port}/metrics")]);
    Seen {
        posts,
        longest,
        downloads,
        log: t.log(),
        metrics,
    }
}

/// A 30 MiB blob uploaded through tessera; its blob id.
fn upload_30_mib(t: &Tessera, token: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("blob.bin");
    std::fs::write(&file, vec![7u8; 30 << 20]).unwrap();
    let data = format!("@{}", file.display());
    let (code, out) = curl(&[
        "-H",
        &bearer(token),
        "-H",
        "Content-Type: application/octet-stream",
        "--data-binary",
        &data,
        &t.url("/jmap/upload/alice/"),
    ]);
    assert_eq!(code, 201, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["blobId"].as_str().unwrap().to_string()
}

const UNSERVED: &str = "tessera_upstream_connections_closed_total{reason=\"unserved\"}";

#[test]
fn more_connections_than_cyrus_serves_are_found_and_every_post_is_answered() {
    let seen = under_load(8);
    println!("max_connections 8: longest POST {:?}", seen.longest);
    assert_eq!(seen.posts, [200; 50], "{}", seen.log);
    let whole = format!("200 {}", 30 << 20);
    assert_eq!(seen.downloads, [whole.as_str(); 4], "{}", seen.log);
    assert!(seen.log.contains("did not serve it"), "{}", seen.log);
    assert!(
        seen.log.contains("upstream.max_connections"),
        "{}",
        seen.log
    );
    assert!(sample(&seen.metrics, UNSERVED) >= 1, "{}", seen.metrics);
}

#[test]
fn as_many_connections_as_cyrus_serves_change_nothing() {
    let seen = under_load(4);
    println!("max_connections 4: longest POST {:?}", seen.longest);
    assert_eq!(seen.posts, [200; 50], "{}", seen.log);
    let whole = format!("200 {}", 30 << 20);
    assert_eq!(seen.downloads, [whole.as_str(); 4], "{}", seen.log);
    assert!(!seen.log.contains("did not serve it"), "{}", seen.log);
    assert_eq!(sample(&seen.metrics, UNSERVED), 0, "{}", seen.metrics);
}

/// A Cyrus serving 4 connections, 2 of them held by idle clients, behind a tessera allowed 8:
/// with `upstream.probe_timeout_ms`, the connections Cyrus accepts and never serves are found
/// by the probe, closed, and taken off the cap, so 12 concurrent JMAP requests all get 200
/// (without the probe, those sent on such connections waited for the response-head timeout),
/// and the log names the setting to change.
#[test]
fn connections_cyrus_accepts_and_does_not_serve_are_left() {
    let cyrus = Cyrus::start_with_maxchild(4);
    // Two idle clients hold two of Cyrus's four children.
    let held: Vec<std::net::TcpStream> = (0..2)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", cyrus.http_port)).unwrap())
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (t, metrics_port) = probing(&cyrus, 8);
    let token = token_of(login_at(&t, "alice", "alice-secret-1"));
    // Each upload takes about a second (4 KiB of JSON whitespace streamed from stdin, which
    // curl paces at 8 KiB/s, unlike a body given whole), so that the requests overlap however
    // the machine staggers the curls, and tessera opens connections past the two Cyrus serves.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("mailbox-get.json");
    std::fs::write(&file, format!("{MAILBOX_GET}{}", " ".repeat(4096))).unwrap();
    let file = file.to_str().unwrap();
    let codes: Vec<u16> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..12)
            .map(|_| {
                s.spawn(|| {
                    let out = std::process::Command::new("curl")
                        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}"])
                        .args(["--max-time", "20", "--limit-rate", "8k", "-X", "POST"])
                        .args(["-T", "-", "-H", &bearer(&token)])
                        .args(["-H", "Content-Type: application/json", &t.url("/jmap/")])
                        .stdin(std::fs::File::open(file).unwrap())
                        .output()
                        .unwrap();
                    String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0)
                })
            })
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    assert_eq!(codes, [200; 12], "{}", t.log());
    let log = t.log_when(|l| l.contains("did not serve it"));
    assert!(log.contains("upstream.max_connections"), "{log}");
    // The metric counts them; once the requests are answered no connection is busy (the slots
    // taken off the cap are not busy connections).
    let (_, metrics) = curl(&[&format!("http://127.0.0.1:{metrics_port}/metrics")]);
    let unserved = "tessera_upstream_connections_closed_total{reason=\"unserved\"}";
    assert!(sample(&metrics, unserved) >= 1, "{metrics}");
    let busy = "tessera_upstream_connections{state=\"busy\"}";
    assert_eq!(sample(&metrics, busy), 0, "{metrics}");
    drop(held);
}
