//! WebSocket load tool for `bench/websocket.sh`: an echo server and a round-trip load client,
//! both tokio-tungstenite (real handshakes and frames), each on one thread.
//!
//! ```text
//! ws_bench echo PORT
//!     Serves WebSocket on 127.0.0.1:PORT: every text or binary message is sent back unchanged.
//!     Accepts any path and any request fields (tessera's injected Authorization included).
//! ws_bench load URL CONNS SECONDS BYTES [WARMUP_SECONDS] [HEADER: VALUE]...
//!     Opens CONNS WebSockets to URL (ws://), each sending a binary message of BYTES and waiting
//!     for its echo, again and again, for WARMUP_SECONDS (default 1, not recorded) then SECONDS.
//!     Prints one JSON line: {"conns", "bytes", "seconds", "round_trips", "per_sec",
//!     "p50_us", "p99_us", "max_us", "errors"}: round trips completed in the recorded window,
//!     their rate, and round-trip time percentiles in microseconds.
//! ```
//! Exit status 1 when a connection cannot be opened or an echo differs from what was sent.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let code = match args.first().map(String::as_str) {
        Some("echo") if args.len() == 2 => rt.block_on(echo(&args[1])),
        Some("load") if args.len() >= 5 => rt.block_on(load(&args[1..])),
        _ => {
            eprintln!(
                "usage: ws_bench echo PORT | ws_bench load URL CONNS SECONDS BYTES [WARMUP_SECONDS] [HEADER: VALUE]..."
            );
            2
        }
    };
    std::process::exit(code);
}

async fn echo(port: &str) -> i32 {
    let listener = match TcpListener::bind(format!("127.0.0.1:{port}")).await {
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

async fn load(args: &[String]) -> i32 {
    let parse = |i: usize, what: &str| -> u64 {
        args[i]
            .parse()
            .unwrap_or_else(|_| panic!("{what} must be a whole number, got {}", args[i]))
    };
    let url = &args[0];
    let conns = parse(1, "CONNS");
    let seconds = parse(2, "SECONDS");
    let bytes = parse(3, "BYTES") as usize;
    let (warmup, headers) = match args.get(4) {
        Some(w) if !w.contains(':') => (parse(4, "WARMUP_SECONDS"), &args[5..]),
        _ => (1, &args[4..]),
    };
    let mut sockets = Vec::new();
    for _ in 0..conns {
        let mut req = url.as_str().into_client_request().expect("a ws:// URL");
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
