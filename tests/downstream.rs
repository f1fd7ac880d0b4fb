//! The downstream side over raw TCP: the real `tessera serve` binary, a client that writes exact
//! bytes (pipelining, split bodies, ambiguous framing, slow heads) and reads exact responses.
//! Requests the HTTP/1.1 fast path takes and those it hands to hyper must both come out right, on
//! the same connection.

mod support;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use support::upstream::{self, Behavior, Script};
use support::*;

type Extra = &'static [(&'static str, &'static str)];

fn behind(upstream: &str, extra: Extra) -> (Tessera, String) {
    let upstream = upstream.to_string();
    let t = Tessera::start(move |port, dir| {
        config(
            port,
            &upstream,
            &format!("embedded:{}/sessions", dir.display()),
            extra,
        )
    });
    let (_, token) = t.create_session("alice", "pw");
    (t, token)
}

/// A current-thread runtime with timers and I/O, for a test's async clients.
fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

type H2cSend = hyper::client::conn::http2::SendRequest<http_body_util::Empty<bytes::Bytes>>;

/// An h2c (prior knowledge) client connection to 127.0.0.1:`port` made by `builder`; the
/// connection runs in a spawned task, whose handle ends with it.
async fn h2c(
    port: u16,
    builder: &hyper::client::conn::http2::Builder<hyper_util::rt::TokioExecutor>,
) -> (H2cSend, tokio::task::JoinHandle<Result<(), hyper::Error>>) {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    h2c_on(stream, builder).await
}

/// [`h2c`] over a connection already open.
async fn h2c_on(
    stream: tokio::net::TcpStream,
    builder: &hyper::client::conn::http2::Builder<hyper_util::rt::TokioExecutor>,
) -> (H2cSend, tokio::task::JoinHandle<Result<(), hyper::Error>>) {
    let (send, conn) = builder
        .handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    (send, tokio::spawn(conn))
}

/// `GET path` on `send` with `token` as the bearer token: the response, its status checked to be
/// 200 (the body not read yet).
async fn h2c_get(
    send: &mut H2cSend,
    path: &str,
    token: &str,
) -> http::Response<hyper::body::Incoming> {
    let req = http::Request::get(format!("http://app{path}"))
        .header("authorization", format!("Bearer {token}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200, "{path}");
    resp
}

/// Started with a soft limit of 64 open files (the hard limit left as it is), tessera raises the
/// soft limit to the hard one and logs it, so 300 clients connected at once, each holding its
/// keep-alive connection open, are all answered. At 64, `accept` would fail with `EMFILE` from
/// about the 55th connection on, and the rest would wait unanswered.
#[test]
fn the_open_files_limit_is_raised_to_the_hard_limit_at_start() {
    let hard: u64 = String::from_utf8(
        std::process::Command::new("sh")
            .args(["-c", "ulimit -Hn"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .trim()
    .parse()
    .expect("a finite hard limit on open files");
    assert!(
        hard >= 1024,
        "the test needs a hard limit of at least 1024, not {hard}"
    );
    let up = upstream::start(Behavior::Scripted(|_| Script {
        bytes: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec(),
        close: false,
        early: false,
    }));
    let upstream = up.url();
    let t = Tessera::start_via(
        &["sh", "-c", "ulimit -S -n 64 && exec \"$@\"", "sh"],
        move |port, dir| {
            config(
                port,
                &upstream,
                &format!("embedded:{}/sessions", dir.display()),
                &[],
            )
        },
    );
    let (_, token) = t.create_session("alice", "pw");
    let log = t.log_when(|l| l.contains("open-files limit"));
    assert!(
        log.contains(&format!("open_files=\"{hard}\" raised_from=\"64\"")),
        "{log}"
    );
    let request = format!("GET /x HTTP/1.1\r\nHost: x\r\n{}\r\n\r\n", bearer(&token));
    let mut clients: Vec<Client> = (0..300).map(|_| Client::connect(&t)).collect();
    for c in &mut clients {
        c.send(request.as_bytes());
    }
    for (i, c) in clients.iter_mut().enumerate() {
        let r = c.response(false);
        assert_eq!((r.status, r.text()), (200, "ok".to_string()), "client {i}");
    }
    assert!(!t.log().contains("accept failed"), "{}", t.log());
}

/// One response as the client read it.
#[derive(Debug)]
struct Resp {
    status: u16,
    /// Header lines, names lowercased: `name: value`.
    headers: Vec<String>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find_map(|h| {
            h.split_once(": ")
                .filter(|(n, _)| *n == name)
                .map(|(_, v)| v)
        })
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A raw client connection with a read buffer.
struct Client {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    fn connect(t: &Tessera) -> Self {
        let s = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Self { s, buf: Vec::new() }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).unwrap();
    }

    /// Reads more bytes; `false` on EOF.
    fn more(&mut self) -> bool {
        let mut tmp = [0u8; 16384];
        match self.s.read(&mut tmp) {
            Ok(0) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&tmp[..n]);
                true
            }
            Err(e) if e.kind() == ErrorKind::ConnectionReset => false,
            Err(e) => panic!("read failed: {e}"),
        }
    }

    /// Reads one response (a 1xx is a response of its own); `head` for a HEAD request's answer.
    fn response(&mut self, head: bool) -> Resp {
        let end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
            assert!(self.more(), "EOF before a response head: {:?}", self.text());
        };
        let text = String::from_utf8(self.buf.drain(..end + 4).collect()).unwrap();
        let mut lines = text.trim_end().split("\r\n");
        let status_line = lines.next().unwrap();
        assert!(status_line.starts_with("HTTP/1.1 "), "{status_line}");
        let status: u16 = status_line[9..12].parse().unwrap();
        let headers: Vec<String> = lines
            .map(|l| {
                let (n, v) = l.split_once(':').unwrap();
                format!("{}: {}", n.to_ascii_lowercase(), v.trim())
            })
            .collect();
        let mut r = Resp {
            status,
            headers,
            body: Vec::new(),
        };
        if head || status < 200 || status == 204 || status == 304 {
            return r;
        }
        if let Some(n) = r.header("content-length") {
            let n: usize = n.parse().unwrap();
            while self.buf.len() < n {
                assert!(self.more(), "EOF inside a {n}-byte body");
            }
            r.body = self.buf.drain(..n).collect();
        } else if r.header("transfer-encoding") == Some("chunked") {
            loop {
                let line = loop {
                    if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                        break i;
                    }
                    assert!(self.more(), "EOF inside a chunk size line");
                };
                let size_text = String::from_utf8(self.buf.drain(..line + 2).collect()).unwrap();
                let size = usize::from_str_radix(size_text.trim(), 16).unwrap();
                while self.buf.len() < size + 2 {
                    assert!(self.more(), "EOF inside a chunk");
                }
                r.body.extend(self.buf.drain(..size));
                assert_eq!(self.buf.drain(..2).collect::<Vec<_>>(), b"\r\n");
                if size == 0 {
                    break;
                }
            }
        } else {
            while self.more() {}
            r.body = std::mem::take(&mut self.buf);
        }
        r
    }

    /// Whether the server closes the connection (EOF) within `within`, with no further bytes.
    fn closed_within(&mut self, within: Duration) -> bool {
        self.s.set_read_timeout(Some(within)).unwrap();
        let mut tmp = [0u8; 64];
        let closed = match self.s.read(&mut tmp) {
            Ok(0) => true,
            Ok(n) => panic!("unexpected bytes: {:?}", String::from_utf8_lossy(&tmp[..n])),
            Err(e) => e.kind() == ErrorKind::ConnectionReset,
        };
        self.s
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        closed
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.buf).into_owned()
    }
}

