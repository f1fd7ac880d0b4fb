//! In-process upstreams for fault injection, on a background runtime shared by a test binary.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn rt() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    })
}

/// What an upstream saw.
#[derive(Default)]
pub struct Stats {
    pub connections: AtomicUsize,
    pub current: AtomicUsize,
    pub max_concurrent: AtomicUsize,
    pub requests: AtomicUsize,
    pub body_bytes: AtomicU64,
    pub last_authorization: Mutex<String>,
    pub raw_bytes: Mutex<Vec<u8>>,
    /// `Users` behaviour: user -> password; tests change it to simulate a password change.
    pub users: Mutex<std::collections::HashMap<String, String>>,
    /// hyper behaviours: connection number -> the distinct `Authorization` values it carried.
    pub auth_by_connection:
        Mutex<std::collections::HashMap<usize, std::collections::BTreeSet<String>>>,
    /// hyper behaviours: request paths in the order the requests arrived.
    pub paths: Mutex<Vec<String>>,
    /// hyper behaviours: `(path, X-Request-Id)` of each request that carried one, in order.
    pub request_ids: Mutex<Vec<(String, String)>>,
    /// hyper behaviours: `(path, X-Forwarded-For)` of each request that carried one, in order.
    pub forwarded_for: Mutex<Vec<(String, String)>>,
    /// `Users` behaviour: `/events` streams being sent now (one ends when its reader is gone).
    pub streams_open: AtomicUsize,
    /// `WebSocket` behaviour: WebSocket connections open now (one ends when its peer closes or
    /// its socket fails).
    pub websockets_open: AtomicUsize,
    /// `WebSocket` behaviour: the request head of the last upgrade request, one `name: value`
    /// line per field (names lowercase), the request line first.
    pub last_upgrade: Mutex<Vec<String>>,
    /// `WebSocket` behaviour: the Close frames received, as `code reason`, in arrival order.
    pub websocket_closes: Mutex<Vec<String>>,
}

impl Stats {
    pub fn set_password(&self, user: &str, password: &str) {
        self.users
            .lock()
            .unwrap()
            .insert(user.to_string(), password.to_string());
    }
}

pub struct TestUpstream {
    pub port: u16,
    pub stats: Arc<Stats>,
}

