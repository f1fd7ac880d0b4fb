//! WebSocket upgrades through tessera against real processes: the tessera binary, a hyper
//! upstream speaking WebSocket (tokio-tungstenite over hyper's upgrade), tokio-tungstenite as
//! the client (real handshakes and frames at both ends), raw TCP where the bytes matter, and
//! the session CLI revoking a session while its WebSocket is open.

mod support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use support::upstream::{self, Behavior, Script, TestUpstream};
use support::{basic, config, free_port, sample, Tessera};

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn ws_upstream() -> TestUpstream {
    let up = upstream::start(Behavior::WebSocket);
    up.stats.set_password("alice", "alice-pw");
    up.stats.set_password("bob", "bob-pw");
    up
}

/// A tessera on the embedded store in front of `up`, with `[metrics]` and the given
/// `[websocket]` lines; returns it with its metrics port.
fn tessera(up: &str, websocket: &str) -> (Tessera, u16) {
    tessera_with(up, websocket, "")
}

/// [`tessera`] with `server` lines added to its `[server]` table.
fn tessera_with(up: &str, websocket: &str, server: &'static str) -> (Tessera, u16) {
    let metrics_port = free_port();
    let tables: &'static str =
        format!("[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n[websocket]\n{websocket}\n")
            .leak();
    let up = up.to_string();
    let t = Tessera::start(move |port, dir| {
        config(
            port,
            &up,
            &format!("embedded:{}/s", dir.display()),
            &[("server", server), ("tables", tables)],
        )
    });
    (t, metrics_port)
}

fn metrics(port: u16) -> String {
    support::curl(&[&format!("http://127.0.0.1:{port}/metrics")]).1
}

/// Opens a WebSocket to `path` on `t` with `headers` added to the handshake.
async fn open(t: &Tessera, path: &str, headers: &[(&str, &str)]) -> Result<Ws, WsError> {
    let mut req = format!("ws://127.0.0.1:{}{path}", t.port)
        .into_client_request()
        .unwrap();
    for (name, value) in headers {
        req.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    tokio_tungstenite::connect_async(req)
        .await
        .map(|(ws, _)| ws)
}

/// The status a refused handshake was answered with.
fn refused(r: Result<Ws, WsError>) -> u16 {
    match r {
        Err(WsError::Http(resp)) => resp.status().as_u16(),
        Err(e) => panic!("handshake failed without an HTTP answer: {e}"),
        Ok(_) => panic!("handshake succeeded"),
    }
}

/// The next text message within 10 s (a bound on failure only).
async fn text<S>(ws: &mut WebSocketStream<S>) -> String
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => return t.as_str().to_owned(),
            Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => continue,
            other => panic!("no text message: {other:?}"),
        }
    }
}

/// Reads until the connection ends; returns how long that took (panics after `limit`).
async fn ended_within(ws: &mut Ws, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        match tokio::time::timeout_at((start + limit).into(), ws.next()).await {
            Err(_) => panic!("still open after {limit:?}"),
            Ok(None | Some(Err(_)) | Some(Ok(Message::Close(_)))) => return start.elapsed(),
            Ok(Some(Ok(_))) => {}
        }
    }
}

/// Reads until the peer's Close frame, which must come within `limit`; returns it as
/// `code reason`.
async fn close_frame_within(ws: &mut Ws, limit: Duration) -> String {
    let start = Instant::now();
    loop {
        match tokio::time::timeout_at((start + limit).into(), ws.next()).await {
            Err(_) => panic!("still open after {limit:?}"),
            Ok(Some(Ok(Message::Close(Some(f))))) => {
                return format!("{} {}", u16::from(f.code), f.reason)
            }
            Ok(None | Some(Err(_)) | Some(Ok(Message::Close(None)))) => {
                panic!("ended without a Close frame with a code")
            }
            Ok(Some(Ok(_))) => {}
        }
    }
}

/// The 101 a scripted upstream answers a WebSocket handshake with (the accept value of the key
/// [`raw_handshake`] sends, RFC 6455 section 1.3).
const SCRIPTED_101: &[u8] = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n";

/// A raw TCP connection to `t` on which a WebSocket handshake for `path` with `token` was sent,
/// `after` in the same write; reads time out after 15 s (a bound on failure only: debug builds
/// on a loaded 2-core CI).
fn raw_handshake(t: &Tessera, path: &str, token: &str, after: &[u8]) -> std::net::TcpStream {
    let sock = std::net::TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    handshake_on(sock, path, token, after)
}

/// [`raw_handshake`] on a connection already open.
fn handshake_on(
    mut sock: std::net::TcpStream,
    path: &str,
    token: &str,
    after: &[u8],
) -> std::net::TcpStream {
    use std::io::Write;
    sock.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let head = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
         Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    );
    sock.write_all(&[head.as_bytes(), after].concat()).unwrap();
    sock
}

