//! The session side against real processes: two tessera instances sharing a real redis-server,
//! a Basic-auth upstream whose passwords the test controls, curl as the client.

mod support;

use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use support::events::EventStream;
use support::upstream::{self, Behavior, TestUpstream};
use support::{bearer, bin, config, curl, Redis, Tessera};

/// Second HMAC key for rotation tests (64 bytes).
const K2: &str = "k2-secret-0123456789-0123456789-0123456789-0123456789-0123456789ab";
const K_OLD: &str = "old-secret-0123456789-0123456789-0123456789-0123456789-0123456789a";

fn users() -> TestUpstream {
    let up = upstream::start(Behavior::Users);
    up.stats.set_password("alice", "alice-pw");
    up.stats.set_password("bob", "bob-pw");
    up
}

/// `[login]` for local http (cookie `tessera`, not Secure), checked at the upstream's `/check`.
const LOCAL_LOGIN: [(&str, &str); 2] = [
    ("login", "cookie_secure = false"),
    ("login", "verify_path = \"/check\""),
];

/// A tessera on Redis with [`LOCAL_LOGIN`].
fn on_redis(up: &TestUpstream, redis: &Redis, extra: &[(&str, &str)]) -> Tessera {
    let mut all: Vec<(&str, &str)> = LOCAL_LOGIN.to_vec();
    all.extend_from_slice(extra);
    let url = redis.url();
    let up_url = up.url();
    Tessera::start(move |port, _| config(port, &up_url, &url, &all))
}

struct Answer {
    code: u16,
    headers: String,
    body: String,
}

impl Answer {
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    fn header(&self, name: &str) -> Option<String> {
        self.headers.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }

    /// `Retry-After` in seconds (RFC 9110 section 10.2.3); panics when absent or not a number.
    fn retry_after(&self) -> u64 {
        let v = self.header("retry-after").expect("Retry-After");
        v.parse()
            .unwrap_or_else(|_| panic!("Retry-After is not seconds: {v}"))
    }
}

/// curl with headers captured separately.
fn call(args: &[&str]) -> Answer {
    let dir = tempfile::tempdir().unwrap();
    let hdr = dir.path().join("h");
    let mut all = vec!["-D", hdr.to_str().unwrap()];
    all.extend_from_slice(args);
    let (code, body) = curl(&all);
    Answer {
        code,
        headers: std::fs::read_to_string(&hdr).unwrap_or_default(),
        body,
    }
}

fn login(t: &Tessera, user: &str, password: &str) -> Answer {
    let body = serde_json::json!({"username": user, "password": password}).to_string();
    call(&[
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        &body,
        &t.url("/auth/login"),
    ])
}

/// A login while the session store is down says so (503, `Retry-After`), not that the upstream
/// failed: the JSON names the store, the page asks to wait without blaming the mail server.
#[test]
fn a_login_while_the_store_is_down_names_the_store() {
    let up = users();
    let mut redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    redis.stop();
    let a = login(&t, "alice", "alice-pw");
    assert_eq!(a.code, 503, "{}", a.body);
    assert_eq!(a.json()["error"], "session store unavailable", "{}", a.body);
    assert!(a.header("retry-after").is_some(), "{}", a.headers);
}

/// An upstream that echoes each request at once.
fn echo() -> TestUpstream {
    upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    })
}

fn token_of(a: &Answer) -> String {
    assert_eq!(a.code, 200, "login failed: {} {}", a.headers, a.body);
    a.json()["token"].as_str().unwrap().to_string()
}

fn session_keys(redis: &Redis) -> Vec<String> {
    redis
        .cli(&["--scan", "--pattern", "tessera:session:*"])
        .lines()
        .map(str::to_string)
        .filter(|l| !l.is_empty())
        .collect()
}

#[test]
fn login_on_a_use_on_b_logout_on_b_refused_on_a() {
    let up = users();
    let redis = Redis::start();
    let a = on_redis(&up, &redis, &[]);
    let b = on_redis(&up, &redis, &[]);

    let answer = login(&a, "alice", "alice-pw");
    let token = token_of(&answer);
    let v = answer.json();
    assert_eq!(v["sub"], "alice");
    assert!(v["expires_at"].as_u64().unwrap() > support_now());
    let cookie = answer.header("set-cookie").expect("token cookie set");
    assert!(cookie.starts_with(&format!("tessera={token};")), "{cookie}");
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(cookie.contains(attr), "{cookie}");
    }
    assert_eq!(session_keys(&redis).len(), 1);

    // the token works on B, as bearer and as the login cookie
    let (code, body) = curl(&["-H", &bearer(&token), &b.url("/mail")]);
    assert_eq!((code, body.as_str()), (200, "{\"user\":\"alice\"}"));
    let (code, _) = curl(&["-H", &format!("Cookie: tessera={token}"), &b.url("/mail")]);
    assert_eq!(code, 200);
    assert_eq!(
        up.stats.last_authorization.lock().unwrap().as_str(),
        support::basic("alice", "alice-pw")
    );

    let who = call(&["-H", &bearer(&token), &a.url("/auth/session")]);
    assert_eq!(who.code, 200, "{}", who.body);
    assert_eq!(who.json()["sub"], "alice");
    assert_eq!(who.json()["sid_hash"].as_str().unwrap().len(), 12);

    let out = call(&["-X", "POST", "-H", &bearer(&token), &b.url("/auth/logout")]);
    assert_eq!(out.code, 204, "{}", out.body);
    assert!(out.header("set-cookie").unwrap().contains("Max-Age=0"));
    assert!(
        session_keys(&redis).is_empty(),
        "logout deleted the session"
    );

    let (code, _) = curl(&["-H", &bearer(&token), &a.url("/mail")]);
    assert_eq!(code, 401, "A refuses the token after logout on B");
    let who = call(&["-H", &bearer(&token), &a.url("/auth/session")]);
    assert_eq!(who.code, 401);
    assert!(!a.log().contains("alice-pw") && !b.log().contains("alice-pw"));
    assert!(!a.log().contains(&token) && !b.log().contains(&token));
}

/// A Secure login cookie named without `__Host-` can be planted by a sibling subdomain (with
/// `Domain`, which only that prefix forbids): the start says so, naming the key.
#[test]
fn a_login_cookie_name_without_the_host_prefix_is_warned_of() {
    let up = users();
    let warning = "without the __Host- prefix can be planted";
    let start = |extra: &'static [(&'static str, &'static str)]| {
        let url = up.url();
        Tessera::start(move |port, dir| {
            config(port, &url, &format!("embedded:{}/s", dir.display()), extra)
        })
    };
    let named = start(&[
        ("login", "verify_path = \"/check\""),
        ("login", "cookie_name = \"__Secure-tessera\""),
    ]);
    let log = named.log_when(|l| l.contains(warning));
    assert!(log.contains("key=login.cookie_name"), "{log}");
    let default = start(&[("login", "verify_path = \"/check\"")]);
    let log = default.log_when(|l| l.contains("tessera serving"));
    assert!(!log.contains(warning), "{log}");
}

/// A cookie planted from a sibling subdomain or over plain http cannot carry the `__Host-`
/// prefix; read before the login cookie it would sign the browser into the planter's session.
#[test]
fn the_login_cookie_wins_over_cookies_anyone_could_plant() {
    use base64::Engine;
    let up = users();
    let redis = Redis::start();
    const SECURE: &[(&str, &str)] = &[("login", "verify_path = \"/check\"")];
    const LISTED: &[(&str, &str)] = &[
        ("login", "verify_path = \"/check\""),
        ("token", "sources = [\"cookie:tessera\", \"bearer\"]"),
    ];
    let url = redis.url();
    // Through a relay that records what the upstream is sent.
    let (relay, seen) = upstream::recording_relay(up.port);
    let up_url = format!("http://127.0.0.1:{relay}");
    let start = |extra: &'static [(&'static str, &'static str)]| {
        let (url, up_url) = (url.clone(), up_url.clone());
        Tessera::start(move |port, _| config(port, &up_url, &url, extra))
    };
    let (t, explicit) = (start(SECURE), start(LISTED));
    let alice = token_of(&login(&t, "alice", "alice-pw"));
    let bob = token_of(&login(&t, "bob", "bob-pw"));
    let bob_b64 = base64::engine::general_purpose::STANDARD.encode(&bob);
    let mail =
        |t: &Tessera, cookie: &str| curl(&["-H", &format!("Cookie: {cookie}"), &t.url("/mail")]);
    for planted in [format!("tessera={bob}"), format!("Authorization={bob_b64}")] {
        for t in [&t, &explicit] {
            let both = format!("{planted}; __Host-tessera={alice}");
            assert_eq!(
                mail(t, &both),
                (200, "{\"user\":\"alice\"}".into()),
                "{both}"
            );
        }
        // Without token.sources listed, a login deployment reads no other cookie.
        assert_eq!(mail(&t, &planted).0, 401, "{planted}");
    }
    assert_eq!(
        mail(&explicit, &format!("tessera={bob}")).0,
        200,
        "listed, so read"
    );
    // tessera's own cookies a browser holds (the login form's CSRF cookie, the device cookie)
    // are not the upstream's either; another cookie is.
    let own =
        format!("__Host-tessera-csrf=c; __Host-tessera-device=d; app=1; __Host-tessera={alice}");
    assert_eq!(mail(&t, &own).0, 200);
    // No token cookie reaches the upstream, read or not.
    let sent = String::from_utf8_lossy(&seen.lock().unwrap()).into_owned();
    for cookie in [
        "tessera=",
        "Authorization=",
        "__Host-tessera=",
        "-csrf=",
        "-device=",
    ] {
        assert!(!sent.contains(cookie), "{cookie} sent upstream");
    }
    assert!(
        sent.contains("GET /mail") && sent.contains("app=1"),
        "{sent}"
    );
}

/// `rediss://` with client certificates required (Redis's default): two instances share
/// sessions over TLS, warm requests read nothing, and a logout on one reaches the other through
/// tracking over TLS. Without the client certificate, or trusting another CA, the store is
/// unavailable: a valid token gets 503 (never 401, never forwarded).
#[test]
fn a_store_over_tls_needs_its_ca_and_client_certificate() {
    let up = users();
    let redis = Redis::start_tls();
    let a = on_redis(&up, &redis, &[]);
    let b = on_redis(&up, &redis, &[]);
    let token = token_of(&login(&a, "alice", "alice-pw"));
    assert_eq!(curl(&["-H", &bearer(&token), &b.url("/x")]).0, 200);
    let gets = redis_calls(&redis, "get");
    for _ in 0..10 {
        assert_eq!(curl(&["-H", &bearer(&token), &b.url("/x")]).0, 200);
    }
    assert_eq!(
        redis_calls(&redis, "get"),
        gets,
        "warm requests read nothing"
    );
    let out = call(&["-X", "POST", "-H", &bearer(&token), &a.url("/auth/logout")]);
    assert_eq!(out.code, 204, "{}", out.body);
    let refused = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(5));
        curl(&["-H", &bearer(&token), &b.url("/x")]).0 == 401
    });
    assert!(refused, "B serves a session revoked on A: {}", b.log());

    let live = token_of(&login(&a, "bob", "bob-pw"));
    let tls = redis.tls.as_ref().unwrap();
    let ca = tls.pki.ca();
    let other = support::tls::ServerTls::new();
    let no_client_certificate = format!(
        "rediss://127.0.0.1:{}/0?ssl_ca_certs={}",
        redis.port,
        ca.display()
    );
    let other_ca = format!(
        "rediss://127.0.0.1:{}/0?ssl_ca_certs={}&ssl_certfile={}&ssl_keyfile={}",
        redis.port,
        other.pki.ca().display(),
        tls.cert.display(),
        tls.key.display()
    );
    let forwarded = up.stats.requests.load(Ordering::SeqCst);
    for (url, why) in [
        (no_client_certificate, "CertificateRequired"),
        (other_ca, "invalid peer certificate"),
    ] {
        let up_url = up.url();
        let t = Tessera::start(move |port, _| config(port, &up_url, &url, &LOCAL_LOGIN));
        let (code, _) = curl(&["-H", &bearer(&live), &t.url("/x")]);
        assert_eq!(code, 503, "{}", t.log());
        assert!(t.log().contains(why), "{}", t.log());
    }
    assert_eq!(up.stats.requests.load(Ordering::SeqCst), forwarded);
}

fn support_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[test]
fn expired_session_is_refused() {
    let up = users();
    let redis = Redis::start();
    // 2 s, not 1: Redis expires `EX 1` anywhere within that second, and a loaded CI machine can
    // take that long between the login and the first request.
    let t = on_redis(&up, &redis, &[("session", "ttl_seconds = 2")]);
    let token = token_of(&login(&t, "alice", "alice-pw"));
    let (code, _) = curl(&["-H", &bearer(&token), &t.url("/x")]);
    assert_eq!(code, 200);
    std::thread::sleep(Duration::from_millis(3200));
    // the token itself is still inside its 5 s leeway: the session's expiry refuses it
    let (code, _) = curl(&["-H", &bearer(&token), &t.url("/x")]);
    assert_eq!(code, 401);
    let log = t.log_when(|l| l.contains("unknown session"));
    assert!(log.contains("unknown session"), "{log}");
}

#[test]
fn wrong_password_is_401_and_stores_nothing_and_upstream_down_is_502() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    let a = login(&t, "alice", "guess");
    assert_eq!(a.code, 401, "{}", a.body);
    assert!(a.header("set-cookie").is_none());
    assert!(a.header("www-authenticate").is_some());
    assert!(session_keys(&redis).is_empty());
    assert!(!t.log().contains("guess"), "password must never be logged");

    // bad shapes
    let bad = call(&[
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        "{\"username\":\"alice\"}",
        &t.url("/auth/login"),
    ]);
    assert_eq!(bad.code, 400);
    let bad = call(&[
        "-H",
        "Content-Type: text/plain",
        "--data-binary",
        "x",
        &t.url("/auth/login"),
    ]);
    assert_eq!(bad.code, 415);
    // The body cap, 8 KiB: a body of exactly that size is read whole (a wrong password: 401), one
    // byte more is refused before any upstream check (413), by its length: with
    // `Expect: 100-continue` no `100` comes first, so the client never sends it.
    let at_cap = format!("{:<8192}", r#"{"username":"alice","password":"guess"}"#);
    assert_eq!(at_cap.len(), 8192);
    for (body, want, asked) in [(at_cap.clone(), 401, 1), (format!("{at_cap} "), 413, 0)] {
        let before = up.stats.requests.load(Ordering::SeqCst);
        let a = call(&[
            "-H",
            "Content-Type: application/json",
            "-H",
            "Expect: 100-continue",
            "--data-binary",
            &body,
            &t.url("/auth/login"),
        ]);
        assert_eq!(a.code, want, "{} bytes: {}", body.len(), a.body);
        assert_eq!(
            a.headers.contains(" 100 "),
            want != 413,
            "a 100 Continue only for a body under the cap: {}",
            a.headers
        );
        let after = up.stats.requests.load(Ordering::SeqCst);
        assert_eq!(
            after - before,
            asked,
            "upstream checks for {} bytes",
            body.len()
        );
    }
    let bad = call(&["-X", "DELETE", &t.url("/auth/login")]);
    assert_eq!(bad.code, 405);

    // upstream down: 502, never a session
    let dead = support::free_port();
    let url = redis.url();
    let down = Tessera::start(move |port, _| {
        config(
            port,
            &format!("http://127.0.0.1:{dead}"),
            &url,
            &LOCAL_LOGIN,
        )
    });
    let a = login(&down, "alice", "alice-pw");
    assert_eq!(a.code, 502, "{}", a.body);
    assert!(session_keys(&redis).is_empty());
}