fn get(path: &str, token: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: app\r\nAuthorization: Bearer {token}\r\n\r\n")
}

fn post(path: &str, token: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: app\r\nAuthorization: Bearer {token}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn bytes_seen(r: &Resp) -> u64 {
    let v: serde_json::Value =
        serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.text()));
    v["bytes"].as_u64().unwrap()
}

#[test]
fn pipelined_split_and_handed_off_requests_on_one_connection() {
    let up = upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    });
    let (t, token) = behind(&up.url(), &[]);
    let mut c = Client::connect(&t);

    // Three requests in one write: answered in order, the body counted once.
    c.send(
        format!(
            "{}{}{}",
            get("/a", &token),
            get("/b", &token),
            post("/c", &token, "hello")
        )
        .as_bytes(),
    );
    for want in [0, 0, 5] {
        let r = c.response(false);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(bytes_seen(&r), want);
        assert!(r.header("date").is_some(), "{:?}", r.headers);
    }

    // A body that looks like a request is body: it is never parsed or forwarded as one.
    let inner = "GET /smuggled HTTP/1.1\r\nHost: app\r\n\r\n";
    c.send(post("/d", &token, inner).as_bytes());
    assert_eq!(bytes_seen(&c.response(false)), inner.len() as u64);

    // Head first, body later: the fast path waits for the whole body.
    let body = "x".repeat(3000);
    let full = post("/e", &token, &body);
    let (head, rest) = full.split_at(full.find("\r\n\r\n").unwrap() + 4);
    c.send(head.as_bytes());
    std::thread::sleep(Duration::from_millis(150));
    c.send(&rest.as_bytes()[..1000]);
    std::thread::sleep(Duration::from_millis(150));
    c.send(&rest.as_bytes()[1000..]);
    assert_eq!(bytes_seen(&c.response(false)), 3000);

    // A chunked upload goes to hyper with the bytes already read, then the connection goes on.
    c.send(
        format!(
            "POST /f HTTP/1.1\r\nHost: app\r\nAuthorization: Bearer {token}\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n{}",
            get("/g", &token)
        )
        .as_bytes(),
    );
    assert_eq!(bytes_seen(&c.response(false)), 7);
    assert_eq!(bytes_seen(&c.response(false)), 0);

    // A body larger than the fast path buffers (64 KiB) streams through hyper.
    let big = "y".repeat(100_000);
    c.send(post("/h", &token, &big).as_bytes());
    assert_eq!(bytes_seen(&c.response(false)), 100_000);

    // An h2 preface after a fast-path request is refused (closed), not a switch to h2.
    let mut c = Client::connect(&t);
    c.send(get("/pri", &token).as_bytes());
    assert_eq!(c.response(false).status, 200);
    c.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
    assert!(c.closed_within(Duration::from_secs(5)));

    let paths = up.stats.paths.lock().unwrap().clone();
    assert_eq!(
        paths,
        ["/a", "/b", "/c", "/d", "/e", "/f", "/g", "/h", "/pri"]
    );
    assert_eq!(up.stats.connections.load(Ordering::SeqCst), 1);

    // HEAD: the representation's length, no body bytes (the next answer parses cleanly).
    let nginx = Nginx::start();
    let (t2, token2) = behind(&nginx.url(), &[]);
    let mut c = Client::connect(&t2);
    c.send(
        format!(
            "HEAD /1k HTTP/1.1\r\nHost: app\r\nAuthorization: Bearer {token2}\r\n\r\n{}",
            get("/1k", &token2)
        )
        .as_bytes(),
    );
    let head = c.response(true);
    assert_eq!(
        (head.status, head.header("content-length")),
        (200, Some("1024"))
    );
    let r = c.response(false);
    assert_eq!((r.status, r.body.len()), (200, 1024));
    assert_eq!(r.body, one_kib_json().as_bytes());

    // Two requests in one write, then a half-close: the first is answered (a client with a
    // pipelined request already read is still there); the last counts as abandoned, as with
    // nginx and hyper, so the connection then ends.
    let mut h = Client::connect(&t);
    h.send(format!("{}{}", get("/h1", &token), get("/h2", &token)).as_bytes());
    h.s.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(h.response(false).status, 200);
    assert!(h.closed_within(Duration::from_secs(2)));
}

