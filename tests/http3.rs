//! HTTP/3 with a quinn + h3 client: requests and a streamed 10 MiB upload through the same
//! phases as h1 and h2, the body limit, Alt-Svc over TLS, and 0-RTT: a GET in the early flight
//! goes on at once with `Early-Data: 1` (an upstream's 425 reaches the client), a POST in the
//! same flight only once the handshake is complete (seen across a delay line, so the two moments are 500 ms apart).

mod support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use bytes::Bytes;
use support::h3::{
    abandoned_handshake, cuttable_line, delay_line, paced_read, request, request_sized,
    request_with, H3Client,
};
use support::h3_raw;
use support::tls::{tls_table, Pki};
use support::upstream::{self, Behavior, Script};
use support::*;

/// nginx answering what it was sent: whether the request came early, and over what.
const EARLY: &str = r#"location = /early { return 200 "early=$http_early_data proto=$http_x_forwarded_proto"; }
    location = /too-early { if ($http_early_data) { return 425; } return 200 "late"; }"#;

/// tessera in front of `upstream` with TLS on a TCP port and HTTP/3 on the same port over UDP,
/// `http3` lines in `[http3]` and `server` lines, its client side logged at debug level; its
/// UDP address and a session token.
fn h3_tessera(
    upstream: &str,
    pki: &Pki,
    http3: &str,
    server: &'static str,
) -> (Tessera, SocketAddr, String) {
    h3_tessera_on(free_port(), upstream, pki, http3, server)
}

/// [`h3_tessera`] in front of an upstream that echoes at once; the upstream (kept for the
/// test's length) and the test PKI with it.
fn h3_echo(
    http3: &str,
    server: &'static str,
) -> (upstream::TestUpstream, Pki, Tessera, SocketAddr, String) {
    let echo = upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    });
    let pki = Pki::new();
    let (t, addr, token) = h3_tessera(&echo.url(), &pki, http3, server);
    (echo, pki, t, addr, token)
}

/// [`h3_tessera`] on TLS and UDP `port`.
fn h3_tessera_on(
    port: u16,
    upstream: &str,
    pki: &Pki,
    http3: &str,
    server: &'static str,
) -> (Tessera, SocketAddr, String) {
    let (cert, key) = pki.leaf("localhost", &["localhost"]);
    let tables = format!("{}[http3]\n{http3}\n", tls_table(port, &cert, &key, ""));
    let upstream = upstream.to_string();
    let t = Tessera::start(move |plain, dir| {
        let store = format!("embedded:{}/sessions", dir.display());
        let log = ("log", "level = \"info,tessera::downstream=debug\"");
        config(
            plain,
            &upstream,
            &store,
            &[("server", server), log, ("tables", &tables)],
        )
    });
    let (_, token) = t.create_session("alice", "pw");
    (t, SocketAddr::from(([127, 0, 0, 1], port)), token)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn requests_and_a_streamed_10_mib_upload_go_through_http3() {
    let (_echo, pki, t, addr, token) = h3_echo("", "");
    runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        let mut send = client.connect(addr).await;
        let got = request(&mut send, "GET", "/x", &token, Bytes::new())
            .await
            .unwrap();
        assert_eq!(got.status, 200);
        let body = String::from_utf8(got.body).unwrap();
        assert!(body.contains("\"auth\":\"Basic "), "{body}");
        let upload = Bytes::from(vec![b'u'; 10 << 20]);
        let got = request(&mut send, "POST", "/up", &token, upload)
            .await
            .unwrap();
        assert_eq!(got.status, 200);
        let body = String::from_utf8(got.body).unwrap();
        assert!(body.contains(&format!("\"bytes\":{}", 10 << 20)), "{body}");
        // The phases as over h1: no token, no entry.
        let got = request(&mut send, "GET", "/x", "", Bytes::new())
            .await
            .unwrap();
        assert_eq!(got.status, 401);
    });
    // Over TLS (TCP), HTTP/3 is advertised on the same port.
    let ca = pki.ca().display().to_string();
    let resolve = format!("localhost:{}:127.0.0.1", addr.port());
    let url = format!("https://localhost:{}/x", addr.port());
    let (code, head) = curl(&["-I", "--cacert", &ca, "--resolve", &resolve, &url]);
    let expected = format!("alt-svc: h3=\":{}\"; ma=86400", addr.port());
    assert!(
        head.to_ascii_lowercase().contains(&expected),
        "{code} {head}"
    );
    assert!(t.log().contains("http3="), "{}", t.log());
    let log = t.log_when(|l| l.contains("path=/up status=200"));
    let upload = log.lines().find(|l| l.contains("path=/up status=200"));
    assert!(
        upload.is_some_and(|l| l.contains(" proto=HTTP/3 ")),
        "{log}"
    );
}

/// Threads of the process named `name` (Linux: /proc/PID/task/*/comm).
fn threads_named(pid: u32, name: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim() == name)
        .count()
}

#[test]
fn http3_runs_on_its_own_threads_one_by_default() {
    let (echo, pki, one, one_addr, one_token) = h3_echo("", "");
    let (two, two_addr, two_token) = h3_tessera(&echo.url(), &pki, "threads = 2", "");
    assert_eq!(threads_named(one.pid(), "tessera-http3"), 1);
    assert_eq!(threads_named(two.pid(), "tessera-http3"), 2);
    runtime().block_on(async {
        let client = std::sync::Arc::new(H3Client::new(&pki.ca()));
        // Several connections at once on each: every one is served.
        let mut asked = Vec::new();
        for (addr, token) in [(one_addr, &one_token), (two_addr, &two_token)] {
            for _ in 0..4 {
                let (client, token) = (client.clone(), token.clone());
                asked.push(tokio::spawn(async move {
                    let mut send = client.connect(addr).await;
                    request(&mut send, "GET", "/x", &token, Bytes::new())
                        .await
                        .unwrap()
                        .status
                }));
            }
        }
        for a in asked {
            assert_eq!(a.await.unwrap(), 200);
        }
    });
}