/// The head tessera answers a WebSocket handshake for `/ws` of `version` with `key` (lower
/// case).
fn handshake_of(t: &Tessera, token: &str, version: &str, key: &str) -> String {
    use std::io::Write;
    let mut sock = std::net::TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let head = format!(
        "GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
         Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: {version}\r\n\
         Sec-WebSocket-Key: {key}\r\n\r\n"
    );
    sock.write_all(head.as_bytes()).unwrap();
    let seen = read_until(&mut sock, |seen| seen.windows(4).any(|w| w == b"\r\n\r\n"));
    String::from_utf8_lossy(&seen)
        .to_ascii_lowercase()
        .replacen("http/1.1", "HTTP/1.1", 1)
}

/// Reads from `sock` until what it read satisfies `done`; returns all of it. Panics if the
/// connection closes or times out first.
fn read_until(sock: &mut std::net::TcpStream, done: impl Fn(&[u8]) -> bool) -> Vec<u8> {
    use std::io::Read;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !done(&seen) {
        let n = sock.read(&mut buf).unwrap_or_else(|e| {
            panic!(
                "no more bytes before the read timeout ({e}) after {:?}",
                String::from_utf8_lossy(&seen)
            )
        });
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    seen
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// Polls `cond` every 20 ms for up to 5 s.
fn eventually(cond: impl Fn() -> bool) -> bool {
    (0..250).any(|_| {
        cond() || {
            std::thread::sleep(Duration::from_millis(20));
            false
        }
    })
}

#[test]
fn a_websocket_carries_frames_both_ways_with_the_upstream_credential_and_nothing_of_the_client() {
    let up = ws_upstream();
    let (t, metrics_port) = tessera(&up.url(), "");
    let (_, token) = t.create_session("alice", "alice-pw");
    let rt = rt();
    rt.block_on(async {
        let auth = bearer(&token);
        let mut ws = open(
            &t,
            "/jmap/ws?x=1",
            &[
                ("authorization", &auth),
                ("cookie", "other=1"),
                ("x-forwarded-for", "6.6.6.6"),
                ("origin", &format!("http://127.0.0.1:{}", t.port)),
            ],
        )
        .await
        .expect("upgrade through tessera");
        assert_eq!(text(&mut ws).await, "hello alice");
        ws.send(Message::text("hi")).await.unwrap();
        assert_eq!(text(&mut ws).await, "alice: hi");
        // A binary message far larger than any buffer on the way, both ways, unchanged.
        let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        ws.send(Message::binary(big.clone())).await.unwrap();
        match tokio::time::timeout(Duration::from_secs(30), ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => assert!(b[..] == big[..], "binary changed"),
            other => panic!("no binary echo: {other:?}"),
        }

        let head = up.stats.last_upgrade.lock().unwrap().clone();
        let has = |line: &str| head.iter().any(|l| l.eq_ignore_ascii_case(line));
        assert_eq!(head[0], "GET /jmap/ws?x=1", "{head:?}");
        assert!(
            has(&format!("authorization: {}", basic("alice", "alice-pw"))),
            "{head:?}"
        );
        assert!(
            has("upgrade: websocket") && has("connection: upgrade"),
            "{head:?}"
        );
        assert!(has("x-forwarded-for: 127.0.0.1"), "{head:?}");
        assert!(has("sec-websocket-version: 13"), "{head:?}");
        assert!(
            head.iter().any(|l| l.starts_with("sec-websocket-key: ")),
            "{head:?}"
        );
        assert!(
            !head
                .iter()
                .any(|l| l.contains(&token) || l.contains("6.6.6.6")),
            "the client's token or forwarding header reached the upstream: {head:?}"
        );
        let m = metrics(metrics_port);
        assert_eq!(sample(&m, "tessera_websockets_open"), 1, "{m}");
        assert_eq!(sample(&m, "tessera_websockets_opened_total"), 1, "{m}");
        assert_eq!(
            sample(&m, "tessera_upstream_connections{state=\"busy\"}"),
            1,
            "the tunnel holds its upstream connection: {m}"
        );

        ws.close(None).await.unwrap();
        ended_within(&mut ws, Duration::from_secs(10)).await;
    });
    assert!(
        eventually(|| up.stats.websockets_open.load(Ordering::SeqCst) == 0
            && up.stats.current.load(Ordering::SeqCst) == 0),
        "the upstream side of the tunnel was not closed"
    );
    // The tunnel's upstream connection is closed, not pooled (tessera may see the close a
    // moment after the upstream did).
    assert!(
        eventually(|| {
            let m = metrics(metrics_port);
            sample(&m, "tessera_websockets_open") == 0
                && sample(&m, "tessera_upstream_connections{state=\"busy\"}")
                    + sample(&m, "tessera_upstream_connections{state=\"idle\"}")
                    == 0
                && sample(
                    &m,
                    "tessera_upstream_connections_closed_total{reason=\"tunnel\"}",
                ) == 1
        }),
        "a tunnel stayed open, its connection went back to the pool, or its close was not counted as a tunnel's: {}",
        metrics(metrics_port)
    );
    let log = t.log_when(|l| l.contains("WebSocket closed"));
    let line = log
        .lines()
        .find(|l| l.contains("WebSocket closed"))
        .unwrap_or_else(|| panic!("no close line: {log}"));
    assert!(
        line.contains("end=closed") && line.contains("sid_hash="),
        "{line}"
    );
    assert!(!log.contains(&token), "the token was logged");
}

/// A WebSocket over HTTP/2 (RFC 8441): the server's SETTINGS allow extended CONNECT, a CONNECT
/// with `:protocol websocket` reaches the upstream as an HTTP/1.1 upgrade (with a key of
/// tessera's), the client gets 200 without the accept, and frames pass both ways on the stream;
/// an upstream that answers without switching is a 502, never a 2xx (which would say the tunnel
/// is open).
#[test]
fn a_websocket_over_http2_carries_frames_on_its_stream() {
    use support::h2ws;
    use tokio_tungstenite::tungstenite::protocol::Role;
    let up = ws_upstream();
    let (t, metrics_port) = tessera(&up.url(), "");
    let (_, token) = t.create_session("alice", "alice-pw");
    let auth = bearer(&token);
    rt().block_on(async {
        let headers = [
            ("authorization", auth.as_str()),
            ("sec-websocket-protocol", "jmap"),
        ];
        let (head, io) = h2ws::connect(t.port, "/ws", &headers).await;
        assert_eq!(head.status, 200, "{head:?}");
        assert!(
            head.headers.get("sec-websocket-accept").is_none(),
            "{head:?}"
        );
        let mut ws = WebSocketStream::from_raw_socket(io.unwrap(), Role::Client, None).await;
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => assert_eq!(t.as_str(), "hello alice"),
            other => panic!("no greeting: {other:?}"),
        }
        ws.send(Message::text("hi")).await.unwrap();
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => assert_eq!(t.as_str(), "alice: hi"),
            other => panic!("no echo: {other:?}"),
        }
        let up_head = up.stats.last_upgrade.lock().unwrap().clone();
        let has = |line: &str| up_head.iter().any(|l| l.eq_ignore_ascii_case(line));
        assert_eq!(up_head[0], "GET /ws", "{up_head:?}");
        assert!(
            has("upgrade: websocket") && has("connection: upgrade"),
            "{up_head:?}"
        );
        assert!(has("sec-websocket-protocol: jmap"), "{up_head:?}");
        let key = up_head
            .iter()
            .find_map(|l| l.strip_prefix("sec-websocket-key: "));
        assert_eq!(key.map(str::len), Some(24), "{up_head:?}");
        ws.close(None).await.unwrap();

        let (head, io) = h2ws::connect(t.port, "/page", &[("authorization", auth.as_str())]).await;
        assert_eq!(head.status, 502, "a 200 that is no switch");
        assert!(io.is_none());
    });
    let m = metrics(metrics_port);
    assert_eq!(sample(&m, "tessera_websockets_opened_total"), 1, "{m}");
    let log = t.log_when(|l| l.contains("WebSocket closed"));
    assert!(log.contains("over=\"HTTP/2\""), "{log}");
}