impl TestUpstream {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

#[derive(Clone, Copy)]
pub enum Behavior {
    /// hyper server: reads the body to the end, answers `{"auth":..,"bytes":N}` after `delay`.
    Echo { delay: Duration },
    /// hyper server: answers 200 with `n` bytes streamed in 64 KiB chunks.
    Download { n: u64 },
    /// raw: answers the first request on each connection with a keep-alive 200, then closes the
    /// connection without answering when the second request arrives (the keep-alive race).
    DropSecondRequest,
    /// hyper server: a Basic-auth service; 200 `{"user":..}` when the credentials match
    /// `Stats::users`, else 401 with a `Basic` challenge (like Cyrus). With the right
    /// credentials `/events` is a server-sent event stream that never ends by itself: an event
    /// `data: <user> <n>` every 100 ms (a JMAP push stream's shape); `/download` is 64 MiB with
    /// a `Content-Length`, sent as fast as it is read.
    Users,
    /// raw: answers with Cyrus-like `Connection: Upgrade`, `Upgrade: h2c`, `Alt-Svc`, `Keep-Alive`.
    HopHeaders,
    /// raw: answers each request with the bytes the function gives for its request line, e.g.
    /// `GET /x HTTP/1.1` (see [`Script`]). A `Content-Length` request body is read (and
    /// dropped) before the answer, after it when the script says `early`; with
    /// `Expect: 100-continue`, or a target ending in `?continue` (tessera forwards no `Expect`),
    /// a `100 Continue` goes first, as nginx does.
    Scripted(fn(&str) -> Script),
    /// hyper server with upgrades: the `Users` credential check (401 with a `Basic` challenge),
    /// then a WebSocket endpoint (tokio-tungstenite over hyper's upgraded connection) on every
    /// path but `/deny` (403, no upgrade) and `/page` (an HTML page, for browsers). On a
    /// WebSocket it first sends `hello <user>`, then answers a text message `tick` with
    /// `tick <n>` every 100 ms from then on, any other text `t` with `<user>: t`, and a binary
    /// message with the same bytes.
    WebSocket,
}

/// A scripted answer.
pub struct Script {
    pub bytes: Vec<u8>,
    /// Close the connection after the answer.
    pub close: bool,
    /// Answer before reading the request body, then read it anyway (a server that drains) or,
    /// with `close`, close at once with the body unread (the kernel then resets the connection,
    /// as with a hyper server whose service never reads the body).
    pub early: bool,
}

pub fn start(behavior: Behavior) -> TestUpstream {
    let stats = Arc::new(Stats::default());
    let listener = rt().block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
    let port = listener.local_addr().unwrap().port();
    let s = stats.clone();
    rt().spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let conn = s.connections.fetch_add(1, Ordering::SeqCst);
            let now = s.current.fetch_add(1, Ordering::SeqCst) + 1;
            s.max_concurrent.fetch_max(now, Ordering::SeqCst);
            let s = s.clone();
            tokio::spawn(async move {
                match behavior {
                    Behavior::DropSecondRequest | Behavior::HopHeaders | Behavior::Scripted(_) => {
                        raw(stream, behavior, &s).await
                    }
                    _ => {
                        let s2 = s.clone();
                        let svc = service_fn(move |req| handle(req, behavior, s2.clone(), conn));
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), svc)
                            .with_upgrades()
                            .await;
                    }
                }
                s.current.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    TestUpstream { port, stats }
}

type Out = http_body_util::combinators::BoxBody<Bytes, Infallible>;

async fn handle(
    req: Request<Incoming>,
    behavior: Behavior,
    s: Arc<Stats>,
    conn: usize,
) -> Result<Response<Out>, Infallible> {
    s.requests.fetch_add(1, Ordering::SeqCst);
    if let Behavior::WebSocket = behavior {
        return Ok(websocket(req, s));
    }
    let path = req.uri().path().to_string();
    s.paths.lock().unwrap().push(path.clone());
    if let Some(id) = req.headers().get("x-request-id") {
        let id = String::from_utf8_lossy(id.as_bytes()).into_owned();
        s.request_ids.lock().unwrap().push((path.clone(), id));
    }
    if let Some(v) = req.headers().get("x-forwarded-for") {
        let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
        s.forwarded_for.lock().unwrap().push((path.clone(), v));
    }
    let auth = req
        .headers()
        .get("authorization")
        .map(|v| v.to_str().unwrap_or("").to_string())
        .unwrap_or_default();
    *s.last_authorization.lock().unwrap() = auth.clone();
    s.auth_by_connection
        .lock()
        .unwrap()
        .entry(conn)
        .or_default()
        .insert(auth.clone());
    let mut body = req.into_body();
    let mut n = 0u64;
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(d) = frame.data_ref() {
            n += d.len() as u64;
        }
    }
    s.body_bytes.fetch_add(n, Ordering::SeqCst);
    match behavior {
        Behavior::Echo { delay } => {
            tokio::time::sleep(delay).await;
            let b = format!("{{\"auth\":\"{auth}\",\"bytes\":{n}}}");
            Ok(Response::new(Full::new(Bytes::from(b)).boxed()))
        }
        Behavior::Users => {
            use base64::Engine;
            let pair = auth
                .strip_prefix("Basic ")
                .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
                .and_then(|b| String::from_utf8(b).ok())
                .unwrap_or_default();
            let ok = pair
                .split_once(':')
                .is_some_and(|(u, p)| s.users.lock().unwrap().get(u).is_some_and(|want| want == p));
            if ok && path == "/download" {
                // 64 MiB in 64 KiB chunks, as fast as the reader takes them
                let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
                let mut resp = Response::new(StreamBody::new(futures_stream(chunk, 1024)).boxed());
                resp.headers_mut()
                    .insert("content-length", (64u64 << 20).to_string().parse().unwrap());
                Ok(resp)
            } else if ok && path == "/app-401" {
                // A path refusing even a good user with 401 (its own rule, not the login's).
                let mut r = Response::new(Full::new(Bytes::from_static(b"not here")).boxed());
                *r.status_mut() = hyper::StatusCode::UNAUTHORIZED;
                r.headers_mut()
                    .insert("www-authenticate", "Basic realm=\"up\"".parse().unwrap());
                Ok(r)
            } else if ok && path == "/events" {
                let user = pair.split_once(':').unwrap().0.to_string();
                let mut resp = Response::new(StreamBody::new(events(user, s.clone())).boxed());
                resp.headers_mut()
                    .insert("content-type", "text/event-stream".parse().unwrap());
                Ok(resp)
            } else if ok {
                let user = pair.split_once(':').unwrap().0.to_string();
                Ok(Response::new(
                    Full::new(Bytes::from(format!("{{\"user\":\"{user}\"}}"))).boxed(),
                ))
            } else {
                let mut r = Response::new(Full::new(Bytes::from_static(b"no")).boxed());
                *r.status_mut() = hyper::StatusCode::UNAUTHORIZED;
                r.headers_mut()
                    .insert("www-authenticate", "Basic realm=\"up\"".parse().unwrap());
                Ok(r)
            }
        }
        Behavior::Download { n } => {
            let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
            let count = n / chunk.len() as u64;
            let stream = futures_stream(chunk, count);
            let mut resp = Response::new(StreamBody::new(stream).boxed());
            resp.headers_mut().insert(
                "content-length",
                (count * 64 * 1024).to_string().parse().unwrap(),
            );
            Ok(resp)
        }
        _ => unreachable!(),
    }
}

