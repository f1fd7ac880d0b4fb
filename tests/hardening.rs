//! Attacks from outside against the real `tessera serve` binary in front of real nginx: paths that
//! climb out of the upstream base path, and one user holding the upstream pool.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::*;

/// nginx answering under `/base/` and, to show an escape, outside it.
const BASE_AND_SECRET: &str = r#"
    location /base/ { return 200 "base $uri\n"; }
    location /secret { return 200 "outside $uri\n"; }
"#;

fn tessera(upstream: &str, extra: &'static [(&'static str, &'static str)]) -> Tessera {
    let upstream = upstream.to_string();
    Tessera::start(move |port, dir| {
        config(
            port,
            &upstream,
            &format!("embedded:{}/sessions", dir.display()),
            extra,
        )
    })
}

fn get_as_is(t: &Tessera, token: &str, path: &str) -> (u16, String) {
    curl(&["--path-as-is", "-H", &bearer(token), &t.url(path)])
}

#[test]
fn no_encoding_of_a_dot_segment_climbs_out_of_the_base_path() {
    let nginx = Nginx::start_with(BASE_AND_SECRET);
    let t = tessera(&format!("{}/base/", nginx.url()), &[]);
    let (_, token) = t.create_session("alice", "pw");
    for path in [
        "/..%2fsecret",
        "/a/..%2f..%2fsecret",
        "/%2e%2e%2fsecret",
        "/.%2e%2fsecret",
        "/..%2Fsecret",
        "/..\\secret",
        "/%5c..%5csecret",
        "/%252e%252e%252fsecret",
        "/%c0%ae%c0%ae/secret",
        "/..;/secret",
    ] {
        let (code, body) = get_as_is(&t, &token, path);
        assert_eq!(code, 400, "{path}: {body}");
    }
    let (code, body) = get_as_is(&t, &token, "/inside");
    assert_eq!((code, body.as_str()), (200, "base /base/inside\n"));
    let uris = nginx.uris_at_least(1);
    assert_eq!(uris, ["/base/inside"], "nginx served paths outside /base/");
    let log = t.log_when(|l| l.contains("encoded slash"));
    assert!(log.contains("dot segment in path"), "{log}");
}

#[test]
fn encoded_slashes_outside_dot_segments_are_refused_unless_allowed() {
    let nginx = Nginx::start_with(BASE_AND_SECRET);
    let refusing = tessera(&format!("{}/base/", nginx.url()), &[]);
    let (_, token) = refusing.create_session("alice", "pw");
    assert_eq!(get_as_is(&refusing, &token, "/a%2Fb").0, 400);
    assert_eq!(get_as_is(&refusing, &token, "/a\\b").0, 400);
    let allowing = tessera(
        &format!("{}/base/", nginx.url()),
        &[("server", "allow_encoded_slashes = true")],
    );
    let (_, token) = allowing.create_session("alice", "pw");
    let (code, body) = get_as_is(&allowing, &token, "/a%2Fb");
    assert_eq!((code, body.as_str()), (200, "base /base/a/b\n"));
    let (code, _) = get_as_is(&allowing, &token, "/..%2fsecret");
    assert_eq!(code, 400, "a dot segment stays refused");
    assert_eq!(nginx.uris_at_least(1), ["/base/a/b"]);
}

/// Sends a request head with a body announced by `framing`, then a byte of body every 500 ms
/// until `stop`; returns what the server answered, if anything.
fn trickle(port: u16, token: &str, framing: &str, stop: Arc<AtomicBool>) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST /base/upload HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n{framing}\r\n\r\n"
    )
    .unwrap();
    let chunked = framing.contains("chunked");
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut answer = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let byte: &[u8] = if chunked { b"1\r\nx\r\n" } else { b"x" };
        if s.write_all(byte).is_err() {
            break;
        }
        let mut buf = [0; 1024];
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

/// Connections nginx has open now (stub_status), not counting the query's own.
fn active(nginx: &Nginx) -> u64 {
    let (_, body) = curl(&[&format!("{}/nginx_status", nginx.url())]);
    let line = body.lines().next().expect("stub_status line 1");
    let n: u64 = line.split_whitespace().last().unwrap().parse().unwrap();
    n - 1
}