#[test]
fn an_oversized_http3_body_is_refused_never_truncated() {
    let (echo, pki, _t, addr, token) = h3_echo("", "max_body_bytes = 1048576");
    runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        let mut send = client.connect(addr).await;
        // Announced: refused before anything is forwarded.
        let upload = Bytes::from(vec![b'u'; 2 << 20]);
        let got = request_sized(&mut send, "/up", &token, upload.clone()).await;
        assert_eq!(got.unwrap().status, 413);
        assert_eq!(echo.stats.requests.load(SeqCst), 0);
        // Unannounced: cut while streaming, the upstream never gets it whole. The answer may
        // come before the client has sent it all (then its send fails).
        if let Ok(got) = request(&mut send, "POST", "/up", &token, upload).await {
            assert_eq!(got.status, 413);
        }
    });
    assert!(echo.stats.body_bytes.load(SeqCst) < 2 << 20);
}

/// Malformed HTTP/3 requests (RFC 9114 section 4.1.2) are refused, never forwarded as if
/// whole: a body shorter or longer than its `Content-Length`, and fields only HTTP/1.1
/// connections have (section 4.2; a `Connection: early-data` would have removed tessera's own
/// `Early-Data` mark).
#[test]
fn malformed_http3_requests_are_refused() {
    let (_echo, pki, _t, addr, token) = h3_echo("", "");
    runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        let mut send = client.connect(addr).await;
        let ten = Bytes::from_static(b"0123456789");
        for length in ["100", "4"] {
            let fields = [("content-length", length)];
            let got = request_with(&mut send, "POST", "/up", &token, &fields, ten.clone()).await;
            assert_eq!(got.map(|a| a.status), Ok(400), "content-length {length}");
        }
        for field in [
            ("connection", "early-data"),
            ("transfer-encoding", "chunked"),
            ("te", "gzip"),
        ] {
            let got = request_with(&mut send, "GET", "/x", &token, &[field], Bytes::new()).await;
            assert_eq!(got.map(|a| a.status), Ok(400), "{field:?}");
        }
        let got = request_with(
            &mut send,
            "POST",
            "/up",
            &token,
            &[("content-length", "10")],
            ten,
        );
        assert_eq!(
            got.await.map(|a| a.body),
            Ok(br#"{"auth":"Basic YWxpY2U6cHc=","bytes":10}"#.to_vec())
        );
    });
}

#[test]
fn zero_rtt_forwards_a_get_at_once_and_holds_a_post_for_the_handshake() {
    let nginx = Nginx::start_with(EARLY);
    let pki = Pki::new();
    let (_t, addr, token) = h3_tessera(&nginx.url(), &pki, "", "");
    runtime().block_on(async {
        // 250 ms each way: the early flight arrives 500 ms before the client's Finished, time
        // enough to take it as early on a loaded machine.
        let far = delay_line(addr, Duration::from_millis(250)).await;
        let client = H3Client::new(&pki.ca());
        let mut first = client.connect(far).await;
        let got = request(&mut first, "GET", "/early", &token, Bytes::new())
            .await
            .unwrap();
        assert_eq!(String::from_utf8(got.body).unwrap(), "early= proto=https");
        drop(first);
        let (mut send, accepted) = client
            .connect_0rtt(far)
            .await
            .expect("no session to resume with 0-RTT");
        let (mut send2, mut send3) = (send.clone(), send.clone());
        // An upstream that refuses early data answers 425 Too Early: it reaches the client.
        let refused = request(&mut send3, "GET", "/too-early", &token, Bytes::new());
        let get = request(&mut send, "GET", "/early", &token, Bytes::new());
        let post = request(
            &mut send2,
            "POST",
            "/early",
            &token,
            Bytes::from_static(b"x"),
        );
        let sent = tokio::time::Instant::now();
        let get = async { (get.await, sent.elapsed()) };
        let post = async { (post.await, sent.elapsed()) };
        let ((get, get_at), (post, post_at), refused) = tokio::join!(get, post, refused);
        println!("0-RTT GET answered after {get_at:?}, POST after {post_at:?}");
        assert!(accepted.await.unwrap(), "the server refused the early data");
        assert_eq!(refused.unwrap().status, 425);
        assert_eq!(
            String::from_utf8(get.unwrap().body).unwrap(),
            "early=1 proto=https"
        );
        assert_eq!(
            String::from_utf8(post.unwrap().body).unwrap(),
            "early= proto=https"
        );
    });
}

/// A trusted proxy's early GET waits for the handshake unless its address was proven first (a
/// token from an earlier connection): anyone with a ticket can send an early flight from a
/// forged source, and a trusted proxy's `X-Forwarded-For` is believed.
#[test]
fn an_early_get_from_an_unproven_trusted_address_waits_for_the_handshake() {
    let nginx = Nginx::start_with(EARLY);
    let pki = Pki::new();
    let trusted = "trusted_proxies = [\"127.0.0.1\"]";
    let (_t, addr, token) = h3_tessera(&nginx.url(), &pki, "", trusted);
    runtime().block_on(async {
        let far = delay_line(addr, Duration::from_millis(250)).await;
        for (client, body) in [
            (H3Client::without_tokens(&pki.ca()), "early= proto=https"),
            (H3Client::new(&pki.ca()), "early=1 proto=https"),
        ] {
            let mut first = client.connect(far).await;
            request(&mut first, "GET", "/early", &token, Bytes::new())
                .await
                .unwrap();
            drop(first);
            let (mut send, accepted) = client.connect_0rtt(far).await.expect("no session");
            let got = request(&mut send, "GET", "/early", &token, Bytes::new()).await;
            assert!(accepted.await.unwrap(), "the server refused the early data");
            assert_eq!(String::from_utf8(got.unwrap().body).unwrap(), body);
        }
    });
}

