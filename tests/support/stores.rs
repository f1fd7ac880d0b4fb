//! Helpers shared by the tests of the shared stores (PostgreSQL, MySQL, Sentinel): an upstream
//! with two users, tessera instances on one store URL, login, logout and polling a status.

use std::time::{Duration, Instant};

use super::upstream::{self, Behavior, TestUpstream};
use super::{bearer, config, curl, Tessera};

/// An upstream checking Basic credentials: alice / alice-pw, bob / bob-pw.
pub fn users() -> TestUpstream {
    let up = upstream::start(Behavior::Users);
    up.stats.set_password("alice", "alice-pw");
    up.stats.set_password("bob", "bob-pw");
    up
}

/// A tessera on the store at `store` in front of `up`, logging in at the upstream's `/check`
/// over plain http.
pub fn on_store(up: &TestUpstream, store: &str) -> Tessera {
    let (store, up_url) = (store.to_string(), up.url());
    Tessera::start(move |port, _| {
        config(
            port,
            &up_url,
            &store,
            &[
                ("login", "cookie_secure = false"),
                ("login", "verify_path = \"/check\""),
            ],
        )
    })
}

/// Logs `user` in on `t`; the token.
pub fn login(t: &Tessera, user: &str, password: &str) -> String {
    let body = serde_json::json!({"username": user, "password": password}).to_string();
    let (code, text) = curl(&[
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        &body,
        &t.url("/auth/login"),
    ]);
    assert_eq!(code, 200, "login failed: {text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["token"].as_str().unwrap().to_string()
}

/// `POST /auth/logout` on `t` with `token`; the status.
pub fn logout(t: &Tessera, token: &str) -> u16 {
    curl(&["-X", "POST", "-H", &bearer(token), &t.url("/auth/logout")]).0
}

/// The status of `GET /mail` on `t` with `token`.
pub fn status(t: &Tessera, token: &str) -> u16 {
    curl(&["-H", &bearer(token), &t.url("/mail")]).0
}

/// How long until `t` answers `want` for `token` (asked again and again), or `None` after
/// `limit`.
pub fn until_status(t: &Tessera, token: &str, want: u16, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if status(t, token) == want {
            return Some(start.elapsed());
        }
    }
    None
}

/// `bytea`/`BLOB` text of `s` as hex digits, to find a record by its JSON in SQL.
pub fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}