#[test]
fn ambiguous_framing_never_reaches_the_upstream() {
    let up = upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    });
    let (t, token) = behind(&up.url(), &[("server", "max_body_bytes = 1000")]);
    let auth = format!("Authorization: Bearer {token}");
    for (what, request) in [
        ("two lengths", format!("POST /x HTTP/1.1\r\nHost: app\r\n{auth}\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!")),
        ("signed length", format!("POST /x HTTP/1.1\r\nHost: app\r\n{auth}\r\nContent-Length: +5\r\n\r\nhello")),
        ("length list", format!("POST /x HTTP/1.1\r\nHost: app\r\n{auth}\r\nContent-Length: 5, 6\r\n\r\nhello!")),
        ("unknown coding", format!("POST /x HTTP/1.1\r\nHost: app\r\n{auth}\r\nTransfer-Encoding: gzip\r\n\r\nhello")),
        ("space before colon", format!("POST /x HTTP/1.1\r\nHost: app\r\n{auth}\r\nContent-Length : 5\r\n\r\nhello")),
        ("folded field", format!("GET /x HTTP/1.1\r\nHost: app\r\n{auth}\r\nX-A: 1\r\n 2\r\n\r\n")),
        ("HTTP/2 request line", format!("GET /x HTTP/2.0\r\nHost: app\r\n{auth}\r\n\r\n")),
        ("no target", "GET\r\nHost: app\r\n\r\n".to_string()),
    ] {
        let mut c = Client::connect(&t);
        c.send(request.as_bytes());
        let r = c.response(false);
        assert!(
            (400..500).contains(&r.status) || r.status == 501,
            "{what}: {} {}",
            r.status,
            r.text()
        );
        assert!(c.closed_within(Duration::from_secs(5)), "{what}: connection kept");
    }
    // Over `server.max_body_bytes`: 413 before any body byte is read or forwarded.
    let mut c = Client::connect(&t);
    c.send(
        format!("POST /x HTTP/1.1\r\nHost: app\r\n{auth}\r\nContent-Length: 5000\r\n\r\n")
            .as_bytes(),
    );
    assert_eq!(c.response(false).status, 413);
    assert_eq!(
        up.stats.requests.load(Ordering::SeqCst),
        0,
        "{:?}",
        up.stats.paths
    );

    // `Expect: 100-continue` (hyper) and an absolute-form target (fast path) still work.
    let mut c = Client::connect(&t);
    c.send(format!("POST /x HTTP/1.1\r\nHost: app\r\n{auth}\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n").as_bytes());
    assert_eq!(c.response(false).status, 100);
    c.send(b"hello");
    assert_eq!(bytes_seen(&c.response(false)), 5);
    c.send(format!("GET http://app/abs HTTP/1.1\r\nHost: app\r\n{auth}\r\n\r\n").as_bytes());
    assert_eq!(c.response(false).status, 200);
    assert_eq!(up.stats.paths.lock().unwrap().clone(), ["/x", "/abs"]);
}

/// An upstream answering after 600 ms, and a tessera in front of it whose head-read timeout is
/// 400 ms; a token.
fn slow_echo_behind_a_short_head_timeout() -> (upstream::TestUpstream, Tessera, String) {
    let up = upstream::start(Behavior::Echo {
        delay: Duration::from_millis(600),
    });
    let (t, token) = behind(&up.url(), &[("server", "header_read_timeout_ms = 400")]);
    (up, t, token)
}

/// `Connection: close` and HTTP/1.0 without keep-alive: answered, then EOF; bytes a client sends
/// after its `Connection: close` are drained, so the close is a FIN, not a reset.
#[test]
fn a_connection_the_client_closes_is_answered_then_ended_cleanly() {
    let (_up, t, token) = slow_echo_behind_a_short_head_timeout();
    // `Connection: close`: answered with `connection: close`, then EOF.
    let mut c = Client::connect(&t);
    c.send(format!("GET /a HTTP/1.1\r\nHost: app\r\nConnection: close\r\nAuthorization: Bearer {token}\r\n\r\n").as_bytes());
    let r = c.response(false);
    assert_eq!((r.status, r.header("connection")), (200, Some("close")));
    assert!(c.closed_within(Duration::from_secs(2)));

    // A client that sends more after `Connection: close` (RFC 9112 section 9.6 says it must
    // not), in the same write (read into tessera's buffer) or while the answer is being made
    // (left in the socket's receive queue): the bytes are drained, never left unread, so the
    // close is a FIN, not a reset.
    for pause in [None, Some(Duration::from_millis(150))] {
        let mut c = Client::connect(&t);
        let first = format!("GET /a HTTP/1.1\r\nHost: app\r\nConnection: close\r\nAuthorization: Bearer {token}\r\n\r\n");
        let extra = "GET /extra HTTP/1.1\r\nHost: app\r\n\r\n";
        match pause {
            None => c.send(format!("{first}{extra}").as_bytes()),
            Some(pause) => {
                c.send(first.as_bytes());
                std::thread::sleep(pause);
                c.send(extra.as_bytes());
            }
        }
        let r = c.response(false);
        assert_eq!((r.status, r.header("connection")), (200, Some("close")));
        let mut rest = Vec::new();
        c.s.read_to_end(&mut rest)
            .unwrap_or_else(|e| panic!("after a close with bytes sent after it ({pause:?}): {e}"));
        assert!(rest.is_empty(), "{:?}", String::from_utf8_lossy(&rest));
    }

    // HTTP/1.0 without keep-alive (hyper): answered, then EOF.
    let mut c = Client::connect(&t);
    c.send(
        format!("GET /b HTTP/1.0\r\nHost: app\r\nAuthorization: Bearer {token}\r\n\r\n").as_bytes(),
    );
    let mut raw = Vec::new();
    let _ = c.s.read_to_end(&mut raw);
    assert!(
        raw.starts_with(b"HTTP/1.1 200 ") || raw.starts_with(b"HTTP/1.0 200 "),
        "{}",
        String::from_utf8_lossy(&raw)
    );
}