/// An early flight whose handshake never completes (cut on the path, or replayed by someone
/// who cannot finish it): the GET in it goes on, safe to replay; the POST held for the
/// handshake is dropped when the connection ends, never forwarded (RFC 8470 section 5.1).
#[test]
fn an_early_post_whose_handshake_never_completes_is_never_forwarded() {
    let echo = upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    });
    let pki = Pki::new();
    // The connection gives up after 1 s without a packet, long before a held request's own
    // wait (`header_read_timeout_ms`) would end it.
    let (t, addr, token) = h3_tessera(
        &echo.url(),
        &pki,
        "idle_timeout_ms = 1000",
        "header_read_timeout_ms = 60000",
    );
    runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        let mut first = client.connect(addr).await;
        request(&mut first, "GET", "/first", &token, Bytes::new())
            .await
            .unwrap();
        drop(first);
        let (line, cut) = cuttable_line(addr, Duration::from_millis(250)).await;
        let (send, _accepted) = client
            .connect_0rtt(line)
            .await
            .expect("no session to resume with 0-RTT");
        for (method, path) in [("GET", "/early-get"), ("POST", "/early-post")] {
            let (mut send, token) = (send.clone(), token.clone());
            tokio::spawn(async move {
                let body = Bytes::from_static(if method == "POST" { b"x" } else { b"" });
                let _ = request(&mut send, method, path, &token, body).await;
            });
        }
        // The early flight is on the line (250 ms to go); nothing the client sends after it,
        // its Finished included, gets through.
        tokio::time::sleep(Duration::from_millis(100)).await;
        cut.store(true, SeqCst);
        // Either end of the held POST's wait: the handshake that never completed, or the
        // connection's end, whichever its task sees first.
        let dropped = |log: &str| {
            log.contains("ended before its handshake completed; early request dropped")
                || log.contains("connection ended with a request open")
        };
        let log = tokio::task::block_in_place(|| t.log_when(dropped));
        assert!(dropped(&log), "the POST was not held and dropped: {log}");
        let paths = echo.stats.paths.lock().unwrap().clone();
        assert_eq!(paths, ["/first", "/early-get"], "{log}");
    });
}

#[test]
fn with_early_data_off_nothing_is_forwarded_early() {
    let nginx = Nginx::start_with(EARLY);
    let pki = Pki::new();
    let (_t, addr, token) = h3_tessera(&nginx.url(), &pki, "early_data = false", "");
    runtime().block_on(async {
        let far = delay_line(addr, Duration::from_millis(250)).await;
        let client = H3Client::new(&pki.ca());
        let mut first = client.connect(far).await;
        request(&mut first, "GET", "/early", &token, Bytes::new())
            .await
            .unwrap();
        drop(first);
        // The server's tickets allow no early data: the client cannot send any.
        assert!(client.connect_0rtt(far).await.is_none(), "0-RTT offered");
        let mut send = client.connect(far).await;
        let got = request(&mut send, "GET", "/early", &token, Bytes::new())
            .await
            .unwrap();
        assert_eq!(String::from_utf8(got.body).unwrap(), "early= proto=https");
    });
}

/// A revocation during a paced download resets the HTTP/3 stream: the client reading 1 MB/s
/// sees the reset within a second and gets less than 256 KiB after the revocation.
#[test]
fn a_revocation_resets_an_http3_download_in_progress() {
    let up = upstream::start(Behavior::Users);
    up.stats.set_password("alice", "alice-pw");
    let pki = Pki::new();
    let (cert, key) = pki.leaf("localhost", &["localhost"]);
    let port = free_port();
    let tables = format!("{}[http3]\n", tls_table(port, &cert, &key, ""));
    let up_url = up.url();
    let t = Tessera::start(move |plain, dir| {
        let store = format!("embedded:{}/sessions", dir.display());
        config(plain, &up_url, &store, &[("tables", &tables)])
    });
    let (sid, token) = t.create_session("alice", "alice-pw");
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    runtime().block_on(async {
        // What the client's own stream window holds before the revocation is beyond tessera's
        // reach: kept small (as the HTTP/1.1 test keeps its socket buffer), so the bytes after
        // the revocation measure tessera's side.
        let client = H3Client::with_window(&pki.ca(), 64 << 10);
        let mut send = client.connect(addr).await;
        let req = http::Request::get("https://localhost/download")
            .header("authorization", format!("Bearer {token}"))
            .body(())
            .unwrap();
        let mut stream = send.send_request(req).await.unwrap();
        stream.finish().await.unwrap();
        assert_eq!(stream.recv_response().await.unwrap().status(), 200);
        let mut before = 0u64;
        while before < 1 << 20 {
            assert_eq!(
                paced_read(&mut stream, &mut before).await,
                Ok(true),
                "download ended early"
            );
        }
        let revoked = tokio::time::Instant::now();
        tokio::task::block_in_place(|| t.revoke(&sid));
        let mut after = 0u64;
        let end = loop {
            match paced_read(&mut stream, &mut after).await {
                Ok(true) => assert!(
                    after < 256 << 10,
                    "{after} bytes after the revocation: {}",
                    t.log()
                ),
                Ok(false) => break "end of stream".to_string(),
                Err(e) => break e,
            }
        };
        println!("HTTP/3 download reset ({end}) {after} bytes after the revocation");
        assert!(
            end.contains("reset") || end.contains("Reset"),
            "ended with {end}, not a reset"
        );
        assert!(
            revoked.elapsed() < Duration::from_secs(1),
            "reset after {:?}",
            revoked.elapsed()
        );
    });
}

