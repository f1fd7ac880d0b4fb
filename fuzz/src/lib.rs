//! The checks behind tessera's fuzz targets, shared by the targets (`fuzz_targets/`, run with
//! `cargo fuzz`) and the corpus replay in the main crate's tests (`tests/fuzz.rs`, on stable).
//!
//! Each check takes one fuzz input: its first byte picks how the rest is cut into pieces (the
//! way bytes may arrive) and the target's options, the rest is the wire bytes. A check panics
//! when tessera's hand-written parser disagrees with a second, independent reading of the same
//! bytes, or with itself when the bytes are cut differently:
//! - [`fast_path`]: the downstream HTTP/1.1 fast path against hyper's server (request
//!   smuggling: the requests it takes must be the ones hyper would have made, bodies included);
//! - [`upstream`]: the upstream HTTP/1.1 client against hyper's client (response framing: a
//!   body both read must be the same bytes);
//! - [`frame_edges`]: the WebSocket tunnel's frame follower against tungstenite's frame-header
//!   parser (a Close frame sent only between frames);
//! - [`token`]: token verification against RFC 7515/7519/8725 and the pinned configuration
//!   (no cut pieces: a token is one string).

use std::io::Cursor;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio_tungstenite::tungstenite::protocol::frame::coding::OpCode;
use tokio_tungstenite::tungstenite::protocol::frame::FrameHeader;

/// The fast path's largest head, bytes: `serve`'s floor, and hyper's smallest read buffer.
const MAX_HEAD: usize = 8192;

/// Cuts `bytes` into pieces of `size` bytes (the last one shorter); 0: one piece.
fn pieces(bytes: &[u8], size: usize) -> Vec<&[u8]> {
    match size {
        0 => vec![bytes],
        n => bytes.chunks(n).collect(),
    }
}

/// The input's option byte and wire bytes.
fn split(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((&first, rest)) => (first, rest),
        None => (0, &[]),
    }
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");
}

/// Runs `f` to its end on this thread's runtime; panics if it takes over 10 s (every exchange
/// here is in memory and ends with an EOF, so that would be a hang).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    RUNTIME.with(|rt| {
        rt.block_on(async { tokio::time::timeout(std::time::Duration::from_secs(10), f).await })
            .expect("an in-memory exchange ended within 10 s")
    })
}

/// Option byte: bit 0 picks the fast path's body limit (16 bytes, or 64 KiB as served), bits
/// 1-7 the piece size (0: all at once).
///
/// Checks: cut anywhere, the fast path takes the same requests; every request it takes, up to
/// the first that asks to close, is the request hyper's HTTP/1.1 server makes of the same bytes
/// at the same place (method, target, fields in order, body).
pub fn fast_path(data: &[u8]) {
    let (opts, bytes) = split(data);
    let max_body = if opts & 1 == 1 { 16 } else { 64 * 1024 };
    let whole = tessera::fuzz::fast_path(&[bytes], MAX_HEAD, max_body);
    let cut = tessera::fuzz::fast_path(&pieces(bytes, usize::from(opts >> 1)), MAX_HEAD, max_body);
    for (i, (a, b)) in whole.requests.iter().zip(&cut.requests).enumerate() {
        assert_eq!(
            view(&a.0),
            view(&b.0),
            "request {i} differs when the bytes are cut"
        );
        assert_eq!(
            a.1, b.1,
            "request {i}'s close differs when the bytes are cut"
        );
    }
    // Hand-off loses and reorders nothing: hyper gets the bytes from the first not taken on.
    for out in [&whole, &cut] {
        if let Some(rest) = &out.handed_off {
            assert!(
                bytes.ends_with(rest),
                "the bytes handed to hyper are not the input's end"
            );
        }
        assert!(
            bytes.ends_with(&out.waiting),
            "the bytes waiting are not the input's end"
        );
    }
    if whole.requests.len() == cut.requests.len() {
        assert_eq!(
            whole.handed_off, cut.handed_off,
            "hand-off differs when cut"
        );
        assert_eq!(
            whole.waiting, cut.waiting,
            "the bytes waiting differ when cut"
        );
    } else {
        // A head that arrives whole can be taken where one arriving in pieces outgrew
        // `MAX_HEAD` first (and went to hyper): the lists may differ only that way.
        assert!(
            cut.handed_off.is_some() && cut.requests.len() < whole.requests.len(),
            "cut into pieces, the fast path took more requests ({} vs {})",
            cut.requests.len(),
            whole.requests.len()
        );
    }
    let taken: Vec<_> = match whole.requests.iter().position(|(_, close)| *close) {
        Some(last) => &whole.requests[..=last],
        None => &whole.requests[..],
    }
    .iter()
    .map(|(r, _)| view(r))
    .collect();
    // Past `MAX_HEAD` bytes a single head may be one the fast path takes whole and hyper
    // refuses (431) for its size; the screen phase answers those 431 too (server.max_header_bytes).
    if taken.is_empty() || bytes.len() > MAX_HEAD {
        return;
    }
    let hyper = hyper_server_requests(bytes);
    for (i, ours) in taken.iter().enumerate() {
        match hyper.get(i) {
            Some(theirs) => assert_eq!(ours, theirs, "request {i}: fast path vs hyper"),
            None => panic!(
                "the fast path took request {i} ({ours:?}); hyper made only {} of the bytes",
                hyper.len()
            ),
        }
    }
}

