//! An HTTP/3 client for tests (quinn + h3, the crates tessera serves with), resuming sessions
//! and sending 0-RTT when asked, and a UDP delay line that puts a client far from a server.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes};
use rustls::pki_types::CertificateDer;

pub type SendRequest = h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>;

/// A QUIC client endpoint trusting `ca`; its session cache lets a second connection resume
/// (and send 0-RTT) after a first one.
pub struct H3Client {
    endpoint: quinn::Endpoint,
}

/// An answer: status, the `early-data`-free headers as `name: value` lines, and the body.
pub struct Answer {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Vec<u8>,
    /// The trailer section after the body, if one came.
    pub trailers: Option<http::HeaderMap>,
}

impl H3Client {
    pub fn new(ca: &Path) -> Self {
        Self::with_window(ca, 1_250_000)
    }

    /// Like [`H3Client::new`], with a stream receive window of `window` bytes (quinn's default
    /// is 1.25 MB), which bounds what the client holds unread.
    pub fn with_window(ca: &Path, window: u32) -> Self {
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        endpoint.set_default_client_config(Self::client_config(ca, window));
        Self { endpoint }
    }

    /// Like [`H3Client::new`], keeping no NEW_TOKEN tokens: every connection comes from an
    /// address the server has not seen proven.
    pub fn without_tokens(ca: &Path) -> Self {
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let mut cfg = Self::config(ca);
        cfg.token_store(Arc::new(quinn::NoneTokenStore));
        endpoint.set_default_client_config(cfg);
        Self { endpoint }
    }

    fn client_config(ca: &Path, window: u32) -> quinn::ClientConfig {
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(ca).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"h3".to_vec()];
        tls.enable_early_data = true;
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
        let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
        let mut transport = quinn::TransportConfig::default();
        transport
            .max_concurrent_bidi_streams(1000u32.into())
            .stream_receive_window(window.into());
        cfg.transport_config(Arc::new(transport));
        cfg
    }

    /// The QUIC client configuration of [`H3Client::new`], trusting `ca`.
    fn config(ca: &Path) -> quinn::ClientConfig {
        Self::client_config(ca, 1_250_000)
    }

    /// A connection with a full handshake (or a resumed one without early data).
    pub async fn connect(&self, server: SocketAddr) -> SendRequest {
        let conn = self
            .endpoint
            .connect(server, "localhost")
            .unwrap()
            .await
            .unwrap();
        session(conn).await
    }

    /// [`H3Client::connect`], telling the server (SETTINGS_MAX_FIELD_SECTION_SIZE) to send no
    /// field section (head or trailers) larger than `max` bytes (RFC 9114 section 4.2.2).
    pub async fn connect_limited(&self, server: SocketAddr, max: u64) -> SendRequest {
        let conn = self.connect_quic(server).await;
        let (mut driver, send) = h3::client::builder()
            .max_field_section_size(max)
            .build(h3_quinn::Connection::new(conn))
            .await
            .unwrap();
        tokio::spawn(async move { std::future::poll_fn(|cx| driver.poll_close(cx)).await });
        send
    }

    /// A bare QUIC connection with ALPN `h3`, for tests that write HTTP/3 frames themselves
    /// ([`super::h3_raw`]).
    pub async fn connect_quic(&self, server: SocketAddr) -> quinn::Connection {
        self.try_connect_quic(server).await.unwrap()
    }

    /// [`H3Client::connect_quic`], its failure returned.
    pub async fn try_connect_quic(
        &self,
        server: SocketAddr,
    ) -> Result<quinn::Connection, quinn::ConnectionError> {
        self.endpoint.connect(server, "localhost").unwrap().await
    }

    /// A connection that sends at once, as 0-RTT; `None` when the client has no session to
    /// resume. The receiver turns true when the handshake completes, with whether the server
    /// accepted the early data.
    pub async fn connect_0rtt(
        &self,
        server: SocketAddr,
    ) -> Option<(SendRequest, tokio::sync::oneshot::Receiver<bool>)> {
        let connecting = self.endpoint.connect(server, "localhost").unwrap();
        let (conn, accepted) = connecting.into_0rtt().ok()?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let _ = tx.send(accepted.await);
        });
        Some((session(conn).await, rx))
    }
}