/// Shutdown during a request: the GOAWAY names the stream after the last request taken, so the
/// client knows the one in flight was not refused and must not be retried elsewhere (RFC 9114
/// section 5.2: requests on the named stream or above were not processed), and it is answered.
#[test]
fn the_goaway_at_shutdown_spares_the_request_in_flight() {
    let echo = upstream::start(Behavior::Echo {
        delay: Duration::from_millis(1500),
    });
    let pki = Pki::new();
    let (t, addr, token) = h3_tessera(&echo.url(), &pki, "", "");
    runtime().block_on(async {
        let conn = H3Client::new(&pki.ca()).connect_quic(addr).await;
        let (_control, mut answer) = h3_raw::get(&conn, "/slow", &token).await;
        while echo.stats.requests.load(SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        std::process::Command::new("kill")
            .args(["-TERM", &t.pid().to_string()])
            .status()
            .unwrap();
        let (goaway, _qpack) = h3_raw::goaway(&conn).await;
        // The request went on stream 0, the client's first bidirectional stream.
        assert_eq!(goaway, 4, "GOAWAY names stream {goaway}");
        assert_eq!(
            h3_raw::status_index(&mut answer).await,
            Some(25),
            "not a 200"
        );
    });
}

/// A request head that never completes is dropped after `server.header_read_timeout_ms`, as
/// over TCP: the client's stream is stopped.
#[test]
fn a_stalled_http3_request_head_is_dropped_after_the_header_timeout() {
    let (_echo, pki, t, addr, _) = h3_echo("", "header_read_timeout_ms = 300");
    runtime().block_on(async {
        let conn = H3Client::new(&pki.ca()).connect_quic(addr).await;
        let (_control, stalled) = h3_raw::partial_head(&conn).await;
        // No bound on how soon: only that it happens (a hung stream would wait for ever).
        let stopped = tokio::time::timeout(Duration::from_secs(30), stalled.stopped()).await;
        assert!(
            matches!(stopped, Ok(Ok(Some(_)))),
            "{stopped:?}\n{}",
            t.log()
        );
        assert!(t
            .log()
            .contains("head not complete in server.header_read_timeout_ms"));
    });
}

/// A frame other than DATA announced far longer than the field section limit is refused with
/// H3_EXCESSIVE_LOAD (RFC 9114 section 8.1) as its header arrives: h3 would keep such a frame
/// whole until it ends, so a client could grow the process's memory without bound. On the
/// control stream the connection is closed; on a request stream that stream alone is stopped.
#[test]
fn oversized_frames_close_the_connection() {
    let (_echo, pki, t, addr, _) = h3_echo("", "");
    runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        let conn = client.connect_quic(addr).await;
        let _streams = h3_raw::oversized_frame(&conn, false, 4 << 20).await;
        // No bound on how soon: only that it happens (unguarded, it stays open).
        let closed = tokio::time::timeout(Duration::from_secs(30), conn.closed()).await;
        let code = match &closed {
            Ok(quinn::ConnectionError::ApplicationClosed(close)) => close.error_code,
            _ => panic!("{closed:?}\n{}", t.log()),
        };
        assert_eq!(code, quinn::VarInt::from_u32(0x107), "{}", t.log());

        let conn = client.connect_quic(addr).await;
        let (mut streams, answer) = h3_raw::oversized_frame(&conn, true, 256 << 10)
            .await
            .unwrap();
        let request = streams.pop().unwrap();
        let stopped = tokio::time::timeout(Duration::from_secs(30), request.stopped()).await;
        assert!(
            matches!(stopped, Ok(Ok(Some(code))) if code == quinn::VarInt::from_u32(0x107)),
            "{stopped:?}\n{}",
            t.log()
        );
        // And its answer is reset, not ended with no head (a malformed empty response).
        let read = answer.unwrap().read_to_end(1 << 20).await;
        assert!(
            matches!(&read, Err(quinn::ReadToEndError::Read(quinn::ReadError::Reset(code)))
                if *code == quinn::VarInt::from_u32(0x107)),
            "{read:?}"
        );
        assert!(conn.close_reason().is_none(), "the connection goes on");
    });
}

/// A client that expects `100 Continue` (RFC 9110 section 10.1.1) gets it once its request is
/// on its way upstream, and only then sends its body; a refused one gets its 401 at once,
/// without a 100 and without its body being waited for.
#[test]
fn a_client_expecting_100_continue_gets_it_once_its_request_goes_on() {
    let (_echo, pki, t, addr, token) = h3_echo("", "");
    runtime().block_on(async {
        let mut send = H3Client::new(&pki.ca()).connect(addr).await;
        let body = Bytes::from(vec![b'x'; 100_000]);
        let expecting = |token: &str| {
            let mut req = http::Request::post("https://localhost/up")
                .header("expect", "100-continue")
                .header("content-length", body.len());
            if !token.is_empty() {
                req = req.header("authorization", format!("Bearer {token}"));
            }
            req.body(()).unwrap()
        };
        let mut stream = send.send_request(expecting(&token)).await.unwrap();
        // No bound on how soon: only that it comes (without it, the body's 60 s timeout).
        let first = tokio::time::timeout(Duration::from_secs(30), stream.recv_response()).await;
        let first = first.expect("no 100 Continue").unwrap();
        assert_eq!(first.status(), 100, "{}", t.log());
        stream.send_data(body.clone()).await.unwrap();
        stream.finish().await.unwrap();
        let answer = stream.recv_response().await.unwrap();
        assert_eq!(answer.status(), 200, "{}", t.log());
        let mut got = Vec::new();
        while let Some(mut chunk) = stream.recv_data().await.unwrap() {
            use bytes::Buf;
            got.extend_from_slice(&chunk.copy_to_bytes(chunk.remaining()));
        }
        let got = String::from_utf8_lossy(&got);
        assert!(got.contains("\"bytes\":100000"), "{got}");

        let mut refused = send.send_request(expecting("")).await.unwrap();
        let first = tokio::time::timeout(Duration::from_secs(30), refused.recv_response()).await;
        assert_eq!(
            first.expect("no answer").unwrap().status(),
            401,
            "{}",
            t.log()
        );
    });
}

/// What a client sends on its QPACK streams (RFC 9204 section 4.2), which h3 keeps and never
/// reads past their type, is read and dropped: unread, quinn would hold each stream's receive
/// window (1.25 MB) of it for the connection's life, and the client's writes would stop there.
/// Here 4 MiB go down each (a type written as a one-byte and as a two-byte integer), and the
/// connection then serves a request.
#[test]
fn a_clients_qpack_streams_are_read_and_dropped() {
    let (_echo, pki, t, addr, token) = h3_echo("", "");
    runtime().block_on(async {
        let conn = H3Client::new(&pki.ca()).connect_quic(addr).await;
        let mut streams = Vec::new();
        for kind in [&[0x02][..], &[0x40, 0x03][..]] {
            let mut stream = conn.open_uni().await.unwrap();
            stream.write_all(kind).await.unwrap();
            let chunk = vec![0u8; 64 << 10];
            let sent = async {
                for _ in 0..64 {
                    stream.write_all(&chunk).await.unwrap();
                }
            };
            // No bound on how soon: only that it goes (unread, it stops at 1.25 MB for good).
            let went = tokio::time::timeout(Duration::from_secs(30), sent).await;
            assert!(went.is_ok(), "4 MiB not taken on {kind:?}\n{}", t.log());
            streams.push(stream);
        }
        // A request after them is served.
        let (_control, mut answer) = h3_raw::get(&conn, "/x", &token).await;
        assert_eq!(
            h3_raw::status_index(&mut answer).await,
            Some(25),
            "{}",
            t.log()
        );
        assert!(conn.close_reason().is_none(), "{}", t.log());
    });
}