/// The user whose `Basic` credentials in `auth` match `Stats::users`.
fn basic_user(auth: &str, s: &Stats) -> Option<String> {
    use base64::Engine;
    let pair = auth
        .strip_prefix("Basic ")
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .and_then(|b| String::from_utf8(b).ok())?;
    let (user, password) = pair.split_once(':')?;
    let users = s.users.lock().unwrap();
    (users.get(user)? == password).then(|| user.to_string())
}

fn answer(status: u16, body: &'static str) -> Response<Out> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())).boxed());
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
    r
}

/// The `WebSocket` behaviour (see [`Behavior::WebSocket`]).
fn websocket(mut req: Request<Incoming>, s: Arc<Stats>) -> Response<Out> {
    use tokio_tungstenite::tungstenite::{handshake::derive_accept_key, protocol::Role, Message};
    let auth = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    *s.last_authorization.lock().unwrap() = auth.clone();
    let Some(user) = basic_user(&auth, &s) else {
        let mut r = answer(401, "no");
        r.headers_mut()
            .insert("www-authenticate", "Basic realm=\"up\"".parse().unwrap());
        return r;
    };
    match req.uri().path() {
        "/deny" => return answer(403, "denied"),
        "/page" => {
            let mut r = answer(200, "<!doctype html><title>ws</title><h1>ws page</h1>");
            r.headers_mut()
                .insert("content-type", "text/html".parse().unwrap());
            return r;
        }
        _ => {}
    }
    let key = req.headers().get("sec-websocket-key").cloned();
    let asked = req
        .headers()
        .get("upgrade")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"websocket"));
    let (true, Some(key)) = (asked, key) else {
        return answer(426, "a WebSocket endpoint");
    };
    let mut head = vec![format!("{} {}", req.method(), req.uri())];
    head.extend(
        req.headers()
            .iter()
            .map(|(n, v)| format!("{}: {}", n.as_str(), String::from_utf8_lossy(v.as_bytes()))),
    );
    *s.last_upgrade.lock().unwrap() = head;
    let on = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let Ok(upgraded) = on.await else { return };
        let mut ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
            TokioIo::new(upgraded),
            Role::Server,
            None,
        )
        .await;
        s.websockets_open.fetch_add(1, Ordering::SeqCst);
        use futures_util::{SinkExt, StreamExt};
        let mut ticking: Option<tokio::time::Interval> = None;
        let mut n = 0u64;
        let mut ok = ws
            .send(Message::text(format!("hello {user}")))
            .await
            .is_ok();
        while ok {
            let tick = async {
                match ticking.as_mut() {
                    Some(t) => t.tick().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tick => {
                    n += 1;
                    ok = ws.send(Message::text(format!("tick {n}"))).await.is_ok();
                }
                msg = ws.next() => match msg {
                    Some(Ok(Message::Text(t))) if t.as_str() == "tick" => {
                        ticking = Some(tokio::time::interval(Duration::from_millis(100)));
                    }
                    Some(Ok(Message::Text(t))) => {
                        ok = ws.send(Message::text(format!("{user}: {}", t.as_str()))).await.is_ok();
                    }
                    Some(Ok(Message::Binary(b))) => ok = ws.send(Message::Binary(b)).await.is_ok(),
                    Some(Ok(Message::Close(frame))) => {
                        let said = frame.map_or("-".into(), |f| format!("{} {}", u16::from(f.code), f.reason));
                        s.websocket_closes.lock().unwrap().push(said);
                    }
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => ok = false,
                }
            }
        }
        s.websockets_open.fetch_sub(1, Ordering::SeqCst);
    });
    let mut r = answer(101, "");
    let h = r.headers_mut();
    h.insert("connection", "Upgrade".parse().unwrap());
    h.insert("upgrade", "websocket".parse().unwrap());
    h.insert(
        "sec-websocket-accept",
        derive_accept_key(key.as_bytes()).parse().unwrap(),
    );
    h.insert("x-upstream", "ws".parse().unwrap());
    r
}