/// A head that stalls is answered 408 after `server.header_read_timeout_ms`, counted from its
/// first byte; an idle connection just closes; keep-alive requests each get the whole timeout.
#[test]
fn a_request_head_gets_the_head_timeout_from_its_first_byte() {
    let (_up, t, token) = slow_echo_behind_a_short_head_timeout();
    // A head that stalls: 408 after the timeout, then EOF; an idle connection just closes.
    let mut c = Client::connect(&t);
    let started = Instant::now();
    c.send(b"GET /c HTTP/1.1\r\nHost: app\r\n");
    let r = c.response(false);
    assert_eq!(r.status, 408);
    assert!(
        started.elapsed() >= Duration::from_millis(350),
        "{:?}",
        started.elapsed()
    );
    assert!(c.closed_within(Duration::from_secs(2)));
    let mut idle = Client::connect(&t);
    assert!(idle.closed_within(Duration::from_secs(3)));
    // Blank lines after a request (RFC 9112 2.2) start nothing: no 408, just the idle close.
    let mut c = Client::connect(&t);
    c.send(format!("{}\r\n", get("/c2", &token)).as_bytes());
    assert_eq!(c.response(false).status, 200);
    assert!(c.closed_within(Duration::from_secs(3)));
    // The head's time counts from its first byte, not from the idle wait before it.
    let mut c = Client::connect(&t);
    std::thread::sleep(Duration::from_millis(300));
    let request = get("/c3", &token);
    c.send(&request.as_bytes()[..10]);
    std::thread::sleep(Duration::from_millis(250));
    c.send(&request.as_bytes()[10..]);
    assert_eq!(c.response(false).status, 200);
    // HEAD to a local answer states its length, as its GET would.
    c.send(b"HEAD /c4 HTTP/1.1\r\nHost: app\r\n\r\n");
    let r = c.response(true);
    assert_eq!(r.status, 401);
    let n: usize = r.header("content-length").unwrap().parse().unwrap();
    c.send(b"GET /c4 HTTP/1.1\r\nHost: app\r\n\r\n");
    assert_eq!(c.response(false).body.len(), n);
    // Keep-alive requests each get the whole timeout (the deadline restarts per request).
    let mut c = Client::connect(&t);
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(250));
        c.send(get("/d", &token).as_bytes());
        assert_eq!(c.response(false).status, 200);
    }
}

/// A body over 16 KiB is not read before its request is authenticated: a request with a bad
/// token that announces 20 KiB and sends none of it is answered 401 at once, where the fast
/// path would wait for the body (up to `server.client_body_timeout_ms`, 60 s) first; 16 KiB
/// or less (the fast path's) is read whole first, as before.
#[test]
fn a_body_over_16_kib_is_not_read_before_the_request_is_authenticated() {
    let up = upstream::start(upstream::Behavior::Echo {
        delay: Duration::from_millis(0),
    });
    let (t, token) = behind(&up.url(), &[]);
    let mut c = Client::connect(&t);
    c.send(b"POST /up HTTP/1.1\r\nHost: app\r\nAuthorization: Bearer nope\r\nContent-Length: 20000\r\n\r\n");
    assert_eq!(c.response(false).status, 401, "{}", t.log());
    // Within the fast path's size a body is taken whole: the request is answered after it.
    let mut c = Client::connect(&t);
    let body = "b".repeat(16 * 1024);
    c.send(post("/up", &token, &body).as_bytes());
    assert_eq!(c.response(false).status, 200);
}

/// Shutdown: the request in flight is answered (with `connection: close`), an idle connection
/// is closed, the listener refuses new clients at once, and the process exits.
#[test]
fn shutdown_answers_the_request_in_flight_and_closes_the_rest() {
    let (_up, t, token) = slow_echo_behind_a_short_head_timeout();
    // Shutdown: the request in flight is answered (with `connection: close`), an idle
    // connection is closed, and the process exits.
    let mut busy = Client::connect(&t);
    let mut idle = Client::connect(&t);
    busy.send(get("/e", &token).as_bytes());
    std::thread::sleep(Duration::from_millis(200));
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &t.pid().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    assert!(idle.closed_within(Duration::from_secs(2)));
    // The listening socket is closed at once: a new client is refused (and can try another
    // instance), not accepted by the kernel and left unanswered through the drain.
    let refused = (0..50).any(|_| match TcpStream::connect(("127.0.0.1", t.port)) {
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => true,
        _ => {
            std::thread::sleep(Duration::from_millis(10));
            false
        }
    });
    assert!(refused, "still accepting connections while draining");
    let r = busy.response(false);
    assert_eq!(
        (r.status, r.header("connection")),
        (200, Some("close")),
        "{}",
        t.log()
    );
    assert!(busy.closed_within(Duration::from_secs(2)));
}