/// What a client may make tessera hold on one connection is bounded: no DATAGRAM frames (HTTP/3
/// has no use for them; quinn would buffer them for a reader that never comes) and 8
/// unidirectional streams at once (HTTP/3 needs 3).
#[test]
fn a_quic_client_gets_no_datagrams_and_few_unidirectional_streams() {
    let (_echo, pki, _t, addr, _) = h3_echo("", "");
    runtime().block_on(async {
        let conn = H3Client::new(&pki.ca()).connect_quic(addr).await;
        assert_eq!(conn.max_datagram_size(), None);
        let mut open = Vec::new();
        for _ in 0..8 {
            open.push(conn.open_uni().await.unwrap());
        }
        // The ninth waits for one of them to end (a busy machine only makes it wait longer).
        let ninth = tokio::time::timeout(Duration::from_millis(300), conn.open_uni()).await;
        assert!(ninth.is_err(), "a ninth unidirectional stream opened");
    });
}

/// An HTTP/3 connection with no request open for `server.header_read_timeout_ms` since its last
/// one ended is sent GOAWAY, and closed with `H3_NO_ERROR` if its client has not closed it
/// within `server.send_timeout_ms` (time to take what quinn still holds of a download), as an
/// idle HTTP/2 connection is: QUIC's own idle timeout (`http3.idle_timeout_ms`, here a
/// minute) never fires for a client that sends PINGs.
#[test]
fn an_idle_http3_connection_is_sent_goaway_and_closed() {
    let (_echo, pki, t, addr, token) = h3_echo(
        "idle_timeout_ms = 60000",
        "header_read_timeout_ms = 1500\nsend_timeout_ms = 2000",
    );
    runtime().block_on(async {
        let conn = H3Client::new(&pki.ca()).connect_quic(addr).await;
        let (_control, mut answer) = h3_raw::get(&conn, "/x", &token).await;
        assert_eq!(h3_raw::status_index(&mut answer).await, Some(25));
        let (goaway, _qpack) = h3_raw::goaway(&conn).await;
        assert_eq!(goaway, 4, "GOAWAY names stream {goaway}");
        // No bound on how soon: only that it happens well before QUIC's idle timeout.
        let closed = tokio::time::timeout(Duration::from_secs(30), conn.closed()).await;
        assert!(
            matches!(&closed, Ok(quinn::ConnectionError::ApplicationClosed(c))
                if c.error_code == quinn::VarInt::from_u32(0x100)),
            "{closed:?}\n{}",
            t.log()
        );
    });
}

/// A response head the client takes no byte of (its stream window is full) is given up after
/// `server.send_timeout_ms` and its stream reset, as a stalled body is.
#[test]
fn an_http3_response_head_the_client_never_takes_is_reset() {
    let up = upstream::start(Behavior::Scripted(|_| Script {
        bytes: format!(
            "HTTP/1.1 200 OK\r\nX-Big: {}\r\nContent-Length: 0\r\n\r\n",
            "b".repeat(4000)
        )
        .into_bytes(),
        close: false,
        early: false,
    }));
    let pki = Pki::new();
    let (t, addr, token) = h3_tessera(&up.url(), &pki, "", "send_timeout_ms = 300");
    runtime().block_on(async {
        // 1,000 bytes of window per stream: room for the server's control streams, not for a
        // 4 KB head; the answer is never read, so the window never grows.
        let conn = H3Client::with_window(&pki.ca(), 1000)
            .connect_quic(addr)
            .await;
        let (_control, _answer) = h3_raw::get(&conn, "/big", &token).await;
        let log = tokio::task::block_in_place(|| {
            t.log_when(|l| l.contains("client took no response bytes"))
        });
        assert!(log.contains("client took no response bytes"), "{log}");
    });
}

/// A client whose connection closes while its request waits on the upstream: the exchange is
/// dropped (logged as 499), not kept until the upstream answers.
#[test]
fn a_closed_http3_connection_ends_its_open_requests() {
    let echo = upstream::start(Behavior::Echo {
        delay: Duration::from_secs(60),
    });
    let pki = Pki::new();
    let (t, addr, token) = h3_tessera(&echo.url(), &pki, "", "");
    runtime().block_on(async {
        let conn = H3Client::new(&pki.ca()).connect_quic(addr).await;
        let (_control, _answer) = h3_raw::get(&conn, "/slow", &token).await;
        while echo.stats.requests.load(SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        conn.close(quinn::VarInt::from_u32(0), b"gone");
        let log = tokio::task::block_in_place(|| t.log_when(|l| l.contains("status=499")));
        assert!(log.contains("path=/slow status=499"), "{log}");
    });
}

/// QUIC connections count against `server.max_connections` with TCP's: past it a new one is
/// refused (CONNECTION_REFUSED), and taken again once one has closed.
#[test]
fn quic_connections_past_max_connections_are_refused() {
    let (_echo, pki, t, addr, _) = h3_echo("", "max_connections = 1");
    runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        let first = client.connect_quic(addr).await;
        let refused = client.try_connect_quic(addr).await.map(|_| ());
        assert!(
            matches!(&refused, Err(quinn::ConnectionError::ConnectionClosed(c))
                if c.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED),
            "{refused:?}"
        );
        assert!(t.log().contains("new QUIC connections are refused"));
        first.close(quinn::VarInt::from_u32(0), b"done");
        let mut again = client.try_connect_quic(addr).await;
        for _ in 0..100 {
            if again.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            again = client.try_connect_quic(addr).await;
        }
        assert!(again.is_ok(), "{:?}", again.map(|_| ()));
    });
}

/// A chunked answer with trailers: `/trailers` small ones, among them a connection's field;
/// `/big-trailers` one of 400 bytes.
fn trailers_script(line: &str) -> Script {
    let trailers = match line {
        "GET /big-trailers HTTP/1.1" => format!("X-Big: {}\r\n", "x".repeat(400)),
        _ => "Keep-Alive: timeout=5\r\nX-Checksum: abc\r\n".to_string(),
    };
    Script {
        bytes: format!(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n{trailers}\r\n"
        )
        .into_bytes(),
        close: false,
        early: false,
    }
}