/// An HTTP/2 connection whose only traffic is a WebSocket stream is not idle: past the idle
/// time (`server.header_read_timeout_ms`, 1 s here, GOAWAY and then the drop) the WebSocket
/// still carries frames.
#[test]
fn an_http2_connection_carrying_a_websocket_is_not_idle() {
    use support::h2ws;
    use tokio_tungstenite::tungstenite::protocol::Role;
    let up = ws_upstream();
    let server = "header_read_timeout_ms = 1000\nmax_connections = 2";
    let (t, _) = tessera_with(&up.url(), "", server);
    let (_, token) = t.create_session("alice", "alice-pw");
    let auth = bearer(&token);
    rt().block_on(async {
        let headers = [("authorization", auth.as_str())];
        let (head, io) = h2ws::connect(t.port, "/ws", &headers).await;
        assert_eq!(head.status, 200, "{head:?}");
        let mut ws = WebSocketStream::from_raw_socket(io.unwrap(), Role::Client, None).await;
        assert_eq!(text(&mut ws).await, "hello alice");
        // Well past the idle time and the drop that follows it.
        tokio::time::sleep(Duration::from_secs(4)).await;
        ws.send(Message::text("still here")).await.unwrap();
        assert_eq!(text(&mut ws).await, "alice: still here");
        // The connection and its WebSocket hold one place of the two, not two.
        let (code, _) =
            support::curl(&["--max-time", "10", "-H", &auth_line(&auth), &t.url("/page")]);
        assert_eq!(code, 200, "a second client waited for a place");
    });
}

fn auth_line(auth: &str) -> String {
    format!("authorization: {auth}")
}

/// No WebSocket on the login endpoints: their 200 would tell an HTTP/2 client that a tunnel is
/// open; an extended CONNECT there is refused (405).
#[test]
fn an_http2_websocket_to_a_login_endpoint_is_refused() {
    let up = ws_upstream();
    let url = up.url();
    let t = Tessera::start(move |port, dir| {
        let store = format!("embedded:{}/s", dir.display());
        let tables = "[websocket]\n";
        config(
            port,
            &url,
            &store,
            &[("login", "verify_path = \"/\""), ("tables", tables)],
        )
    });
    let (_, token) = t.create_session("alice", "alice-pw");
    let auth = bearer(&token);
    rt().block_on(async {
        for path in ["/auth/login", "/auth/session"] {
            let headers = [("authorization", auth.as_str())];
            let (head, io) = support::h2ws::connect(t.port, path, &headers).await;
            assert_eq!(head.status, 405, "{path}: {head:?}");
            assert!(io.is_none());
        }
    });
}