#[test]
fn one_user_trickling_bodies_cannot_hold_every_upstream_connection() {
    let nginx = Nginx::start_with(BASE_AND_SECRET);
    // 8 connections, 6 for one user at most (the default three quarters).
    let t = tessera(
        &nginx.url(),
        &[
            ("upstream", "max_connections = 8"),
            ("server", "client_body_timeout_ms = 600000"),
        ],
    );
    let (_, alice) = t.create_session("alice", "pw");
    let (_, bob) = t.create_session("bob", "pw");
    let stop = Arc::new(AtomicBool::new(false));
    let trickles: Vec<_> = (0..10)
        .map(|i| {
            let (stop, alice, port) = (stop.clone(), alice.clone(), t.port);
            let framing = if i % 2 == 0 {
                "Transfer-Encoding: chunked"
            } else {
                "Content-Length: 100000"
            };
            std::thread::spawn(move || trickle(port, &alice, framing, stop))
        })
        .collect();
    // Until alice's trickles hold all she may: 6 upstream connections.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while nginx.accepted() < 6 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let (code, body) = curl(&["--max-time", "15", "-H", &bearer(&bob), &t.url("/base/bob")]);
    let held = active(&nginx);
    let opened = nginx.accepted();
    stop.store(true, Ordering::Relaxed);
    for h in trickles {
        h.join().unwrap();
    }
    assert_eq!(
        (code, body.as_str()),
        (200, "base /base/bob\n"),
        "bob was not served while alice trickled"
    );
    assert!(
        held <= 7,
        "alice held more than her share: {held} upstream connections ({opened} opened)"
    );
}

/// What the server sends until the end of a response head, or the connection's end (at most
/// 30 s).
fn read_head(s: &mut TcpStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut answer = Vec::new();
    let mut buf = [0; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            // A read with a timeout is not restarted after a signal handler ran (signal(7)).
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Ok(0) => {
                answer.extend_from_slice(b"<end of stream>");
                break;
            }
            Err(e) => {
                answer.extend_from_slice(format!("<read failed: {e}>").as_bytes());
                break;
            }
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

#[test]
fn a_stalled_request_body_is_answered_408_and_frees_its_upstream_connection() {
    let nginx = Nginx::start_with(BASE_AND_SECRET);
    let t = tessera(
        &nginx.url(),
        &[
            ("upstream", "max_connections = 1"),
            ("server", "client_body_timeout_ms = 1000"),
        ],
    );
    let (_, token) = t.create_session("alice", "pw");
    for framing in ["Content-Length: 100000", "Transfer-Encoding: chunked"] {
        let mut s = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
        let first: &str = if framing.contains("chunked") {
            "a\r\n0123456789\r\n"
        } else {
            "0123456789"
        };
        write!(
            s,
            "POST /base/upload HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n{framing}\r\n\r\n{first}"
        )
        .unwrap();
        let answer = read_head(&mut s);
        assert!(
            answer.starts_with("HTTP/1.1 408"),
            "{framing}: {answer} {}",
            t.log()
        );
        // The one upstream connection is free again.
        let (code, _) = curl(&["--max-time", "15", "-H", &bearer(&token), &t.url("/base/x")]);
        assert_eq!(code, 200, "{framing}");
    }
    let log = t.log_when(|l| l.matches("client request body timed out").count() >= 2);
    assert_eq!(
        log.matches("client request body timed out").count(),
        2,
        "{log}"
    );
}

/// Opens one HTTP/2 connection (prior knowledge) whose flow-control window stays shut, with one
/// stream per token in `tokens`, each asking for a large download it never reads; returns what
/// keeps them open (a dropped response would reset its stream).
async fn shut_window_streams(port: u16, tokens: Vec<String>) -> Vec<Box<dyn std::any::Any>> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, bytes::Bytes>(tcp)
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let mut pending = Vec::new();
    for token in tokens {
        let req = http::Request::get(format!("http://127.0.0.1:{port}/big"))
            .header("authorization", format!("Bearer {token}"))
            .body(())
            .unwrap();
        pending.push(client.send_request(req, true).unwrap().0);
        client = client.ready().await.unwrap();
    }
    let mut kept: Vec<Box<dyn std::any::Any>> = vec![Box::new(client)];
    for resp in pending {
        kept.push(Box::new(resp));
    }
    kept
}

#[test]
fn the_streams_of_one_http2_connection_share_one_bound() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big");
    std::fs::write(&big, vec![b'x'; 16 << 20]).unwrap();
    let nginx = Nginx::start_with(&format!("location = /big {{ alias {}; }}", big.display()));
    let t = tessera(&nginx.url(), &[("upstream", "max_connections = 8")]);
    // Five users, two streams each: no user over its share of 6, the connection over it.
    let tokens: Vec<String> = (0..10)
        .map(|i| t.create_session(&format!("user{}", i / 2), "pw").1)
        .collect();
    let (_, bob) = t.create_session("bob", "pw");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let _client = runtime.block_on(shut_window_streams(t.port, tokens));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while active(&nginx) < 6 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let held = active(&nginx);
    let (code, body) = curl(&["--max-time", "15", "-H", &bearer(&bob), &t.url("/echo")]);
    assert_eq!(
        code, 200,
        "bob was not served while the streams held the pool: {body}"
    );
    assert_eq!(
        held, 6,
        "the connection's streams held {held} upstream connections"
    );
}

