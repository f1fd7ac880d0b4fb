//! HTTP/3 upload tool for `bench/http3.sh` (field report 4: 1,000 uploads of 10 KiB over one
//! QUIC connection), quinn + h3 as tessera itself uses them, on one thread.
//!
//! ```text
//! h3_bench raw-server PORT CERT KEY
//!     A bare quinn server on 127.0.0.1:PORT (UDP) reading every unidirectional stream to its end:
//!     the floor, QUIC alone.
//! h3_bench raw PORT CA STREAMS BYTES
//!     One connection to raw-server, STREAMS unidirectional streams of BYTES each, sent one after
//!     another, then all in flight. Prints {"sequential_ms", "in_flight_ms"}.
//! h3_bench h3 PORT CA STREAMS BYTES PATH TOKEN
//!     One HTTP/3 connection to tessera, STREAMS POSTs of BYTES to PATH with the bearer TOKEN,
//!     one after another, then all in flight (each answer read). Prints the same JSON.
//! h3_bench rtt ADDR CA N PATH TOKEN
//!     N GETs one after another on a new HTTP/3 connection to ADDR (IP:PORT, SNI localhost), timed
//!     from the connect; then again on a connection resuming the first one's session with 0-RTT.
//!     Prints {"fresh_ms", "zero_rtt_ms", "zero_rtt_accepted"}.
//! ```
//! Exit status 1 on a failed connection or a non-2xx answer.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Buf, Bytes};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let result = rt.block_on(async {
        match args.first().map(String::as_str) {
            Some("raw-server") => raw_server(&args[1..]).await,
            Some("raw") => run(&args[1..], false).await,
            Some("h3") => run(&args[1..], true).await,
            Some("rtt") => rtt(&args[1..]).await,
            _ => Err("usage: see the module documentation of examples/h3_bench.rs".into()),
        }
    });
    if let Err(e) = result {
        eprintln!("h3_bench: {e}");
        std::process::exit(1);
    }
}

type Res<T> = Result<T, String>;

fn port_addr(port: &str) -> Res<SocketAddr> {
    format!("127.0.0.1:{port}")
        .parse()
        .map_err(|e| format!("{e}"))
}

/// Large enough windows and stream limits for 1,000 streams at once.
fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(2000u32.into())
        .max_concurrent_uni_streams(2000u32.into());
    Arc::new(t)
}

async fn raw_server(args: &[String]) -> Res<()> {
    let [port, cert, key] = args else {
        return Err("raw-server PORT CERT KEY".into());
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| e.to_string())?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| e.to_string())?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| e.to_string())?;
    // QUIC needs an application protocol (RFC 9001 section 8.1).
    tls.alpn_protocols = vec![b"hq-bench".to_vec()];
    let crypto =
        quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(transport());
    let endpoint = quinn::Endpoint::server(cfg, port_addr(port)?).map_err(|e| e.to_string())?;
    while let Some(incoming) = endpoint.accept().await {
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok(mut stream) = conn.accept_uni().await {
                tokio::spawn(async move {
                    let _ = stream.read_to_end(usize::MAX).await;
                });
            }
        });
    }
    Ok(())
}

fn client(ca: &Path, alpn: &[u8]) -> Res<quinn::Endpoint> {
    let mut cfg = client_config(ca, alpn)?;
    cfg.transport_config(transport());
    // Any address: the rtt mode reaches the server across network namespaces.
    let mut endpoint =
        quinn::Endpoint::client("0.0.0.0:0".parse().unwrap()).map_err(|e| e.to_string())?;
    endpoint.set_default_client_config(cfg);
    Ok(endpoint)
}