#[test]
fn twenty_failed_logins_then_429_even_for_the_right_password() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    for i in 0..20 {
        let a = login(&t, "alice", &format!("wrong-{i}"));
        assert_eq!(a.code, 401, "attempt {i}: {}", a.body);
    }
    let before = up.stats.requests.load(std::sync::atomic::Ordering::SeqCst);
    let a = login(&t, "alice", "alice-pw");
    assert_eq!(a.code, 429, "{}", a.body);
    let wait = a.retry_after();
    assert!(
        (1..=15).contains(&wait),
        "one failure refills every 300 s / 20 = 15 s: {wait}"
    );
    // another user from the same address is limited too, and the upstream is not asked
    assert_eq!(login(&t, "bob", "bob-pw").code, 429);
    assert_eq!(
        up.stats.requests.load(std::sync::atomic::Ordering::SeqCst),
        before
    );
    assert!(session_keys(&redis).is_empty());
}

/// An address over its cap stays refused for the rest of the shared window, here and without
/// a store call, even once the in-process block (one failure forgiven every window / cap, 1 s
/// here) has ended: a refused attempt with a new user name leaves no counter of its own.
#[test]
fn an_address_over_its_cap_is_refused_without_a_store_write_per_attempt() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[("login", "failure_window_seconds = 20")]);
    for i in 0..20 {
        assert_eq!(login(&t, "alice", &format!("wrong-{i}")).code, 401);
    }
    std::thread::sleep(Duration::from_millis(1200));
    for i in 0..30 {
        let a = login(&t, &format!("user-{i}"), "x");
        assert_eq!(a.code, 429, "attempt {i}: {}", a.body);
    }
    // alice's, and the first refused name's: the attempt that found the address over its cap.
    let users = redis.cli(&["--scan", "--pattern", "tessera:login-failures:user:*"]);
    assert_eq!(
        users.lines().filter(|l| !l.is_empty()).count(),
        2,
        "{users}"
    );
}

/// A logout carrying a bearer token and the login cookie (a fetch with credentials sends both)
/// ends the sessions of both: the cookie it deletes names a session that must not outlive it;
/// the browser is told to drop its cache of the user's answers.
#[test]
fn a_logout_ends_the_session_of_every_token_it_carries() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    let alice = token_of(&login(&t, "alice", "alice-pw"));
    let bob = token_of(&login(&t, "bob", "bob-pw"));
    let mail = |token: &str| curl(&["-H", &bearer(token), &t.url("/mail")]).0;
    assert_eq!((mail(&alice), mail(&bob)), (200, 200));
    let out = curl(&[
        "-i",
        "-X",
        "POST",
        "-H",
        &bearer(&bob),
        "-H",
        &format!("Cookie: tessera={alice}"),
        &t.url("/auth/logout"),
    ]);
    assert_eq!(out.0, 204);
    // The browser drops what it cached of the user's answers.
    let head = out.1.to_ascii_lowercase();
    assert!(head.contains("clear-site-data: \"cache\"\r\n"), "{}", out.1);
    assert_eq!((mail(&alice), mail(&bob)), (401, 401));
    assert!(session_keys(&redis).is_empty());
}