/// A connection's first request that goes to hyper (a chunked upload here), whose head
/// completes after shutdown began, is answered with `connection: close`, not dropped: hyper's
/// auto-detecting connection asked to stop before it read the version would end unanswered.
#[test]
fn shutdown_answers_a_first_request_handed_to_hyper() {
    let up = upstream::start(Behavior::Echo {
        delay: Duration::from_millis(100),
    });
    let metrics_port = free_port();
    let metrics: &'static str = format!("[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"").leak();
    let extra = vec![("tables", metrics)];
    let (t, token) = behind(&up.url(), extra.leak());
    let head = format!(
        "POST /e HTTP/1.1\r\nHost: app\r\nAuthorization: Bearer {token}\r\n\
         Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
    );
    let (first, rest) = head.split_at(20);
    let mut clients: Vec<Client> = (0..10).map(|_| Client::connect(&t)).collect();
    for c in &mut clients {
        c.send(first.as_bytes());
    }
    // Every connection accepted (and its first bytes sent) before the stop.
    let open = || {
        let (_, text) = curl(&[&format!("http://127.0.0.1:{metrics_port}/metrics")]);
        sample(&text, "tessera_client_connections")
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while open() < 10 {
        assert!(Instant::now() < deadline, "not all accepted: {}", t.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    t.signal("-TERM");
    std::thread::sleep(Duration::from_millis(100));
    for c in &mut clients {
        c.send(rest.as_bytes());
    }
    for (i, c) in clients.iter_mut().enumerate() {
        let r = c.response(false);
        let got = (r.status, r.header("connection"));
        assert_eq!(got, (200, Some("close")), "client {i}: {}", t.log());
    }
}

/// hyper's HTTP/2 server has no idle or connection-preface timeout of its own: before the idle
/// check, every connection below stayed open for as long as its client kept it.
#[test]
fn h2c_connections_left_idle_are_closed() {
    use http_body_util::BodyExt;
    use hyper_util::rt::TokioExecutor;

    let up = upstream::start(Behavior::Echo {
        delay: Duration::from_millis(1000),
    });
    let (t, token) = behind(&up.url(), &[("server", "header_read_timeout_ms = 300")]);
    // Reads (and drops) whatever the server sends until it closes; whether that was in time.
    let closes_within = |s: &mut TcpStream, within: Duration| {
        let started = Instant::now();
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut tmp = [0u8; 256];
        while started.elapsed() < within {
            match s.read(&mut tmp) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
                Err(_) => {}
            }
        }
        false
    };

    // Half a connection preface, then nothing.
    let mut half = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    half.write_all(b"PRI * HTTP/2.0\r\n").unwrap();
    // The whole preface and an empty SETTINGS frame, then nothing: no request, and no answer to
    // the PING that follows GOAWAY, so a graceful close alone would never end it.
    let mut silent = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    silent
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .unwrap();
    assert!(
        closes_within(&mut half, Duration::from_secs(3)),
        "half a preface: still open"
    );
    assert!(
        closes_within(&mut silent, Duration::from_secs(3)),
        "no request: still open"
    );

    current_thread().block_on(async {
        let (mut send, conn) = h2c(
            t.port,
            &hyper::client::conn::http2::Builder::new(TokioExecutor::new()),
        )
        .await;
        // A request in flight for three times the idle time (the upstream answers after 1 s) is
        // not cut, and the connection stays open for the next one.
        for path in ["/slow1", "/slow2"] {
            let resp = h2c_get(&mut send, path, &token).await;
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert!(body.starts_with(b"{\"auth\":\"Basic "), "{path}: {body:?}");
        }
        // Then idle: GOAWAY, which hyper's client answers, and the connection ends.
        let idle = Instant::now();
        tokio::time::timeout(Duration::from_secs(3), conn)
            .await
            .expect("an idle h2c connection still open after 3 s")
            .unwrap()
            .unwrap();
        assert!(
            idle.elapsed() >= Duration::from_millis(250),
            "{:?}",
            idle.elapsed()
        );
    });
}

fn responses(line: &str) -> Script {
    let bytes = if line.starts_with("GET /chunked ") {
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n".to_vec()
    } else if line.starts_with("GET /short ") {
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello".to_vec()
    } else if line.starts_with("GET /until-close ") {
        b"HTTP/1.1 200 OK\r\n\r\nuntil close".to_vec()
    } else {
        b"HTTP/1.1 204 No Content\r\n\r\n".to_vec()
    };
    let close = !line.starts_with("GET /chunked ") && !line.starts_with("GET /none ");
    Script {
        bytes,
        close,
        early: false,
    }
}

#[test]
fn response_framing_chunked_short_and_until_close() {
    let up = upstream::start(Behavior::Scripted(responses));
    let (t, token) = behind(&up.url(), &[]);
    let mut c = Client::connect(&t);
    c.send(format!("{}{}", get("/chunked", &token), get("/none", &token)).as_bytes());
    let r = c.response(false);
    assert_eq!((r.status, r.text().as_str()), (200, "hello world"));
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    let r = c.response(false);
    assert_eq!((r.status, r.header("content-length")), (204, None));

    // An upstream body of unknown length is chunked downstream, and the connection stays.
    c.send(get("/until-close", &token).as_bytes());
    let r = c.response(false);
    assert_eq!((r.status, r.text().as_str()), (200, "until close"));
    c.send(get("/none", &token).as_bytes());
    assert_eq!(c.response(false).status, 204);

    // A body cut short upstream: the client gets the promised length and then EOF, never a
    // complete-looking response.
    c.send(get("/short", &token).as_bytes());
    let end = loop {
        if let Some(i) = c.buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        assert!(c.more());
    };
    let head = String::from_utf8_lossy(&c.buf[..end]).to_ascii_lowercase();
    assert!(head.contains("content-length: 10"), "{head}");
    while c.more() {}
    assert_eq!(&c.buf[end + 4..], b"hello");
}

/// The size of the download the stalled and the second client ask for.
const STALLED_N: u64 = 64 << 20;

/// The second client: a whole download over the only upstream connection, once the stalled
/// response has given it back. Returns when its first byte came, counted from `since` (the
/// stalled response's first byte). On a wrong answer the failure shows the end of tessera's
/// log (`log`), whose access lines give the reason.
fn second_client(auth: &str, url: &str, what: &str, since: Instant, log: &Path) -> Duration {
    let launched = since.elapsed();
    let out = std::process::Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w"])
        .args(["%{http_code} %{size_download} %{time_starttransfer}"])
        .args(["--max-time", "20", "-H", auth, url])
        .output()
        .unwrap();
    let got = String::from_utf8_lossy(&out.stdout).to_string();
    let (answer, first_byte) = got.rsplit_once(' ').unwrap_or((&got, "0"));
    if answer != format!("200 {STALLED_N}") {
        let log = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        panic!(
            "{what}: the second client got {answer:?}, want \"200 {STALLED_N}\"; tessera's log ends:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    launched + Duration::from_secs_f64(first_byte.parse().unwrap())
}

/// Reads what a stalled client was sent until the connection ends; how many bytes.
fn drain_stalled(s: &mut TcpStream) -> u64 {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (mut n, mut tmp) = (0u64, vec![0u8; 1 << 16]);
    loop {
        match s.read(&mut tmp) {
            Ok(0) => return n,
            Ok(k) => n += k as u64,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return n,
            Err(e) => panic!("stalled client: {e} after {n} bytes"),
        }
    }
}

/// Waits until the response has started to arrive (the upstream connection is taken).
fn response_started(s: &TcpStream) {
    let mut b = [0u8; 1];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(s.peek(&mut b).unwrap(), 1, "no response started");
}

/// A 64 MiB download upstream; tessera with `send_timeout_ms = 500` and one upstream connection.
fn one_connection_and_a_short_send_timeout() -> (upstream::TestUpstream, Tessera, String) {
    let up = upstream::start(Behavior::Download { n: STALLED_N });
    let (t, token) = behind(
        &up.url(),
        &[
            ("server", "send_timeout_ms = 500"),
            ("upstream", "max_connections = 1"),
        ],
    );
    (up, t, token)
}

/// A client that stops reading its response (a full socket buffer) holds the upstream
/// connection that carries it for `server.send_timeout_ms` and no longer: with one upstream
/// connection allowed, a second client is answered once the first has taken nothing for that
/// long, and the first one's response is cut (never complete). On the fast path and on hyper's
/// HTTP/1 (an HTTP/1.0 request). Without the timeout the second client waited for as long as
/// the first did not read.
#[test]
fn an_http1_client_that_stops_reading_frees_its_upstream_connection_after_the_send_timeout() {
    const N: u64 = STALLED_N;
    let (_up, t, token) = one_connection_and_a_short_send_timeout();
    let (auth, url) = (bearer(&token), t.url("/second"));
    let log = t.dir.path().join("tessera.log");
    for (what, version) in [("fast path", "1.1"), ("hyper HTTP/1", "1.0")] {
        let mut a = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
        a.write_all(
            format!("GET /a HTTP/{version}\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n")
                .as_bytes(),
        )
        .unwrap();
        response_started(&a);
        // Not before the stalled response had stopped for about the timeout (the kernel buffers
        // fill after its first byte; curl's own start-up is not in its transfer times).
        let waited = second_client(&auth, &url, what, Instant::now(), &log);
        assert!(waited >= Duration::from_millis(450), "{what}: {waited:?}");
        let got = drain_stalled(&mut a);
        assert!(
            got < N,
            "{what}: the stalled response was not cut ({got} bytes)"
        );
    }
}

/// The same over h2c: a stream whose client grants no flow-control window holds its upstream
/// connection for `server.send_timeout_ms`, then is reset.
#[test]
fn an_h2c_stream_that_takes_nothing_frees_its_upstream_connection_after_the_send_timeout() {
    use http_body_util::BodyExt;
    use hyper_util::rt::TokioExecutor;
    const N: u64 = STALLED_N;
    let (_up, t, token) = one_connection_and_a_short_send_timeout();
    let (auth, url) = (bearer(&token), t.url("/second"));
    let log = t.dir.path().join("tessera.log");
    current_thread().block_on(async {
        let mut small_window = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
        small_window
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(1 << 20)
            .adaptive_window(false);
        let (mut send, _conn) = h2c(t.port, &small_window).await;
        // The head, then nothing read: the stream's 64 KiB window fills and stays full.
        let resp = h2c_get(&mut send, "/a", &token).await;
        let since = Instant::now();
        let (auth, url, log) = (auth.clone(), url.clone(), log.clone());
        let waited =
            tokio::task::spawn_blocking(move || second_client(&auth, &url, "h2c", since, &log))
                .await
                .unwrap();
        assert!(waited >= Duration::from_millis(450), "h2c: {waited:?}");
        // Reading it now: the window bytes, then the stream's reset, never the whole body.
        let mut body = resp.into_body();
        let mut got = 0u64;
        let end = loop {
            match tokio::time::timeout(Duration::from_secs(10), body.frame()).await {
                Ok(Some(Ok(f))) => got += f.data_ref().map_or(0, |d| d.len() as u64),
                Ok(Some(Err(e))) => break format!("error: {e}"),
                Ok(None) => break "end".to_string(),
                Err(_) => break "timeout".to_string(),
            }
        };
        assert!(
            end.starts_with("error"),
            "h2c: the stalled stream ended with {end} after {got} bytes"
        );
        assert!(got < N, "h2c: {got} bytes");
    });
}

/// The send timeout counts only while the client does not take bytes that are there to send: a
/// response waiting on its upstream (an event stream, 100 ms between events) is never cut, with
/// `server.send_timeout_ms` at half that gap, on the fast path, on hyper's HTTP/1 and over h2c.
#[test]
fn responses_that_wait_on_the_upstream_are_not_cut_by_the_send_timeout() {
    use http_body_util::BodyExt;
    use hyper_util::rt::TokioExecutor;

    let up = upstream::start(Behavior::Users);
    up.stats.set_password("alice", "pw");
    let (t, token) = behind(&up.url(), &[("server", "send_timeout_ms = 50")]);
    const LAST: &str = "data: alice 12";
    for version in ["1.1", "1.0"] {
        let mut s = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(
            format!(
                "GET /events HTTP/{version}\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n"
            )
            .as_bytes(),
        )
        .unwrap();
        let (mut got, mut tmp) = (String::new(), [0u8; 4096]);
        while !got.contains(LAST) {
            match s.read(&mut tmp) {
                Ok(0) => panic!("HTTP/{version}: closed after {got:?}"),
                Ok(n) => got.push_str(&String::from_utf8_lossy(&tmp[..n])),
                Err(e) => panic!("HTTP/{version}: {e} after {got:?}"),
            }
        }
        assert!(got.starts_with(&format!("HTTP/{version} 200")), "{got}");
    }
    current_thread().block_on(async {
        let (mut send, _conn) = h2c(
            t.port,
            &hyper::client::conn::http2::Builder::new(TokioExecutor::new()),
        )
        .await;
        let mut body = h2c_get(&mut send, "/events", &token).await.into_body();
        let mut got = String::new();
        while !got.contains(LAST) {
            match tokio::time::timeout(Duration::from_secs(5), body.frame()).await {
                Ok(Some(Ok(f))) => {
                    if let Some(d) = f.data_ref() {
                        got.push_str(&String::from_utf8_lossy(d));
                    }
                }
                other => panic!("h2c: {other:?} after {got:?}"),
            }
        }
    });
}

/// The send timeout counts one stall, not the whole response: a client with a small receive
/// buffer that reads a 16 MiB download in bursts, pausing 100 ms after every MiB (a quarter of
/// `server.send_timeout_ms = 400`), gets all of it on the fast path, on hyper's HTTP/1 and over
/// h2c, although each download takes several times the timeout. tessera's writes do wait on
/// the pauses: with 600 ms pauses instead, each path was cut within its first 3 MiB (tried by
/// hand: a reset after 1.1 MiB on both HTTP/1 paths, `RST_STREAM` after 2.8 MiB over h2c).
#[test]
fn a_client_that_reads_slowly_but_steadily_is_never_cut_by_the_send_timeout() {
    use http_body_util::BodyExt;
    use hyper_util::rt::TokioExecutor;

    const N: u64 = 16 << 20;
    const EVERY: u64 = 1 << 20;
    const PAUSE: Duration = Duration::from_millis(100);
    let up = upstream::start(Behavior::Download { n: N });
    let (t, token) = behind(&up.url(), &[("server", "send_timeout_ms = 400")]);
    let rt = current_thread();
    // A connection to tessera whose receive buffer is fixed at 64 KiB (no autotuning).
    let connect = || async {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.set_recv_buffer_size(64 << 10).unwrap();
        s.connect(addr(t.port)).await.unwrap()
    };
    // Each download spans several timeouts by construction (16 pauses of 100 ms alone take 1.6 s,
    // four times the 400 ms timeout), so this only reports what it took.
    let paced = |what: &str, start: Instant, pauses: u32| {
        eprintln!(
            "{what}: {N} bytes in {:?}, {pauses} pauses of {PAUSE:?}",
            start.elapsed()
        );
    };

    for (what, version) in [("fast path", "1.1"), ("hyper HTTP/1", "1.0")] {
        let mut s = rt.block_on(connect()).into_std().unwrap();
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let start = Instant::now();
        s.write_all(
            format!("GET /a HTTP/{version}\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n")
                .as_bytes(),
        )
        .unwrap();
        let (mut seen, mut tmp) = (Vec::new(), vec![0u8; 64 << 10]);
        let head_end = loop {
            if let Some(i) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = s.read(&mut tmp).unwrap();
            assert!(n > 0, "{what}: closed in the head");
            seen.extend_from_slice(&tmp[..n]);
        };
        let head = String::from_utf8_lossy(&seen[..head_end]).to_string();
        assert!(head.starts_with(&format!("HTTP/{version} 200")), "{head}");
        let (mut body, mut pauses) = ((seen.len() - head_end) as u64, 0u32);
        while body < N {
            let n = match s.read(&mut tmp) {
                Ok(0) => panic!("{what}: closed after {body} of {N} bytes"),
                Ok(n) => n as u64,
                Err(e) => panic!("{what}: {e} after {body} of {N} bytes"),
            };
            if (body + n) / EVERY > body / EVERY {
                std::thread::sleep(PAUSE);
                pauses += 1;
            }
            body += n;
        }
        assert_eq!(body, N, "{what}");
        paced(what, start, pauses);
    }

    rt.block_on(async {
        let builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
        let (mut send, _conn) = h2c_on(connect().await, &builder).await;
        let start = Instant::now();
        let mut body = h2c_get(&mut send, "/a", &token).await.into_body();
        let (mut got, mut pauses) = (0u64, 0u32);
        while got < N {
            let n = match tokio::time::timeout(Duration::from_secs(10), body.frame()).await {
                Ok(Some(Ok(f))) => f.data_ref().map_or(0, |d| d.len() as u64),
                other => panic!("h2c: {other:?} after {got} of {N} bytes"),
            };
            if (got + n) / EVERY > got / EVERY {
                tokio::time::sleep(PAUSE).await;
                pauses += 1;
            }
            got += n;
        }
        assert_eq!(got, N, "h2c");
        paced("h2c", start, pauses);
    });
}

/// `server.http2_max_concurrent_streams` is what an h2c client is told in the server's SETTINGS
/// (as nghttp, nghttp2's client, prints them): 3 when set to 3, hyper's 200 by default; the
/// request on the same connection is answered either way.
#[test]
fn the_h2c_stream_limit_is_announced_in_the_settings() {
    require("nghttp");
    let up = upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    });
    let set: Extra = &[("server", "http2_max_concurrent_streams = 3")];
    for (extra, want) in [(set, 3), (&[][..], 200)] {
        let (t, token) = behind(&up.url(), extra);
        let out = std::process::Command::new("nghttp")
            .args(["-nv", "-t", "10", "-H"])
            .arg(format!("authorization: Bearer {token}"))
            .arg(t.url("/x"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let settings = text
            .lines()
            .skip_while(|l| !l.contains("recv SETTINGS frame"))
            .take(4)
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            settings.contains(&format!("[SETTINGS_MAX_CONCURRENT_STREAMS(0x03):{want}]")),
            "want {want}: {text}"
        );
        assert!(text.contains(":status: 200"), "{text}");
    }
}

/// HPACK (RFC 7541) for the raw h2c client below: an integer with an `n`-bit prefix (5.1) after
/// the `first` byte's flag bits.
fn hpack_int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

/// One HTTP/2 frame (RFC 9113 4.1): `kind`, `flags`, `stream` and its payload.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Reads one frame: (type, flags, stream, payload).
fn read_h2_frame(s: &mut TcpStream) -> std::io::Result<(u8, u8, u32, Vec<u8>)> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head)?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0; len];
    s.read_exact(&mut payload)?;
    Ok((head[3], head[4], stream, payload))
}