/// A client that keeps its HTTP/2 stream's window shut (reads nothing) while the upstream
/// sends: the tunnel ends after `server.send_timeout_ms` (1 s here), not after the WebSocket
/// idle timeout (10 minutes), and frees its upstream connection.
#[test]
fn an_http2_websocket_whose_client_takes_nothing_is_cut_after_the_send_timeout() {
    use support::h2ws;
    use tokio_tungstenite::tungstenite::protocol::Role;
    let up = ws_upstream();
    let (t, metrics_port) = tessera_with(&up.url(), "", "send_timeout_ms = 1000");
    let (_, token) = t.create_session("alice", "alice-pw");
    let auth = bearer(&token);
    let open = || sample(&metrics(metrics_port), "tessera_websockets_open");
    rt().block_on(async {
        let (head, io) = h2ws::connect(t.port, "/ws", &[("authorization", auth.as_str())]).await;
        assert_eq!(head.status, 200, "{head:?}");
        let mut ws = WebSocketStream::from_raw_socket(io.unwrap(), Role::Client, None).await;
        // Echoed whole by the upstream: far more than the client's 64 KiB window.
        ws.send(Message::binary(vec![7u8; 1 << 20])).await.unwrap();
        assert_eq!(open(), 1);
        let started = Instant::now();
        while open() > 0 && started.elapsed() < Duration::from_secs(30) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(open(), 0, "the tunnel outlived the send timeout");
        drop(ws);
    });
}

/// A WebSocket keeps its client connection's place under `server.max_connections` after the
/// connection's own task hands the socket to the tunnel: with one place and a WebSocket open, a
/// new connection waits (counted), and is served once the WebSocket ends.
#[test]
fn a_websocket_holds_its_place_under_max_connections() {
    let up = ws_upstream();
    let (t, metrics_port) = tessera_with(&up.url(), "", "max_connections = 1");
    let (_, token) = t.create_session("alice", "alice-pw");
    let rt = rt();
    rt.block_on(async {
        let auth = bearer(&token);
        let mut ws = open(&t, "/ws", &[("authorization", &auth)]).await.unwrap();
        assert_eq!(text(&mut ws).await, "hello alice");
        let (url, header) = (t.url("/page"), format!("Authorization: {auth}"));
        let waiting = std::thread::spawn(move || support::curl(&["-H", &header, &url]).0);
        let waits = || {
            sample(
                &metrics(metrics_port),
                "tessera_client_connection_waits_total",
            )
        };
        let held = eventually(|| waits() >= 1);
        assert!(held, "served past the limit: {}", metrics(metrics_port));
        ws.close(None).await.unwrap();
        drop(ws);
        let served = waiting.join().unwrap();
        assert_eq!(served, 200);
    });
}

/// A WebSocket keeps its client address's place under `server.max_connections_per_ip` too:
/// with two places and two WebSockets open, the address's next connection is closed; once one
/// WebSocket ends, it is served.
#[test]
fn a_websocket_holds_its_place_under_max_connections_per_ip() {
    let up = ws_upstream();
    let (t, metrics_port) = tessera_with(&up.url(), "", "max_connections_per_ip = 2");
    let (_, token) = t.create_session("alice", "alice-pw");
    let rt = rt();
    rt.block_on(async {
        let auth = bearer(&token);
        let mut first = open(&t, "/ws", &[("authorization", &auth)]).await.unwrap();
        let mut second = open(&t, "/ws", &[("authorization", &auth)]).await.unwrap();
        for ws in [&mut first, &mut second] {
            assert_eq!(text(ws).await, "hello alice");
        }
        let header = format!("Authorization: {auth}");
        let page = || support::curl(&["-H", &header, &t.url("/page")]).0;
        assert_eq!(page(), 0, "a third connection was served");
        let over = sample(
            &metrics(metrics_port),
            "tessera_client_connections_over_ip_limit_total",
        );
        assert!(over >= 1, "{}", metrics(metrics_port));
        first.close(None).await.unwrap();
        drop(first);
        assert!(eventually(|| page() == 200), "{}", t.log());
    });
}