/// Login checks in flight are bounded for the process (a quarter of the upstream pool): more,
/// from any number of addresses, get 503 with `Retry-After` at once instead of filling the pool's
/// queue ahead of every user's request; once the checks end, logins go on.
#[test]
fn logins_checked_at_once_are_bounded_and_the_rest_get_503() {
    let up = upstream::start(Behavior::Echo {
        delay: Duration::from_millis(1500),
    });
    let url = up.url();
    let mut extra: Vec<(&str, &str)> = LOCAL_LOGIN.to_vec();
    extra.push(("server", "trusted_proxies = [\"127.0.0.1\"]"));
    // A pool of 4: one check at a time.
    extra.push(("upstream", "max_connections = 4"));
    let t = Tessera::start(move |port, dir| {
        config(port, &url, &format!("embedded:{}/s", dir.display()), &extra)
    });
    let login_from = |client: &str, user: &str| {
        let body = serde_json::json!({"username": user, "password": "pw"}).to_string();
        call(&[
            "-H",
            "Content-Type: application/json",
            "-H",
            &format!("X-Forwarded-For: {client}"),
            "--data-binary",
            &body,
            &t.url("/auth/login"),
        ])
    };
    std::thread::scope(|scope| {
        let first = scope.spawn(|| login_from("2001:db8:1::1", "alice"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while up.stats.current.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            assert!(
                Instant::now() < deadline,
                "the first check never reached the upstream"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let second = login_from("2001:db8:2::1", "bob");
        assert_eq!(second.code, 503, "{} {}", second.headers, second.body);
        assert_eq!(second.retry_after(), 1);
        assert_eq!(first.join().unwrap().code, 200);
    });
    assert_eq!(login_from("2001:db8:2::1", "bob").code, 200);
    assert_eq!(
        up.stats
            .max_concurrent
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
}

/// One who fails as a user from elsewhere locks out that user's new devices, not the ones the
/// user signed in on: their device cookie spares them the per-user limit, not the per-address
/// one. Another user's device cookie, or a forged one, or one for the name in another case,
/// spares nothing; one planted beside it hides nothing; a stolen one is good for the user's cap
/// of guesses, then refused.
#[test]
fn a_device_the_user_signed_in_on_is_not_locked_out_by_failures_elsewhere() {
    let up = users();
    let redis = Redis::start();
    let trusted = [("server", "trusted_proxies = [\"127.0.0.1\"]")];
    let t = on_redis(&up, &redis, &trusted);
    let login_as = |client: &str, user: &str, password: &str, cookie: &str| {
        let body = serde_json::json!({"username": user, "password": password}).to_string();
        call(&[
            "-H",
            "Content-Type: application/json",
            "-H",
            &format!("X-Forwarded-For: {client}"),
            "-H",
            &format!("Cookie: {cookie}"),
            "--data-binary",
            &body,
            &t.url("/auth/login"),
        ])
    };
    let device_of = |a: &Answer| {
        assert_eq!(a.code, 200, "{}", a.body);
        let set = a
            .headers
            .lines()
            .find_map(|l| l.strip_prefix("set-cookie: tessera-device="))
            .unwrap_or_else(|| panic!("no device cookie: {}", a.headers));
        assert!(
            set.contains("HttpOnly") && set.contains("Max-Age=2592000"),
            "{set}"
        );
        format!("tessera-device={}", set.split(';').next().unwrap())
    };
    let alices = device_of(&login_as("203.0.113.2", "alice", "alice-pw", ""));
    let bobs = device_of(&login_as("203.0.113.3", "bob", "bob-pw", ""));
    for i in 0..20 {
        let a = login_as("198.51.100.1", "alice", &format!("wrong-{i}"), "");
        assert_eq!(a.code, 401, "attempt {i}");
    }
    // Every instance shares the per-user count: a new device of alice's is refused.
    assert_eq!(login_as("203.0.113.2", "alice", "alice-pw", "").code, 429);
    assert_eq!(
        login_as("203.0.113.2", "alice", "alice-pw", &bobs).code,
        429
    );
    let forged = "tessera-device=tsl1.k1.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
    assert_eq!(
        login_as("203.0.113.2", "alice", "alice-pw", forged).code,
        429
    );
    let code = |user: &str, cookie: &str| login_as("203.0.113.2", user, "alice-pw", cookie).code;
    assert_eq!(code("ALICE", &alices), 429);
    assert_eq!(code("alice", &alices), 200);
    assert_eq!(code("alice", &format!("tessera-device=x; {alices}")), 200);
    // The attacker's address is over its own cap, device cookie or not.
    assert_eq!(login_as("198.51.100.1", "alice", "x", &alices).code, 429);
    // Stolen: its own failures count, from any addresses, up to the user's cap.
    for i in 0..20 {
        let a = login_as(&format!("192.0.2.{}", i + 1), "alice", "guess", &alices);
        assert_eq!(a.code, 401, "guess {i}");
    }
    assert_eq!(
        login_as("192.0.2.99", "alice", "alice-pw", &alices).code,
        429
    );
}

/// Behind a load balancer every client shares its address: with `server.trusted_proxies` the
/// failed-login limit is per client it names, so one client's failures lock out no one else.
#[test]
fn behind_a_trusted_proxy_failed_logins_are_limited_per_named_client() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(
        &up,
        &redis,
        &[("server", "trusted_proxies = [\"127.0.0.1\"]")],
    );
    let login_as = |client: &str, user: &str, password: &str| {
        let body = serde_json::json!({"username": user, "password": password}).to_string();
        call(&[
            "-H",
            "Content-Type: application/json",
            "-H",
            &format!("X-Forwarded-For: {client}"),
            "--data-binary",
            &body,
            &t.url("/auth/login"),
        ])
        .code
    };
    for i in 0..20 {
        assert_eq!(login_as("203.0.113.1", "alice", &format!("wrong-{i}")), 401);
    }
    assert_eq!(
        login_as("203.0.113.1", "bob", "bob-pw"),
        429,
        "the limit is per client"
    );
    assert_eq!(
        login_as("203.0.113.2", "bob", "bob-pw"),
        200,
        "another client behind the same proxy was locked out"
    );
    // A client cannot pose as another by sending its own X-Forwarded-For: the proxy appends
    // the address it saw, and that rightmost entry is the client.
    assert_eq!(login_as("203.0.113.2, 203.0.113.1", "bob", "bob-pw"), 429);
    // The upstream's password checks name the client who tried (its own defence, fail2ban on
    // its auth log, must not ban tessera): 20 by the first client, then one by the second.
    let checks: Vec<String> = up
        .stats
        .forwarded_for
        .lock()
        .unwrap()
        .iter()
        .filter(|(path, _)| path == "/check")
        .map(|(_, client)| client.clone())
        .collect();
    let mut want = vec!["203.0.113.1".to_string(); 20];
    want.push("203.0.113.2".into());
    assert_eq!(checks, want);
}

/// Two instances behind one load balancer share the failed-login count through their store
/// (Redis, or one embedded file): 2 failures on A and 1 on B reach the limit of 3 for both.
/// Before, each instance counted only its own, so n instances allowed n times the attempts.
#[test]
fn failed_logins_are_counted_by_every_instance_on_the_store() {
    let up = users();
    let redis = Redis::start();
    let pg = support::postgres::Postgres::start();
    let my = support::mysql::Mariadb::start();
    let shared_dir = tempfile::tempdir().unwrap();
    let embedded = format!("embedded:{}/sessions", shared_dir.path().display());
    for store in [redis.url(), embedded, pg.url(), my.url()] {
        let start = || {
            let (store, up_url) = (store.clone(), up.url());
            Tessera::start(move |port, _| {
                config(
                    port,
                    &up_url,
                    &store,
                    &[
                        LOCAL_LOGIN[0],
                        LOCAL_LOGIN[1],
                        ("login", "max_failures_per_user = 3"),
                        ("login", "max_failures_per_ip = 6"),
                    ],
                )
            })
        };
        let (a, b) = (start(), start());
        assert_eq!(login(&a, "alice", "wrong-1").code, 401, "{store}");
        assert_eq!(login(&a, "alice", "wrong-2").code, 401, "{store}");
        assert_eq!(login(&b, "alice", "wrong-3").code, 401, "{store}");
        let before = up.stats.requests.load(std::sync::atomic::Ordering::SeqCst);
        for t in [&a, &b] {
            let r = login(t, "alice", "alice-pw");
            assert_eq!(r.code, 429, "{store}: {}", r.body);
            let wait = r.retry_after();
            assert!((1..=300).contains(&wait), "{store}: {wait}");
        }
        assert_eq!(
            up.stats.requests.load(std::sync::atomic::Ordering::SeqCst),
            before,
            "{store}: the upstream was asked"
        );
        // Another user from the same address (3 of 20 address failures) is not held back, and a
        // right password gives its attempt back: more logins in a row than the limit all pass.
        for t in [&a, &b, &a, &b] {
            token_of(&login(t, "bob", "bob-pw"));
        }
        // Three more failures fill the address's 6; the next attempt, for a user never tried,
        // is refused, and counts against that user not at all (else one address over its cap
        // could lock out every user it names).
        for user in ["carol", "carol", "erin"] {
            assert_eq!(login(&a, user, "nope").code, 401, "{store}");
        }
        assert_eq!(login(&b, "dave", "dave-pw").code, 429, "{store}");
        if store.starts_with("redis") {
            use sha2::{Digest, Sha256};
            let hex: String = Sha256::digest(b"dave")
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            let key = format!("tessera:login-failures:user:{hex}");
            let given_back = (0..50).any(|_| {
                std::thread::sleep(Duration::from_millis(20));
                matches!(redis.cli(&["GET", &key]).as_str(), "" | "0")
            });
            assert!(given_back, "dave's count: {}", redis.cli(&["GET", &key]));
        }
    }
    // One counter for the address and one per user, keyed by a hash: no user name in clear.
    let keys = redis.cli(&["--scan", "--pattern", "tessera:login-failures:*"]);
    let rows = pg.sql("SELECT key FROM tessera_counters");
    let my_rows = my.sql("SELECT `key` FROM tessera_counters");
    for keys in [keys, rows, my_rows] {
        assert_eq!(keys.lines().count(), 6, "{keys}");
        for user in ["alice", "bob", "carol", "dave", "erin"] {
            assert!(!keys.contains(user), "{keys}");
        }
    }
}

/// The probes on the operator's listener: `/healthz` answers while the process serves;
/// `/readyz` follows the session store (503 while Redis is down, 200 once it is back) and turns
/// 503 when shutdown begins, while a busy request still drains.
#[test]
fn health_and_readiness_probes_follow_the_store_and_shutdown() {
    let up = upstream::start(Behavior::Echo {
        delay: Duration::from_millis(1500),
    });
    let mut redis = Redis::start();
    let metrics_port = support::free_port();
    let (up_url, redis_url) = (up.url(), redis.url());
    let t = Tessera::start(move |port, _| {
        format!(
            "{}[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n",
            config(port, &up_url, &redis_url, &[])
        )
    });
    support::wait_for_port(metrics_port, "tessera metrics");
    let probe = |path: &str| curl(&[&format!("http://127.0.0.1:{metrics_port}{path}")]);
    assert_eq!(probe("/healthz"), (200, "ok\n".into()));
    // 503 `starting` until the serving threads run (an instant after the port is bound).
    let started = Instant::now();
    loop {
        match probe("/readyz") {
            (200, body) => break assert_eq!(body, "ready\n"),
            (503, body) if body == "starting\n" => {}
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(10), "never ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        curl(&[
            "-X",
            "POST",
            &format!("http://127.0.0.1:{metrics_port}/readyz")
        ])
        .0,
        405
    );

    redis.stop();
    assert_eq!(
        probe("/readyz"),
        (503, "session store unavailable\n".into())
    );
    assert_eq!(probe("/healthz").0, 200, "alive all the same");
    redis.restart();
    let back = Instant::now();
    while probe("/readyz").0 != 200 {
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "not ready 10 s after Redis came back"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The outage in the log: one warning however many retries, one line when it is back.
    let log = t.log_when(|l| l.contains("redis invalidation stream back"));
    assert!(log.contains("redis invalidation stream back"), "{log}");
    assert_eq!(log.matches("invalidation stream lost").count(), 1, "{log}");

    // A request that keeps the drain going (the restarted Redis is empty: a session now).
    let (_, token2) = t.create_session("alice", "pw");
    let url = t.url("/slow");
    let busy = std::thread::spawn(move || curl(&["-H", &bearer(&token2), &url]).0);
    std::thread::sleep(Duration::from_millis(300));
    let killed = Command::new("kill")
        .args(["-TERM", &t.pid().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(probe("/readyz"), (503, "shutting down\n".into()));
    assert_eq!(probe("/healthz").0, 200);
    assert_eq!(busy.join().unwrap(), 200, "the busy request drained");
}

/// `server.shutdown_delay_ms`: after SIGTERM `/readyz` answers 503 at once while new
/// connections are still served for the delay (a balancer, or Kubernetes' lagging endpoints,
/// moves away meanwhile), and a SIGHUP reloads nothing; then the drain, and the process ends
/// on its own. A second signal ends it at once, with exit code 1.
#[test]
fn a_shutdown_delay_keeps_serving_while_not_ready_and_a_second_signal_ends_it() {
    let up = echo();
    let metrics_port = support::free_port();
    let up_url = up.url();
    let start = move |delay: &'static str| {
        let up_url = up_url.clone();
        let t = Tessera::start(move |port, dir| {
            format!(
                "{}[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n",
                config(
                    port,
                    &up_url,
                    &format!("embedded:{}/s", dir.display()),
                    &[("server", delay)]
                )
            )
        });
        let (_, token) = t.create_session("alice", "pw");
        let probe = move || curl(&[&format!("http://127.0.0.1:{metrics_port}/readyz")]);
        assert!(
            (0..500).any(|_| probe().0 == 200 || {
                std::thread::sleep(Duration::from_millis(20));
                false
            }),
            "never ready"
        );
        t.signal("-TERM");
        let leaving = (0..500).any(|_| probe() == (503, "shutting down\n".into()));
        assert!(leaving, "{}", t.log());
        let served = curl(&["-H", &bearer(&token), &t.url("/x")]).0;
        (t, served)
    };
    let (mut t, served) = start("shutdown_delay_ms = 2000");
    assert_eq!(
        served,
        200,
        "a new connection during the delay: {}",
        t.log()
    );
    // The shutdown has begun: a SIGHUP reloads nothing from here on.
    t.signal("-HUP");
    let status = t.exit_status(Duration::from_secs(30));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", t.log());
    let log = t.log();
    assert!(log.contains("server.shutdown_delay_ms"), "{log}");
    assert!(
        log.contains("SIGHUP ignored: shutting down") && !log.contains("configuration reloaded"),
        "{log}"
    );

    let (mut t, _) = start("shutdown_delay_ms = 60000");
    t.signal("-TERM");
    let status = t.exit_status(Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{}", t.log());
    assert!(t.log().contains("a second signal"), "{}", t.log());
}

/// `server.shutdown_timeout_ms` bounds the drain: a request still in flight when it ends is cut
/// (the default 10 s would have let this 3 s one finish), the process still exits 0, and the
/// log says why.
#[test]
fn the_drain_ends_at_server_shutdown_timeout_ms() {
    let up = upstream::start(Behavior::Echo {
        delay: Duration::from_millis(3000),
    });
    let up_url = up.url();
    let mut t = Tessera::start(move |port, dir| {
        let store = format!("embedded:{}/s", dir.display());
        config(
            port,
            &up_url,
            &store,
            &[("server", "shutdown_timeout_ms = 500")],
        )
    });
    let (_, token) = t.create_session("alice", "pw");
    let url = t.url("/slow");
    let before = up.stats.requests.load(Ordering::SeqCst);
    let busy = std::thread::spawn(move || curl(&["-H", &bearer(&token), &url]).0);
    let arrived = (0..500).any(|_| {
        up.stats.requests.load(Ordering::SeqCst) > before || {
            std::thread::sleep(Duration::from_millis(10));
            false
        }
    });
    assert!(arrived, "{}", t.log());
    t.signal("-TERM");
    let status = t.exit_status(Duration::from_secs(30));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", t.log());
    assert_ne!(busy.join().unwrap(), 200, "cut when the drain ended");
    let log = t.log();
    assert!(
        log.contains("connections still open after 500ms (server.shutdown_timeout_ms)"),
        "{log}"
    );
}

/// `serve` on an embedded store whose opening lock another process holds (`sessions.lock`,
/// here held by flock(1)) waits 5 s, then exits 1, naming the store: what may pass by itself,
/// for a service manager to retry. A configuration it cannot serve exits 2.
#[test]
fn a_store_that_cannot_open_exits_1_a_bad_configuration_2() {
    let up = echo();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s");
    std::fs::create_dir(&store).unwrap();
    let mut holder = Command::new("flock")
        .arg(store.join("sessions.lock"))
        .args(["sleep", "60"])
        .spawn()
        .expect("flock(1), util-linux");
    let held = (0..500).any(|_| {
        let free = Command::new("flock")
            .args(["-n"])
            .arg(store.join("sessions.lock"))
            .arg("true")
            .status()
            .unwrap();
        !free.success() || {
            std::thread::sleep(Duration::from_millis(10));
            false
        }
    });
    assert!(held, "flock(1) never took the lock");
    let serve = |extra: &str| {
        let path = dir.path().join("t.toml");
        let store = format!("embedded:{}", store.display());
        let text = config(support::free_port(), &up.url(), &store, &[]) + extra;
        std::fs::write(&path, text).unwrap();
        let out = Command::new(bin())
            .args(["serve", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = serve("");
    let _ = holder.kill();
    let _ = holder.wait();
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("session.store") && err.contains("still locked"),
        "{err}"
    );
    let tls =
        "[tls]\ncertificate = \"file:/nonexistent.pem\"\nprivate_key = \"file:/nonexistent.key\"\n";
    let (code, err) = serve(tls);
    assert_eq!(code, Some(2), "{err}");
}

/// The embedded store deletes an expired row only a day after its expiry (it is never read
/// once expired), so that a wall clock set ahead by mistake and put back loses no session; a
/// row expired longer ago goes at the next write. The file is read with Python's sqlite3.
#[test]
fn the_embedded_store_deletes_an_expired_row_a_day_later() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.toml");
    let store = format!("embedded:{}/s", dir.path().display());
    std::fs::write(&path, config(1, "http://127.0.0.1:9", &store, &[])).unwrap();
    let db = dir.path().join("s/sessions.sqlite3");
    let sql = |query: &str| {
        let out = Command::new("python3")
            .args([
                "-c",
                "import sqlite3, sys\n\
                 c = sqlite3.connect(sys.argv[1])\n\
                 print(c.execute(sys.argv[2]).fetchall())\n\
                 c.commit()",
            ])
            .arg(&db)
            .arg(query)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let sessions = "SELECT count(*) FROM kv WHERE key LIKE 'tessera:session:%'";
    let expire = |seconds: u64| {
        sql(&format!(
            "UPDATE kv SET expires_at = CAST(strftime('%s', 'now') AS INTEGER) - {seconds} \
             WHERE key LIKE 'tessera:session:%'"
        ))
    };
    support::create_session(&path, "alice", "pw", None);
    expire(3600);
    support::create_session(&path, "bob", "pw", None);
    assert_eq!(
        sql(sessions),
        "[(2,)]",
        "an hour past its expiry, alice's row stays"
    );
    expire(2 * 86_400);
    support::create_session(&path, "carol", "pw", None);
    assert_eq!(
        sql(sessions),
        "[(1,)]",
        "two days past, both went at carol's write"
    );
}

/// Under systemd (`NOTIFY_SOCKET`, sd_notify(3); here a datagram socket the test reads, as
/// systemd's is): `READY=1` once serving, `RELOADING=1` with `MONOTONIC_USEC` then `READY=1`
/// around a SIGHUP, `STOPPING=1` at SIGTERM, so that `Type=notify-reload` units start, reload
/// and stop in step.
#[test]
fn systemd_is_told_ready_reloading_and_stopping() {
    let up = echo();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify");
    let sock = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let next = || {
        let mut buf = [0u8; 512];
        let n = sock.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let env = format!("NOTIFY_SOCKET={}", path.display());
    let up_url = up.url();
    let mut t = Tessera::start_via(&["env", &env], move |port, dir| {
        config(port, &up_url, &format!("embedded:{}/s", dir.display()), &[])
    });
    assert_eq!(next().trim(), "READY=1");
    t.signal("-HUP");
    let reloading = next();
    assert!(
        reloading.starts_with("RELOADING=1\nMONOTONIC_USEC="),
        "{reloading:?}"
    );
    assert_eq!(next().trim(), "READY=1", "{}", t.log());
    t.stop();
    assert_eq!(next().trim(), "STOPPING=1");
}

/// The store's counters (the shared failed-login counts), on both backends: counted from 1 with
/// the seconds left in their window, taken back without going below 0 or creating one, started
/// again at 1 once their window has passed; on Redis, one found without an expiry gets one.
#[test]
fn store_counters_count_within_a_window_and_start_again_after_it() {
    use tessera::session::Store;
    use tessera::session::StoreSpec;
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for spec in [
        StoreSpec::Redis(redis.url()),
        StoreSpec::Embedded(dir.path().join("sessions")),
    ] {
        let store = Store::open(&spec, Duration::from_secs(2)).unwrap();
        rt.block_on(async {
            assert_eq!(
                store.increment("c:short", 2).await.unwrap().0,
                1,
                "{spec:?}"
            );
            let (n, left) = store.increment("c:short", 2).await.unwrap();
            assert_eq!(n, 2, "{spec:?}");
            assert!((1..=2).contains(&left), "{spec:?}: {left}");
            for _ in 0..3 {
                store.increment("c:long", 300).await.unwrap();
            }
            store.decrement("c:long").await.unwrap();
            let (n, left) = store.increment("c:long", 300).await.unwrap();
            assert_eq!(n, 3, "{spec:?}: one taken back");
            assert!((299..=300).contains(&left), "{spec:?}: {left}");
            store.decrement("c:none").await.unwrap();
            assert_eq!(
                store.increment("c:none", 300).await.unwrap().0,
                1,
                "{spec:?}"
            );
            store.decrement("c:none").await.unwrap();
            store.decrement("c:none").await.unwrap();
            assert_eq!(
                store.increment("c:none", 300).await.unwrap().0,
                1,
                "{spec:?}: below 0"
            );
            // Past its two-second window (whole seconds on the embedded store) it starts over.
            tokio::time::sleep(Duration::from_millis(3100)).await;
            assert_eq!(
                store.increment("c:short", 2).await.unwrap().0,
                1,
                "{spec:?}"
            );
            assert_eq!(
                store.increment("c:long", 300).await.unwrap().0,
                4,
                "{spec:?}"
            );
        });
    }
    redis.cli(&["SET", "c:stale", "7"]);
    let store = Store::open(&StoreSpec::Redis(redis.url()), Duration::from_secs(2)).unwrap();
    let counted = rt.block_on(store.increment("c:stale", 60)).unwrap();
    assert_eq!(counted, (8, 60));
    let ttl = redis.cli(&["TTL", "c:stale"]);
    assert!(ttl == "60" || ttl == "59", "{ttl}");
}

/// `login.max_failures_per_user`: past it, the user name (case and spaces ignored) is refused
/// 429 even with the right password; other users log in.
#[test]
fn failed_logins_are_limited_per_user_name() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[("login", "max_failures_per_user = 3")]);
    for _ in 0..3 {
        assert_eq!(login(&t, "bob", "nope").code, 401);
    }
    assert_eq!(login(&t, "bob", "bob-pw").code, 429, "bob is limited");
    assert_eq!(
        login(&t, "BOB ", "bob-pw").code,
        429,
        "user key is case- and space-insensitive"
    );
    token_of(&login(&t, "alice", "alice-pw"));
}

/// The login page carries a CSRF token in a hidden field and a cookie (double submit); a form
/// post needs both to match and no foreign `Origin`, and `rd` must be a same-origin path; a
/// wrong password shows the page again with an accessible error and makes no session.
#[test]
fn the_login_form_is_csrf_protected_and_redirects_only_same_origin() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    // the page sets a CSRF cookie and carries the same value in a hidden field
    let page = call(&[&t.url("/auth/login?rd=/inbox%3Fid%3D3")]);
    assert_eq!(page.code, 200);
    assert!(page
        .body
        .contains("<form method=\"post\" action=\"/auth/login\">"));
    assert!(
        page.body.contains("name=\"rd\" value=\"/inbox?id=3\""),
        "{}",
        page.body
    );
    assert!(page
        .header("content-security-policy")
        .unwrap()
        .contains("default-src 'none'"));
    let csrf_cookie = page.header("set-cookie").unwrap();
    let csrf = csrf_cookie
        .strip_prefix("tessera-csrf=")
        .and_then(|r| r.split(';').next())
        .unwrap()
        .to_string();
    assert!(page
        .body
        .contains(&format!("name=\"csrf\" value=\"{csrf}\"")));
    let form = |csrf_field: &str, cookie: &str, rd: &str, origin: Option<&str>| {
        let mut args = vec![
            "--data-urlencode".to_string(),
            "username=alice".into(),
            "--data-urlencode".into(),
            "password=alice-pw".into(),
            "--data-urlencode".into(),
            format!("csrf={csrf_field}"),
            "--data-urlencode".into(),
            format!("rd={rd}"),
            "-H".into(),
            format!("Cookie: tessera-csrf={cookie}"),
        ];
        if let Some(o) = origin {
            args.push("-H".into());
            args.push(format!("Origin: {o}"));
        }
        args.push(t.url("/auth/login"));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        call(&refs)
    };
    let ok = form(
        &csrf,
        &csrf,
        "/inbox?id=3",
        Some(&format!("http://127.0.0.1:{}", t.port)),
    );
    assert_eq!(ok.code, 303, "{}", ok.body);
    assert_eq!(ok.header("location").as_deref(), Some("/inbox?id=3"));
    assert!(
        ok.headers.contains("Set-Cookie: tessera=ey")
            || ok.headers.contains("set-cookie: tessera=ey"),
        "{}",
        ok.headers
    );

    assert_eq!(form("other", &csrf, "/", None).code, 403, "CSRF mismatch");
    assert_eq!(form("", "", "/", None).code, 403, "CSRF missing");
    assert_eq!(
        form(&csrf, &csrf, "/", Some("http://evil.example")).code,
        403,
        "cross-origin"
    );
    for evil in [
        "//evil.example",
        "/\\evil",
        "/%09/evil",
        "https:evil",
        "https://evil.example/",
    ] {
        let a = form(&csrf, &csrf, evil, None);
        assert_eq!(a.code, 400, "rd {evil:?} must be refused");
        assert!(a.header("location").is_none());
    }
    // wrong password in the form: the page again, with an accessible error
    let keys_before = session_keys(&redis).len();
    let mut args = vec![
        "--data-urlencode",
        "username=alice",
        "--data-urlencode",
        "password=bad",
    ];
    let c = format!("csrf={csrf}");
    let cookie = format!("Cookie: tessera-csrf={csrf}");
    args.extend(["--data-urlencode", &c, "-H", &cookie]);
    let u = t.url("/auth/login");
    args.push(&u);
    let bad = call(&args);
    assert_eq!(bad.code, 401);
    assert!(bad.body.contains("role=\"alert\""), "{}", bad.body);
    assert_eq!(session_keys(&redis).len(), keys_before);
}

/// A new login in a browser that holds a login cookie revokes the session that cookie named:
/// left alone, it would keep its sealed password in the store until its TTL, out of any
/// logout's reach (the cookie now names the new one). A login from elsewhere leaves it, and so
/// does another user's login in that browser.
#[test]
fn a_new_login_revokes_the_session_its_cookie_replaces() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    let first = token_of(&login(&t, "alice", "alice-pw"));
    let body = serde_json::json!({"username": "alice", "password": "alice-pw"}).to_string();
    let again = call(&[
        "-H",
        "Content-Type: application/json",
        "-H",
        &format!("Cookie: tessera={first}"),
        "--data-binary",
        &body,
        &t.url("/auth/login"),
    ]);
    let second = token_of(&again);
    assert_eq!(session_keys(&redis).len(), 1, "the first session is left");
    assert_eq!(curl(&["-H", &bearer(&first), &t.url("/x")]).0, 401);
    assert_eq!(curl(&["-H", &bearer(&second), &t.url("/x")]).0, 200);
    let elsewhere = token_of(&login(&t, "alice", "alice-pw"));
    assert_eq!(session_keys(&redis).len(), 2);
    assert_eq!(curl(&["-H", &bearer(&second), &t.url("/x")]).0, 200);
    assert_eq!(curl(&["-H", &bearer(&elsewhere), &t.url("/x")]).0, 200);
    // Another user's login in that browser leaves alice's session to her.
    let body = serde_json::json!({"username": "bob", "password": "bob-pw"}).to_string();
    let bob = call(&[
        "-H",
        "Content-Type: application/json",
        "-H",
        &format!("Cookie: tessera={second}"),
        "--data-binary",
        &body,
        &t.url("/auth/login"),
    ]);
    token_of(&bob);
    assert_eq!(session_keys(&redis).len(), 3);
    assert_eq!(curl(&["-H", &bearer(&second), &t.url("/x")]).0, 200);
}

/// A browser navigation without a token is sent to the login page with `rd`; an API client
/// gets the 401.
#[test]
fn a_browser_without_a_token_is_sent_to_the_login_page() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    // a browser navigation without a token is sent to the login page with rd
    let nav = call(&["-H", "Accept: text/html", &t.url("/mail/inbox?x=1")]);
    assert_eq!(nav.code, 303);
    assert_eq!(
        nav.header("location").as_deref(),
        Some("/auth/login?rd=%2Fmail%2Finbox%3Fx%3D1")
    );
    // API clients get the 401, and so does a page's own fetch asking for HTML (which could
    // not use the login page; from another origin, a redirect leaves it no answer at all).
    assert_eq!(curl(&[&t.url("/mail/inbox")]).0, 401);
    let fetch = ["-H", "Accept: text/html", "-H", "Sec-Fetch-Mode: cors"];
    assert_eq!(
        curl(&[&fetch[..], &[&t.url("/mail/inbox")]].concat()).0,
        401
    );
    let navigate = ["-H", "Accept: text/html", "-H", "Sec-Fetch-Mode: navigate"];
    assert_eq!(
        curl(&[&navigate[..], &[&t.url("/mail/inbox")]].concat()).0,
        303
    );
}

#[test]
fn upstream_401_deletes_the_session_and_says_why() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    let token = token_of(&login(&t, "alice", "alice-pw"));
    assert_eq!(curl(&["-H", &bearer(&token), &t.url("/x")]).0, 200);
    up.stats.set_password("alice", "changed-elsewhere");
    let a = call(&["-H", &bearer(&token), &t.url("/x")]);
    assert_eq!(a.code, 401);
    assert_eq!(
        a.header("www-authenticate").as_deref(),
        Some("Bearer realm=\"tessera\", error=\"invalid_token\", error_description=\"upstream rejected credentials\"")
    );
    assert!(!a.headers.to_ascii_lowercase().contains("basic realm"));
    assert!(session_keys(&redis).is_empty(), "session deleted");
    let again = call(&["-H", &bearer(&token), &t.url("/x")]);
    assert_eq!(again.code, 401);
    let log = t.log_when(|l| l.contains("session deleted"));
    assert!(log.contains("session deleted"), "{log}");
}

/// A 401 from a path of the upstream's own, to credentials still good at `login.verify_path`
/// (or a cross-site GET to such a path), logs nobody out: concurrent 401s of one session are
/// checked once, the session is kept, and the answer passes without its `Basic` challenge.
#[test]
fn an_upstream_401_on_a_path_keeps_a_session_whose_credentials_still_pass() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    let token = token_of(&login(&t, "alice", "alice-pw"));
    let checks = || {
        up.stats
            .paths
            .lock()
            .unwrap()
            .iter()
            .filter(|p| *p == "/check")
            .count()
    };
    assert_eq!(checks(), 1, "the login's check");
    let stored = session_keys(&redis);
    assert!(!stored.is_empty());
    let answers: Vec<Answer> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..4)
            .map(|_| s.spawn(|| call(&["-H", &bearer(&token), &t.url("/app-401")])))
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    for a in &answers {
        assert_eq!((a.code, a.body.as_str()), (401, "not here"));
        assert!(
            !a.headers.to_ascii_lowercase().contains("www-authenticate"),
            "{}",
            a.headers
        );
    }
    assert_eq!(checks(), 2, "one re-check for the four 401s");
    assert_eq!(session_keys(&redis), stored, "session kept");
    assert_eq!(curl(&["-H", &bearer(&token), &t.url("/x")]).0, 200);
    let log = t.log_when(|l| l.contains("session kept"));
    assert!(
        log.contains("credentials still accepted at login.verify_path"),
        "{log}"
    );
}