/// A handshake begun and then abandoned, as from a spoofed address: a client's first Initial
/// (made by quinn's protocol state machine, trusting `ca`) sent to `server` from a UDP socket
/// of its own, which nothing answers from then on. Returns the first byte of the server's first
/// datagram back masked to its form and type bits (RFC 9000 section 17.2: `0x80` Initial,
/// `0xb0` Retry; quinn greases the fixed bit between them, RFC 9287), and the socket (to keep
/// the address taken).
pub async fn abandoned_handshake(ca: &Path, server: SocketAddr) -> (u8, tokio::net::UdpSocket) {
    let mut endpoint = quinn_proto::Endpoint::new(Default::default(), None, false, None);
    let now = std::time::Instant::now();
    let (_, mut conn) = endpoint
        .connect(now, H3Client::config(ca), server, "localhost")
        .unwrap();
    let mut buf = Vec::new();
    let sent = conn.poll_transmit(now, 1, &mut buf).expect("an Initial");
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    socket.send_to(&buf[..sent.size], server).await.unwrap();
    let mut answer = [0u8; 1500];
    let got = tokio::time::timeout(Duration::from_secs(10), socket.recv(&mut answer));
    let n = got.await.expect("an answer to the Initial").unwrap();
    assert!(n > 0);
    (answer[0] & 0xb0, socket)
}

/// The HTTP/3 session on `conn`, its driver running in a task.
async fn session(conn: quinn::Connection) -> SendRequest {
    let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(conn))
        .await
        .unwrap();
    tokio::spawn(async move { std::future::poll_fn(|cx| driver.poll_close(cx)).await });
    send
}

/// One request on `send`: `method path` with `token` (none when empty) and `body` (sent in
/// 64 KiB DATA frames); waits for the whole answer.
pub async fn request(
    send: &mut SendRequest,
    method: &str,
    path: &str,
    token: &str,
    body: Bytes,
) -> Result<Answer, String> {
    let req = http::Request::builder()
        .method(method)
        .uri(format!("https://localhost{path}"));
    exchange(send, req, token, body).await
}

/// A POST with its `content-length` announced.
pub async fn request_sized(
    send: &mut SendRequest,
    path: &str,
    token: &str,
    body: Bytes,
) -> Result<Answer, String> {
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("https://localhost{path}"))
        .header("content-length", body.len());
    exchange(send, req, token, body).await
}

/// A request with more fields (`name: value`), e.g. a `content-length` that differs from the
/// body's length, or a field HTTP/3 forbids.
pub async fn request_with(
    send: &mut SendRequest,
    method: &str,
    path: &str,
    token: &str,
    fields: &[(&str, &str)],
    body: Bytes,
) -> Result<Answer, String> {
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("https://localhost{path}"));
    for (name, value) in fields {
        req = req.header(*name, *value);
    }
    exchange(send, req, token, body).await
}