/// A client that ignores the stream limit gets the streams beyond it refused: with
/// `server.http2_max_concurrent_streams = 3`, a raw h2c client (no library that would respect
/// the limit) sends five GETs at once, against an upstream that answers after 300 ms. Streams
/// 1, 3 and 5 are answered 200; 7 and 9 are reset with `REFUSED_STREAM` (RFC 9113 5.1.2; by
/// 8.7 the client knows they were not processed and may retry them).
#[test]
fn h2c_streams_beyond_the_limit_are_refused() {
    const HEADERS: u8 = 0x1;
    const RST_STREAM: u8 = 0x3;
    const SETTINGS: u8 = 0x4;
    const REFUSED_STREAM: u32 = 0x7;
    let up = upstream::start(Behavior::Echo {
        delay: Duration::from_millis(300),
    });
    let (t, token) = behind(&up.url(), &[("server", "http2_max_concurrent_streams = 3")]);
    let mut s = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    s.write_all(&h2_frame(SETTINGS, 0, 0, &[])).unwrap();
    // The server's SETTINGS first (RFC 9113 3.4), acknowledged before the requests.
    let (kind, flags, _, _) = read_h2_frame(&mut s).unwrap();
    assert_eq!((kind, flags & 1), (SETTINGS, 0), "the server's preface");
    s.write_all(&h2_frame(SETTINGS, 0x1, 0, &[])).unwrap();

    let mut block = Vec::new();
    block.extend_from_slice(&[0x82, 0x86]); // :method GET, :scheme http (static table)
    for (index, value) in [
        (4, "/x".to_string()),                // :path
        (1, format!("127.0.0.1:{}", t.port)), // :authority
        (23, format!("Bearer {token}")),      // authorization
    ] {
        hpack_int(&mut block, 0x00, 4, index); // literal without indexing, indexed name
        hpack_int(&mut block, 0x00, 7, value.len()); // not Huffman-coded
        block.extend_from_slice(value.as_bytes());
    }
    let mut burst = Vec::new();
    for stream in [1, 3, 5, 7, 9] {
        // END_STREAM | END_HEADERS
        burst.extend(h2_frame(HEADERS, 0x5, stream, &block));
    }
    s.write_all(&burst).unwrap();

    let mut status = std::collections::BTreeMap::new();
    let mut refused = std::collections::BTreeMap::new();
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < 5 {
        let (kind, flags, stream, payload) = read_h2_frame(&mut s).unwrap_or_else(|e| {
            panic!("frames stopped ({e}); answered {status:?}, reset {refused:?}")
        });
        match kind {
            // The response head (the first HEADERS of its stream; a later one is trailers):
            // `:status: 200` is the static table's index 8 (0x88), after the pad length
            // (PADDED) and the priority fields (PRIORITY) if present.
            HEADERS if stream != 0 => {
                let skip = usize::from(flags & 0x8 != 0) + 5 * usize::from(flags & 0x20 != 0);
                status
                    .entry(stream)
                    .or_insert_with(|| payload.get(skip).copied());
                seen.insert(stream);
            }
            RST_STREAM if stream != 0 => {
                refused.insert(stream, u32::from_be_bytes(payload[..4].try_into().unwrap()));
                seen.insert(stream);
            }
            _ => {}
        }
    }
    assert_eq!(
        status.into_iter().collect::<Vec<_>>(),
        [(1, Some(0x88)), (3, Some(0x88)), (5, Some(0x88))],
        "the first three answered 200"
    );
    assert_eq!(
        refused.into_iter().collect::<Vec<_>>(),
        [(7, REFUSED_STREAM), (9, REFUSED_STREAM)],
        "the two beyond the limit refused"
    );
}