/// With `upstream.request_id_header`, the upstream's credential checks carry the id of the
/// request that made them (a login; the re-check after an upstream 401), the one its client got.
#[test]
fn credential_checks_carry_the_id_of_the_request_that_made_them() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(
        &up,
        &redis,
        &[("upstream", "request_id_header = \"X-Request-Id\"")],
    );
    let answer = login(&t, "alice", "alice-pw");
    let token = token_of(&answer);
    let login_id = answer.header("x-request-id").expect("the login's id");
    let refused = call(&["-H", &bearer(&token), &t.url("/app-401")]);
    assert_eq!(refused.code, 401);
    let refused_id = refused.header("x-request-id").expect("the request's id");
    let seen = up.stats.request_ids.lock().unwrap().clone();
    let want = [
        ("/check", login_id),
        ("/app-401", refused_id.clone()),
        ("/check", refused_id),
    ]
    .map(|(path, id)| (path.to_string(), id));
    assert_eq!(seen, want);
    // Both checks name the client whose request made them (an upstream's fail2ban must not
    // ban tessera when a changed password fails for every live session).
    let named: Vec<(String, String)> = up.stats.forwarded_for.lock().unwrap().clone();
    let checks: Vec<&str> = named
        .iter()
        .filter(|(path, _)| path == "/check")
        .map(|(_, client)| client.as_str())
        .collect();
    assert_eq!(checks, ["127.0.0.1", "127.0.0.1"]);
}

fn hs512_with_kid(kid: &str, secret: &str, sid: &str) -> String {
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS512);
    header.kid = Some(kid.to_string());
    let claims = serde_json::json!({"sub": "alice", "sid": sid, "iat": support_now(), "exp": support_now() + 600});
    jsonwebtoken::encode(
        &header,
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap()
}

fn sid_of(token: &str) -> String {
    use base64::Engine;
    let payload = token.split('.').nth(1).unwrap();
    let v: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    )
    .unwrap();
    v["sid"].as_str().unwrap().to_string()
}

fn header_of(token: &str) -> serde_json::Value {
    use base64::Engine;
    serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(token.split('.').next().unwrap())
            .unwrap(),
    )
    .unwrap()
}

#[test]
fn jwt_key_rotation_listed_old_key_accepted_retired_key_refused() {
    let up = users();
    let redis = Redis::start();
    let k2 = format!("[[token.keys]]\nkid = \"k2\"\nalg = \"HS512\"\nsecret = \"{K2}\"");
    let old = format!("[[token.keys]]\nkid = \"old\"\nalg = \"HS512\"\nsecret = \"{K_OLD}\"");
    let both = on_redis(
        &up,
        &redis,
        &[
            ("token", "active_kid = \"k2\""),
            ("tables", &k2),
            ("tables", &old),
        ],
    );
    let token = token_of(&login(&both, "alice", "alice-pw"));
    assert_eq!(header_of(&token)["kid"], "k2", "the active key signs");
    let sid = sid_of(&token);
    let by_old = hs512_with_kid("old", K_OLD, &sid);
    assert_eq!(
        curl(&["-H", &bearer(&by_old), &both.url("/x")]).0,
        200,
        "listed old key verifies"
    );
    let forged = hs512_with_kid("k2", K_OLD, &sid);
    assert_eq!(
        curl(&["-H", &bearer(&forged), &both.url("/x")]).0,
        401,
        "kid k2 with another secret"
    );

    // "old" retired: its tokens are refused, the active key's still work
    let retired = on_redis(
        &up,
        &redis,
        &[("token", "active_kid = \"k2\""), ("tables", &k2)],
    );
    assert_eq!(curl(&["-H", &bearer(&by_old), &retired.url("/x")]).0, 401);
    let log = retired.log_when(|l| l.contains("unknown key id"));
    assert!(log.contains("unknown key id"), "{log}");
    assert_eq!(curl(&["-H", &bearer(&token), &retired.url("/x")]).0, 200);
}