/// A GET of `path` over HTTP/3 through tessera to [`trailers_script`], from a client that takes
/// field sections of at most `limit` bytes.
fn get_with_trailers(path: &str, limit: u64) -> Result<support::h3::Answer, String> {
    let up = upstream::start(Behavior::Scripted(trailers_script));
    let pki = Pki::new();
    let (_t, addr, token) = h3_tessera(&up.url(), &pki, "", "");
    runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        let mut send = client.connect_limited(addr, limit).await;
        request(&mut send, "GET", path, &token, Bytes::new()).await
    })
}

/// A chunked response's trailers reach an HTTP/3 client after the body (RFC 9114 section
/// 4.1), without the connection's fields.
#[test]
fn an_upstreams_trailers_reach_an_http3_client() {
    let answer = get_with_trailers("/trailers", 16 * 1024).unwrap();
    assert_eq!((answer.status, answer.body.as_slice()), (200, &b"ok"[..]));
    let trailers = answer.trailers.expect("trailers");
    assert_eq!(trailers.get("x-checksum").unwrap(), "abc");
    assert!(trailers.get("keep-alive").is_none(), "{trailers:?}");
}

/// Trailers larger than the client takes (its SETTINGS_MAX_FIELD_SECTION_SIZE) cannot be sent:
/// the stream is reset, never ended as if the answer were whole without them.
#[test]
fn trailers_the_client_cannot_take_reset_the_stream() {
    let answer = get_with_trailers("/big-trailers", 300);
    assert!(
        answer.is_err(),
        "an answer that looks whole: {:?}",
        answer.map(|a| a.trailers)
    );
}

/// `[metrics]` on a free port, as lines to add after `[http3]`'s; and the port.
fn metrics_table() -> (String, u16) {
    let port = free_port();
    (format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"), port)
}

fn metrics(port: u16) -> String {
    curl(&[&format!("http://127.0.0.1:{port}/metrics")]).1
}

/// Handshakes begun from addresses that never answer (spoofed Initials) are met with a Retry
/// once they pass their limit (an eighth of `server.max_connections`, 2 here); a real client
/// still gets in (it comes back with the Retry's token) and so do TCP clients; the abandoned
/// handshakes end after `server.header_read_timeout_ms` and give their places back.
#[test]
fn a_flood_of_abandoned_handshakes_is_met_with_retry() {
    let echo = upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    });
    let pki = Pki::new();
    let (table, metrics_port) = metrics_table();
    let server = "max_connections = 16\nheader_read_timeout_ms = 2000";
    let (t, addr, token) = h3_tessera(&echo.url(), &pki, &table, server);
    wait_for_port(metrics_port, "tessera metrics");
    runtime().block_on(async {
        let mut kinds = Vec::new();
        let mut sockets = Vec::new();
        for _ in 0..3 {
            let (kind, socket) = abandoned_handshake(&pki.ca(), addr).await;
            kinds.push(kind);
            sockets.push(socket);
        }
        assert_eq!(kinds, [0x80, 0x80, 0xb0], "Initial, Initial, then Retry");
        let client = H3Client::new(&pki.ca());
        let mut send = client.connect(addr).await;
        let answer = request(&mut send, "GET", "/x", &token, Bytes::new()).await;
        assert_eq!(answer.unwrap().status, 200);
    });
    let m = metrics(metrics_port);
    assert!(sample(&m, "tessera_http3_retries_total") >= 2, "{m}");
    let bearer = format!("authorization: Bearer {token}");
    assert_eq!(curl(&["-H", &bearer, &t.url("/tcp")]).0, 200);
    // The two abandoned handshakes end at the header timeout: no place stays taken.
    let mut m = metrics(metrics_port);
    for _ in 0..100 {
        if sample(&m, "tessera_http3_unvalidated_handshakes") == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        m = metrics(metrics_port);
    }
    assert_eq!(sample(&m, "tessera_http3_unvalidated_handshakes"), 0, "{m}");
    assert!(t.log().contains("new ones are answered with a Retry"));
}

/// `http3.retry = "always"`: every new client proves its address first, and is served; a client
/// back with an address token from its last connection (NEW_TOKEN, RFC 9000 section 8.1.3)
/// skips that round trip.
#[test]
fn with_retry_always_new_clients_are_retried_and_returning_ones_are_not() {
    let echo = upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    });
    let pki = Pki::new();
    let (table, metrics_port) = metrics_table();
    let http3 = format!("retry = \"always\"\n{table}");
    let (_t, addr, token) = h3_tessera(&echo.url(), &pki, &http3, "");
    wait_for_port(metrics_port, "tessera metrics");
    runtime().block_on(async {
        let (kind, _socket) = abandoned_handshake(&pki.ca(), addr).await;
        assert_eq!(kind, 0xb0, "a Retry");
        let client = H3Client::new(&pki.ca());
        let mut send = client.connect(addr).await;
        let answer = request(&mut send, "GET", "/x", &token, Bytes::new()).await;
        assert_eq!(answer.unwrap().status, 200);
        let m = metrics(metrics_port);
        assert_eq!(sample(&m, "tessera_http3_retries_total"), 2, "{m}");
        // The same client again: its token (sent before the first answer) stands for the Retry.
        let mut again = client.connect(addr).await;
        let answer = request(&mut again, "GET", "/y", &token, Bytes::new()).await;
        assert_eq!(answer.unwrap().status, 200);
    });
    let m = metrics(metrics_port);
    assert_eq!(sample(&m, "tessera_http3_retries_total"), 2, "{m}");
    assert_eq!(sample(&m, "tessera_http3_unvalidated_handshakes"), 0, "{m}");
}

/// A UDP socket passed by socket activation (`ListenDatagram=`; here `systemd-socket-activate
/// --datagram`, which starts tessera at the first datagram) serves HTTP/3, while tessera binds
/// its TCP listeners itself.
#[test]
fn a_udp_socket_passed_by_systemd_serves_http3() {
    require("systemd-socket-activate");
    let echo = upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    });
    let pki = Pki::new();
    let (cert, key) = pki.leaf("localhost", &["localhost"]);
    let (port, udp_port) = (free_port(), free_port());
    let tables = format!("{}[http3]\n", tls_table(udp_port, &cert, &key, ""));
    let listen = format!("127.0.0.1:{udp_port}");
    // The datagram that starts tessera (not QUIC: quinn drops it).
    let first = listen.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        socket.send_to(b"start", &first).unwrap();
    });
    let upstream = echo.url();
    let via = ["systemd-socket-activate", "--datagram", "-l", &listen];
    let t = Tessera::start_via_on(port, &via, move |port, dir| {
        let store = format!("embedded:{}/sessions", dir.display());
        config(port, &upstream, &store, &[("tables", &tables)])
    });
    let (_, token) = t.create_session("alice", "pw");
    let addr = SocketAddr::from(([127, 0, 0, 1], udp_port));
    let answer = runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        let mut send = client.connect(addr).await;
        request(&mut send, "GET", "/x", &token, Bytes::new()).await
    });
    assert_eq!(answer.unwrap().status, 200);
    let log = t.log();
    assert!(
        log.contains("UDP socket passed by the service manager"),
        "{log}"
    );
}

