//! Service tests: `Proxy::handle` called directly with in-memory requests, no listening socket.
//! Covers each failure status and each bad-token class of RFC 8725 that must never be forwarded.

mod support;

use std::net::SocketAddr;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tessera::{admin, Config, Proxy};

const SECRET: &str = "service-test-secret-0123456789-0123456789-0123456789-0123456789-0123";
const KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

struct Fixture {
    proxy: Proxy,
    cfg: Config,
    _dir: tempfile::TempDir,
}

/// Upstream: a loopback port nothing listens on (only reached by the 502 case).
fn fixture(extra_session: &str) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let closed = support::free_port();
    let store = if extra_session.is_empty() {
        format!("embedded:{}/s", dir.path().display())
    } else {
        extra_session.to_string()
    };
    let text = format!(
        "[server]\nmax_uri_bytes = 300\nmax_header_bytes = 12000\nmax_body_bytes = 10\n[upstream]\nurl = \"http://127.0.0.1:{closed}\"\n\
         [token]\nsecret = \"{SECRET}\"\nissuer = \"tessera\"\naudience = \"mail\"\n[session]\nstore = \"{store}\"\ntimeout_ms = 300\n\
         [credentials]\nkeys = {{ k1 = \"{KEY}\" }}\n[log]\naccess_log = false\n"
    );
    let cfg = Config::from_toml(&text).unwrap();
    let proxy = Proxy::from_config(&cfg).unwrap();
    Fixture {
        proxy,
        cfg,
        _dir: dir,
    }
}

fn peer() -> SocketAddr {
    "127.0.0.1:40000".parse().unwrap()
}

fn get(headers: &[(&str, &str)], uri: &str) -> Request<Full<Bytes>> {
    let mut b = Request::get(uri).header("host", "mail.example");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(Bytes::new())).unwrap()
}

fn sign(header: &serde_json::Value, claims: &serde_json::Value) -> String {
    let msg = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    );
    let key = jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes());
    let sig =
        jsonwebtoken::crypto::sign(msg.as_bytes(), &key, jsonwebtoken::Algorithm::HS512).unwrap();
    format!("{msg}.{sig}")
}

fn now() -> u64 {
    tessera::unix_now()
}