/// `kill -HUP` tessera, then waits for its log to show the `n`th reload's outcome (`ok`: keys
/// in place, else refused); returns the log.
fn hangup(t: &Tessera, n: usize, ok: bool) -> String {
    let hup = Command::new("kill")
        .args(["-HUP", &t.pid().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let outcomes = |l: &str| {
        l.matches("configuration reloaded").count()
            + l.matches("configuration reload refused").count()
    };
    let log = t.log_when(|l| outcomes(l) >= n);
    assert_eq!(outcomes(&log), n, "reload {n} has no outcome: {log}");
    let last = log
        .lines()
        .rfind(|l| l.contains("configuration reload"))
        .unwrap();
    assert_eq!(last.contains("configuration reloaded"), ok, "{last}");
    log
}

/// One request on an open keep-alive connection; the status code.
fn get_on(conn: &mut std::net::TcpStream, port: u16, token: &str) -> u16 {
    use std::io::{BufRead, BufReader, Read, Write};
    write!(
        conn,
        "GET /x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n\r\n"
    )
    .unwrap();
    let mut reader = BufReader::new(conn);
    let mut status = String::new();
    reader.read_line(&mut status).unwrap();
    let mut length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line == "\r\n" {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    status.split(' ').nth(1).unwrap().parse().unwrap()
}

const C1: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
const C2: &str = "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=";

/// One instance on the embedded store (the single-node default, where a restart would refuse
/// clients) with `[login]`, `[metrics]`, JWT key `old` and sealing key `c1`, whose config the
/// SIGHUP tests rewrite.
struct Reloadable {
    t: Tessera,
    up_url: String,
    metrics_port: u16,
    _up: TestUpstream,
}

impl Reloadable {
    fn start() -> Self {
        let up = users();
        let up_url = up.url();
        let metrics_port = support::free_port();
        let (u, m) = (up_url.clone(), metrics_port);
        let t = Tessera::start(move |port, dir| {
            Self::text(&u, m, port, dir, &[("old", K_OLD)], &[("c1", C1)])
        });
        support::wait_for_port(metrics_port, "tessera metrics");
        let this = Self {
            t,
            up_url,
            metrics_port,
            _up: up,
        };
        assert_eq!(this.reloads(), (0, 0, 1));
        this
    }

    /// The config with these JWT keys (the first signs) and sealing keys (the first seals).
    fn text(
        up_url: &str,
        metrics_port: u16,
        port: u16,
        dir: &std::path::Path,
        jwt: &[(&str, &str)],
        seal: &[(&str, &str)],
    ) -> String {
        let seal_keys: Vec<String> = seal
            .iter()
            .map(|(id, k)| format!("{id} = \"{k}\""))
            .collect();
        let credentials = format!(
            "keys = {{ {} }}\nactive = \"{}\"",
            seal_keys.join(", "),
            seal[0].0
        );
        let active = format!("active_kid = \"{}\"", jwt[0].0);
        let tables: String = jwt
            .iter()
            .map(|(kid, s)| {
                format!("[[token.keys]]\nkid = \"{kid}\"\nalg = \"HS512\"\nsecret = \"{s}\"\n")
            })
            .collect();
        let store = format!("embedded:{}/sessions", dir.display());
        let lines = [
            LOCAL_LOGIN[0],
            LOCAL_LOGIN[1],
            ("token", &active),
            ("credentials", &credentials),
            ("tables", &tables),
        ];
        format!(
            "{}[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n",
            config(port, up_url, &store, &lines)
        )
    }

    /// The config text with these keys, for this instance.
    fn with_keys(&self, jwt: &[(&str, &str)], seal: &[(&str, &str)]) -> String {
        Self::text(
            &self.up_url,
            self.metrics_port,
            self.t.port,
            self.t.dir.path(),
            jwt,
            seal,
        )
    }

    fn rewrite(&self, jwt: &[(&str, &str)], seal: &[(&str, &str)]) {
        std::fs::write(self.t.config_path(), self.with_keys(jwt, seal)).unwrap();
    }

    /// (applied, refused, the last one applied) from /metrics.
    fn reloads(&self) -> (u64, u64, u64) {
        let (_, m) = curl(&[&format!("http://127.0.0.1:{}/metrics", self.metrics_port)]);
        let n = |result: &str| {
            support::sample(
                &m,
                &format!("tessera_config_reloads_total{{result=\"{result}\"}}"),
            )
        };
        let last = support::sample(&m, "tessera_config_last_reload_successful");
        (n("applied"), n("refused"), last)
    }

    fn status(&self, token: &str) -> u16 {
        curl(&["-H", &bearer(token), &self.t.url("/x")]).0
    }

    /// The sealing key id of `user`'s session, from `tessera session list`.
    fn sealed_with(&self, user: &str) -> String {
        let config = self.t.config_path();
        let listed = run_cli(&[
            "session",
            "list",
            "--json",
            "--config",
            config.to_str().unwrap(),
        ]);
        let line = listed
            .lines()
            .find(|l| l.contains(&format!("\"sub\":\"{user}\"")))
            .unwrap();
        serde_json::from_str::<serde_json::Value>(line).unwrap()["key_id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// A token of alice's session, signed with `old` and sealed with `c1`, verified and cached.
    fn alice(&self) -> String {
        let token = token_of(&login(&self.t, "alice", "alice-pw"));
        assert_eq!(header_of(&token)["kid"], "old");
        assert_eq!(self.sealed_with("alice"), "c1");
        assert_eq!(self.status(&token), 200, "verified, and now cached");
        token
    }
}

/// SIGHUP with new keys in front and the old ones still listed: both work, the new ones sign
/// and seal, and a connection open before the reload goes on.
#[test]
fn sighup_puts_new_keys_in_place_beside_the_old_without_a_restart() {
    let r = Reloadable::start();
    let t_alice = r.alice();
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", r.t.port)).unwrap();
    assert_eq!(get_on(&mut conn, r.t.port, &t_alice), 200);
    r.rewrite(&[("k2", K2), ("old", K_OLD)], &[("c2", C2), ("c1", C1)]);
    let log = hangup(&r.t, 1, true);
    assert_eq!(r.reloads(), (1, 0, 1));
    assert!(
        log.contains("token kids [k2, old], signing k2; sealing keys [c1, c2], active c2"),
        "{log}"
    );
    let t_bob = token_of(&login(&r.t, "bob", "bob-pw"));
    assert_eq!(header_of(&t_bob)["kid"], "k2");
    assert_eq!(r.sealed_with("bob"), "c2");
    assert_eq!((r.status(&t_alice), r.status(&t_bob)), (200, 200));
    assert_eq!(
        get_on(&mut conn, r.t.port, &t_bob),
        200,
        "the connection open before the reload"
    );
    let t_bob_old = hs512_with_kid("old", K_OLD, &sid_of(&t_bob));
    assert_eq!(
        r.status(&t_bob_old),
        200,
        "a token of the old key still verifies"
    );
}

/// A reload names what it cannot do, by key: changes that apply only at the next restart (a
/// listen address here; the log once said only "other settings apply at the next restart"),
/// and reloaded keys given as `env:`, which keep the environment the process started with.
#[test]
fn sighup_names_the_keys_it_leaves_for_a_restart() {
    let r = Reloadable::start();
    let text = r.with_keys(&[("old", K_OLD)], &[("c1", C1)]);
    let listen = format!("listen = \"127.0.0.1:{}\"", r.t.port);
    assert!(text.contains(&listen));
    let moved = text.replace(&listen, "listen = \"127.0.0.1:1\"");
    std::fs::write(r.t.config_path(), &moved).unwrap();
    let log = hangup(&r.t, 1, true);
    assert!(
        log.contains("keys=server.listen")
            && log.contains("take effect at the next restart")
            && !log.contains("keys given as env:"),
        "{log}"
    );
    let from_env = moved.replace(C1, "env:TESSERA_ROTATED_KEY");
    std::fs::write(r.t.config_path(), from_env).unwrap();
    let log = hangup(&r.t, 2, false);
    assert!(
        log.contains("keys=credentials.keys.c1") && log.contains("keys given as env:"),
        "{log}"
    );
}

/// A config that does not load changes nothing (its error names the key); nor does one whose
/// keys could not sign for the running login (without [login] it loads, but this instance
/// serves login and a reload does not stop that).
#[test]
fn sighup_with_a_config_that_cannot_serve_changes_nothing() {
    let r = Reloadable::start();
    let t_alice = r.alice();
    std::fs::write(r.t.config_path(), "[token]\nactive_kid = 7\n").unwrap();
    let log = hangup(&r.t, 1, false);
    assert!(log.contains("token.active_kid"), "{log}");
    let mut cut = r.with_keys(&[("k2", K2), ("old", K_OLD)], &[("c2", C2)]);
    for line in [
        "[login]\ncookie_secure = false\nverify_path = \"/check\"\n".to_string(),
        "active_kid = \"k2\"\n".to_string(),
        format!("secret = \"{}\"\n", support::JWT_SECRET),
    ] {
        assert!(cut.contains(&line), "{line} in {cut}");
        cut = cut.replace(&line, "");
    }
    std::fs::write(r.t.config_path(), cut).unwrap();
    let log = hangup(&r.t, 2, false);
    assert!(log.contains("no key can sign"), "{log}");
    assert_eq!(r.reloads(), (0, 2, 0));
    assert_eq!(r.status(&t_alice), 200, "still the first keys");
    let t_bob = token_of(&login(&r.t, "bob", "bob-pw"));
    assert_eq!(header_of(&t_bob)["kid"], "old");
}

/// Keys removed by a reload stop working at once: a token of the removed JWT key is refused
/// although its verification was cached, and a session sealed with a removed key is refused
/// though it was cached too, whichever key signed its token, and its open stream ends; a
/// session sealed with a kept key goes on, on the same connection and in its open stream.
#[test]
fn sighup_removing_keys_refuses_what_they_made_at_once() {
    let r = Reloadable::start();
    let t_alice = r.alice();
    r.rewrite(&[("k2", K2), ("old", K_OLD)], &[("c2", C2), ("c1", C1)]);
    hangup(&r.t, 1, true);
    let t_bob = token_of(&login(&r.t, "bob", "bob-pw"));
    let t_bob_old = hs512_with_kid("old", K_OLD, &sid_of(&t_bob));
    assert_eq!(r.status(&t_bob_old), 200, "verified, and now cached");
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", r.t.port)).unwrap();
    assert_eq!(get_on(&mut conn, r.t.port, &t_bob), 200);
    let mut alice_events = EventStream::open(&r.t, &t_alice);
    let mut bob_events = EventStream::open(&r.t, &t_bob);
    r.rewrite(&[("k2", K2)], &[("c2", C2)]);
    hangup(&r.t, 2, true);
    assert_eq!(r.reloads(), (2, 0, 1));
    assert!(
        alice_events.ended_within(Duration::from_secs(5)).is_some(),
        "alice's open stream ends: her session can no longer be unsealed"
    );
    bob_events.drain();
    assert!(
        bob_events.events_within(1, Duration::from_secs(5)),
        "bob's stream goes on"
    );
    assert_eq!(r.status(&t_bob_old), 401, "a token of a removed JWT key");
    assert_eq!(
        r.status(&hs512_with_kid("k2", K2, &sid_of(&t_alice))),
        401,
        "sealed with a removed key"
    );
    assert_eq!(get_on(&mut conn, r.t.port, &t_bob), 200);
    assert_eq!(r.status(&t_bob), 200);
}

fn run_cli(args: &[&str]) -> String {
    let out = Command::new(bin()).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `session create --password-stdin` at a terminal (a pty made by util-linux `script`) asks
/// for the password with the terminal's echo off: what is typed is not shown.
#[test]
fn a_password_typed_at_a_terminal_is_not_shown() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let store = format!("embedded:{}/s", dir.path().display());
    let path = dir.path().join("tessera.toml");
    std::fs::write(
        &path,
        config(support::free_port(), "http://127.0.0.1:9", &store, &[]),
    )
    .unwrap();
    let command = format!(
        "{} session create --config {} --user alice --password-stdin",
        bin(),
        path.display()
    );
    let mut child = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut chunk = [0u8; 4096];
        while let Ok(n @ 1..) = stdout.read(&mut chunk) {
            let _ = tx.send(chunk[..n].to_vec());
        }
    });
    // Typed once it asks: the terminal echoes anything typed before its echo is off.
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("password: ") {
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(bytes) => seen.extend(bytes),
            Err(_) => panic!("no prompt: {:?}", String::from_utf8_lossy(&seen)),
        }
    }
    // rpassword writes its prompt, then turns the echo off: typed in between, the password
    // would be echoed (a terminal's race, not tessera's). A moment for it to be off.
    std::thread::sleep(Duration::from_millis(500));
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"typed-secret\n").unwrap();
    assert!(child.wait().unwrap().success());
    seen.extend(rx.iter().flatten());
    let shown = String::from_utf8_lossy(&seen);
    assert!(
        shown.contains("\"token\"") && !shown.contains("typed-secret"),
        "{shown}"
    );
}

/// `session create` that cannot give a token for its session (no signing key, a sid claim
/// tessera does not issue, a lifetime past ten years) fails before it stores anything: a
/// session no token names would keep its sealed password until its expiry.
#[test]
fn session_create_stores_nothing_it_cannot_give_a_token_for() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("embedded:{}/s", dir.path().display());
    let path = dir.path().join("tessera.toml");
    let cfg = path.to_str().unwrap();
    let create = |extra: &[(&str, &str)], args: &[&str]| {
        std::fs::write(
            &path,
            config(support::free_port(), "http://127.0.0.1:9", &store, extra),
        )
        .unwrap();
        let mut child = Command::new(bin())
            .args(["session", "create", "--config", cfg, "--user", "alice"])
            .args(["--password-stdin"])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(b"pw\n").unwrap();
        let out = child.wait_with_output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = create(&[("token", "sid_claim = \"uid\"")], &[]);
    assert!(!ok && err.contains("cannot sign token"), "{err}");
    let (ok, err) = create(&[], &["--ttl", "20y"]);
    assert!(!ok && err.contains("--ttl"), "{err}");
    let (ok, err) = create(&[], &["--ttl", "500ms"]);
    assert!(!ok && err.contains("--ttl must be at least 1s"), "{err}");
    // Nothing stored, and no store made either.
    assert!(!dir.path().join("s").exists());
    let (ok, err) = create(&[], &["--ttl", "1h"]);
    assert!(ok, "a good one is stored: {err}");
    assert!(err.contains("made a new embedded store at"), "{err}");
    assert_eq!(
        run_cli(&["session", "list", "--json", "--config", cfg])
            .lines()
            .count(),
        1
    );
}

/// The session commands work on the store `serve` made: run from another working directory
/// (a relative `embedded:` path), `list`, `revoke` and `reseal` refuse (exit 2, naming where
/// they looked) instead of answering from a new empty store, and `check-config` makes nothing.
/// A reader that stops reading `session list` early ends it quietly (exit 0, no panic).
#[test]
fn session_commands_refuse_a_store_that_is_not_there() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tessera.toml");
    let text = config(
        support::free_port(),
        "http://127.0.0.1:9",
        "embedded:./rel",
        &[],
    );
    std::fs::write(&cfg, text).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(bin())
            .args(args)
            .arg("--config")
            .arg(&cfg)
            .current_dir(elsewhere.path())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let looked = format!(
        "no embedded store at {}",
        elsewhere.path().join("rel").display()
    );
    for args in [
        &["session", "list"][..],
        &["session", "revoke", "--user", "mallory"],
        &["session", "reseal"],
    ] {
        let (code, err) = run(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(&looked), "{args:?}: {err}");
    }
    let out = Command::new(bin())
        .args(["check-config", "--config"])
        .arg(&cfg)
        .current_dir(elsewhere.path())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("`tessera serve` makes it there"), "{said}");
    assert!(!elsewhere.path().join("rel").exists(), "a store was made");

    // A store made, one session in it; a reader that goes away at once.
    let mut create = create_alice(&cfg)
        .current_dir(elsewhere.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    create.stdin.take().unwrap().write_all(b"pw\n").unwrap();
    assert!(create.wait().unwrap().success());
    let mut list = Command::new(bin())
        .args(["session", "list", "--config"])
        .arg(&cfg)
        .current_dir(elsewhere.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(list.stdout.take());
    let out = list.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}

/// `tessera session create --user alice --password-stdin` on the config at `cfg`.
fn create_alice(cfg: &std::path::Path) -> Command {
    let mut c = Command::new(bin());
    c.args([
        "session",
        "create",
        "--user",
        "alice",
        "--password-stdin",
        "--config",
    ])
    .arg(cfg);
    c
}

/// A store the command's user may not look at (`serve`'s own, 0700, another user's) is said to
/// be that, naming who to run as, not "no store": `session list` and `check-config` exit 2.
/// `session create` with an empty password makes nothing.
/// (As root, the commands run as `nobody`; else the store's directory is made unsearchable.)
#[test]
fn a_store_another_user_owns_is_said_to_be_unreadable() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let open = |p: &std::path::Path, mode| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    open(dir.path(), 0o755);
    let store = dir.path().join("store");
    let cfg = dir.path().join("tessera.toml");
    let store_spec = format!("embedded:{}", store.display());
    std::fs::write(
        &cfg,
        config(support::free_port(), "http://127.0.0.1:9", &store_spec, &[]),
    )
    .unwrap();
    open(&cfg, 0o644);
    // An empty password (nothing on stdin) makes no session, and no store.
    let empty = create_alice(&cfg)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&empty.stderr);
    assert_eq!(empty.status.code(), Some(2), "{said}");
    assert!(
        said.contains("password on stdin is empty") && !store.exists(),
        "{said}"
    );
    let made = create_alice(&cfg)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write as _;
            c.stdin.take().unwrap().write_all(b"pw\n")?;
            c.wait_with_output()
        })
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    let root = rustix::process::getuid().is_root();
    let binary = dir.path().join("tessera");
    std::fs::copy(bin(), &binary).unwrap();
    let as_other = |args: &[&str]| {
        let mut c = if root {
            let mut c = Command::new("setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
                .arg(&binary);
            c
        } else {
            Command::new(&binary)
        };
        let out = c.args(args).arg("--config").arg(&cfg).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // Searchable again at the end, also after a failed assert, so the directory can go.
    struct Restore<'a>(&'a std::path::Path);
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            let mode = std::fs::Permissions::from_mode(0o700);
            let _ = std::fs::set_permissions(self.0, mode);
        }
    }
    let _restore = Restore(&store);
    if !root {
        open(&store, 0o000);
    }
    for args in [&["session", "list"][..], &["check-config"]] {
        let (code, err) = as_other(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(
            err.contains("cannot look at the embedded store") && err.contains("Permission denied"),
            "{args:?}: {err}"
        );
    }
}

/// `session revoke --user` ends every session of a user (the name in any case), `--sid-hash`
/// the one session a list or a log line shows by its hash; others go on. One that finds none
/// says so.
#[test]
fn the_cli_revokes_a_users_sessions_or_one_by_its_hash() {
    let up = upstream::start(Behavior::Echo {
        delay: Duration::ZERO,
    });
    let upstream = up.url();
    let t = Tessera::start(move |port, dir| {
        config(
            port,
            &upstream,
            &format!("embedded:{}/s", dir.display()),
            &[],
        )
    });
    let (_, alice1) = t.create_session("alice", "pw");
    // Signed in as typed: Cyrus and most directories take the name in any case.
    let (_, alice2) = t.create_session("Alice", "pw");
    let (_, bob) = t.create_session("bob", "pw");
    for token in [&alice1, &alice2, &bob] {
        assert_eq!(status_with(&t, token), 200);
    }
    let cfg = t.config_path();
    let cfg = cfg.to_str().unwrap();
    let out = run_cli(&["session", "revoke", "--config", cfg, "--user", "alice"]);
    let out: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(out["revoked"], 2, "{out}");
    let until_refused = |token: &str| {
        let start = Instant::now();
        while status_with(&t, token) != 401 {
            assert!(start.elapsed() < Duration::from_secs(10), "still served");
        }
    };
    until_refused(&alice1);
    until_refused(&alice2);
    assert_eq!(status_with(&t, &bob), 200);
    let listed = run_cli(&["session", "list", "--json", "--config", cfg]);
    let bob_hash = serde_json::from_str::<serde_json::Value>(listed.trim()).unwrap()["sid_hash"]
        .as_str()
        .unwrap()
        .to_string();
    let out = run_cli(&[
        "session",
        "revoke",
        "--config",
        cfg,
        "--sid-hash",
        &bob_hash,
    ]);
    let out: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(out["sid_hashes"], serde_json::json!([bob_hash]), "{out}");
    until_refused(&bob);
    // A revoke that finds nothing says so (exit 0: nothing of it is left either way).
    for selector in [["--user", "mallory"], ["--sid", "no-such-sid"]] {
        let out = Command::new(bin())
            .args(["session", "revoke", "--config", cfg])
            .args(selector)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(err.contains("no session matched"), "{selector:?}: {err}");
    }
}