/// A handshake that never completes (a forged source's Initial; 0-RTT takes the connection at
/// once) takes no place under `server.max_connections_per_ip`: the address it names is still
/// served.
#[test]
fn abandoned_handshakes_take_no_place_per_address() {
    let (_echo, pki, _t, addr, token) = h3_echo("", "max_connections_per_ip = 1");
    runtime().block_on(async {
        let (_kind, _socket) = abandoned_handshake(&pki.ca(), addr).await;
        let client = H3Client::new(&pki.ca());
        let mut send = client.connect(addr).await;
        let answer = request(&mut send, "GET", "/x", &token, Bytes::new()).await;
        assert_eq!(answer.unwrap().status, 200);
    });
}

/// `server.max_connections_per_ip` holds for QUIC too, counted once a handshake completes (or at
/// once, from an address a token proved): past it a connection is closed with
/// `H3_EXCESSIVE_LOAD` (or refused before its handshake).
#[test]
fn quic_connections_past_max_connections_per_ip_are_closed() {
    let (_echo, pki, _t, addr, _) = h3_echo("", "max_connections_per_ip = 1");
    runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        let _first = client.connect_quic(addr).await;
        let second = client.try_connect_quic(addr).await;
        let closed = match second {
            Ok(conn) => tokio::time::timeout(Duration::from_secs(10), conn.closed())
                .await
                .expect("the second connection is closed"),
            Err(e) => e,
        };
        // Before the client has the handshake's confirmation, RFC 9000 section 10.2.3 has an
        // application's close sent as a transport APPLICATION_ERROR, its code hidden.
        assert!(
            matches!(&closed, quinn::ConnectionError::ApplicationClosed(c)
                if c.error_code == quinn::VarInt::from_u32(0x107))
                || matches!(&closed, quinn::ConnectionError::ConnectionClosed(c)
                if c.error_code == quinn::TransportErrorCode::APPLICATION_ERROR
                    || c.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED),
            "{closed:?}"
        );
    });
}

/// A client whose address a token proved takes its place under
/// `server.max_connections_per_ip` from its first Initial: handshakes it leaves hanging hold
/// no more than its own share of `server.max_connections`.
#[test]
fn a_proven_address_takes_its_place_per_address_before_its_handshake() {
    use std::sync::atomic::Ordering::SeqCst;
    let (_echo, pki, t, addr, token) = h3_echo("", "max_connections_per_ip = 2");
    runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        // A first connection, kept: its answer comes after the NEW_TOKEN token (quinn sends it
        // with the handshake's confirmation), which proves the address from then on.
        let mut first = client.connect(addr).await;
        let answer = request(&mut first, "GET", "/x", &token, Bytes::new()).await;
        assert_eq!(answer.unwrap().status, 200);
        let (line, answers) = support::h3::first_datagram_line(addr).await;
        // Complete on the client's side (the server's flight comes back); the server never
        // gets the client's Finished.
        let _hanging = client.try_connect_quic(line).await;
        assert!(answers.load(SeqCst) > 0);
        let third = client.try_connect_quic(addr).await;
        let refused = match third {
            Ok(conn) => tokio::time::timeout(Duration::from_secs(10), conn.closed())
                .await
                .map_err(|_| t.log()),
            Err(e) => Ok(e),
        };
        assert!(
            matches!(&refused, Ok(quinn::ConnectionError::ConnectionClosed(c))
                if c.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED),
            "{refused:?}"
        );
    });
}

/// Shutdown (SIGTERM) during an HTTP/3 request: the request in flight is answered, then the
/// process ends (the connection is sent GOAWAY, and not waited on once its request is done).
#[test]
fn shutdown_answers_the_http3_request_in_flight_then_ends() {
    let echo = upstream::start(Behavior::Echo {
        delay: Duration::from_millis(1500),
    });
    let pki = Pki::new();
    let (mut t, addr, token) = h3_tessera(&echo.url(), &pki, "", "");
    let pid = t.pid();
    let t = &mut t;
    runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        let mut send = client.connect(addr).await;
        let slow =
            tokio::spawn(
                async move { request(&mut send, "GET", "/slow", &token, Bytes::new()).await },
            );
        tokio::time::sleep(Duration::from_millis(300)).await;
        std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        let got = slow.await.unwrap();
        assert_eq!(got.map(|a| a.status), Ok(200), "{}", t.log());
        // The client keeps its connection open: the server must not wait for it to go.
        let ended = tokio::task::block_in_place(|| t.wait_exit(Duration::from_secs(15)));
        assert!(ended, "still running: {}", t.log());
        drop(client);
    });
}

/// A connection lingering after its idle GOAWAY (up to `server.send_timeout_ms` for the client
/// to take its last answers and close) does not hold a shutdown past its own short linger.
#[test]
fn shutdown_does_not_wait_out_an_idle_connections_linger() {
    let (_echo, pki, mut t, addr, token) = h3_echo("", "header_read_timeout_ms = 1000");
    let pid = t.pid();
    let t = &mut t;
    runtime().block_on(async {
        let conn = H3Client::new(&pki.ca()).connect_quic(addr).await;
        let (_control, mut answer) = h3_raw::get(&conn, "/x", &token).await;
        assert_eq!(h3_raw::status_index(&mut answer).await, Some(25));
        // Idle: GOAWAY; the client does not close, so the connection lingers (60 s).
        let (_goaway, _qpack) = h3_raw::goaway(&conn).await;
        std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        let ended = tokio::task::block_in_place(|| t.wait_exit(Duration::from_secs(30)));
        assert!(ended, "still running: {}", t.log());
        let log = t.log();
        assert!(!log.contains("connections still open after"), "{log}");
    });
}