#[test]
fn websocket_upgrades_are_refused_with_the_right_status_and_never_reach_the_upstream_unasked() {
    let up = ws_upstream();
    let (t, _) = tessera(
        &up.url(),
        "max_connections = 1\nallowed_origins = [\"https://mail.example.com\"]",
    );
    let (_, token) = t.create_session("alice", "alice-pw");
    let auth = bearer(&token);
    let rt = rt();
    rt.block_on(async {
        // No token: 401 from tessera, the upstream sees nothing.
        assert_eq!(refused(open(&t, "/ws", &[]).await), 401);
        // A page of another origin (cross-site WebSocket hijacking): 403, nothing forwarded.
        let before = up.stats.requests.load(Ordering::SeqCst);
        let foreign = open(
            &t,
            "/ws",
            &[("authorization", &auth), ("origin", "https://evil.example")],
        )
        .await;
        assert_eq!(refused(foreign), 403);
        assert_eq!(
            up.stats.requests.load(Ordering::SeqCst),
            before,
            "a foreign-origin upgrade reached the upstream"
        );
        // A handshake RFC 6455 refuses never takes a slot or reaches the upstream: another
        // version gets 426 naming 13, a key that is not 16 bytes in base64 400.
        for (version, key, status) in [
            ("8", "dGhlIHNhbXBsZSBub25jZQ==", "426"),
            ("13", "x", "400"),
            ("13", "dGhlIHNhbXBsZQ==", "400"),
        ] {
            let answer = handshake_of(&t, &token, version, key);
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {status} ")),
                "{answer}"
            );
            if status == "426" {
                assert!(
                    answer.contains("\r\nsec-websocket-version: 13\r\n"),
                    "{answer}"
                );
            }
        }
        assert_eq!(up.stats.requests.load(Ordering::SeqCst), before);
        // The upstream's own refusal is passed on.
        assert_eq!(
            refused(open(&t, "/deny", &[("authorization", &auth)]).await),
            403
        );
        // A listed origin may open one; it takes the only slot: a second gets 503.
        let mut first = open(
            &t,
            "/ws",
            &[
                ("authorization", &auth),
                ("origin", "https://Mail.Example.com"),
            ],
        )
        .await
        .expect("listed origin");
        assert_eq!(text(&mut first).await, "hello alice");
        assert_eq!(
            refused(open(&t, "/ws", &[("authorization", &auth)]).await),
            503
        );
        // Plain requests still get through beside the tunnel.
        let (status, _) =
            support::curl(&["-H", &format!("authorization: {auth}"), &t.url("/page")]);
        assert_eq!(status, 200);
        first.close(None).await.unwrap();
        ended_within(&mut first, Duration::from_secs(10)).await;
        // The slot is free again once the tunnel has ended.
        // (`first` stays open on the client's side: the tunnel ends a second after the upstream
        // closed, not when this client gets round to closing.)
        let mut again = None;
        for _ in 0..250 {
            match open(&t, "/ws", &[("authorization", &auth)]).await {
                Ok(ws) => {
                    again = Some(ws);
                    break;
                }
                Err(WsError::Http(r)) if r.status() == 503 => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                Err(e) => panic!("{e}"),
            }
        }
        let mut again = again.expect("the slot was never freed");
        assert_eq!(text(&mut again).await, "hello alice");
    });
    let log = t.log();
    assert!(
        log.contains("WebSocket upgrade from a foreign origin"),
        "{log}"
    );
    assert!(log.contains("too many WebSocket connections"), "{log}");
}

/// One user holds at most `websocket.max_connections_per_user` tunnels (429 past it), so that
/// one user's tabs or scripts cannot take every slot: another user still opens one.
#[test]
fn one_user_cannot_take_every_websocket() {
    let up = ws_upstream();
    let (t, _) = tessera(
        &up.url(),
        "max_connections = 3\nmax_connections_per_user = 2",
    );
    let (_, alice) = t.create_session("alice", "alice-pw");
    let (_, bob) = t.create_session("bob", "bob-pw");
    let (alice, bob) = (bearer(&alice), bearer(&bob));
    rt().block_on(async {
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut ws = open(&t, "/ws", &[("authorization", &alice)]).await.unwrap();
            assert_eq!(text(&mut ws).await, "hello alice");
            held.push(ws);
        }
        let third = open(&t, "/ws", &[("authorization", &alice)]).await;
        assert_eq!(refused(third), 429);
        let mut ws = open(&t, "/ws", &[("authorization", &bob)]).await.unwrap();
        assert_eq!(text(&mut ws).await, "hello bob");
    });
}

#[test]
fn with_websockets_off_an_upgrade_goes_upstream_as_a_plain_get() {
    let up = ws_upstream();
    let (t, _) = tessera(&up.url(), "max_connections = 0");
    let (_, token) = t.create_session("alice", "alice-pw");
    let rt = rt();
    rt.block_on(async {
        let got = open(&t, "/ws", &[("authorization", &bearer(&token))]).await;
        // The upstream saw no `Upgrade` and answered as to any GET of its endpoint.
        assert_eq!(refused(got), 426);
    });
}