#[test]
fn sealing_key_rotation_and_reseal_move_every_session() {
    let up = users();
    let redis = Redis::start();
    const C1: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
    const C2: &str = "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=";
    let one = format!("keys = {{ c1 = \"{C1}\" }}");
    let first = on_redis(&up, &redis, &[("credentials", &one)]);
    let t_alice = token_of(&login(&first, "alice", "alice-pw"));
    let t_bob = token_of(&login(&first, "bob", "bob-pw"));
    let values = || -> Vec<String> {
        session_keys(&redis)
            .iter()
            .map(|k| redis.cli(&["GET", k]))
            .collect()
    };
    assert!(
        values().iter().all(|v| v.contains("\"tsl1.c1.")),
        "{:?}",
        values()
    );

    // rotate: c2 seals, c1 still unseals
    let two = format!("keys = {{ c1 = \"{C1}\", c2 = \"{C2}\" }}\nactive = \"c2\"");
    let rotated = on_redis(&up, &redis, &[("credentials", &two)]);
    assert_eq!(curl(&["-H", &bearer(&t_alice), &rotated.url("/x")]).0, 200);
    let t_carol_up = token_of(&login(&rotated, "bob", "bob-pw"));
    assert_eq!(
        values().iter().filter(|v| v.contains("\"tsl1.c2.")).count(),
        1
    );

    let listed = run_cli(&[
        "session",
        "list",
        "--json",
        "--config",
        rotated.config_path().to_str().unwrap(),
    ]);
    assert_eq!(listed.lines().count(), 3, "{listed}");
    assert!(listed.contains("\"sub\":\"alice\"") && listed.contains("\"key_id\":\"c1\""));
    assert!(
        !listed.contains("alice-pw") && !listed.contains(&sid_of(&t_alice)),
        "{listed}"
    );
    let table = run_cli(&[
        "session",
        "list",
        "--config",
        rotated.config_path().to_str().unwrap(),
    ]);
    assert!(
        table.starts_with("SID_HASH") && table.contains("alice"),
        "{table}"
    );

    let report: serde_json::Value = serde_json::from_str(&run_cli(&[
        "session",
        "reseal",
        "--config",
        rotated.config_path().to_str().unwrap(),
    ]))
    .unwrap();
    assert_eq!(report["total"], 3);
    assert_eq!(report["resealed"], 2);
    assert_eq!(report["already_active"], 1);
    assert!(
        values().iter().all(|v| v.contains("\"tsl1.c2.")),
        "{:?}",
        values()
    );
    let ttl: i64 = redis
        .cli(&["TTL", &session_keys(&redis)[0]])
        .trim()
        .parse()
        .unwrap();
    assert!(ttl > 40_000, "reseal keeps the expiry: {ttl}");

    // A reseal from a config that lacks c2 opens none of them: it says so and exits 1, so
    // that a rotation script stops before removing a key.
    let stale = Command::new(bin())
        .args(["session", "reseal", "--config"])
        .arg(first.config_path())
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&stale.stdout).unwrap();
    assert_eq!(report["unreadable"], 3, "{report}");
    assert_eq!(stale.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&stale.stderr).contains("could not be opened"));

    // c1 retired: every session still works
    let only_c2 = format!("keys = {{ c2 = \"{C2}\" }}");
    let last = on_redis(&up, &redis, &[("credentials", &only_c2)]);
    for t in [&t_alice, &t_bob, &t_carol_up] {
        assert_eq!(curl(&["-H", &bearer(t), &last.url("/x")]).0, 200);
    }
}

fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Ed25519 key pair in `dir`: (private PEM path, public PEM path, JWK `x`).
fn ed25519(dir: &std::path::Path, name: &str) -> (String, String, String) {
    use base64::Engine;
    let key = dir.join(format!("{name}.pem"));
    let publ = dir.join(format!("{name}.pub.pem"));
    let der = dir.join(format!("{name}.pub.der"));
    openssl(&[
        "genpkey",
        "-algorithm",
        "ed25519",
        "-out",
        key.to_str().unwrap(),
    ]);
    openssl(&[
        "pkey",
        "-in",
        key.to_str().unwrap(),
        "-pubout",
        "-out",
        publ.to_str().unwrap(),
    ]);
    openssl(&[
        "pkey",
        "-in",
        key.to_str().unwrap(),
        "-pubout",
        "-outform",
        "DER",
        "-out",
        der.to_str().unwrap(),
    ]);
    let raw = std::fs::read(&der).unwrap();
    let x = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&raw[raw.len() - 32..]);
    (
        key.to_str().unwrap().into(),
        publ.to_str().unwrap().into(),
        x,
    )
}

fn sign_pem(alg: jsonwebtoken::Algorithm, kid: &str, pem_path: &str, sid: &str) -> String {
    let pem = std::fs::read(pem_path).unwrap();
    let key = match alg {
        jsonwebtoken::Algorithm::EdDSA => jsonwebtoken::EncodingKey::from_ed_pem(&pem),
        jsonwebtoken::Algorithm::ES256 => jsonwebtoken::EncodingKey::from_ec_pem(&pem),
        _ => jsonwebtoken::EncodingKey::from_rsa_pem(&pem),
    }
    .unwrap();
    let mut header = jsonwebtoken::Header::new(alg);
    header.kid = Some(kid.to_string());
    let claims = serde_json::json!({"sub": "alice", "sid": sid, "iat": support_now(), "exp": support_now() + 600});
    jsonwebtoken::encode(&header, &claims, &key).unwrap()
}

/// PEM files made by openssl in `d`: an RSA 2048 key, a P-256 key (PKCS#8), and their public keys.
struct Pems {
    rsa: String,
    rsa_pub: String,
    ec8: String,
    ec_pub: String,
}

fn rsa_and_ec_pems(d: &std::path::Path) -> Pems {
    let path = |name: &str| d.join(name).to_str().unwrap().to_owned();
    let p = Pems {
        rsa: path("rsa.pem"),
        rsa_pub: path("rsa.pub.pem"),
        ec8: path("ec8.pem"),
        ec_pub: path("ec.pub.pem"),
    };
    let ec = path("ec.pem");
    let rsa_bits = "rsa_keygen_bits:2048";
    openssl(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        rsa_bits,
        "-out",
        &p.rsa,
    ]);
    openssl(&["pkey", "-in", &p.rsa, "-pubout", "-out", &p.rsa_pub]);
    let curve = "ec_paramgen_curve:P-256";
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        curve,
        "-out",
        &ec,
    ]);
    openssl(&["pkcs8", "-topk8", "-nocrypt", "-in", &ec, "-out", &p.ec8]);
    openssl(&["pkey", "-in", &ec, "-pubout", "-out", &p.ec_pub]);
    p
}

/// The status of a request to `/x` with `token`.
fn status_with(t: &Tessera, token: &str) -> u16 {
    curl(&["-H", &bearer(token), &t.url("/x")]).0
}

/// An EdDSA key signs the login's tokens; RS256 and ES256 public keys from PEM files verify
/// tokens signed elsewhere for the same session; a key id is bound to its algorithm.
#[test]
fn eddsa_signs_and_pem_public_keys_verify_each_bound_to_its_alg() {
    let up = users();
    let redis = Redis::start();
    let keys = tempfile::tempdir().unwrap();
    let d = keys.path();
    let (ed_priv, ed_pub, _) = ed25519(d, "ed1");
    let p = rsa_and_ec_pems(d);
    let tables = format!(
        "[[token.keys]]\nkid = \"ed1\"\nalg = \"EdDSA\"\nprivate_key = \"file:{ed_priv}\"\npublic_key = \"file:{ed_pub}\"\n\
         [[token.keys]]\nkid = \"rsa1\"\nalg = \"RS256\"\npublic_key = \"file:{}\"\n\
         [[token.keys]]\nkid = \"ec1\"\nalg = \"ES256\"\npublic_key = \"file:{}\"",
        p.rsa_pub, p.ec_pub
    );
    let extra = [("token", "active_kid = \"ed1\""), ("tables", &tables)];
    let t = on_redis(&up, &redis, &extra);
    let token = token_of(&login(&t, "alice", "alice-pw"));
    let h = header_of(&token);
    assert_eq!(
        (h["alg"].as_str(), h["kid"].as_str()),
        (Some("EdDSA"), Some("ed1"))
    );
    assert_eq!(status_with(&t, &token), 200);
    let sid = sid_of(&token);
    use jsonwebtoken::Algorithm::{ES256, RS256};
    let rs = sign_pem(RS256, "rsa1", &p.rsa, &sid);
    assert_eq!(status_with(&t, &rs), 200, "RS256 PEM public key");
    let es = sign_pem(ES256, "ec1", &p.ec8, &sid);
    assert_eq!(status_with(&t, &es), 200, "ES256 PEM public key");
    let wrong_alg = sign_pem(RS256, "ec1", &p.rsa, &sid);
    assert_eq!(status_with(&t, &wrong_alg), 401, "kid bound to its alg");
}

/// A JWKS file's keys verify; when the identity provider rotates, a token with an unknown kid
/// makes tessera read the document again (at most once per `jwks_min_refresh_seconds`), and a
/// key gone from it stops verifying.
#[test]
fn a_jwks_file_is_read_again_on_an_unknown_kid() {
    let up = users();
    let redis = Redis::start();
    let keys = tempfile::tempdir().unwrap();
    let d = keys.path();
    let (idp_priv, _, idp_x) = ed25519(d, "idp1");
    let (idp2_priv, _, idp2_x) = ed25519(d, "idp2");
    let jwks = d.join("jwks.json");
    let doc = |keys: &[(&str, &str)]| {
        let keys: Vec<_> = keys
            .iter()
            .map(|(kid, x)| serde_json::json!({"kty": "OKP", "crv": "Ed25519", "kid": kid, "x": x, "use": "sig"}))
            .collect();
        serde_json::json!({ "keys": keys }).to_string()
    };
    std::fs::write(&jwks, doc(&[("idp1", &idp_x)])).unwrap();
    let jwks_line = format!(
        "jwks = \"file:{}\"\njwks_min_refresh_seconds = 1",
        jwks.display()
    );
    let t = on_redis(&up, &redis, &[("token", &jwks_line)]);
    let sid = sid_of(&token_of(&login(&t, "alice", "alice-pw")));
    use jsonwebtoken::Algorithm::EdDSA;
    let idp = sign_pem(EdDSA, "idp1", &idp_priv, &sid);
    assert_eq!(status_with(&t, &idp), 200, "JWKS key");
    let idp2 = sign_pem(EdDSA, "idp2", &idp2_priv, &sid);
    assert_eq!(status_with(&t, &idp2), 401, "not published yet");
    std::fs::write(&jwks, doc(&[("idp2", &idp2_x)])).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(status_with(&t, &idp2), 200, "refreshed on unknown kid");
    // idp1 is gone from the document: the next refresh drops it
    std::thread::sleep(Duration::from_millis(1100));
    let unknown = sign_pem(EdDSA, "idp9", &idp_priv, &sid);
    assert_eq!(status_with(&t, &unknown), 401);
    assert_eq!(status_with(&t, &idp), 401, "retired by the IdP");
}

#[test]
fn jwks_over_http_is_fetched_at_start() {
    let up = users();
    let redis = Redis::start();
    let keys = tempfile::tempdir().unwrap();
    let (idp_priv, jwks_server, _) = idp_with_jwks_server(keys.path());
    let token_lines = format!("jwks = \"http://127.0.0.1:{jwks_server}/.well-known/jwks.json\"");
    let t = on_redis(&up, &redis, &[("token", &token_lines)]);
    let (sid, _) = t.create_session("alice", "alice-pw");
    let idp = sign_pem(jsonwebtoken::Algorithm::EdDSA, "idp", &idp_priv, &sid);
    assert_eq!(curl(&["-H", &bearer(&idp), &t.url("/x")]).0, 200);
    assert!(t.log().contains("JWKS loaded"), "{}", t.log());
}

/// SIGTERM while tessera still starts (its first JWKS fetch waits on an IdP that accepts and
/// never answers) is a shutdown once serving begins, exit 0 and logged, not the signal's
/// default action (the process ended unlogged).
#[test]
fn sigterm_during_start_up_is_a_clean_shutdown() {
    let up = users();
    let redis = Redis::start();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let token_lines = format!("jwks = \"http://127.0.0.1:{port}/jwks.json\"");
    let mut t = on_redis(&up, &redis, &[("token", &token_lines)]);
    assert!(!t.log().contains("tessera serving"), "{}", t.log());
    t.signal("-TERM");
    let status = t.exit_status(Duration::from_secs(30));
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "{status:?}: {}",
        t.log()
    );
    assert!(t.log().contains("shutdown: done"), "{}", t.log());
}

/// A JWKS over https (nginx with TLS, a certificate for 127.0.0.1 from a throw-away CA made
/// by the openssl CLI): loaded when `token.jwks_ca` names that CA; without it the system's
/// roots are used, the certificate is refused, no key is loaded and the token gets 401.
#[test]
fn jwks_over_https_is_fetched_with_the_certificate_checked() {
    let up = users();
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (idp_priv, port, _nginx) = idp_jwks(dir.path());
    let ca = dir.path().join("ca.pem");
    let url = format!("https://127.0.0.1:{port}/jwks.json");
    assert_eq!(
        curl(&["--cacert", &ca.display().to_string(), &url]).0,
        200,
        "the JWKS server itself"
    );

    let trusted = format!("jwks = \"{url}\"\njwks_ca = \"file:{}\"", ca.display());
    let t = on_redis(&up, &redis, &[("token", &trusted)]);
    let (sid, _) = t.create_session("alice", "alice-pw");
    let idp = sign_pem(jsonwebtoken::Algorithm::EdDSA, "idp", &idp_priv, &sid);
    assert_eq!(curl(&["-H", &bearer(&idp), &t.url("/x")]).0, 200);
    assert!(t.log().contains("JWKS loaded"), "{}", t.log());

    let system_roots = format!("jwks = \"{url}\"");
    let u = on_redis(&up, &redis, &[("token", &system_roots)]);
    assert_eq!(
        curl(&["-H", &bearer(&idp), &u.url("/x")]).0,
        401,
        "a key from a server whose certificate no trusted CA signed"
    );
    let log = u.log();
    assert!(
        log.contains("JWKS refresh failed") && log.contains("TLS") && log.contains("certificate"),
        "{log}"
    );
    assert!(!log.contains("JWKS loaded"), "{log}");
    // check-config fetches it as serve would: it says so, not "ok" (serve only warns).
    let check = |t: &Tessera| {
        let out = Command::new(bin())
            .args(["check-config", "--config"])
            .arg(t.config_path())
            .output()
            .unwrap();
        let said = [out.stdout, out.stderr].concat();
        (
            out.status.code(),
            String::from_utf8_lossy(&said).into_owned(),
        )
    };
    let (code, said) = check(&t);
    assert!(
        code == Some(0) && said.contains("token.jwks: 1 key(s)"),
        "{said}"
    );
    let (code, said) = check(&u);
    assert!(
        code == Some(2) && said.contains("config key `token.jwks`") && said.contains("certificate"),
        "{said}"
    );

    // The trusted CA, but a name the certificate does not carry (it is for IP 127.0.0.1).
    let by_name = format!(
        "jwks = \"https://localhost:{port}/jwks.json\"\njwks_ca = \"file:{}\"",
        ca.display()
    );
    let v = on_redis(&up, &redis, &[("token", &by_name)]);
    assert_eq!(curl(&["-H", &bearer(&idp), &v.url("/x")]).0, 401);
    let log = v.log();
    assert!(
        log.contains("JWKS refresh failed") && log.contains("not valid for name \"localhost\""),
        "{log}"
    );
}

