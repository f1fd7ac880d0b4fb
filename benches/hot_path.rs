//! Micro-benchmark of one request's CPU work before forwarding: screen + extract + verify +
//! unseal + inject, for HS512 and EdDSA tokens, cold (verify and unseal every time, as without
//! the caches) and warm (ready header from the session cache, the token from the verified-token
//! cache; and HS512 with `token.cache_hmac = false`, verified every time).
//!
//! Run: `cargo bench --bench hot_path` (criterion; reports in target/criterion/).

use std::collections::BTreeMap;

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use http::{header, HeaderValue, Request};
use tessera::screen::{screen_request, Limits};
use tessera::seal::CredentialsConfig;
use tessera::seal::{Credentials, Sealer};
use tessera::token::{self, Verifier};
use tessera::Config;

const SECRET: &str = "bench-secret-0123456789-0123456789-0123456789-0123456789-01234567";

fn config(extra_token: &str, tables: &str) -> Config {
    let text = format!(
        "[upstream]\nurl = \"http://127.0.0.1:9\"\n[token]\nsecret = \"{SECRET}\"\n{extra_token}\n\
         [credentials]\nkeys = {{ k1 = \"AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\" }}\n{tables}"
    );
    Config::from_toml(&text).expect("bench config")
}

fn request(token: &str) -> http::request::Parts {
    let (parts, ()) = Request::get("/jmap/api?x=1")
        .header(header::HOST, "mail.example")
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::ACCEPT, "application/json")
        .header(header::USER_AGENT, "bench/1.0")
        .header(header::COOKIE, "theme=dark")
        .body(())
        .unwrap()
        .into_parts();
    parts
}

fn bench(c: &mut Criterion) {
    let limits = Limits {
        max_header_bytes: 16384,
        max_uri_bytes: 8192,
        max_body_bytes: 0,
        allow_encoded_slashes: false,
    };
    let sealer = Sealer::new(&CredentialsConfig {
        keys: BTreeMap::from([("k1".to_string(), zeroize::Zeroizing::new([7u8; 32]))]),
        active: "k1".into(),
        allow_plaintext_legacy: false,
    });
    let sid = "bench-session-id-0123456";
    let sealed = sealer.seal(sid, b"alice:correct horse battery staple");

    // EdDSA key pair generated once with openssl at build of the bench (PKCS#8 PEM).
    let dir = std::env::temp_dir().join(format!("tessera-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key = dir.join("ed.pem");
    let publ = dir.join("ed.pub.pem");
    let ok = std::process::Command::new("openssl")
        .args(["genpkey", "-algorithm", "ed25519", "-out"])
        .arg(&key)
        .status()
        .unwrap()
        .success()
        && std::process::Command::new("openssl")
            .args(["pkey", "-pubout", "-in"])
            .arg(&key)
            .arg("-out")
            .arg(&publ)
            .status()
            .unwrap()
            .success();
    assert!(ok, "openssl is needed for the EdDSA key");
    let ed_tables = format!(
        "[[token.keys]]\nkid = \"ed\"\nalg = \"EdDSA\"\nprivate_key = \"file:{}\"\npublic_key = \"file:{}\"",
        key.display(),
        publ.display()
    );

    for (name, cfg) in [
        ("HS512", config("", "")),
        ("EdDSA", config("active_kid = \"ed\"", &ed_tables)),
    ] {
        let now = tessera::unix_now();
        let verifier = Verifier::new(&cfg.token);
        let token = verifier
            .keys()
            .signer()
            .unwrap()
            .issue(&cfg.token, "alice", sid, now, now + 3600)
            .unwrap();
        let mut hmac_cfg = cfg.token.clone();
        hmac_cfg.cache_hmac = false;
        let hmac_uncached = Verifier::new(&hmac_cfg);
        let mut cold_cfg = cfg.token.clone();
        cold_cfg.cache_max_entries = 0;
        let cold_verifier = Verifier::new(&cold_cfg);
        let ready: HeaderValue = Credentials::from_pair(&sealer.unseal(sid, &sealed).unwrap())
            .unwrap()
            .basic_header();

        c.bench_function(
            &format!("request path {name} cold (verify + unseal)"),
            |b| {
                b.iter(|| {
                    let mut parts = request(&token);
                    let _screened = screen_request(&mut parts, &limits).unwrap();
                    let tok = token::extract(&parts.headers, &cfg.token.sources).unwrap();
                    let v = cold_verifier.verify(&tok, now).unwrap();
                    let pair = sealer.unseal(&v.sid, black_box(&sealed)).unwrap();
                    let creds = Credentials::from_pair(&pair).unwrap();
                    parts
                        .headers
                        .insert(header::AUTHORIZATION, creds.basic_header());
                    black_box(parts)
                })
            },
        );
        // cache_hmac only changes HS*: an EdDSA token is cached either way.
        if name.starts_with("HS") {
            c.bench_function(
                &format!("request path {name} warm, cache_hmac = false"),
                |b| {
                    b.iter(|| {
                        let mut parts = request(&token);
                        let _screened = screen_request(&mut parts, &limits).unwrap();
                        let tok = token::extract(&parts.headers, &cfg.token.sources).unwrap();
                        let v = hmac_uncached.verify(&tok, now).unwrap();
                        black_box(&v.sid);
                        parts.headers.insert(header::AUTHORIZATION, ready.clone());
                        black_box(parts)
                    })
                },
            );
        }
        c.bench_function(&format!("request path {name} warm (caches hit)"), |b| {
            b.iter(|| {
                let mut parts = request(&token);
                let _screened = screen_request(&mut parts, &limits).unwrap();
                let tok = token::extract(&parts.headers, &cfg.token.sources).unwrap();
                let v = verifier.verify(&tok, now).unwrap();
                black_box(&v.sid);
                parts.headers.insert(header::AUTHORIZATION, ready.clone());
                black_box(parts)
            })
        });
    }
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, bench);
criterion_main!(benches);