/// Bytes the upstream sends right behind its 101 head, in the same write, reach the client;
/// after the switch the connection carries raw bytes both ways. A 101 to another protocol is a
/// broken upstream (502).
#[test]
fn bytes_after_the_101_and_raw_bytes_both_ways_pass_and_a_switch_to_another_protocol_is_502() {
    use std::io::{Read, Write};
    fn script(line: &str) -> Script {
        let bytes = match line {
            "GET /ws HTTP/1.1" => [SCRIPTED_101, b"\x81\x05hello"].concat(),
            "GET /h2c HTTP/1.1" => {
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
                    .to_vec()
            }
            // A 101 that answers another key, or leaves out `Connection`.
            "GET /stale HTTP/1.1" => String::from_utf8_lossy(SCRIPTED_101)
                .replace(
                    "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=",
                    "dGhlIGFjY2VwdCBvZiBhbm90aGVy",
                )
                .into_bytes(),
            "GET /bare HTTP/1.1" => String::from_utf8_lossy(SCRIPTED_101)
                .replace("Connection: Upgrade\r\n", "")
                .into_bytes(),
            // After the switch the upstream's request parser sees the client's raw bytes.
            "PING" => b"PONG".to_vec(),
            _ => b"HTTP/1.1 500 Unexpected\r\nContent-Length: 0\r\n\r\n".to_vec(),
        };
        Script {
            bytes,
            close: false,
            early: false,
        }
    }
    let up = upstream::start(Behavior::Scripted(script));
    let (t, _) = tessera(&up.url(), "");
    let (_, token) = t.create_session("alice", "alice-pw");
    // The client's first bytes of the new protocol come in the same write as its handshake
    // (hyper reads them with it): they must reach the upstream after the switch, once.
    let mut sock = raw_handshake(&t, "/ws", &token, b"PING\r\n\r\n");
    // The upstream's frame, then its answer to the client's first bytes (one read or several).
    let seen = read_until(&mut sock, |seen| seen.ends_with(b"\x81\x05helloPONG"));
    let text = String::from_utf8_lossy(&seen).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 101 "), "{text}");
    assert!(text.contains("\r\nupgrade: websocket\r\n"), "{text}");
    assert!(
        text.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{text}"
    );
    let mut pong = [0u8; 4];
    // And raw bytes later, both ways.
    sock.write_all(b"PING\r\n\r\n").unwrap();
    sock.read_exact(&mut pong).unwrap();
    assert_eq!(&pong, b"PONG");

    for path in ["/h2c", "/stale", "/bare"] {
        let mut sock = raw_handshake(&t, path, &token, b"");
        // The 502 keeps the connection open: read its head, not to the end.
        let answer = read_until(&mut sock, |seen| seen.windows(4).any(|w| w == b"\r\n\r\n"));
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 502 "), "{path}: {answer}");
    }
    // Over HTTP/2 the key is tessera's: the scripted 101 answers the RFC's sample key instead,
    // which only tessera can tell (RFC 8441 gives the client no accept to check).
    rt().block_on(async {
        let auth = bearer(&token);
        let (head, io) = support::h2ws::connect(t.port, "/ws", &[("authorization", &auth)]).await;
        assert_eq!(head.status, 502, "{head:?}");
        assert!(io.is_none());
    });
    let log = t.log();
    assert!(
        log.contains("does not complete the WebSocket handshake"),
        "{log}"
    );
}

/// With `[login]`, the upstream's `101` cannot set tessera's own cookies either (browsers store
/// cookies from a handshake's answer); its other cookies pass.
#[test]
fn a_websockets_101_cannot_set_tesseras_own_cookies() {
    fn script(_: &str) -> Script {
        let head = String::from_utf8_lossy(SCRIPTED_101).replace(
            "\r\n\r\n",
            "\r\nSet-Cookie: tessera=planted; Path=/\r\nSet-Cookie: =tessera-csrf=x\r\n\
             Set-Cookie: app=1\r\n\r\n",
        );
        Script {
            bytes: head.into_bytes(),
            close: false,
            early: false,
        }
    }
    let up = upstream::start(Behavior::Scripted(script));
    let t = Tessera::start(|port, dir| {
        let login = [
            ("login", "cookie_secure = false"),
            ("login", "verify_path = \"/check\""),
            ("tables", "[websocket]\n"),
        ];
        config(
            port,
            &up.url(),
            &format!("embedded:{}/s", dir.display()),
            &login,
        )
    });
    let (_, token) = t.create_session("alice", "alice-pw");
    let mut sock = raw_handshake(&t, "/ws", &token, b"");
    let head = read_until(&mut sock, |seen| seen.windows(4).any(|w| w == b"\r\n\r\n"));
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101 "), "{head}");
    let cookies: Vec<&str> = head
        .lines()
        .filter_map(|l| l.strip_prefix("set-cookie: "))
        .collect();
    assert_eq!(cookies, ["app=1"], "{head}");
}