/// Two connections from 127.0.0.1, each answered `request` and kept open, once the readiness
/// probe of `Tessera::start` no longer holds a place (`tessera_client_connections` at 0).
fn two_served(t: &Tessera, metrics_url: &str, request: &str) -> Vec<TcpStream> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while sample(&curl(&[metrics_url]).1, "tessera_client_connections") != 0
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    (0..2)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
            s.write_all(request.as_bytes()).unwrap();
            assert!(read_head(&mut s).starts_with("HTTP/1.1 200"));
            s
        })
        .collect()
}

#[test]
fn client_connections_past_server_max_connections_wait_and_are_counted() {
    let nginx = Nginx::start_with(BASE_AND_SECRET);
    let (t, metrics_url) = with_metrics(
        &nginx.url(),
        &[("server", "max_connections = 2\nthreads = 1")],
    );
    let (_, token) = t.create_session("alice", "pw");
    let get = format!("GET /base/x HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n");
    let metrics = || curl(&[&metrics_url]).1;
    let mut held = two_served(&t, &metrics_url, &get);
    let mut third = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    third.write_all(get.as_bytes()).unwrap();
    third
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buf = [0; 64];
    assert!(
        third.read(&mut buf).is_err(),
        "a third connection was served past server.max_connections = 2"
    );
    let text = metrics();
    assert_eq!(sample(&text, "tessera_client_connections"), 2, "{text}");
    assert!(
        sample(&text, "tessera_client_connection_waits_total") >= 1,
        "{text}"
    );
    held.pop();
    assert!(
        read_head(&mut third).starts_with("HTTP/1.1 200"),
        "served once a place freed"
    );
    assert!(t
        .log()
        .contains("server.max_connections client connections are open"));
}