async fn exchange(
    send: &mut SendRequest,
    mut req: http::request::Builder,
    token: &str,
    body: Bytes,
) -> Result<Answer, String> {
    if !token.is_empty() {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    let mut stream = send
        .send_request(req.body(()).unwrap())
        .await
        .map_err(|e| e.to_string())?;
    let mut rest = body;
    let mut sent = true;
    while !rest.is_empty() {
        let chunk = rest.split_to(rest.len().min(64 * 1024));
        // A server may answer before the body is all sent, and stop reading it
        // (RFC 9114 section 4.1.2): the answer is still read.
        if stream.send_data(chunk).await.is_err() {
            sent = false;
            break;
        }
    }
    if sent {
        stream.finish().await.map_err(|e| e.to_string())?;
    }
    let resp = stream.recv_response().await.map_err(|e| e.to_string())?;
    let mut got = Vec::new();
    while let Some(mut chunk) = stream.recv_data().await.map_err(|e| e.to_string())? {
        while chunk.has_remaining() {
            let part = chunk.chunk();
            got.extend_from_slice(part);
            let n = part.len();
            chunk.advance(n);
        }
    }
    let trailers = stream.recv_trailers().await.map_err(|e| e.to_string())?;
    Ok(Answer {
        status: resp.status().as_u16(),
        headers: resp.headers().clone(),
        body: got,
        trailers,
    })
}

/// A UDP delay line for one client: datagrams to the returned address go to `server` after
/// `delay`, and the server's answers back to the client after `delay` too (a round trip of
/// twice `delay`), in the order they came: quinn drops a 0-RTT packet that overtakes its
/// Initial, so a line that reorders would turn early data into a retransmission. Runs until
/// the runtime ends.
pub async fn delay_line(server: SocketAddr, delay: Duration) -> SocketAddr {
    cuttable_line(server, delay).await.0
}

/// [`delay_line`] with a switch: once it is set, every datagram the client sends from then on
/// is dropped (the server's still reach the client), as on a path that cuts a handshake short.
pub async fn cuttable_line(
    server: SocketAddr,
    delay: Duration,
) -> (SocketAddr, Arc<std::sync::atomic::AtomicBool>) {
    let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let front = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let back = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    back.connect(server).await.unwrap();
    let addr = front.local_addr().unwrap();
    let client: Arc<std::sync::Mutex<Option<SocketAddr>>> = Arc::default();
    let up = fifo({
        let back = back.clone();
        move |datagram| {
            let back = back.clone();
            async move {
                let _ = back.send(&datagram).await;
            }
        }
    });
    let down = fifo({
        let (front, client) = (front.clone(), client.clone());
        move |datagram| {
            let (front, to) = (front.clone(), *client.lock().unwrap());
            async move {
                if let Some(to) = to {
                    let _ = front.send_to(&datagram, to).await;
                }
            }
        }
    });
    let (c, cutting) = (client.clone(), cut.clone());
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, from)) = front.recv_from(&mut buf).await {
            *c.lock().unwrap() = Some(from);
            if !cutting.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = up.send((tokio::time::Instant::now() + delay, buf[..n].to_vec()));
            }
        }
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok(n) = back.recv(&mut buf).await {
            let _ = down.send((tokio::time::Instant::now() + delay, buf[..n].to_vec()));
        }
    });
    (addr, cut)
}

/// A UDP line for one client that passes only its first datagram to `server` (its Initial)
/// and every answer back: a handshake its client begins and then leaves hanging. The counter
/// is the server's datagrams seen (nonzero: the server has taken the Initial).
pub async fn first_datagram_line(
    server: SocketAddr,
) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::Ordering::SeqCst;
    let answers = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let front = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let back = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    back.connect(server).await.unwrap();
    let addr = front.local_addr().unwrap();
    let client: Arc<std::sync::Mutex<Option<SocketAddr>>> = Arc::default();
    let (f, b, c) = (front.clone(), back.clone(), client.clone());
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, from)) = f.recv_from(&mut buf).await {
            if c.lock().unwrap().replace(from).is_none() {
                let _ = b.send(&buf[..n]).await;
            }
        }
    });
    let seen = answers.clone();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok(n) = back.recv(&mut buf).await {
            seen.fetch_add(1, SeqCst);
            let to = *client.lock().unwrap();
            if let Some(to) = to {
                let _ = front.send_to(&buf[..n], to).await;
            }
        }
    });
    (addr, answers)
}

/// One direction of a delay line: datagrams queued with their due time, sent one after
/// another by a single task, so none overtakes another.
fn fifo<F, Fut>(send: F) -> tokio::sync::mpsc::UnboundedSender<(tokio::time::Instant, Vec<u8>)>
where
    F: Fn(Vec<u8>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    tokio::spawn(async move {
        while let Some((due, datagram)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            send(datagram).await;
        }
    });
    tx
}

/// One read of a response body at about 1 MB/s (after a chunk of N bytes, a pause of N µs):
/// `Ok(true)` with `got` counting its bytes, `Ok(false)` at the end, `Err` on a reset.
pub async fn paced_read(
    stream: &mut h3::client::RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>,
    got: &mut u64,
) -> Result<bool, String> {
    match stream.recv_data().await {
        Ok(Some(chunk)) => {
            let n = chunk.remaining() as u64;
            *got += n;
            tokio::time::sleep(Duration::from_micros(n)).await;
            Ok(true)
        }
        Ok(None) => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}