/// How an HTTP/3 request's body is framed upstream (RFC 9112 section 6): none for a GET whose
/// stream ended with its head, `Content-Length` when the client gave one, and chunked only when
/// its length is unknown; every byte of it, across a zero-length DATA frame too. A DATA frame
/// cut by the FIN is refused against a `content-length`, and panics nothing.
#[test]
fn http3_request_bodies_are_framed_upstream_as_their_clients_sent_them() {
    let up = upstream::start(Behavior::HopHeaders);
    let pki = Pki::new();
    let (_t, addr, token) = h3_tessera(&up.url(), &pki, "", "");
    let seen = |up: &upstream::TestUpstream| {
        let raw = std::mem::take(&mut *up.stats.raw_bytes.lock().unwrap());
        String::from_utf8_lossy(&raw).to_ascii_lowercase()
    };
    runtime().block_on(async {
        let client = H3Client::new(&pki.ca());
        let mut send = client.connect(addr).await;
        let get = request(&mut send, "GET", "/get", &token, Bytes::new()).await;
        assert_eq!(get.unwrap().status, 200);
        let raw = seen(&up);
        assert!(raw.starts_with("get /get "), "{raw}");
        assert!(
            !raw.contains("transfer-encoding") && !raw.contains("content-length"),
            "{raw}"
        );
        let sized = request_sized(&mut send, "/sized", &token, Bytes::from_static(b"12345")).await;
        assert_eq!(sized.unwrap().status, 200);
        let raw = seen(&up);
        assert!(
            raw.contains("content-length: 5\r\n") && !raw.contains("transfer-encoding"),
            "{raw}"
        );
        assert!(raw.ends_with("\r\n\r\n12345"), "{raw}");
        // A zero-length DATA frame in the middle (which h3 reports as the end) ends nothing:
        // the whole body goes, with its length or chunked.
        let conn = client.connect_quic(addr).await;
        let parts = h3_raw::data_frames(&[b"abc", b"", b"def"]);
        let (_control, mut answer) = h3_raw::post(&conn, "/cl", &token, &[(4, "6")], &parts).await;
        assert_eq!(h3_raw::status_index(&mut answer).await, Some(25), "200");
        let raw = seen(&up);
        assert!(
            raw.contains("content-length: 6\r\n") && raw.ends_with("\r\n\r\nabcdef"),
            "{raw}"
        );
        // A connection of its own: the helper opens the client's control stream each time.
        let conn = client.connect_quic(addr).await;
        let (_control, mut answer) = h3_raw::post(&conn, "/chunked", &token, &[], &parts).await;
        assert_eq!(h3_raw::status_index(&mut answer).await, Some(25), "200");
        let raw = seen(&up);
        assert!(
            raw.ends_with("\r\n\r\n3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n"),
            "{raw}"
        );
        // A DATA frame cut by the FIN (its header promises 10 bytes, none follow; h3 asserts on
        // such a stream if asked for trailers): refused against its content-length, and no
        // panic with or without one.
        let cut = [0x00, 0x0a];
        let conn = client.connect_quic(addr).await;
        let (_control, mut answer) = h3_raw::post(&conn, "/cut", &token, &[(4, "10")], &cut).await;
        assert_ne!(h3_raw::status_index(&mut answer).await, Some(25), "not 200");
        let conn = client.connect_quic(addr).await;
        let (_control, mut answer) = h3_raw::post(&conn, "/cut", &token, &[], &cut).await;
        h3_raw::status_index(&mut answer).await;
    });
    let log = _t.log();
    assert!(!log.contains("panicked"), "{log}");
}

/// `http3.host_key`: a restarted instance (after a crash) answers a packet of a connection it no
/// longer has with a stateless reset the client can verify (RFC 9000 section 10.3), so the
/// client learns at once, not at its idle timeout; and it takes the address tokens given before
/// the restart (a returning client skips the Retry that `retry = "always"` asks of new ones).
#[test]
fn a_host_key_carries_stateless_resets_and_tokens_across_a_restart() {
    let echo = upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    });
    let pki = Pki::new();
    const KEY: &str = "host_key = \"quic-host-key-0123456789-0123456789-abcdef\"\n";
    let port = free_port();
    let start = || {
        let (table, metrics_port) = metrics_table();
        let http3 = format!("retry = \"always\"\n{KEY}{table}");
        let (t, addr, token) = h3_tessera_on(port, &echo.url(), &pki, &http3, "");
        wait_for_port(metrics_port, "tessera metrics");
        (t, addr, token, metrics_port)
    };
    let retries = |port| sample(&metrics(port), "tessera_http3_retries_total");
    let (first, addr, token, first_metrics) = start();
    // One runtime for the client's endpoint throughout (its driver runs there).
    let rt = runtime();
    let client = rt.block_on(async { H3Client::new(&pki.ca()) });
    let conn = rt.block_on(async {
        let mut send = client.connect(addr).await;
        let answer = request(&mut send, "GET", "/a", &token, Bytes::new()).await;
        assert_eq!(answer.unwrap().status, 200);
        client.connect_quic(addr).await
    });
    assert_eq!(retries(first_metrics), 1, "the first connection only");
    // A crash, then a restart on the same port with the same secret.
    let killed = std::process::Command::new("kill")
        .args(["-9", &first.pid().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    drop(first);
    let (_second, _, token, second_metrics) = start();
    rt.block_on(async {
        // A packet for the new process (unless the client's own acknowledgements got there
        // first: then the reset has come already).
        if let Ok(mut stream) = conn.open_uni().await {
            let _ = stream.write_all(&[0u8; 200]).await;
        }
        // Reset, not the idle timeout (30 s) a client without a reset it can check waits for.
        let closed = conn.closed().await;
        assert!(
            matches!(closed, quinn::ConnectionError::Reset),
            "{closed:?}"
        );
        let mut send = client.connect(addr).await;
        let answer = request(&mut send, "GET", "/b", &token, Bytes::new()).await;
        assert_eq!(answer.unwrap().status, 200);
    });
    assert_eq!(
        retries(second_metrics),
        0,
        "a token from before the restart"
    );
}