/// A request as compared: method, target, fields (names lowercase, in order), body.
type RequestView = (Method, String, Vec<(String, Vec<u8>)>, Bytes);

fn view(r: &Request<Bytes>) -> RequestView {
    (
        r.method().clone(),
        r.uri().to_string(),
        r.headers()
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect(),
        r.body().clone(),
    )
}

/// The requests hyper's HTTP/1.1 server makes of `bytes` (then EOF), bodies read whole; each is
/// answered 200 so the next one is read.
fn hyper_server_requests(bytes: &[u8]) -> Vec<RequestView> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    block_on(async move {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
            let record = record.clone();
            async move {
                let (parts, body) = req.into_parts();
                let body = body.collect().await?.to_bytes();
                record
                    .lock()
                    .unwrap()
                    .push(view(&Request::from_parts(parts, body)));
                Ok::<_, hyper::Error>(Response::new(Empty::<Bytes>::new()))
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        // half_close: the EOF after the bytes must not abort requests being served.
        builder.max_buf_size(MAX_HEAD).half_close(true);
        let conn = builder.serve_connection(TokioIo::new(server), service);
        let feed = async {
            let _ = client.write_all(bytes).await;
            let _ = client.shutdown().await;
            // Read (and drop) the answers so the server never waits on a full pipe.
            let _ = tokio::io::copy(&mut client, &mut tokio::io::sink()).await;
        };
        let _ = tokio::join!(conn, feed);
    });
    let seen = seen.lock().unwrap();
    seen.clone()
}

/// Option byte: bit 0 makes the request a HEAD, bits 1-7 pick the piece size (0: all at once).
///
/// Checks: cut anywhere, the upstream client reads the same response (or fails the same way)
/// and leaves the same bytes unread; when hyper's HTTP/1.1 client reads a response from the
/// same bytes too, both have the same status, the same body bytes and the same trailers but
/// those tessera drops.
pub fn upstream(data: &[u8]) {
    let (opts, bytes) = split(data);
    let head = opts & 1 == 1;
    let whole = tessera::fuzz::upstream_response(&[bytes], head);
    let cut = tessera::fuzz::upstream_response(&pieces(bytes, usize::from(opts >> 1)), head);
    assert_eq!(whole, cut, "the response differs when the bytes are cut");
    let Ok(ours) = whole.0 else {
        return;
    };
    if let Some((status, body, trailers)) = hyper_client_response(bytes, head) {
        assert_eq!(ours.status, status, "status: ours vs hyper's");
        assert_eq!(ours.body, body, "body: ours vs hyper's");
        if let (Some(ours), Some(theirs)) = (&ours.trailers, &trailers) {
            let theirs: HeaderMap = theirs
                .iter()
                .filter(|(name, _)| !tessera::fuzz::trailer_dropped(name.as_str()))
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect();
            assert_eq!(ours, &theirs, "trailers: ours vs hyper's");
        }
    }
}

