//! `tessera demo`: the whole job on the embedded default, with nothing else installed.
//!
//! Starts a small built-in upstream that only accepts `Authorization: Basic demo:demo-password`
//! (and answers with what it saw), a throw-away embedded store and fresh keys, creates a session,
//! and prints a `curl` line whose answer shows the upstream receiving the injected credential.

use std::net::SocketAddr;
use std::sync::Arc;

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

/// Runs the demo: proxy on `listen`, upstream on a free port, store in `store_dir`.
/// Prints the curl line to stdout, then serves until `shutdown` resolves.
///
/// Errors: binding or store failures, as text.
pub async fn run(
    listen: SocketAddr,
    store_dir: &std::path::Path,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), String> {
    let up = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("bind demo upstream: {e}"))?;
    let up_addr = up.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(serve_demo_upstream(up));

    let mut jwt = [0u8; 64];
    let mut key = [0u8; 32];
    getrandom::getrandom(&mut jwt).map_err(|e| e.to_string())?;
    getrandom::getrandom(&mut key).map_err(|e| e.to_string())?;
    let b64 = |b: &[u8]| base64::Engine::encode(&base64::engine::general_purpose::STANDARD, b);
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| format!("bind {listen}: {e} (try --listen 127.0.0.1:0)"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let toml = format!(
        "[server]\nlisten = \"{addr}\"\n[upstream]\nurl = \"http://{up_addr}\"\n[token]\nsecret = \"{}\"\n\
         [session]\nstore = \"embedded:{}\"\n[credentials]\nkeys = {{ demo = \"{}\" }}\n\
         [login]\nverify_path = \"/\"\ncookie_secure = false\n[log]\nlevel = \"warn\"\n",
        b64(&jwt),
        store_dir.display(),
        b64(&key)
    );
    let cfg = Config::from_toml(&toml).map_err(|e| e.to_string())?;
    let created = crate::admin::create_session(&cfg, DEMO_USER.into(), DEMO_PASSWORD.into(), 3600)
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "tessera demo: proxy on http://{addr}, built-in Basic-auth upstream on http://{up_addr}"
    );
    println!(
        "session {} for user `{DEMO_USER}` (expires at {}). Try:",
        created.sid, created.expires_at
    );
    println!(
        "curl -s -H 'Authorization: Bearer {}' http://{addr}/hello",
        created.token
    );
    println!("(without the header tessera answers 401; Ctrl-C stops the demo)");
    println!("or open http://{addr}/ in a browser and sign in as {DEMO_USER} / {DEMO_PASSWORD}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let proxy = crate::Proxy::from_config(&cfg).map_err(|e| e.to_string())?;
    let proxy = Arc::new(proxy.with_client_side(crate::downstream::client_side));
    crate::downstream::serve(
        listener,
        crate::downstream::Edge::Plain,
        proxy,
        &cfg.server,
        shutdown,
    )
    .await;
    Ok(())
}