/// An https client on the plain listener (its TLS ClientHello) gets no HTTP answer: the
/// connection is closed at once, and the log says what came, for the operator.
#[test]
fn a_tls_handshake_on_the_plain_listener_is_closed_and_logged() {
    let up = upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    });
    let (t, _) = behind(&up.url(), &[]);
    let mut s = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // The start of a TLS 1.2/1.3 ClientHello record.
    s.write_all(&[
        0x16, 0x03, 0x01, 0x00, 0xf4, 0x01, 0x00, 0x00, 0xf0, 0x03, 0x03,
    ])
    .unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    assert!(answer.is_empty(), "{:?}", String::from_utf8_lossy(&answer));
    let log = t.log_when(|l| l.contains("TLS handshake on the plain listener"));
    assert!(log.contains("TLS handshake on the plain listener"), "{log}");
}

/// SIGHUP once shutdown has begun is ignored, and the log says so rather than announcing a
/// reload that will not be done.
#[test]
fn a_sighup_during_shutdown_is_said_to_be_ignored() {
    let (_up, t, token) = slow_echo_behind_a_short_head_timeout();
    let mut busy = Client::connect(&t);
    busy.send(get("/e", &token).as_bytes());
    std::thread::sleep(Duration::from_millis(200));
    t.signal("-TERM");
    let log = t.log_when(|l| l.contains("shutdown: no new connections"));
    assert!(log.contains("shutdown: no new connections"), "{log}");
    t.signal("-HUP");
    let log = t.log_when(|l| l.contains("SIGHUP ignored"));
    assert!(
        log.contains("SIGHUP ignored: shutting down") && !log.contains("SIGHUP: reloading"),
        "{log}"
    );
    assert_eq!(busy.response(false).status, 200);
}

