//! The login page in a real browser: Debian's headless Chromium driven by playwright-core
//! (`tests/browser/login.mjs`), against the tessera binary in front of the built-in demo
//! upstream (`Basic demo:demo-password`, an HTML page with a logout button).

mod support;

use std::process::Command;

use support::{config, Tessera};

#[test]
fn login_page_in_headless_chromium() {
    let root = env!("CARGO_MANIFEST_DIR");
    assert!(
        std::path::Path::new("/usr/bin/chromium").exists(),
        "chromium is not installed: run ./scripts/test.sh, which installs it"
    );
    assert!(
        std::path::Path::new(&format!(
            "{root}/tests/browser/node_modules/playwright-core"
        ))
        .exists(),
        "playwright-core is not installed: run ./scripts/test.sh (npm ci in tests/browser)"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let up = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(tessera::demo::serve_demo_upstream(listener));

    // Production cookie defaults (__Host-tessera, Secure): Chromium treats 127.0.0.1 as a
    // secure context, so this runs over plain loopback HTTP unchanged.
    let t = Tessera::start(move |port, dir| {
        config(
            port,
            &up,
            &format!("embedded:{}/s", dir.display()),
            &[
                ("login", "page_title = \"Sign in\""),
                ("login", "verify_path = \"/\""),
            ],
        )
    });
    let shot = t.dir.path().join("login-page.png");
    let args = [t.url(""), shot.display().to_string()];
    assert_eq!(page_findings(&t, "login.mjs", &args), 13);
    // The screenshot is a real PNG of the page; keep it for the docs when asked to.
    let png = std::fs::read(&shot).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    if std::env::var_os("TESSERA_UPDATE_SCREENSHOT").is_some() {
        std::fs::write(format!("{root}/docs/login-page.png"), &png).unwrap();
    }
    assert!(!t.log().contains("demo-password"), "password in the log");
}

/// A page's WebSocket in Chromium: authenticated by the token cookie, same origin, frames both
/// ways through tessera, and closed when the session is revoked (`websocket.mjs`).
#[test]
fn a_pages_websocket_in_headless_chromium_ends_with_its_session() {
    let up = support::upstream::start(support::upstream::Behavior::WebSocket);
    up.stats.set_password("alice", "alice-pw");
    let url = up.url();
    let t = Tessera::start(move |port, dir| {
        config(port, &url, &format!("embedded:{}/s", dir.display()), &[])
    });
    let (sid, token) = t.create_session("alice", "alice-pw");
    websocket_page(&t, &t.url(""), &token, &sid);
    let head = up.stats.last_upgrade.lock().unwrap().clone();
    assert!(
        head.iter()
            .any(|l| *l == format!("origin: http://127.0.0.1:{}", t.port)),
        "the browser's Origin: {head:?}"
    );
    assert!(
        head.iter()
            .any(|l| *l == format!("authorization: {}", support::basic("alice", "alice-pw"))),
        "{head:?}"
    );
    assert!(
        !head.iter().any(|l| l.contains(&token)),
        "the token cookie reached the upstream: {head:?}"
    );
}

/// The same page over TLS: Chromium loads it over HTTP/2 and, as tessera's SETTINGS allow
/// extended CONNECT, opens its `wss://` WebSocket on a stream of that connection (RFC 8441),
/// which tessera passes to the upstream as an HTTP/1.1 upgrade; frames, the cookie and the
/// revocation's Close frame behave as over HTTP/1.1.
#[test]
fn a_pages_wss_websocket_in_headless_chromium_rides_its_http2_connection() {
    let up = support::upstream::start(support::upstream::Behavior::WebSocket);
    up.stats.set_password("alice", "alice-pw");
    let pki = support::tls::Pki::new();
    let tls_port = support::free_port();
    let (cert, key) = pki.leaf("localhost", &["localhost"]);
    let table = support::tls::tls_table(tls_port, &cert, &key, "");
    let url = up.url();
    let t = Tessera::start(move |port, dir| {
        let store = format!("embedded:{}/s", dir.display());
        config(port, &url, &store, &[("tables", &table)])
    });
    support::wait_for_port(tls_port, "tessera tls");
    let (sid, token) = t.create_session("alice", "alice-pw");
    websocket_page(&t, &format!("https://localhost:{tls_port}"), &token, &sid);
    let head = up.stats.last_upgrade.lock().unwrap().clone();
    assert!(
        head.iter()
            .any(|l| *l == format!("origin: https://localhost:{tls_port}")),
        "the browser's Origin: {head:?}"
    );
    let log = t.log();
    let closed = log.lines().find(|l| l.contains("WebSocket closed"));
    assert!(
        closed.is_some_and(|l| l.contains("over=\"HTTP/2\"")),
        "not on the page's HTTP/2 connection: {log}"
    );
}

/// Runs `websocket.mjs` against `base` with `token` as the cookie, revokes `sid` once the page
/// says its WebSocket is ticking, and checks the page's findings: all seven ok.
fn websocket_page(t: &Tessera, base: &str, token: &str, sid: &str) {
    use std::io::BufRead;
    let root = env!("CARGO_MANIFEST_DIR");
    assert!(
        std::path::Path::new("/usr/bin/chromium").exists(),
        "chromium is not installed: run ./scripts/test.sh, which installs it"
    );
    let mut node = Command::new("node")
        .arg(format!("{root}/tests/browser/websocket.mjs"))
        .arg(base)
        .arg(token)
        .current_dir(format!("{root}/tests/browser"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("node");
    let mut lines = std::io::BufReader::new(node.stdout.take().unwrap()).lines();
    let mut out = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let ticking = line == "ticking";
        out.push(line);
        if ticking {
            t.revoke(sid);
            break;
        }
    }
    out.extend(lines.map(Result::unwrap));
    let status = node.wait().unwrap();
    let last = out.last().cloned().unwrap_or_default();
    assert!(
        status.success(),
        "browser flow failed:\n{}\ntessera log:\n{}",
        out.join("\n"),
        t.log()
    );
    let findings: serde_json::Value = serde_json::from_str(&last).unwrap();
    eprintln!("{findings}");
    let checks = findings.as_object().unwrap();
    assert_eq!(
        checks.values().filter(|v| *v == "ok").count(),
        7,
        "{findings}"
    );
}

/// A page of another origin (`http://localhost:N`, nginx) calls the API at tessera
/// (`http://127.0.0.1:M`) with a token in Chromium (`cors.mjs`): its preflighted PUT is answered
/// and readable, an exposed field and a 401 too; the same call from an origin not allowed is
/// refused by the browser.
#[test]
fn a_page_of_another_origin_calls_the_api_in_headless_chromium() {
    let nginx = support::Nginx::start_with(
        r#"location = /app { default_type text/html; return 200 "<html><body>app</body></html>"; }
    location = /api { add_header ETag '"v1"'; return 200 "api"; }"#,
    );
    let page_port = nginx.port;
    let up = nginx.url();
    let t = Tessera::start(move |port, dir| {
        let cors = format!(
            "[cors]\nallow_origins = [\"http://localhost:{page_port}\"]\nexpose_headers = [\"ETag\"]"
        );
        config(
            port,
            &up,
            &format!("embedded:{}/s", dir.display()),
            &[("tables", &cors)],
        )
    });
    let (_, token) = t.create_session("alice", "pw");
    let args = [
        t.url(""),
        format!("http://localhost:{page_port}/app"),
        format!("http://127.0.0.1:{page_port}/app"),
        token,
    ];
    assert_eq!(page_findings(&t, "cors.mjs", &args), 4);
    // The browser asked first, and tessera answered it alone.
    let log = t.log();
    assert!(
        log.contains("method=OPTIONS path=/api status=204")
            && log.contains("method=OPTIONS path=/api status=403"),
        "{log}"
    );
    assert_eq!(
        nginx.uris().iter().filter(|u| *u == "/api").count(),
        1,
        "only the allowed PUT reaches the upstream: {:?}",
        nginx.uris()
    );
}

/// Runs `tests/browser/SCRIPT` with `args` (it drives Chromium and prints its findings as one
/// JSON line last); fails with its output and `t`'s log unless it succeeds with every finding
/// `ok`. Returns how many there are.
fn page_findings(t: &Tessera, script: &str, args: &[String]) -> usize {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("node")
        .arg(format!("{root}/tests/browser/{script}"))
        .args(args)
        .current_dir(format!("{root}/tests/browser"))
        .output()
        .expect("node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "browser flow failed:\n{stdout}\n{}\ntessera log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        t.log()
    );
    let findings: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let checks = findings.as_object().unwrap();
    assert!(checks.values().all(|v| v == "ok"), "{findings}");
    checks.len()
}
