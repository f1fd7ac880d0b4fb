//! `tessera demo`: the whole job on the embedded default, with nothing else installed.
//!
//! Starts a small built-in upstream that only accepts `Authorization: Basic demo:demo-password`
//! (and answers with what it saw), a throw-away embedded store and fresh keys, creates a session,
//! and prints a `curl` line whose answer shows the upstream receiving the injected credential.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use crate::Config;

/// The demo upstream's user and password.
pub const DEMO_USER: &str = "demo";
/// The demo upstream's password.
pub const DEMO_PASSWORD: &str = "demo-password";

async fn demo_upstream(
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let expected = format!(
        "Basic {}",
        base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            format!("{DEMO_USER}:{DEMO_PASSWORD}")
        )
    );
    let seen = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let html = req
        .headers()
        .get(http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/html"));
    if seen == expected && html {
        let page = format!(
            "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>tessera demo</title></head>\
             <body><main><h1>Hello, {DEMO_USER}</h1><p id=\"seen\">The upstream received <code>{seen}</code> for <code>{}</code>.</p>\
             <form method=\"post\" action=\"/auth/logout\"><input type=\"hidden\" name=\"rd\" value=\"/auth/login\">\
             <button type=\"submit\">Log out</button></form></main></body></html>\n",
            req.uri().path()
        );
        let mut resp = Response::new(Full::new(Bytes::from(page)));
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/html; charset=utf-8"),
        );
        return Ok(resp);
    }
    let (status, body) = if seen == expected {
        (StatusCode::OK, format!("{{\"upstream\":\"tessera demo\",\"user\":\"{DEMO_USER}\",\"authorization_seen\":\"{seen}\",\"path\":\"{}\"}}\n", req.uri().path()))
    } else {
        (
            StatusCode::UNAUTHORIZED,
            "{\"upstream\":\"tessera demo\",\"error\":\"Basic credentials missing or wrong\"}\n"
                .to_string(),
        )
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

/// Serves the demo upstream on `listener` forever (used by `tessera demo` and tests).
pub async fn serve_demo_upstream(listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service_fn(demo_upstream))
                .await;
        });
    }
}

/// Runs the demo: proxy on `listen` (and with `tls`, TLS and HTTP/3 there too, on a certificate
/// made for `localhost` now), upstream on a free port, store and certificate in `store_dir`.
/// Prints the curl line to stdout, then serves until `shutdown` resolves.
///
/// Errors: binding or store failures, as text.
pub async fn run(
    listen: SocketAddr,
    tls: Option<SocketAddr>,
    store_dir: &std::path::Path,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), String> {
    let up = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("bind demo upstream: {e}"))?;
    let up_addr = up.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(serve_demo_upstream(up));
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| format!("bind {listen}: {e} (try --listen 127.0.0.1:0)"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let mut listeners = crate::Listeners {
        plain: Some(listener),
        ..Default::default()
    };
    let tls_lines = match tls {
        None => String::new(),
        Some(at) => {
            let (tcp, udp) = bind_tls(at).await?;
            let at = tcp.local_addr().map_err(|e| e.to_string())?;
            listeners.tls = Some(tcp);
            listeners.quic = Some(udp);
            tls_table(at, store_dir)?
        }
    };
    let toml = demo_toml(addr, up_addr, store_dir, &tls_lines)?;
    let cfg = Config::from_toml(&toml).map_err(|e| e.to_string())?;
    let created = crate::admin::create_session(&cfg, DEMO_USER.into(), DEMO_PASSWORD.into(), 3600)
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "tessera demo: proxy on http://{addr}, built-in Basic-auth upstream on http://{up_addr}"
    );
    println!(
        "store and demo keys in {} (removed when the demo ends)",
        store_dir.display()
    );
    println!(
        "session {} for user `{DEMO_USER}` (expires at {}). Try:",
        created.sid, created.expires_at
    );
    println!(
        "curl -s -H 'Authorization: Bearer {}' http://{addr}/hello",
        created.token
    );
    if let Some(t) = &cfg.tls {
        println!(
            "curl -s --cacert {} -H 'Authorization: Bearer {}' https://localhost:{}/hello",
            store_dir.join("demo-cert.pem").display(),
            created.token,
            t.listen.port()
        );
        println!("(HTTP/3 on the same port over UDP, advertised in Alt-Svc)");
    }
    println!("(without the header tessera answers 401; Ctrl-C stops the demo)");
    println!("or open http://{addr}/ in a browser and sign in as {DEMO_USER} / {DEMO_PASSWORD}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let (_never, reloads) = tokio::sync::mpsc::channel(1);
    crate::run(cfg, listeners, reloads, shutdown)
        .await
        .map_err(|e| e.to_string())
}

/// The demo's configuration: fresh keys, the embedded store in `store_dir`, `[login]` checked
/// at the upstream's `/`, and `tls` (the `[tls]` and `[http3]` tables, or nothing).
fn demo_toml(
    addr: SocketAddr,
    up_addr: SocketAddr,
    store_dir: &std::path::Path,
    tls: &str,
) -> Result<String, String> {
    let mut jwt = [0u8; 64];
    let mut key = [0u8; 32];
    getrandom::getrandom(&mut jwt).map_err(|e| e.to_string())?;
    getrandom::getrandom(&mut key).map_err(|e| e.to_string())?;
    let b64 = |b: &[u8]| base64::Engine::encode(&base64::engine::general_purpose::STANDARD, b);
    Ok(format!(
        "[server]\nlisten = \"{addr}\"\n[upstream]\nurl = \"http://{up_addr}\"\n[token]\nsecret = \"{}\"\n\
         [session]\nstore = \"embedded:{}\"\n[credentials]\nkeys = {{ demo = \"{}\" }}\n\
         [login]\nverify_path = \"/\"\ncookie_secure = false\n[log]\nlevel = \"warn\"\n{tls}",
        b64(&jwt),
        store_dir.display(),
        b64(&key)
    ))
}

/// TCP and UDP sockets on `at` (the same port: a free one when `at`'s is 0).
async fn bind_tls(at: SocketAddr) -> Result<(TcpListener, std::net::UdpSocket), String> {
    let tcp = TcpListener::bind(at)
        .await
        .map_err(|e| format!("bind {at}: {e} (try --tls-listen 127.0.0.1:0)"))?;
    let at = tcp.local_addr().map_err(|e| e.to_string())?;
    let udp = crate::downstream::bind_udp(at).map_err(|e| format!("bind {at} (UDP): {e}"))?;
    Ok((tcp, udp))
}

/// A self-signed certificate for `localhost` and 127.0.0.1 written to `dir`, and the `[tls]`
/// and `[http3]` tables serving it at `at`.
fn tls_table(at: SocketAddr, dir: &std::path::Path) -> Result<String, String> {
    let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    let made = rcgen::generate_simple_self_signed(names).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let (cert, key) = (dir.join("demo-cert.pem"), dir.join("demo-key.pem"));
    std::fs::write(&cert, made.cert.pem()).map_err(|e| e.to_string())?;
    std::fs::write(&key, made.signing_key.serialize_pem()).map_err(|e| e.to_string())?;
    Ok(format!(
        "[tls]\nlisten = \"{at}\"\ncertificate = \"file:{}\"\nprivate_key = \"file:{}\"\n[http3]\n",
        cert.display(),
        key.display()
    ))
}