/// An endless event stream for `user`, counted in `Stats::streams_open` while it is read.
fn events(
    user: String,
    s: Arc<Stats>,
) -> impl futures_core::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        s.streams_open.fetch_add(1, Ordering::SeqCst);
        for n in 0u64.. {
            let event = Bytes::from(format!("data: {user} {n}\n\n"));
            if tx.send(Ok(Frame::data(event))).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        s.streams_open.fetch_sub(1, Ordering::SeqCst);
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

fn futures_stream(
    chunk: Bytes,
    count: u64,
) -> impl futures_core::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send {
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    tokio::spawn(async move {
        for _ in 0..count {
            if tx.send(Ok(Frame::data(chunk.clone()))).await.is_err() {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

async fn raw(mut stream: tokio::net::TcpStream, behavior: Behavior, s: &Stats) {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let mut served = 0;
    loop {
        let Ok(n) = stream.read(&mut tmp).await else {
            return;
        };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&tmp[..n]);
        s.raw_bytes.lock().unwrap().extend_from_slice(&tmp[..n]);
        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head: Vec<u8> = buf.drain(..end + 4).collect();
            s.requests.fetch_add(1, Ordering::SeqCst);
            served += 1;
            if let Behavior::Scripted(script) = behavior {
                let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
                let answer = script(String::from_utf8_lossy(&head).lines().next().unwrap_or(""));
                let body_len: usize = text
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                let first: &[u8] = if answer.early {
                    &answer.bytes
                } else if text.contains("\r\nexpect: 100-continue")
                    || text
                        .lines()
                        .next()
                        .is_some_and(|l| l.contains("?continue "))
                {
                    b"HTTP/1.1 100 Continue\r\n\r\n"
                } else {
                    b""
                };
                if stream.write_all(first).await.is_err() {
                    return;
                }
                if answer.early && answer.close {
                    return;
                }
                while buf.len() < body_len {
                    match stream.read(&mut tmp).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&tmp[..n]),
                    }
                }
                buf.drain(..body_len);
                s.body_bytes.fetch_add(body_len as u64, Ordering::SeqCst);
                if !answer.early && stream.write_all(&answer.bytes).await.is_err() {
                    return;
                }
                if answer.close {
                    return;
                }
                continue;
            }
            let resp: &[u8] = match behavior {
                Behavior::DropSecondRequest if served > 1 => return,
                Behavior::DropSecondRequest => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
                _ => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: Upgrade, Keep-Alive, X-Hop\r\nUpgrade: h2c\r\nKeep-Alive: timeout=5\r\nX-Hop: secret\r\nAlt-Svc: h3=\":443\"\r\nX-Kept: yes\r\n\r\nok",
            };
            if stream.write_all(resp).await.is_err() {
                return;
            }
        }
    }
}

/// A TCP relay to `target_port` that records every byte sent towards the target (to prove what
/// a real upstream received). Returns (relay port, recorded bytes).
pub fn recording_relay(target_port: u16) -> (u16, Arc<Mutex<Vec<u8>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let listener = rt().block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
    let port = listener.local_addr().unwrap().port();
    let rec = seen.clone();
    rt().spawn(async move {
        loop {
            let Ok((mut down, _)) = listener.accept().await else {
                continue;
            };
            let rec = rec.clone();
            tokio::spawn(async move {
                let Ok(up) = tokio::net::TcpStream::connect(("127.0.0.1", target_port)).await
                else {
                    return;
                };
                let (mut up_r, mut up_w) = up.into_split();
                let (mut down_r, mut down_w) = down.split();
                let to_up = async {
                    let mut buf = [0u8; 16 * 1024];
                    loop {
                        let n = match down_r.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        rec.lock().unwrap().extend_from_slice(&buf[..n]);
                        if up_w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = up_w.shutdown().await;
                };
                let to_down = async {
                    let _ = tokio::io::copy(&mut up_r, &mut down_w).await;
                    let _ = down_w.shutdown().await;
                };
                tokio::join!(to_up, to_down);
            });
        }
    });
    (port, seen)
}

/// A hyper server answering every request with `body` as JSON (a JWKS endpoint). Returns its
/// port and the number of requests it has answered so far.
pub fn serve_static(body: String) -> (u16, Arc<AtomicUsize>) {
    let listener = rt().block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
    let port = listener.local_addr().unwrap().port();
    let body = Bytes::from(body);
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    rt().spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let (body, count) = (body.clone(), count.clone());
            tokio::spawn(async move {
                let svc = service_fn(move |_req: Request<Incoming>| {
                    let body = body.clone();
                    count.fetch_add(1, Ordering::SeqCst);
                    async move {
                        let mut r = Response::new(Full::new(body));
                        r.headers_mut()
                            .insert("content-type", "application/json".parse().unwrap());
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (port, served)
}