/// An upstream that answers its first request with the head of an event stream, then waits
/// for `release` before the first event (a JMAP push stream with no event yet).
fn silent_event_stream(release: std::sync::mpsc::Receiver<()>) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).unwrap();
            assert!(n > 0, "request unfinished");
            seen.extend_from_slice(&buf[..n]);
        }
        let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
        conn.write_all(head.as_bytes()).unwrap();
        let _ = release.recv();
        let _ = conn.write_all(b"e\r\ndata: hello\n\n\r\n0\r\n\r\n");
    });
    port
}

/// The head of a response whose body has nothing yet reaches the HTTP/1.1 client at once (an
/// `EventSource` opens; a client's header timeout does not fire), then its events.
#[test]
fn a_response_head_is_not_held_for_a_body_that_has_nothing_yet() {
    let (release, released) = std::sync::mpsc::channel();
    let port = silent_event_stream(released);
    let (t, token) = behind(&format!("http://127.0.0.1:{port}"), &[]);
    let mut client = TcpStream::connect(addr(t.port)).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let request = format!(
        "GET /events HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
    );
    client.write_all(request.as_bytes()).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = client
            .read(&mut buf)
            .expect("the head before the first event");
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    release.send(()).unwrap();
    while !got.windows(11).any(|w| w == b"data: hello") {
        let n = client.read(&mut buf).unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
}