/// A renewed `token.jwks_ca` (here a new file, the provider's new CA in it) is put in place by
/// SIGHUP, and the JWKS fetched again at once: a provider certificate the old CA did not sign
/// is then trusted without a restart or waiting for the next refresh.
#[test]
fn sighup_puts_a_renewed_jwks_ca_in_place_and_fetches_the_jwks_again() {
    let up = users();
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (idp_priv, port, _nginx) = idp_jwks(dir.path());
    // Another CA, which did not sign the provider's certificate.
    let other = tempfile::tempdir().unwrap();
    let (_, _other_nginx) = https_server(other.path());
    let ca = dir.path().join("idp-ca.pem");
    std::fs::copy(other.path().join("ca.pem"), &ca).unwrap();

    let url = format!("https://127.0.0.1:{port}/jwks.json");
    let token = format!("jwks = \"{url}\"\njwks_ca = \"file:{}\"", ca.display());
    let t = on_redis(&up, &redis, &[("token", &token)]);
    let (sid, _) = t.create_session("alice", "alice-pw");
    let idp = sign_pem(jsonwebtoken::Algorithm::EdDSA, "idp", &idp_priv, &sid);
    assert_eq!(curl(&["-H", &bearer(&idp), &t.url("/x")]).0, 401);
    assert!(t.log().contains("JWKS refresh failed"), "{}", t.log());

    let renewed = dir.path().join("idp-ca-2027.pem");
    std::fs::copy(dir.path().join("ca.pem"), &renewed).unwrap();
    let text = std::fs::read_to_string(t.config_path()).unwrap();
    let text = text.replace(&ca.display().to_string(), &renewed.display().to_string());
    std::fs::write(t.config_path(), text).unwrap();
    t.signal("-HUP");
    let log = t.log_when(|l| l.contains("JWKS loaded"));
    assert!(log.contains("JWKS loaded"), "{log}");
    assert!(
        !log.contains("keys=token.jwks_ca"),
        "not a restart-only key: {log}"
    );
    assert_eq!(curl(&["-H", &bearer(&idp), &t.url("/x")]).0, 200);
}

/// An identity provider's key `idp` (Ed25519) in `dir`, its JWKS served over https by
/// [`https_server`]: the private key (as [`ed25519`] gives it), the port, and the server's guard.
fn idp_jwks(dir: &std::path::Path) -> (String, u16, impl Drop) {
    let (idp_priv, _, idp_x) = ed25519(dir, "idp");
    let doc =
        serde_json::json!({"keys": [{"kty": "OKP", "crv": "Ed25519", "kid": "idp", "x": idp_x}]});
    std::fs::write(dir.join("jwks.json"), doc.to_string()).unwrap();
    let (port, nginx) = https_server(dir);
    (idp_priv, port, nginx)
}

/// nginx serving `dir`/jwks.json at `/jwks.json` over TLS on a free port, with a server
/// certificate for IP 127.0.0.1 signed by a CA made here (`dir`/ca.pem); the port and a guard
/// that stops nginx.
fn https_server(dir: &std::path::Path) -> (u16, impl Drop) {
    struct Stop(std::process::Child);
    impl Drop for Stop {
        fn drop(&mut self) {
            support::terminate(&mut self.0);
        }
    }
    support::require("nginx");
    support::require("openssl");
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl (installed by scripts/test.sh)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=tessera test CA",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign",
            ],
        ]
        .concat(),
    );
    openssl(
        &[
            &["req"][..],
            &ec,
            &[
                "-keyout",
                "srv.key",
                "-out",
                "srv.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        ]
        .concat(),
    );
    std::fs::write(
        dir.join("srv.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.pem",
        "-days",
        "2",
        "-extfile",
        "srv.ext",
    ]);
    let port = support::free_port();
    let d = dir.display();
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    let conf = format!(
        "worker_processes 1; daemon off; pid {d}/nginx.pid; error_log {d}/nginx-error.log warn;
events {{ worker_connections 64; }}
http {{
  access_log off;
  client_body_temp_path {d}/tmp; proxy_temp_path {d}/tmp; fastcgi_temp_path {d}/tmp;
  uwsgi_temp_path {d}/tmp; scgi_temp_path {d}/tmp;
  server {{
    listen 127.0.0.1:{port} ssl;
    ssl_certificate {d}/srv.pem; ssl_certificate_key {d}/srv.key;
    location = /jwks.json {{ default_type application/json; alias {d}/jwks.json; }}
  }}
}}
"
    );
    std::fs::write(dir.join("nginx.conf"), conf).unwrap();
    let child = Command::new("nginx")
        .args(["-p", &d.to_string(), "-c", &format!("{d}/nginx.conf")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("nginx (installed by scripts/test.sh)");
    let stop = Stop(child);
    support::wait_for_port(port, "nginx (TLS)");
    (port, stop)
}

/// An Ed25519 identity-provider key `idp` made in `dir`, and a JWKS server publishing it: the
/// private key's path, the server's port, and how many requests it has answered.
fn idp_with_jwks_server(
    dir: &std::path::Path,
) -> (String, u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let (idp_priv, _, idp_x) = ed25519(dir, "idp");
    let doc =
        serde_json::json!({"keys": [{"kty": "OKP", "crv": "Ed25519", "kid": "idp", "x": idp_x}]})
            .to_string();
    let (port, served) = support::upstream::serve_static(doc);
    (idp_priv, port, served)
}

/// `tessera::run` ends its JWKS refresh task when it returns: a program embedding the proxy
/// that stops it stops fetching keys too.
#[test]
fn run_stops_refreshing_the_jwks_when_it_returns() {
    let keys = tempfile::tempdir().unwrap();
    let (_, jwks_port, fetches) = idp_with_jwks_server(keys.path());
    let token_lines =
        format!("jwks = \"http://127.0.0.1:{jwks_port}/jwks.json\"\njwks_refresh_seconds = 1");
    let text = config(
        support::free_port(),
        "http://127.0.0.1:9",
        &format!("embedded:{}/sessions", keys.path().display()),
        &[("token", &token_lines)],
    );
    let cfg = tessera::Config::from_toml(&text).unwrap();
    // The runtime outlives `run`: a task `run` left behind would go on fetching on it.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let count = || fetches.load(std::sync::atomic::Ordering::SeqCst);
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        // Stopped 300 ms after the first refresh (a fetch at start, then one a second later):
        // the next is 700 ms away, so none is in flight when `run` returns.
        let shutdown = async {
            while count() < 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        };
        let listeners = tessera::Listeners {
            plain: Some(listener),
            ..Default::default()
        };
        tessera::run(cfg, listeners, tokio::sync::mpsc::channel(1).1, shutdown)
            .await
            .unwrap();
    });
    let at_return = count();
    assert!(
        at_return >= 2,
        "JWKS fetched {at_return} times while running"
    );
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(
        fetches.load(std::sync::atomic::Ordering::SeqCst),
        at_return,
        "fetched after run returned"
    );
}

fn redis_calls(redis: &Redis, cmd: &str) -> u64 {
    redis
        .cli(&["INFO", "commandstats"])
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

#[test]
fn warm_requests_touch_no_store_and_any_writer_evicts() {
    let up = users();
    let redis = Redis::start();
    let a = on_redis(&up, &redis, &[]);
    let b = on_redis(&up, &redis, &[]);
    let token = token_of(&login(&a, "alice", "alice-pw"));
    assert_eq!(curl(&["-H", &bearer(&token), &b.url("/x")]).0, 200);
    let gets = redis_calls(&redis, "get");
    for _ in 0..25 {
        assert_eq!(curl(&["-H", &bearer(&token), &b.url("/x")]).0, 200);
    }
    assert_eq!(
        redis_calls(&redis, "get") - gets,
        0,
        "warm requests read no session"
    );

    // A DEL by any writer (here redis-cli, not tessera) reaches B's cache through tracking.
    let key = session_keys(&redis).pop().unwrap();
    redis.cli(&["DEL", &key]);
    let refused = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(2));
        curl(&["-H", &bearer(&token), &b.url("/x")]).0 == 401
    });
    assert!(refused, "external DEL evicted the cached session");

    // Losing the invalidation connection flushes the cache; a revocation made while it
    // reconnects is still honoured.
    let token = token_of(&login(&a, "bob", "bob-pw"));
    assert_eq!(curl(&["-H", &bearer(&token), &b.url("/x")]).0, 200);
    redis.cli(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
    let key = session_keys(&redis).pop().unwrap();
    redis.cli(&["DEL", &key]);
    assert_eq!(curl(&["-H", &bearer(&token), &b.url("/x")]).0, 401);
    assert!(b.log().contains("invalidation stream lost"), "{}", b.log());
    // and the cache comes back: warm again after one read
    let token = token_of(&login(&a, "alice", "alice-pw"));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(curl(&["-H", &bearer(&token), &b.url("/x")]).0, 200);
    let gets = redis_calls(&redis, "get");
    for _ in 0..10 {
        assert_eq!(curl(&["-H", &bearer(&token), &b.url("/x")]).0, 200);
    }
    assert_eq!(
        redis_calls(&redis, "get") - gets,
        0,
        "cache live again after reconnect"
    );
}

/// A tessera on the embedded store in front of `up`, with the `[upstream]` lines `pool`.
fn with_pool(up: &TestUpstream, pool: &[&str]) -> Tessera {
    let url = up.url();
    let pool: Vec<String> = pool.iter().map(|l| l.to_string()).collect();
    Tessera::start(move |port, dir| {
        let lines: Vec<(&str, &str)> = pool.iter().map(|l| ("upstream", l.as_str())).collect();
        config(port, &url, &format!("embedded:{}/s", dir.display()), &lines)
    })
}

/// A GET of `/events` asking for an event stream with `token`, given up after `secs` seconds.
fn events_within(t: &Tessera, token: &str, secs: &str) -> Answer {
    call(&[
        "--max-time",
        secs,
        "-H",
        &bearer(token),
        "-H",
        "Accept: text/event-stream",
        &t.url("/events"),
    ])
}

/// `upstream.max_event_streams`: an event stream past it is answered 503 with `Retry-After`,
/// never queued, while API calls still find upstream connections; a place its stream left is
/// taken again.
#[test]
fn event_streams_past_their_cap_are_refused_and_api_calls_go_on() {
    let up = users();
    let pool = [
        "max_connections = 3",
        "max_connections_per_user = 3",
        "max_event_streams = 2",
    ];
    let t = with_pool(&up, &pool);
    let (_, token) = t.create_session("alice", "alice-pw");
    let first = EventStream::open(&t, &token);
    let _second = EventStream::open(&t, &token);
    let third = events_within(&t, &token, "5");
    assert_eq!(third.code, 503, "{} {}", third.headers, third.body);
    assert!(
        third
            .headers
            .to_ascii_lowercase()
            .contains("retry-after: 1"),
        "{}",
        third.headers
    );
    assert!(upstream_streams(&up, 2), "the third reached the upstream");
    for _ in 0..3 {
        assert_eq!(curl(&["-H", &bearer(&token), &t.url("/x")]).0, 200);
    }
    // The first page leaves: its place is found free once tessera's next write fails.
    drop(first);
    let reopened = (0..100).any(|_| {
        let code = events_within(&t, &token, "1").code;
        code == 200 || {
            std::thread::sleep(Duration::from_millis(50));
            false
        }
    });
    assert!(
        reopened,
        "the place of a closed stream was not freed: {}",
        t.log()
    );
    // A serving thread writes its access lines when it next idles.
    let log = t.log_when(|l| l.contains("too many event streams"));
    assert!(log.contains("too many event streams"), "{log}");
}

/// With per-user shares, one user holds at most its share's part of the event-stream places
/// (here 4 of 8 connections: 2 of the 4 places), so its pages cannot take them all.
#[test]
fn one_user_cannot_take_every_event_stream_place() {
    let up = users();
    let pool = [
        "max_connections = 8",
        "max_connections_per_user = 4",
        "max_event_streams = 4",
    ];
    let t = with_pool(&up, &pool);
    let (_, alice) = t.create_session("alice", "alice-pw");
    let (_, bob) = t.create_session("bob", "bob-pw");
    let _pages = [EventStream::open(&t, &alice), EventStream::open(&t, &alice)];
    let third = events_within(&t, &alice, "5");
    assert_eq!(third.code, 503, "{} {}", third.headers, third.body);
    let _bobs = [EventStream::open(&t, &bob), EventStream::open(&t, &bob)];
    assert!(upstream_streams(&up, 4));
}

/// One account under names in other cases (`alice`, `Alice`: one account to an upstream that
/// folds case, as Cyrus does) holds one share of the pool, not one per spelling.
#[test]
fn an_account_in_another_case_holds_the_same_share() {
    let up = users();
    up.stats.set_password("Alice", "alice-pw");
    let pool = [
        "max_connections = 4",
        "max_connections_per_user = 2",
        "max_event_streams = 4",
    ];
    let t = with_pool(&up, &pool);
    let (_, lower) = t.create_session("alice", "alice-pw");
    let (_, upper) = t.create_session("Alice", "alice-pw");
    let (_, bob) = t.create_session("bob", "bob-pw");
    let _held = [EventStream::open(&t, &lower), EventStream::open(&t, &lower)];
    // A third of the account's, in another case: it waits for one of its own to end.
    let third = events_within(&t, &upper, "2");
    assert_eq!(third.code, 0, "{} {}", third.headers, third.body);
    assert!(upstream_streams(&up, 2), "the third reached the upstream");
    // The others are not held up by it.
    assert_eq!(curl(&["-H", &bearer(&bob), &t.url("/x")]).0, 200);
}

/// Waits up to 5 s for the upstream to be sending exactly `n` event streams.
fn upstream_streams(up: &TestUpstream, n: usize) -> bool {
    (0..250).any(|_| {
        let now = up
            .stats
            .streams_open
            .load(std::sync::atomic::Ordering::SeqCst);
        now == n || {
            std::thread::sleep(Duration::from_millis(20));
            false
        }
    })
}