#[test]
fn a_revoked_sessions_websocket_is_cut_and_an_idle_one_is_closed_while_others_go_on() {
    let up = ws_upstream();
    let (t, metrics_port) = tessera(&up.url(), "idle_timeout_ms = 1500");
    let (alice_sid, alice) = t.create_session("alice", "alice-pw");
    let (_, bob) = t.create_session("bob", "bob-pw");
    let rt = rt();
    rt.block_on(async {
        let start = Instant::now();
        let mut a = open(&t, "/ws", &[("authorization", &bearer(&alice))])
            .await
            .unwrap();
        let mut b = open(&t, "/ws", &[("authorization", &bearer(&bob))])
            .await
            .unwrap();
        let mut quiet = open(&t, "/ws", &[("authorization", &bearer(&bob))])
            .await
            .unwrap();
        for ws in [&mut a, &mut b, &mut quiet] {
            text(ws).await;
        }
        for ws in [&mut a, &mut b] {
            ws.send(Message::text("tick")).await.unwrap();
            assert_eq!(text(ws).await, "tick 1");
        }
        // The quiet one idles out, told so by a Close frame 1001 (going away); the ticking ones
        // outlive the timeout (twice over).
        assert_eq!(
            close_frame_within(&mut quiet, Duration::from_secs(10)).await,
            "1001 idle timeout"
        );
        assert!(
            start.elapsed() >= Duration::from_millis(1500),
            "closed before its idle timeout: {:?}",
            start.elapsed()
        );
        while start.elapsed() < Duration::from_millis(3100) {
            for ws in [&mut a, &mut b] {
                assert!(
                    text(ws).await.starts_with("tick "),
                    "a busy tunnel was closed"
                );
            }
        }

        // Another process revokes alice's session: her tunnel ends, bob's goes on.
        let cli = std::thread::spawn({
            let config = t.config_path();
            move || {
                let out = std::process::Command::new(support::bin())
                    .args(["session", "revoke", "--config"])
                    .arg(config)
                    .args(["--sid", &alice_sid])
                    .output()
                    .unwrap();
                assert!(out.status.success());
            }
        });
        let start = Instant::now();
        assert_eq!(
            close_frame_within(&mut a, Duration::from_secs(10)).await,
            "1008 session revoked",
            "the client is told why (1008, policy violation)"
        );
        let cut = start.elapsed();
        cli.join().unwrap();
        eprintln!("revocation to cut: {cut:?} (the CLI run included)");
        let mut fresh = 0;
        while fresh < 3 {
            assert!(
                text(&mut b).await.starts_with("tick "),
                "bob's tunnel ended"
            );
            fresh += 1;
        }
    });
    assert!(
        eventually(|| up.stats.websockets_open.load(Ordering::SeqCst) == 0),
        "the cut tunnels stayed open upstream"
    );
    let m = metrics(metrics_port);
    assert_eq!(sample(&m, "tessera_session_streams_ended_total"), 1, "{m}");
    let log = t.log();
    assert!(log.contains("end=idle timeout"), "{log}");
    assert!(log.contains("end=session revoked"), "{log}");
    assert!(log.contains("close_code=1008"), "{log}");
    // The upstream was told too: 1001, going away, with the same reason.
    let closes = up.stats.websocket_closes.lock().unwrap().clone();
    assert_eq!(
        {
            let mut c = closes.clone();
            c.sort();
            c
        },
        ["1001 idle timeout", "1001 session revoked"],
        "{closes:?}"
    );
}

/// A cut writes a Close frame only between frames: a client in the middle of a frame (here the
/// upstream sent 10 of a frame's 100 payload bytes) gets a plain TCP close, nothing spliced
/// into the frame; one between frames gets `0x88`, 1008 and the reason.
#[test]
fn a_cut_sends_a_close_frame_only_between_frames() {
    use std::io::Read;
    fn script(line: &str) -> Script {
        let frame: &[u8] = match line {
            // A whole text frame.
            "GET /whole HTTP/1.1" => b"\x81\x05hello",
            // A binary frame of 100 payload bytes (16-bit length), only 10 of them sent.
            "GET /part HTTP/1.1" => b"\x82\x7e\x00\x640123456789",
            _ => {
                return Script {
                    bytes: b"HTTP/1.1 500 Unexpected\r\nContent-Length: 0\r\n\r\n".to_vec(),
                    close: false,
                    early: false,
                }
            }
        };
        Script {
            bytes: [SCRIPTED_101, frame].concat(),
            close: false,
            early: false,
        }
    }
    let up = upstream::start(Behavior::Scripted(script));
    let (t, _) = tessera(&up.url(), "");
    let (sid, token) = t.create_session("alice", "alice-pw");
    let open = |path: &str, first: &[u8]| {
        let mut sock = raw_handshake(&t, path, &token, b"");
        let seen = read_until(&mut sock, |seen| seen.ends_with(first));
        assert!(seen.starts_with(b"HTTP/1.1 101 "));
        sock
    };
    let mut whole = open("/whole", b"\x81\x05hello");
    let mut part = open("/part", b"0123456789");
    t.revoke(&sid);
    let rest = |sock: &mut std::net::TcpStream| {
        let mut rest = Vec::new();
        sock.read_to_end(&mut rest).expect("a close, not a timeout");
        rest
    };
    assert_eq!(rest(&mut whole), b"\x88\x11\x03\xf0session revoked");
    assert_eq!(
        rest(&mut part),
        b"",
        "bytes were written into the middle of a frame"
    );
}

/// A graceful shutdown (SIGTERM) tells every open WebSocket that the server is going away
/// (Close 1001 to the client and to the upstream) and waits for the tunnels to end, well inside
/// its 10 s drain.
#[test]
fn a_shutdown_closes_websockets_with_going_away_and_waits_for_them() {
    let up = ws_upstream();
    let (mut t, _) = tessera(&up.url(), "");
    let (_, token) = t.create_session("alice", "alice-pw");
    let rt = rt();
    let mut ws = rt.block_on(async {
        let mut ws = open(&t, "/ws", &[("authorization", &bearer(&token))])
            .await
            .unwrap();
        assert_eq!(text(&mut ws).await, "hello alice");
        ws
    });
    let start = Instant::now();
    let pid = t.pid().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    rt.block_on(async {
        assert_eq!(
            close_frame_within(&mut ws, Duration::from_secs(10)).await,
            "1001 server shutting down"
        );
        // The client reads on, which sends its Close answer (as a browser does), to the end.
        ended_within(&mut ws, Duration::from_secs(10)).await;
    });
    // The process ends by itself once its tunnel did (`stop` would SIGKILL after 5 s).
    // A zombie (not yet reaped by this test) has exited too.
    let exited = eventually(|| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| s.contains(") Z "))
    });
    let took = start.elapsed();
    assert!(exited, "tessera still running {took:?} after SIGTERM");
    eprintln!("SIGTERM to exit with an open WebSocket: {took:?}");
    t.stop();
    let log = t.log();
    assert!(log.contains("end=shutdown"), "{log}");
    assert!(log.contains("close_code=1001"), "{log}");
    assert!(
        eventually(|| !up.stats.websocket_closes.lock().unwrap().is_empty()),
        "the upstream got no Close frame"
    );
    assert_eq!(
        up.stats.websocket_closes.lock().unwrap()[0],
        "1001 server shutting down"
    );
}