/// The response hyper's HTTP/1.1 client reads from `bytes` (then EOF) for a GET or HEAD: status,
/// body and trailers; `None` when hyper fails to read it.
fn hyper_client_response(bytes: &[u8], head: bool) -> Option<(u16, Bytes, Option<HeaderMap>)> {
    block_on(async move {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(client))
            .await
            .ok()?;
        let respond = async {
            let _ = server.write_all(bytes).await;
            let _ = server.shutdown().await;
            let _ = tokio::io::copy(&mut server, &mut tokio::io::sink()).await;
        };
        let method = if head { Method::HEAD } else { Method::GET };
        let request = Request::builder()
            .method(method)
            .uri("/")
            .header(http::header::HOST, "upstream")
            .body(Empty::<Bytes>::new())
            .expect("a valid request");
        let exchange = async {
            let response = send.send_request(request).await.ok()?;
            let status = response.status();
            let collected = response.into_body().collect().await.ok()?;
            let trailers = collected.trailers().cloned();
            Some((status, collected.to_bytes(), trailers))
        };
        let (got, _, _) = tokio::join!(exchange, conn, respond);
        let (status, body, trailers) = got?;
        Some((status.as_u16(), body, trailers))
    })
}

/// Option byte: the piece size (0: all at once).
///
/// Checks: after each piece, the tunnel's frame follower says "between frames" exactly where
/// tungstenite's frame-header parser puts a frame's end, and "Close begun" exactly once a Close
/// frame's header was whole.
pub fn frame_edges(data: &[u8]) {
    let (opts, bytes) = split(data);
    let cut = pieces(bytes, usize::from(opts));
    let ours = tessera::fuzz::frame_edges(&cut);
    // Frame ends and the first Close header's end, by tungstenite.
    let mut ends = Vec::new();
    let mut close_at = None;
    let mut cursor = Cursor::new(bytes);
    let mut parsed_to = 0u64;
    loop {
        match FrameHeader::parse(&mut cursor) {
            Ok(Some((header, len))) => {
                let payload_start = cursor.position();
                if header.opcode
                    == OpCode::Control(
                        tokio_tungstenite::tungstenite::protocol::frame::coding::Control::Close,
                    )
                {
                    close_at.get_or_insert(payload_start);
                }
                let end = payload_start.saturating_add(len);
                ends.push(end);
                if end > bytes.len() as u64 {
                    parsed_to = bytes.len() as u64;
                    break;
                }
                cursor.set_position(end);
                parsed_to = end;
            }
            Ok(None) => {
                parsed_to = bytes.len() as u64;
                break;
            }
            Err(_) => break,
        }
    }
    let mut at = 0u64;
    for (i, (piece, (edge, close))) in cut.iter().zip(ours).enumerate() {
        at += piece.len() as u64;
        if at > parsed_to {
            break;
        }
        let expected_edge = ends.contains(&at) || (at == 0);
        assert_eq!(
            edge, expected_edge,
            "piece {i}: at a frame edge after {at} bytes"
        );
        let expected_close = close_at.is_some_and(|c| c <= at);
        assert_eq!(
            close, expected_close,
            "piece {i}: Close begun after {at} bytes"
        );
    }
}

/// The verifier's clock in [`token`], seconds since the Unix epoch.
const NOW: u64 = 1_800_000_000;
/// The HS256 key [`token`] signs and verifies with.
const SECRET: &[u8] = b"tessera fuzz secret, 32 bytes at least";

/// A verifier as a deployment pins it: HS256 only, `iss` "tessera", `aud` "webmail", 5 s
/// leeway, `sid`, the verified-token cache on (HS* included).
fn verifier() -> tessera::token::Verifier {
    use tessera::token::{Algorithm, KeyMaterial, KeySpec, TokenSource};
    tessera::token::Verifier::new(&tessera::token::TokenConfig {
        algorithms: vec![Algorithm::HS256],
        keys: vec![KeySpec {
            kid: None,
            algs: vec![Algorithm::HS256],
            material: KeyMaterial::Secret(SECRET.to_vec().into()),
        }],
        active_kid: None,
        jwks: None,
        cache_max_entries: 100,
        cache_hmac: true,
        sources: vec![TokenSource::Bearer],
        sid_claim: "sid".into(),
        leeway_seconds: 5,
        issuer: Some("tessera".into()),
        audience: Some("webmail".into()),
        max_token_bytes: 8192,
    })
}

