//! WebSocket load tool for `bench/websocket.sh`: an echo server and a round-trip load client,
//! both tokio-tungstenite (real handshakes and frames), each on one thread.
//!
//! ```text
//! ws_bench echo PORT
//!     Serves WebSocket on 127.0.0.1:PORT: every text or binary message is sent back unchanged.
//!     Accepts any path and any request fields (tessera's injected Authorization included).
//! ws_bench load URL CONNS SECONDS BYTES [WARMUP_SECONDS [HEADER: VALUE]...]
//!     Opens CONNS WebSockets to URL (ws://), each sending a binary message of BYTES and waiting
//!     for its echo, again and again, for WARMUP_SECONDS (default 1, not recorded) then SECONDS.
//!     Prints one JSON line: {"conns", "bytes", "seconds", "round_trips", "per_sec",
//!     "p50_us", "p99_us", "max_us", "errors"}: round trips completed in the recorded window,
//!     their rate, and round-trip time percentiles in microseconds.
//! ```
//! Exit status 1 when a connection cannot be opened or an echo differs from what was sent.

use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use futures_util::{SinkExt, StreamExt};
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Echo server on 127.0.0.1:PORT.
    Echo { port: u16 },
    /// Round-trip load against URL.
    Load {
        url: String,
        /// WebSockets open at once.
        conns: u64,
        /// Seconds recorded.
        seconds: u64,
        /// Bytes per message.
        bytes: usize,
        /// Seconds before the recorded ones (not recorded).
        #[arg(default_value_t = 1)]
        warmup: u64,
        /// Handshake fields, "NAME: VALUE".
        headers: Vec<String>,
    },
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let code = match Cli::parse().cmd {
        Cmd::Echo { port } => rt.block_on(echo(port)),
        Cmd::Load {
            url,
            conns,
            seconds,
            bytes,
            warmup,
            headers,
        } => rt.block_on(load(&url, conns, seconds, bytes, warmup, &headers)),
    };
    std::process::exit(code);
}

async fn echo(port: u16) -> i32 {
    let listener = match TcpListener::bind(("127.0.0.1", port)).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("ws_bench echo: cannot listen on 127.0.0.1:{port}: {e}");
            return 1;
        }
    };
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                return;
            };
            while let Some(Ok(msg)) = ws.next().await {
                if (msg.is_binary() || msg.is_text()) && ws.send(msg).await.is_err() {
                    return;
                }
            }
        });
    }
}

async fn load(
    url: &str,
    conns: u64,
    seconds: u64,
    bytes: usize,
    warmup: u64,
    headers: &[String],
) -> i32 {
    let mut sockets = Vec::new();
    for _ in 0..conns {
        let mut req = url.into_client_request().expect("a ws:// URL");
        for h in headers {
            let (name, value) = h.split_once(':').expect("HEADER: VALUE");
            req.headers_mut().insert(
                http::HeaderName::from_bytes(name.trim().as_bytes()).expect("a header name"),
                value.trim().parse().expect("a header value"),
            );
        }
        match tokio_tungstenite::connect_async(req).await {
            Ok((ws, _)) => sockets.push(ws),
            Err(e) => {
                eprintln!("ws_bench load: cannot open {url}: {e}");
                return 1;
            }
        }
    }
    let start = Instant::now() + Duration::from_secs(warmup);
    let end = start + Duration::from_secs(seconds);
    let payload: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    let tasks: Vec<_> = sockets
        .into_iter()
        .map(|mut ws| {
            let payload = payload.clone();
            tokio::spawn(async move {
                let mut rtts: Vec<u32> = Vec::new();
                let mut errors = 0u64;
                loop {
                    let sent = Instant::now();
                    if sent >= end {
                        break;
                    }
                    if ws.send(Message::binary(payload.clone())).await.is_err() {
                        errors += 1;
                        break;
                    }
                    match ws.next().await {
                        Some(Ok(Message::Binary(b))) if b[..] == payload[..] => {}
                        _ => {
                            errors += 1;
                            break;
                        }
                    }
                    if sent >= start {
                        rtts.push(sent.elapsed().as_micros().min(u32::MAX as u128) as u32);
                    }
                }
                let _ = ws.close(None).await;
                (rtts, errors)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (rtts, e) = t.await.expect("a load task");
        all.extend(rtts);
        errors += e;
    }
    all.sort_unstable();
    let pct = |p: f64| -> u32 {
        if all.is_empty() {
            return 0;
        }
        all[((all.len() as f64 * p).ceil() as usize).clamp(1, all.len()) - 1]
    };
    println!(
        "{{\"conns\":{conns},\"bytes\":{bytes},\"seconds\":{seconds},\"round_trips\":{},\"per_sec\":{:.1},\"p50_us\":{},\"p99_us\":{},\"max_us\":{},\"errors\":{errors}}}",
        all.len(),
        all.len() as f64 / seconds as f64,
        pct(0.50),
        pct(0.99),
        all.last().copied().unwrap_or(0),
    );
    i32::from(errors > 0)
}
