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
    let out = Command::new("node")
        .arg(format!("{root}/tests/browser/login.mjs"))
        .arg(t.url(""))
        .arg(&shot)
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
    assert_eq!(findings.as_object().unwrap().len(), 12, "{findings}");
    assert!(findings.as_object().unwrap().values().all(|v| v == "ok"));
    // The screenshot is a real PNG of the page; keep it for the docs when asked to.
    let png = std::fs::read(&shot).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    if std::env::var_os("TESSERA_UPDATE_SCREENSHOT").is_some() {
        std::fs::write(format!("{root}/docs/login-page.png"), &png).unwrap();
    }
    assert!(!t.log().contains("demo-password"), "password in the log");
}