/// `server.max_connections_per_ip`: one address holds at most its limit of connections (2
/// here); its next one is closed unanswered and counted, another address (127.0.0.2) is served
/// meanwhile, and a place given back is taken again.
#[test]
fn one_address_holds_at_most_max_connections_per_ip() {
    let nginx = Nginx::start_with(BASE_AND_SECRET);
    let (t, metrics_url) = with_metrics(&nginx.url(), &[("server", "max_connections_per_ip = 2")]);
    let (_, token) = t.create_session("alice", "pw");
    let get = format!("GET /base/x HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n");
    let metrics = || curl(&[&metrics_url]).1;
    let mut held = two_served(&t, &metrics_url, &get);
    let mut third = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    let _ = third.write_all(get.as_bytes());
    third
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0; 64];
    assert!(
        matches!(third.read(&mut buf), Ok(0) | Err(_)),
        "a third connection from one address was served"
    );
    let auth = format!("Authorization: Bearer {token}");
    let other = curl(&["--interface", "127.0.0.2", "-H", &auth, &t.url("/base/x")]);
    assert_eq!(other.0, 200, "another address is served: {}", other.1);
    let text = metrics();
    assert_eq!(
        sample(&text, "tessera_client_connections_over_ip_limit_total"),
        1,
        "{text}"
    );
    held.pop();
    let mut served = false;
    for _ in 0..100 {
        if curl(&["-H", &auth, &t.url("/base/x")]).0 == 200 {
            served = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(served, "a place given back was not taken again");
    assert!(t.log().contains("server.max_connections_per_ip"));
}

/// h2spec (every check of RFC 9113 and RFC 7541 it knows, over h2c with prior knowledge) finds
/// no fault: an invalid preface closes the connection, and a request answered before its body
/// is read still gets the stream error its broken framing asks for.
#[test]
fn h2spec_finds_no_fault_over_h2c() {
    require("h2spec");
    let nginx = Nginx::start();
    let t = tessera(&nginx.url(), &[]);
    let out = std::process::Command::new("h2spec")
        .args(["-h", "127.0.0.1", "-o", "5", "-p"])
        .arg(t.port.to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let summary = text
        .lines()
        .find(|l| l.ends_with(" failed") && l.contains(" tests, "))
        .unwrap_or_else(|| panic!("no h2spec summary: {text}"));
    let count = |what: &str| -> u32 {
        summary
            .split(", ")
            .find_map(|p| p.strip_suffix(what))
            .and_then(|n| n.trim().split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("{what} in {summary}"))
    };
    assert_eq!(count(" failed"), 0, "{text}");
    assert!(count(" passed") >= 145, "{summary}");
}

/// Answers `request` on a new connection to `port`: the status line's code.
fn raw_status(port: u16, request: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    read_head(&mut s)
}

/// An HTTP/2 GET whose `:path` is `path` as given (no leading `/` added); the status.
async fn h2_get_raw_path(port: u16, token: &str, path: &'static str) -> u16 {
    let client = h2c_client(port).await;
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(http::uri::Scheme::HTTP);
    parts.authority = Some(format!("127.0.0.1:{port}").parse().unwrap());
    parts.path_and_query = Some(http::uri::PathAndQuery::from_static(path));
    let uri = http::Uri::from_parts(parts).unwrap();
    assert_eq!(uri.path_and_query().unwrap().as_str(), path);
    let req = http::Request::get(uri)
        .header("authorization", format!("Bearer {token}"))
        .body(())
        .unwrap();
    let mut client = client.ready().await.unwrap();
    let (resp, _) = client.send_request(req, true).unwrap();
    resp.await.unwrap().status().as_u16()
}

#[test]
fn a_request_target_without_a_leading_slash_is_refused() {
    let nginx = Nginx::start_with(BASE_AND_SECRET);
    let t = tessera(&format!("{}/base/", nginx.url()), &[]);
    let (_, token) = t.create_session("alice", "pw");
    // None is origin-form, absolute-form or `*`: each a 400, never `/base` + its bytes.
    for target in ["-x", "2/x", "secret", "?x=1"] {
        let head = raw_status(
            t.port,
            &format!("GET {target} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n"),
        );
        assert!(head.starts_with("HTTP/1.1 400"), "{target}: {head}");
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // The http crate refuses a `:path` that starts with neither `/` nor `?`; `?x=1` would be
    // forwarded as `/base?x=1`.
    for path in ["?x=1", "?"] {
        let code = runtime.block_on(h2_get_raw_path(t.port, &token, path));
        assert_eq!(code, 400, "HTTP/2 :path {path}");
    }
    // `*` stays for OPTIONS (RFC 9112 section 3.2.4), refused under a base path.
    let head = raw_status(
        t.port,
        &format!("OPTIONS * HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n"),
    );
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    let (code, _) = get_as_is(&t, &token, "/inside");
    assert_eq!(code, 200);
    // An absolute form with a query alone has the path `/` (RFC 3986 section 6.2.3).
    let head = raw_status(
        t.port,
        &format!("GET http://t?x=1 HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n"),
    );
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let uris = nginx.uris_at_least(2);
    assert_eq!(
        uris,
        ["/base/inside", "/base/"],
        "nginx served paths outside /base/"
    );
    assert_eq!(
        runtime.block_on(h2_get_raw_path(t.port, &token, "/inside")),
        200
    );
}

/// A `Host` that names no server (sub-delimiters, a port that is not a number) is a 400 on the
/// fast path as in the screen: the upstream would write it into its absolute links (host-header
/// poisoning), and `X-Forwarded-Host` carries it even with `preserve_host = false`.
#[test]
fn a_host_that_names_no_server_is_refused() {
    let nginx = Nginx::start_with(BASE_AND_SECRET);
    let t = tessera(&format!("{}/base/", nginx.url()), &[]);
    let (_, token) = t.create_session("alice", "pw");
    for host in ["mail.test,evil.test", "mail.test:x", "mail.test'", "[::1"] {
        let head = raw_status(
            t.port,
            &format!(
                "GET /inside HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n\r\n"
            ),
        );
        assert!(head.starts_with("HTTP/1.1 400"), "{host}: {head}");
    }
    let head = raw_status(
        t.port,
        &format!(
            "GET /inside HTTP/1.1\r\nHost: mail.test:8443\r\nAuthorization: Bearer {token}\r\n\r\n"
        ),
    );
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(nginx.uris_at_least(1), ["/base/inside"]);
}

/// A secret any local user can read is warned of by key and file, never by value: at start,
/// at each reload and by `check-config` (which still passes). A sealing key moved to a file
/// readable by all, then the configuration itself, holding the JWT secret inline, opened up.
#[test]
fn secrets_readable_by_every_local_user_are_warned_of() {
    use std::os::unix::fs::PermissionsExt;
    let nginx = Nginx::start();
    let t = tessera(&nginx.url(), &[]);
    let said = "a secret is readable by every local user";
    assert!(!t.log().contains(said), "{}", t.log());
    let key_file = t.dir.path().join("k1.key");
    std::fs::write(&key_file, CRED_KEY).unwrap();
    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let cfg = t.config_path();
    let text = std::fs::read_to_string(&cfg).unwrap();
    let moved = format!("file:{}", key_file.display());
    std::fs::write(&cfg, text.replace(CRED_KEY, &moved)).unwrap();
    t.signal("-HUP");
    let log = t.log_when(|l| l.contains("configuration reloaded"));
    assert!(
        log.contains(said) && log.contains("key=credentials.keys.k1"),
        "{log}"
    );
    assert!(
        !log.contains("key=token.secret") && !log.contains(CRED_KEY),
        "{log}"
    );
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o644)).unwrap();
    let checked = std::process::Command::new(bin())
        .args(["check-config", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert!(checked.status.success(), "{stderr}");
    for key in ["credentials.keys.k1", "token.secret"] {
        assert!(
            stderr.contains(&format!("`{key}`")) && stderr.contains(said),
            "{stderr}"
        );
    }
    assert!(
        !stderr.contains(JWT_SECRET) && !stderr.contains(CRED_KEY),
        "{stderr}"
    );
}

/// An HTTP/2 request of many short field lines, which HTTP/2's own size bound lets through by
/// the hundred, is refused with 431 past 200 lines; 150 pass.
#[test]
fn an_http2_request_of_too_many_field_lines_gets_431() {
    let nginx = Nginx::start();
    let t = tessera(&nginx.url(), &[]);
    let (_, token) = t.create_session("alice", "pw");
    let status = |lines: usize| {
        let mut args = vec![
            "--http2-prior-knowledge".to_string(),
            "-H".into(),
            bearer(&token),
        ];
        for i in 0..lines {
            args.extend(["-H".to_string(), format!("x-{i}: 1")]);
        }
        args.push(t.url("/1k"));
        curl(&args.iter().map(String::as_str).collect::<Vec<_>>()).0
    };
    assert_eq!(status(150), 200, "{}", t.log());
    assert_eq!(status(250), 431, "{}", t.log());
}

/// An upstream that works `work` on each request whether or not its client is still there (as
/// a Cyrus child does), one request at a time per connection; returns its port, the requests
/// it has in hand now, and the most it had at once.
fn stubborn_upstream(work: Duration) -> (u16, [Arc<std::sync::atomic::AtomicUsize>; 2]) {
    use std::sync::atomic::AtomicUsize;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let counts = [Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0))];
    let kept = counts.clone();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let [now, peak] = counts.clone();
            std::thread::spawn(move || loop {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match conn.read(&mut byte) {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                peak.fetch_max(now.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                std::thread::sleep(work);
                now.fetch_sub(1, Ordering::SeqCst);
                let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                if conn.write_all(answer).is_err() {
                    return;
                }
            });
        }
    });
    (port, kept)
}

