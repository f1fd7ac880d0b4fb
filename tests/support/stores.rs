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
    on_store_with(up, store, &[])
}

/// [`on_store`] with more `(section, line)` config lines.
pub fn on_store_with(up: &TestUpstream, store: &str, extra: &[(&str, &str)]) -> Tessera {
    let (store, up_url) = (store.to_string(), up.url());
    let mut lines = vec![
        ("login", "cookie_secure = false"),
        ("login", "verify_path = \"/check\""),
    ];
    lines.extend_from_slice(extra);
    Tessera::start(move |port, _| config(port, &up_url, &store, &lines))
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

/// Two instances A and B on `store`, alice and bob logged in on A and each session served
/// (so cached) on both: (A, B, alice's token, bob's token).
pub fn two_warm(up: &TestUpstream, store: &str) -> (Tessera, Tessera, String, String) {
    let (a, b) = (on_store(up, store), on_store(up, store));
    let alice = login(&a, "alice", "alice-pw");
    let bob = login(&a, "bob", "bob-pw");
    for t in [&a, &b] {
        assert_eq!(status(t, &alice), 200);
        assert_eq!(status(t, &bob), 200);
    }
    (a, b, alice, bob)
}

/// The store key of `token`'s session (`tessera:session:` and its `sid` claim).
pub fn session_key(token: &str) -> String {
    use base64::Engine;
    let payload = token.split('.').nth(1).expect("a JWT");
    let claims: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .expect("base64url"),
    )
    .expect("JSON claims");
    format!("tessera:session:{}", claims["sid"].as_str().expect("sid"))
}

/// Two instances on `url`, a store account that may only read and write tessera's tables
/// (made by an earlier instance): a login on one, use and logout on the other, the token then
/// refused by the first.
pub fn a_restricted_account_serves(up: &TestUpstream, url: &str) {
    let (a, b) = (on_store(up, url), on_store(up, url));
    let token = login(&a, "bob", "bob-pw");
    assert_eq!(status(&b, &token), 200);
    assert_eq!(logout(&b, &token), 204);
    assert!(until_status(&a, &token, 401, Duration::from_secs(10)).is_some());
}

/// Through a failover: polls `t` with `live` until it answers 200 and `moved` says the new
/// primary serves (at most 20 s), asserting on the way that `live` gets only 200 or 503 and
/// `revoked` never 200. Returns whether `live` was served after the move, and the time spent in
/// 503 answers.
pub fn through_failover(
    t: &Tessera,
    live: &str,
    revoked: &str,
    moved: impl Fn() -> bool,
) -> (bool, Duration) {
    let start = Instant::now();
    let mut unavailable = Duration::ZERO;
    while start.elapsed() < Duration::from_secs(20) {
        let asked = Instant::now();
        match status(t, live) {
            200 if moved() => return (true, unavailable),
            200 => {}
            503 => unavailable += asked.elapsed(),
            other => panic!(
                "a live session got {other} during the failover: {}",
                t.log()
            ),
        }
        assert_ne!(status(t, revoked), 200, "a revoked session came back");
    }
    (false, unavailable)
}