#[test]
fn logout_ends_the_sessions_open_streams_on_every_instance_and_no_other() {
    let up = users();
    let redis = Redis::start();
    let a = on_redis(&up, &redis, &[]);
    let b = on_redis(&up, &redis, &[]);
    let alice = token_of(&login(&a, "alice", "alice-pw"));
    let bob = token_of(&login(&a, "bob", "bob-pw"));
    let mut alice_a = EventStream::open(&a, &alice);
    let mut alice_b = EventStream::open(&b, &alice);
    let mut bob_a = EventStream::open(&a, &bob);
    // and alice over h2c (prior knowledge), where a cut is a stream reset
    let mut alice_h2 = Command::new("curl")
        .args(["-sN", "--http2-prior-knowledge", "-o", "/dev/null"])
        .args(["-H", &bearer(&alice), &a.url("/events")])
        .spawn()
        .unwrap();
    assert!(upstream_streams(&up, 4), "the four streams did not start");

    // A write that leaves the session usable (another writer rewriting it) ends nothing, even
    // though both instances read it again.
    let alice_key = session_keys(&redis)
        .into_iter()
        .find(|k| redis.cli(&["GET", k]).contains("\"sub\":\"alice\""))
        .unwrap();
    let record = redis.cli(&["GET", &alice_key]);
    let gets = redis_calls(&redis, "get");
    redis.cli(&["SET", &alice_key, &record, "KEEPTTL"]);
    let reread = (0..250).any(|_| {
        std::thread::sleep(Duration::from_millis(20));
        redis_calls(&redis, "get") >= gets + 2
    });
    assert!(
        reread,
        "the instances did not read the rewritten session again"
    );
    // Both read it: anything buffered before now is not proof the streams live on.
    std::thread::sleep(Duration::from_millis(100));
    alice_a.drain();
    alice_b.drain();
    assert!(upstream_streams(&up, 4), "a rewrite ended a stream");
    assert!(
        alice_a.events_within(3, Duration::from_secs(5)),
        "a rewrite ended A's stream"
    );
    assert!(
        alice_b.events_within(3, Duration::from_secs(5)),
        "a rewrite ended B's stream"
    );

    // Logout on B: alice's streams end on B at once and on A within milliseconds.
    let logout = std::time::Instant::now();
    let out = call(&["-X", "POST", "-H", &bearer(&alice), &b.url("/auth/logout")]);
    assert_eq!(out.code, 204, "{}", out.body);
    let on_b = alice_b
        .ended_within(Duration::from_secs(5))
        .map(|_| logout.elapsed());
    let on_a = alice_a
        .ended_within(Duration::from_secs(5))
        .map(|_| logout.elapsed());
    println!(
        "alice's streams ended, counted from the logout request (curl included): on B (same \
         instance) {on_b:?}, on A {on_a:?}"
    );
    assert!(
        on_b.is_some(),
        "B kept alice's stream open after her logout"
    );
    assert!(
        on_a.is_some(),
        "A kept alice's stream open after her logout on B"
    );
    let h2_ended = (0..250).find_map(|_| {
        std::thread::sleep(Duration::from_millis(20));
        alice_h2.try_wait().unwrap()
    });
    let status = h2_ended.expect("the h2 stream stayed open after logout");
    assert!(
        !status.success(),
        "the h2 stream ended as if complete: {status}"
    );

    // Bob's stream, on the same instance and upstream, goes on (events sent after alice's
    // streams ended); the upstream stops sending alice's three.
    bob_a.drain();
    assert!(
        bob_a.events_within(3, Duration::from_secs(5)),
        "bob's stream ended"
    );
    assert!(
        upstream_streams(&up, 1),
        "the upstream still sends alice's streams"
    );
    let log = a.log_when(|l| l.contains("open responses of a revoked session ended"));
    assert!(
        log.contains("open responses of a revoked session ended"),
        "{log}"
    );
    assert!(!log.contains(&alice) && !log.contains("alice-pw"));
}

#[test]
fn a_revocation_while_the_invalidation_stream_is_down_ends_the_stream_when_it_is_back() {
    let up = users();
    let redis = Redis::start();
    let a = on_redis(&up, &redis, &[]);
    let alice = token_of(&login(&a, "alice", "alice-pw"));
    let key = session_keys(&redis).pop().unwrap();
    let bob = token_of(&login(&a, "bob", "bob-pw"));
    let mut stream = EventStream::open(&a, &alice);
    let mut bobs = EventStream::open(&a, &bob);
    // Both commands in one redis-cli run, microseconds apart: the DEL happens while tessera's
    // tracking connection is gone (it reconnects after 100 ms), so no invalidation names it.
    let mut cli = Command::new("redis-cli")
        .args(["-p", &redis.port.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = cli.stdin.take().unwrap();
        writeln!(stdin, "CLIENT KILL TYPE normal SKIPME yes\nDEL {key}").unwrap();
    }
    assert!(cli.wait().unwrap().success());
    let ended = stream.ended_within(Duration::from_secs(5));
    println!("stream ended {ended:?} after the DEL made while the invalidation stream was down");
    assert!(
        ended.is_some(),
        "the stream outlived its session: {}",
        a.log()
    );
    assert!(a.log().contains("invalidation stream lost"), "{}", a.log());
    // bob's session, read again too, is still there: his stream goes on.
    bobs.drain();
    assert!(
        bobs.events_within(3, Duration::from_secs(5)),
        "a session read again after the loss lost its stream"
    );
}

/// A tessera on the embedded store with `[metrics]`, in front of `up`; its metrics port.
fn embedded_with_metrics(up: &TestUpstream) -> (Tessera, u16) {
    let up_url = up.url();
    let metrics_port = support::free_port();
    let t = Tessera::start(move |port, dir| {
        format!(
            "{}[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n",
            config(port, &up_url, &format!("embedded:{}/s", dir.display()), &[])
        )
    });
    support::wait_for_port(metrics_port, "tessera metrics");
    (t, metrics_port)
}

/// The sample `name` of the metrics on `port`.
fn scrape_on(port: u16, name: &str) -> u64 {
    let (_, text) = curl(&[&format!("http://127.0.0.1:{port}/metrics")]);
    support::sample(&text, name)
}

/// Waits (at most 2 s) until `want` open responses are followed for their session's end.
fn streams_open(metrics_port: u16, want: u64) {
    let registered = (0..100).any(|_| {
        scrape_on(metrics_port, "tessera_session_streams_open") == want || {
            std::thread::sleep(Duration::from_millis(20));
            false
        }
    });
    assert!(registered, "the {want} open responses are not counted");
}

/// No open response is followed any more, and `ended` were ended by their session's end.
fn all_streams_ended(metrics_port: u16, ended: u64) {
    assert_eq!(scrape_on(metrics_port, "tessera_session_streams_open"), 0);
    let total = scrape_on(metrics_port, "tessera_session_streams_ended_total");
    assert_eq!(total, ended);
}

/// `tessera session revoke`, another process, ends the session's open responses (the server
/// hears it from the embedded store's change log): an event stream at once, a 64 MiB download
/// after what was on its way.
#[test]
fn a_session_revoked_by_the_cli_ends_its_open_responses() {
    use std::io::{Read, Write};
    let up = users();
    up.stats.set_password("carol", "carol-pw");
    let (t, metrics_port) = embedded_with_metrics(&up);
    let (sid, token) = t.create_session("alice", "alice-pw");
    let (carol_sid, carol) = t.create_session("carol", "carol-pw");
    let mut revoked = EventStream::open(&t, &token);
    // carol downloads 64 MiB (Content-Length) and reads only the first MiB for now. (On loopback
    // her body also waits for the upstream now and then; that a body which never waits is
    // registered once it outlives two frames is shown by the unit test in streams.rs.)
    let mut download = std::net::TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    write!(
        download,
        "GET /download HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {carol}\r\n\r\n"
    )
    .unwrap();
    download
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0usize;
    while got < 1 << 20 {
        got += download.read(&mut buf).unwrap();
    }
    streams_open(metrics_port, 2);
    // `tessera session revoke` is another process: the server hears it from the change log.
    t.revoke(&sid);
    let ended = revoked.ended_within(Duration::from_secs(5));
    println!("stream ended {ended:?} after `tessera session revoke`");
    assert!(ended.is_some(), "the stream outlived its revoked session");

    // carol's download: what was on its way still arrives, then it is cut short.
    t.revoke(&carol_sid);
    std::thread::sleep(Duration::from_millis(300));
    loop {
        match download.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => {
                use std::io::ErrorKind::{TimedOut, WouldBlock};
                assert!(
                    !matches!(e.kind(), TimedOut | WouldBlock),
                    "the download stalled instead of ending"
                );
                break;
            }
        }
    }
    println!("the download was cut after {got} of 67108864 bytes (plus its head)");
    assert!(
        got < 64 << 20,
        "the download ran to its end after revocation"
    );

    all_streams_ended(metrics_port, 2);
}

/// A session's event stream runs until the session expires (fresh events keep arriving until
/// 0.3 s before its `expires_at`), then ends.
#[test]
fn an_expiring_session_ends_its_open_stream_at_its_expiry() {
    use std::io::Write;
    let up = users();
    let (t, metrics_port) = embedded_with_metrics(&up);
    // bob's session lasts 10 s (9 to 10 s, expiry being in whole seconds): its `expires_at`,
    // from the CLI's answer.
    let out = Command::new(bin())
        .args(["session", "create", "--config"])
        .arg(t.config_path())
        .args(["--user", "bob", "--password-stdin", "--ttl", "10s"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(b"bob-pw\n")?;
            c.wait_with_output()
        })
        .unwrap();
    let created: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (short, expires_at) = (
        created["token"].as_str().unwrap().to_string(),
        created["expires_at"].as_u64().unwrap(),
    );
    let mut expiring = EventStream::open(&t, &short);
    streams_open(metrics_port, 1);
    // bob's stream runs until his session expires (fresh events keep arriving until 0.3 s
    // before it), then ends.
    let unix_now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let mut alive = 0;
    expiring.drain();
    while unix_now() < expires_at as f64 - 0.3 {
        // 5 s bounds a stall only (debug builds on a loaded 2-core CI); an end fails at once.
        if let Err(why) = expiring.more_events(1, Duration::from_secs(5)) {
            panic!(
                "{why}, {:.3} s before its session expired:\n{}",
                expires_at as f64 - unix_now(),
                t.log()
            );
        }
        alive += 1;
    }
    let ended = expiring.ended_within(Duration::from_secs(5));
    let late = unix_now() - expires_at as f64;
    println!("the 10 s session's stream ended {late:.3} s after its expires_at ({alive} fresh events seen)");
    assert!(ended.is_some(), "the stream outlived its session's expiry");
    assert!(
        late >= -0.05,
        "ended {:.3} s before its session expired",
        -late
    );
    assert!(
        alive > 0,
        "the test reached the expiry before it could watch the stream"
    );
    let log = t.log_when(|l| l.contains("open response of an expired session ended"));
    assert!(
        log.contains("open response of an expired session ended"),
        "{log}"
    );
    all_streams_ended(metrics_port, 1);
}

/// A logout during a paced download resets the connection, so what sat in tessera's send buffer
/// is dropped (a graceful close let 2.9 MB arrive over 2.9 s here): the client reading 1 MiB/s
/// gets less than 256 KiB more (its receive buffer, and the write in progress when the session
/// ended; 13 KiB here), then the reset. The writer blocked on the slow client watches the session
/// too, so this holds however large the kernel makes the socket's send buffer (with
/// `net.ipv4.tcp_wmem` defaulting to 4 MiB, or cached TCP metrics for 127.0.0.1, it waited
/// for a third of it to drain: 380 KiB here).
#[test]
fn a_logout_resets_a_download_in_progress() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    let token = token_of(&login(&t, "alice", "alice-pw"));
    let (after, end) = logout_during_download(&t, &token, "1.1", "\r\n");
    println!("download reset ({end}) {after} bytes after the logout");
    assert!(end.contains("reset"), "ended with {end}, not a reset");
}

/// The same on connections the fast path hands to hyper (see `downstream/handoff.rs`): an
/// HTTP/1.0 request, and an HTTP/1.1 request with a (zero-length) chunked body. hyper polls a
/// body only when its write buffer has room, so the connection is reset by its owner.
#[test]
fn a_logout_resets_a_download_served_by_hyper() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    for (version, tail) in [
        ("1.0", "\r\n"),
        ("1.1", "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    ] {
        let token = token_of(&login(&t, "alice", "alice-pw"));
        let (after, end) = logout_during_download(&t, &token, version, tail);
        println!("HTTP/{version}: download reset ({end}) {after} bytes after the logout");
        assert!(
            end.contains("reset"),
            "HTTP/{version}: ended with {end}, not a reset"
        );
    }
}

/// The same over HTTP/2 (h2c, one stream): the logout ends the stream with `RST_STREAM`, and the
/// client gets fewer than 256 KiB after it (its stream window is 64 KiB; about 75 ms here).
#[test]
fn a_logout_resets_an_http2_download_with_rst_stream() {
    let up = users();
    let redis = Redis::start();
    let t = on_redis(&up, &redis, &[]);
    let token = token_of(&login(&t, "alice", "alice-pw"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (after, end, took) = rt.block_on(async {
        let client = support::h2c_client(t.port).await;
        let mut client = client.ready().await.unwrap();
        let req = http::Request::get(format!("http://127.0.0.1:{}/download", t.port))
            .header("authorization", format!("Bearer {token}"))
            .body(())
            .unwrap();
        let (resp, _) = client.send_request(req, true).unwrap();
        let mut body = resp.await.unwrap().into_body();
        let mut before = 0u64;
        while before < 1 << 20 {
            assert!(
                matches!(paced_h2_read(&mut body, &mut before).await, Some(Ok(()))),
                "ended early"
            );
        }
        let logout = tokio::task::spawn_blocking({
            let url = t.url("/auth/logout");
            let auth = bearer(&token);
            move || curl(&["-X", "POST", "-H", &auth, &url]).0
        });
        assert_eq!(logout.await.unwrap(), 204);
        let logged_out = Instant::now();
        let mut after = 0u64;
        let end = loop {
            match paced_h2_read(&mut body, &mut after).await {
                Some(Ok(())) => assert!(after < 256 << 10, "{after} bytes after the logout"),
                Some(Err(e)) => break e,
                None => break "end of stream".to_string(),
            }
        };
        (after, end, logged_out.elapsed())
    });
    println!("HTTP/2 download ended ({end}) {took:?} and {after} bytes after the logout");
    // h2 reports a peer's RST_STREAM as "stream error received: <reason>".
    assert!(
        end.contains("stream error received"),
        "ended with {end}, not a reset"
    );
}

/// One read of an HTTP/2 body at about 1 MB/s (after a chunk of N bytes, a pause of N µs: a
/// pause per read would starve the window into 1-byte frames), the window given back only as
/// bytes are read: `None` at the end, `Some(Err)` on a reset.
async fn paced_h2_read(body: &mut h2::RecvStream, got: &mut u64) -> Option<Result<(), String>> {
    let chunk = match body.data().await? {
        Ok(chunk) => chunk,
        Err(e) => return Some(Err(e.to_string())),
    };
    *got += chunk.len() as u64;
    tokio::time::sleep(Duration::from_micros(chunk.len() as u64)).await;
    let _ = body.flow_control().release_capacity(chunk.len());
    Some(Ok(()))
}

/// Reads `/download` at 1 MiB/s over HTTP/`version` (`tail`: the rest of the request after
/// its `Authorization` line), logs out after 1 MiB, and reads on; the bytes read after the
/// logout (fewer than 256 KiB, else it fails) and how the read ended.
fn logout_during_download(t: &Tessera, token: &str, version: &str, tail: &str) -> (u64, String) {
    use std::io::{Read, Write};
    let mut download = std::net::TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    write!(
        download,
        "GET /download HTTP/{version}\r\nHost: t\r\nAuthorization: Bearer {token}\r\n{tail}"
    )
    .unwrap();
    download
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    // What the client's own receive buffer took before the logout is beyond tessera's reach:
    // kept small (the kernel doubles it to 64 KiB), so the bytes after the logout measure
    // tessera's side.
    rustix::net::sockopt::set_socket_recv_buffer_size(&download, 32 << 10).unwrap();
    // 1 MiB/s: 16 KiB every 15.6 ms.
    let mut buf = vec![0u8; 16 * 1024];
    let mut paced_read = |got: &mut u64| -> std::io::Result<usize> {
        std::thread::sleep(Duration::from_micros(15_600));
        let n = download.read(&mut buf)?;
        *got += n as u64;
        Ok(n)
    };
    let mut before = 0u64;
    while before < 1 << 20 {
        assert!(paced_read(&mut before).unwrap() > 0, "download ended early");
    }
    let (code, _) = curl(&["-X", "POST", "-H", &bearer(token), &t.url("/auth/logout")]);
    assert_eq!(code, 204);
    let mut after = 0u64;
    let end = loop {
        match paced_read(&mut after) {
            Ok(0) => break "EOF".to_string(),
            Ok(_) => assert!(
                after < 256 << 10,
                "HTTP/{version}: {after} bytes after the logout"
            ),
            Err(e) => break e.kind().to_string(),
        }
    };
    (after, end)
}