/// A client that stops reading its WebSocket while the upstream keeps sending (here the echo of
/// its own binary messages) is cut once tessera's writes to it have waited
/// `server.send_timeout_ms` (300 ms), not left to the idle timeout (60 s): the client's
/// connection is reset, the upstream's closed, and the log says why. Before the send timeout
/// such a client held its tunnel, and its upstream connection, for as long as it liked.
#[test]
fn a_websocket_client_that_stops_reading_is_cut_after_the_send_timeout() {
    use std::io::{ErrorKind, Write};
    let up = ws_upstream();
    let (t, _) = tessera_with(
        &up.url(),
        "idle_timeout_ms = 60000",
        "send_timeout_ms = 300",
    );
    let (_, alice) = t.create_session("alice", "alice-pw");
    // A 64 KiB receive buffer (no autotuning): the echoes back up at once. (The sockets between
    // tessera and the upstream still take about 20 MB before the client's writes block.)
    let rt = rt();
    let sock = rt.block_on(async {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.set_recv_buffer_size(64 << 10).unwrap();
        s.connect(support::addr(t.port)).await.unwrap()
    });
    let sock = sock.into_std().unwrap();
    sock.set_nonblocking(false).unwrap();
    let mut sock = handshake_on(sock, "/ws", &alice, b"");
    let head = read_until(&mut sock, |b| b.windows(4).any(|w| w == b"\r\n\r\n"));
    assert!(head.starts_with(b"HTTP/1.1 101"), "{head:?}");
    let open = || up.stats.websockets_open.load(Ordering::SeqCst);
    assert!(eventually(|| open() == 1));
    // Binary messages of 60,000 bytes (16-bit length), masked with a zero key (RFC 6455 section
    // 5.3: the payload goes as is), written until a write fails; never a byte read.
    let mut frame = vec![0x82, 0x80 | 126, 0xEA, 0x60, 0, 0, 0, 0];
    frame.resize(frame.len() + 60_000, b'x');
    sock.set_write_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let start = Instant::now();
    let mut sent = 0u64;
    let failed = loop {
        match sock.write_all(&frame) {
            Ok(()) => sent += frame.len() as u64,
            Err(e) => break e,
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "still taking bytes after {sent} bytes in {:?}",
            start.elapsed()
        );
    };
    let took = start.elapsed();
    eprintln!("cut after {took:?}, {sent} bytes written, then: {failed}");
    assert!(
        matches!(
            failed.kind(),
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe
        ),
        "the write ended with {failed} after {took:?} and {sent} bytes, not a reset"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(
        eventually(|| open() == 0),
        "the upstream's side stayed open"
    );
    let log = t.log_when(|l| l.contains("WebSocket closed"));
    assert!(log.contains("end=failed: timed out"), "{log}");
}

/// An upstream that switches to WebSocket and then reads nothing, while its client sends until
/// its writes block and then leaves: the tunnel ends after `server.send_timeout_ms` of no
/// progress towards the upstream, not at the idle timeout (off here).
#[test]
fn a_websocket_upstream_that_stops_reading_ends_its_tunnel_after_the_send_timeout() {
    use std::io::{Read, Write};
    let deaf = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = deaf.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (mut conn, _) = deaf.accept().unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
            head.push(byte[0]);
        }
        conn.write_all(SCRIPTED_101).unwrap();
        // Held open and never read from again.
        std::thread::sleep(Duration::from_secs(120));
    });
    let up = format!("http://127.0.0.1:{port}");
    let (t, _) = tessera_with(&up, "idle_timeout_ms = 0", "send_timeout_ms = 300");
    let (_, alice) = t.create_session("alice", "alice-pw");
    let mut sock = raw_handshake(&t, "/deaf", &alice, b"");
    let head = read_until(&mut sock, |b| b.windows(4).any(|w| w == b"\r\n\r\n"));
    assert!(head.starts_with(b"HTTP/1.1 101"), "{head:?}");
    sock.set_write_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let chunk = vec![b'x'; 1 << 20];
    while sock.write_all(&chunk).is_ok() {}
    drop(sock);
    let log = t.log_when(|l| l.contains("WebSocket closed"));
    assert!(log.contains("end=failed: timed out"), "{log}");
    let lasted: u64 = log
        .split("duration_ms=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("no duration: {log}"));
    assert!(
        lasted >= 300,
        "ended after {lasted} ms, before the send timeout"
    );
}