/// A client that cancels its requests (HTTP/2 resets, a few frames each) never has more of
/// them at the upstream than its share of the pool: a cancelled exchange frees its slot but
/// keeps its shares until the upstream answers it, as the upstream works on it all the same;
/// then they are free at once (not at the response-head timeout, 60 s).
#[test]
fn http2_resets_pile_no_more_work_on_the_upstream_than_the_users_share() {
    let (port, [in_hand, peak]) = stubborn_upstream(Duration::from_secs(2));
    // A pool of 8: one user's share is 6.
    let t = tessera(
        &format!("http://127.0.0.1:{port}"),
        &[("upstream", "max_connections = 8")],
    );
    let (_, token) = t.create_session("alice", "pw");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let client = h2c_client(t.port).await;
        let mut client = client.ready().await.unwrap();
        for round in 0..4 {
            let mut cancelled = Vec::new();
            for _ in 0..6 {
                let req = http::Request::get(format!("http://127.0.0.1:{}/slow", t.port))
                    .header("authorization", format!("Bearer {token}"))
                    .body(())
                    .unwrap();
                cancelled.push(client.send_request(req, true).unwrap());
                client = client.ready().await.unwrap();
            }
            // The first six reach the upstream before they are cancelled; the later ones
            // would, were the first six's shares freed.
            let until = std::time::Instant::now() + Duration::from_secs(10);
            while round == 0 && in_hand.load(Ordering::SeqCst) < 6 {
                assert!(
                    std::time::Instant::now() < until,
                    "not forwarded: {}",
                    t.log()
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            // Dropping a stream's halves resets it (RST_STREAM CANCEL).
            drop(cancelled);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    let most = peak.load(Ordering::SeqCst);
    assert_eq!(
        most,
        6,
        "the upstream had {most} cancelled requests in hand at once: {}",
        t.log()
    );
    // Once the upstream has answered them, the user's share is free again.
    let (code, body) = curl(&["--max-time", "20", "-H", &bearer(&token), &t.url("/slow")]);
    assert_eq!((code, body.as_str()), (200, "ok"), "{}", t.log());
}

/// An HTTP/2 request whose DATA frames say more than its `content-length` (a second request
/// hidden after the declared bytes) or less: RFC 9113 section 8.1.1 makes it malformed. The
/// upstream, reached over HTTP/1.1 on a pooled connection, never reads a byte past the length,
/// nor the hidden request.
#[test]
fn an_http2_body_longer_or_shorter_than_its_length_smuggles_nothing_upstream() {
    use support::upstream::{self, Behavior, Script};
    let up = upstream::start(Behavior::Scripted(|_| Script {
        bytes: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec(),
        close: false,
        early: false,
    }));
    let t = tessera(&up.url(), &[]);
    let (_, token) = t.create_session("alice", "pw");
    let hidden = "hello GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n";
    let runtime = tokio::runtime::Runtime::new().unwrap();
    for (length, body) in [("5", hidden), ("40", "short")] {
        let failed = runtime.block_on(async {
            let client = h2c_client(t.port).await;
            let req = http::Request::post(format!("http://127.0.0.1:{}/up", t.port))
                .header("authorization", format!("Bearer {token}"))
                .header("content-length", length)
                .body(())
                .unwrap();
            let mut client = client.ready().await.unwrap();
            let (resp, mut send) = client.send_request(req, false).unwrap();
            let _ = send.send_data(bytes::Bytes::from_static(body.as_bytes()), true);
            match resp.await {
                Ok(resp) => resp.status().is_success().then_some(()).is_none(),
                Err(_) => true,
            }
        });
        assert!(
            failed,
            "content-length {length} with {} bytes passed",
            body.len()
        );
    }
    // A request after them is served (on the pooled connection, or a new one).
    assert_eq!(get_as_is(&t, &token, "/after").0, 200);
    let raw = String::from_utf8_lossy(&up.stats.raw_bytes.lock().unwrap()).to_string();
    assert!(!raw.contains("/smuggled"), "{raw}");
    assert!(
        !raw.contains("GET /smuggled") && !raw.contains("hello G"),
        "{raw}"
    );
}