/// TLS 1.3 trusting `ca`, ALPN `alpn`, early data on (0-RTT when a session is resumed).
fn client_config(ca: &Path, alpn: &[u8]) -> Res<quinn::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).map_err(|e| e.to_string())? {
        roots
            .add(c.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![alpn.to_vec()];
    tls.enable_early_data = true;
    let crypto =
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
    Ok(quinn::ClientConfig::new(Arc::new(crypto)))
}

async fn run(args: &[String], h3: bool) -> Res<()> {
    let (port, ca, streams, bytes) = match args {
        [p, ca, n, b, ..] => (p, ca, n, b),
        _ => return Err("PORT CA STREAMS BYTES [PATH TOKEN]".into()),
    };
    let streams: usize = streams.parse().map_err(|_| "STREAMS: a number")?;
    let body = Bytes::from(vec![b'u'; bytes.parse().map_err(|_| "BYTES: a number")?]);
    let alpn: &[u8] = if h3 { b"h3" } else { b"hq-bench" };
    let endpoint = client(Path::new(ca), alpn)?;
    let conn = endpoint
        .connect(port_addr(port)?, "localhost")
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    let (sequential, in_flight) = if h3 {
        let (path, token) = match args {
            [_, _, _, _, path, token] => (path.clone(), token.clone()),
            _ => return Err("h3 needs PATH TOKEN".into()),
        };
        let upload = Upload { path, token, body };
        h3_uploads(conn, streams, upload).await?
    } else {
        raw_uploads(conn, streams, body).await?
    };
    println!("{{\"sequential_ms\": {sequential:.1}, \"in_flight_ms\": {in_flight:.1}}}");
    Ok(())
}

/// Runs `one` `n` times one after another, then `n` times all at once; the two times in ms.
async fn timed<F, Fut>(n: usize, one: F) -> Res<(f64, f64)>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Res<()>> + std::marker::Send + 'static,
{
    let start = Instant::now();
    for _ in 0..n {
        one().await?;
    }
    let sequential = start.elapsed().as_secs_f64() * 1e3;
    let start = Instant::now();
    let all: Vec<_> = (0..n).map(|_| tokio::spawn(one())).collect();
    for t in all {
        t.await.map_err(|e| e.to_string())??;
    }
    Ok((sequential, start.elapsed().as_secs_f64() * 1e3))
}

async fn raw_uploads(conn: quinn::Connection, n: usize, body: Bytes) -> Res<(f64, f64)> {
    timed(n, || {
        let (conn, body) = (conn.clone(), body.clone());
        async move {
            let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
            s.write_all(&body).await.map_err(|e| e.to_string())?;
            s.finish().map_err(|e| e.to_string())?;
            s.stopped().await.map_err(|e| e.to_string())?;
            Ok(())
        }
    })
    .await
}

#[derive(Clone)]
struct Upload {
    path: String,
    token: String,
    body: Bytes,
}

type Send = h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>;

/// One request with the bearer `token` (a POST of `body` when there is one, else a GET); its
/// answer read to the end. Errors: a failed stream, or an answer other than 2xx.
async fn exchange(send: &mut Send, path: &str, token: &str, body: Option<Bytes>) -> Res<()> {
    let req = match &body {
        Some(b) => http::Request::post(format!("https://localhost{path}"))
            .header("content-length", b.len()),
        None => http::Request::get(format!("https://localhost{path}")),
    };
    let req = req
        .header("authorization", format!("Bearer {token}"))
        .body(())
        .map_err(|e| e.to_string())?;
    let mut stream = send.send_request(req).await.map_err(|e| e.to_string())?;
    if let Some(b) = body {
        stream.send_data(b).await.map_err(|e| e.to_string())?;
    }
    stream.finish().await.map_err(|e| e.to_string())?;
    let resp = stream.recv_response().await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("answer {}", resp.status()));
    }
    while let Some(mut chunk) = stream.recv_data().await.map_err(|e| e.to_string())? {
        chunk.advance(chunk.remaining());
    }
    Ok(())
}

async fn h3_uploads(conn: quinn::Connection, n: usize, u: Upload) -> Res<(f64, f64)> {
    let send = session(conn).await?;
    timed(n, || {
        let (mut send, u) = (send.clone(), u.clone());
        async move { exchange(&mut send, &u.path, &u.token, Some(u.body)).await }
    })
    .await
}

/// The HTTP/3 session on `conn`, its driver in a task.
async fn session(conn: quinn::Connection) -> Res<Send> {
    let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(conn))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move { std::future::poll_fn(|cx| driver.poll_close(cx)).await });
    Ok(send)
}

async fn rtt(args: &[String]) -> Res<()> {
    let [addr, ca, n, path, token] = args else {
        return Err("rtt ADDR CA N PATH TOKEN".into());
    };
    let addr: SocketAddr = addr.parse().map_err(|e| format!("{e}"))?;
    let n: usize = n.parse().map_err(|_| "N: a number")?;
    let endpoint = client(Path::new(ca), b"h3")?;
    let start = Instant::now();
    let conn = endpoint
        .connect(addr, "localhost")
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    let mut send = session(conn.clone()).await?;
    for _ in 0..n {
        exchange(&mut send, path, token, None).await?;
    }
    let fresh = start.elapsed().as_secs_f64() * 1e3;
    conn.close(0u32.into(), b"done");
    let start = Instant::now();
    let connecting = endpoint
        .connect(addr, "localhost")
        .map_err(|e| e.to_string())?;
    let (conn, accepted) = connecting
        .into_0rtt()
        .map_err(|_| "no session to resume with 0-RTT".to_string())?;
    let mut send = session(conn).await?;
    for _ in 0..n {
        exchange(&mut send, path, token, None).await?;
    }
    let zero_rtt = start.elapsed().as_secs_f64() * 1e3;
    let accepted = accepted.await;
    println!(
        "{{\"fresh_ms\": {fresh:.1}, \"zero_rtt_ms\": {zero_rtt:.1}, \"zero_rtt_accepted\": {accepted}}}"
    );
    Ok(())
}