/// Option byte: bit 0 set, the rest is the token text as is (a forged signature must fail);
/// clear, the rest is a JOSE header and a claims set (JSON, split at the first newline), signed
/// here with the right key, so only the verifier's own rules stand between them and a session.
///
/// Checks: no panic; the same answer from the verified-token cache the second time; and a token
/// accepted only when RFC 7515/7519/8725 and the pinned configuration allow it, as read here
/// with serde_json: a valid HMAC over the first two segments, `alg` HS256, no `crit`, `jku`,
/// `x5u`, `jwk` or `x5c`, `typ` absent or JWT, a numeric `exp` not past (with the leeway),
/// `nbf`/`iat` numeric and not in the future, `iss` "tessera", `aud` "webmail" or a list holding
/// it, and a non-empty string `sid`, which is the one returned.
pub fn token(data: &[u8]) {
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use base64::Engine;
    use jsonwebtoken::{crypto, Algorithm, DecodingKey, EncodingKey};
    let (opts, rest) = split(data);
    let text = if opts & 1 == 1 {
        String::from_utf8_lossy(rest).into_owned()
    } else {
        let (header, claims) = match rest.iter().position(|&b| b == b'\n') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, &[][..]),
        };
        let signed = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header),
            URL_SAFE_NO_PAD.encode(claims)
        );
        let sig = crypto::sign(
            signed.as_bytes(),
            &EncodingKey::from_secret(SECRET),
            Algorithm::HS256,
        )
        .expect("HMAC signs anything");
        format!("{signed}.{sig}")
    };
    let verifier = verifier();
    let first = verifier.verify(&text, NOW);
    assert_eq!(
        first,
        verifier.verify(&text, NOW),
        "the cached answer differs"
    );
    let Ok(verified) = first else {
        return;
    };
    let parts: Vec<&str> = text.split('.').collect();
    assert_eq!(
        parts.len(),
        3,
        "accepted a token of {} segments",
        parts.len()
    );
    let signed = &text[..parts[0].len() + 1 + parts[1].len()];
    assert!(
        crypto::verify(
            parts[2],
            signed.as_bytes(),
            &DecodingKey::from_secret(SECRET),
            Algorithm::HS256
        )
        .unwrap_or(false),
        "accepted a token whose HMAC does not verify"
    );
    let json = |b64: &str| -> Option<serde_json::Map<String, serde_json::Value>> {
        let bytes = URL_SAFE_NO_PAD
            .decode(b64)
            .expect("an accepted token's segments are base64url");
        serde_json::from_slice(&bytes).ok()
    };
    let claims = json(parts[1]).expect("an accepted token's claims are a JSON object");
    // serde_json does not check the escapes (a lone surrogate) of members tessera ignores; such
    // a header passes there but not here. Its other rules are checked on the rest.
    let Some(header) = json(parts[0]) else {
        return;
    };
    assert_eq!(header.get("alg").and_then(|v| v.as_str()), Some("HS256"));
    for member in ["crit", "jku", "x5u", "jwk", "x5c"] {
        assert!(
            !header.contains_key(member),
            "accepted a header with {member}"
        );
    }
    // A null `typ` says no type, as an absent one does.
    if let Some(typ) = header.get("typ").filter(|t| !t.is_null()) {
        assert!(
            typ.as_str().is_some_and(|t| t.eq_ignore_ascii_case("JWT")),
            "accepted typ {typ}"
        );
    }
    // NumericDate (RFC 7519 section 2): a non-negative number of seconds, fractions truncated.
    let date = |name: &str| {
        claims.get(name).map(|v| {
            let n = v.as_number()?;
            n.as_u64()
                .or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
        })
    };
    let exp = date("exp")
        .flatten()
        .expect("accepted without a numeric exp");
    assert!(
        exp.saturating_add(5) > NOW,
        "accepted an expired token (exp {exp})"
    );
    assert_eq!(verified.exp, exp, "exp returned");
    for name in ["nbf", "iat"] {
        if let Some(n) = date(name) {
            let n = n.unwrap_or_else(|| panic!("accepted a non-numeric {name}"));
            assert!(n <= NOW + 5, "accepted {name} {n} in the future");
        }
    }
    assert_eq!(claims.get("iss").and_then(|v| v.as_str()), Some("tessera"));
    let aud_ok = match claims.get("aud") {
        Some(serde_json::Value::String(s)) => s == "webmail",
        Some(serde_json::Value::Array(a)) => a.iter().any(|v| v.as_str() == Some("webmail")),
        _ => false,
    };
    assert!(aud_ok, "accepted aud {:?}", claims.get("aud"));
    let sid = claims.get("sid").and_then(|v| v.as_str()).unwrap_or("");
    assert!(!sid.is_empty(), "accepted without a sid");
    assert_eq!(&*verified.sid, sid, "sid returned");
}