async fn status(f: &Fixture, req: Request<Full<Bytes>>) -> (StatusCode, http::HeaderMap, String) {
    let resp = f
        .proxy
        .handle(req, &tessera::proxy::Peer::new(peer()))
        .await;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

#[tokio::test]
async fn no_token_is_401_with_bearer_challenge() {
    let f = fixture("");
    let (code, h, _) = status(&f, get(&[], "/")).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    assert_eq!(h["www-authenticate"], "Bearer realm=\"tessera\"");
    let (code, _, _) = status(&f, get(&[("authorization", "Basic YTpi")], "/")).await;
    assert_eq!(
        code,
        StatusCode::UNAUTHORIZED,
        "client Basic credentials are not a token"
    );
}

/// A fixture with alice's session, and its token's good claims.
async fn with_session() -> (Fixture, serde_json::Value) {
    let f = fixture("");
    let created = admin::create_session(&f.cfg, "alice".into(), "pw".into(), 600)
        .await
        .unwrap();
    let claims = serde_json::json!({"sub":"alice","sid":created.sid,"iat":now(),"exp":now()+600,"iss":"tessera","aud":"mail"});
    (f, claims)
}

/// `claims` with `k` set to `v`, or removed when `v` is null.
fn with(claims: &serde_json::Value, k: &str, v: serde_json::Value) -> serde_json::Value {
    let mut c = claims.clone();
    if v.is_null() {
        c.as_object_mut().unwrap().remove(k);
    } else {
        c[k] = v;
    }
    c
}

/// Each token is answered 401 with an `invalid_token` challenge, and never echoed.
async fn refused_as_invalid_token(f: &Fixture, cases: Vec<(&str, String)>) {
    for (name, token) in cases {
        let (code, h, body) = status(
            f,
            get(&[("authorization", &format!("Bearer {token}"))], "/"),
        )
        .await;
        assert_eq!(code, StatusCode::UNAUTHORIZED, "{name}");
        assert!(
            h["www-authenticate"]
                .to_str()
                .unwrap()
                .contains("invalid_token"),
            "{name}"
        );
        assert!(!body.contains(&token), "{name}: token echoed");
    }
}

/// JOSE headers RFC 8725 warns of: `alg: none`, an algorithm not pinned, `crit`, and keys named
/// by the token itself (`jku`, `x5u`, `jwk`).
#[tokio::test]
async fn tokens_with_a_dangerous_header_are_401_invalid_token() {
    let (f, claims) = with_session().await;
    let none = |sig: &str| {
        format!(
            "{}.{}.{sig}",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"none"}"#),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        )
    };
    let header = |h: serde_json::Value| sign(&h, &claims);
    let cases = vec![
        ("alg none", none("")),
        ("alg none with sig", none("c2ln")),
        ("alg not pinned", header(serde_json::json!({"alg":"HS256"}))),
        (
            "crit",
            header(serde_json::json!({"alg":"HS512","crit":["exp"]})),
        ),
        (
            "jku",
            header(serde_json::json!({"alg":"HS512","jku":"http://127.0.0.1/k"})),
        ),
        (
            "x5u",
            header(serde_json::json!({"alg":"HS512","x5u":"http://127.0.0.1/k"})),
        ),
        (
            "jwk",
            header(serde_json::json!({"alg":"HS512","jwk":{"kty":"oct","k":"AA"}})),
        ),
    ];
    refused_as_invalid_token(&f, cases).await;
}

/// Tokens of the wrong shape (segments, base64url, size) or with a bad signature; the good
/// token passes every check and reaches forward (the closed upstream: 502, its details only in
/// the log).
#[tokio::test]
async fn misshapen_or_badly_signed_tokens_are_401_invalid_token() {
    let (f, claims) = with_session().await;
    let good = sign(&serde_json::json!({"alg":"HS512","typ":"JWT"}), &claims);
    let too_large = format!(
        "{}.{}.AAAA",
        URL_SAFE_NO_PAD.encode(r#"{"alg":"HS512"}"#),
        "A".repeat(9000)
    );
    let cases = vec![
        ("four segments", format!("{good}.e30")),
        ("two segments", good.rsplit_once('.').unwrap().0.to_string()),
        ("padding", format!("{good}==")),
        ("std alphabet", good.replacen('.', ".+/", 1)),
        ("too large", too_large),
        ("bad signature", format!("{}AAAA", &good[..good.len() - 4])),
    ];
    refused_as_invalid_token(&f, cases).await;
    let (code, _, body) = status(
        &f,
        get(&[("authorization", &format!("Bearer {good}"))], "/"),
    )
    .await;
    assert_eq!(code, StatusCode::BAD_GATEWAY, "{body}");
    assert!(
        !body.contains("127.0.0.1"),
        "upstream details stay in the log"
    );
}

/// Claims RFC 7519 and the configuration refuse: `exp` missing or past, `nbf` or `iat` in the
/// future, the wrong `iss` or `aud`, no `sid` or an unknown one.
#[tokio::test]
async fn tokens_with_refused_claims_are_401_invalid_token() {
    let (f, claims) = with_session().await;
    let hs512 = serde_json::json!({"alg":"HS512","typ":"JWT"});
    let signed = |k: &str, v: serde_json::Value| sign(&hs512, &with(&claims, k, v));
    let null = serde_json::Value::Null;
    let cases = vec![
        ("exp missing", signed("exp", null.clone())),
        ("expired", signed("exp", (now() - 60).into())),
        ("nbf future", signed("nbf", (now() + 600).into())),
        ("iat future", signed("iat", (now() + 600).into())),
        ("wrong iss", signed("iss", "evil".into())),
        ("wrong aud", signed("aud", "other".into())),
        ("no sid", signed("sid", null)),
        ("unknown sid", signed("sid", "no-such-session".into())),
    ];
    refused_as_invalid_token(&f, cases).await;
}

#[tokio::test]
async fn request_limits_and_malformed_requests() {
    let f = fixture("");
    let long = format!("/{}", "a".repeat(400));
    assert_eq!(
        status(&f, get(&[], &long)).await.0,
        StatusCode::URI_TOO_LONG
    );
    let big = "b".repeat(13000);
    assert_eq!(
        status(&f, get(&[("x-big", &big)], "/")).await.0,
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );
    assert_eq!(
        status(&f, get(&[("content-length", "11")], "/")).await.0,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(
        status(&f, get(&[("host", "second")], "/")).await.0,
        StatusCode::BAD_REQUEST
    );
    let no_host = Request::get("/").body(Full::new(Bytes::new())).unwrap();
    assert_eq!(status(&f, no_host).await.0, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn store_down_is_503_with_retry_after_never_401() {
    let closed = support::free_port();
    let f = fixture(&format!("redis://127.0.0.1:{closed}/0"));
    let claims = serde_json::json!({"sid":"any","exp":now()+600,"iss":"tessera","aud":"mail"});
    let token = sign(&serde_json::json!({"alg":"HS512"}), &claims);
    let (code, h, _) = status(
        &f,
        get(&[("authorization", &format!("Bearer {token}"))], "/"),
    )
    .await;
    assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(h["retry-after"], "1");
    assert_eq!(
        f.proxy
            .upstream()
            .stats()
            .opened
            .load(std::sync::atomic::Ordering::SeqCst),
        0,
        "never forwarded"
    );
}