/// The request-path check (`tessera::screen::path::check`) against three upstreams' own
/// resolution of the forwarded path under a base path: nginx (one percent-decoding, `/` only),
/// IIS (two decodings, `%uXXXX`, `\` as `/`) and Tomcat (`;` parameters dropped, one decoding).
/// The input's bytes, kept to visible ASCII without `?` and `#`, are the path after a `/`. Fails
/// when a path the check lets through resolves outside `/base/` on any of them, or when the check
/// panics.
pub fn path(data: &[u8]) {
    let tail: String = data
        .iter()
        .filter(|b| b.is_ascii_graphic() && !matches!(b, b'?' | b'#'))
        .map(|&b| b as char)
        .collect();
    let path = format!("/{tail}");
    for allow in [false, true] {
        if tessera::screen::path::check(&path, allow).is_err() {
            continue;
        }
        let forwarded = format!("/base{path}");
        for (server, resolved) in [
            (
                "nginx",
                resolve(&percent_decode(forwarded.as_bytes()), false),
            ),
            ("iis", resolve(&iis_decode(forwarded.as_bytes()), true)),
            (
                "tomcat",
                resolve(&percent_decode(&drop_params(forwarded.as_bytes())), false),
            ),
        ] {
            assert!(
                resolved == b"/base" || resolved.starts_with(b"/base/"),
                "{path:?} (allow_encoded_slashes = {allow}) reaches {:?} on {server}",
                String::from_utf8_lossy(&resolved)
            );
        }
    }
}

/// `%XX` decoded once; anything else kept.
fn percent_decode(s: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' && i + 2 < s.len() {
            if let (Some(h), Some(l)) = (hex(s[i + 1]), hex(s[i + 2])) {
                out.push(h * 16 + l);
                i += 3;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

/// IIS's reading: `%uXXXX` (ASCII code points only), then `%XX` twice.
fn iis_decode(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' && matches!(s.get(i + 1), Some(b'u' | b'U')) && i + 5 < s.len() {
            // Four hex digits exactly: `from_str_radix` alone also takes a sign (`%u+02e`),
            // which IIS does not.
            let code = std::str::from_utf8(&s[i + 2..i + 6])
                .ok()
                .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
                .and_then(|h| u32::from_str_radix(h, 16).ok());
            if let Some(c) = code.filter(|c| *c < 0x80) {
                out.push(c as u8);
                i += 6;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    percent_decode(&percent_decode(&out))
}

/// Tomcat's path parameters (`;...` up to the next `/`) removed.
fn drop_params(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut in_params = false;
    for &b in s {
        match b {
            b'/' => {
                in_params = false;
                out.push(b);
            }
            b';' => in_params = true,
            _ if in_params => {}
            _ => out.push(b),
        }
    }
    out
}

/// RFC 3986 5.2.4 dot-segment removal (with `\` as a separator when `backslash`), as the
/// resolved path; a `..` above the root stays at the root.
fn resolve(path: &[u8], backslash: bool) -> Vec<u8> {
    let mut segments: Vec<&[u8]> = Vec::new();
    let split = path.split(|&b| b == b'/' || (backslash && b == b'\\'));
    for segment in split.skip(1) {
        match segment {
            b"." => {}
            b".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = Vec::new();
    for s in segments {
        out.push(b'/');
        out.extend_from_slice(s);
    }
    if out.is_empty() {
        out.push(b'/');
    }
    out
}
