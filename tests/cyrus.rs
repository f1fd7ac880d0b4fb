//! End to end against a real Cyrus IMAP 3.6 JMAP server (Debian packages, set up by
//! `scripts/cyrus.sh`): users log in through `POST /auth/login` (checked against Cyrus's own JMAP
//! session resource) and their tokens become Cyrus Basic credentials.

mod support;

use std::process::Command;

use support::cyrus::{client_saw_everything, login_at, token_of, Cyrus};
use support::upstream::recording_relay;
use support::*;

/// tessera in front of Cyrus's JMAP at `port` (directly, or through a relay): 4 upstream
/// connections, `[login]` checked at `/jmap/`, the JMAP mode on.
fn in_front_of(port: u16) -> Tessera {
    in_front_of_with(port, &[])
}

/// [`in_front_of`] with more `(section, line)` config lines.
fn in_front_of_with(port: u16, extra: &[(&'static str, &'static str)]) -> Tessera {
    let upstream = format!("http://127.0.0.1:{port}");
    let mut lines = vec![
        ("upstream", "max_connections = 4"),
        ("login", "verify_path = \"/jmap/\""),
        ("login", "cookie_secure = false"),
        ("tables", "[jmap]\nsession_urls = \"absolute\"\n"),
    ];
    lines.extend_from_slice(extra);
    Tessera::start(move |port, dir| {
        config(
            port,
            &upstream,
            &format!("embedded:{}/s", dir.display()),
            &lines,
        )
    })
}

/// An attachment whose name holds a `/`, which a JMAP client sends as `%2F` in the download
/// URL's `{name}` (RFC 8620 section 6.2, an RFC 6570 template): refused by default as any
/// encoded slash, downloaded whole from Cyrus under `server.allow_encoded_slashes_under`.
#[test]
fn an_attachment_named_with_a_slash_downloads_under_its_prefix() {
    let cyrus = Cyrus::start();
    let plain = in_front_of(cyrus.http_port);
    let under = in_front_of_with(
        cyrus.http_port,
        &[(
            "server",
            "allow_encoded_slashes_under = [\"/jmap/download/\"]",
        )],
    );
    let alice = token_of(login_at(&under, "alice", "alice-secret-1"));
    let (code, body) = curl(&[
        "-H",
        &bearer(&alice),
        "-H",
        "Content-Type: application/pdf",
        "--data-binary",
        "invoice body",
        &under.url("/jmap/upload/alice/"),
    ]);
    assert_eq!(code, 201, "{body}");
    let upload: serde_json::Value = serde_json::from_str(&body).unwrap();
    let blob = upload["blobId"].as_str().unwrap();
    let path =
        format!("/jmap/download/alice/{blob}/Invoice%2003%2F2024.pdf?accept=application/pdf");
    let (code, body) = curl(&["-H", &bearer(&alice), &under.url(&path)]);
    assert_eq!(
        (code, body.as_str()),
        (200, "invoice body"),
        "{}",
        under.log()
    );
    let alice_plain = token_of(login_at(&plain, "alice", "alice-secret-1"));
    assert_eq!(
        curl(&["-H", &bearer(&alice_plain), &plain.url(&path)]).0,
        400
    );
    // Elsewhere, the same encoded slash is still refused.
    assert_eq!(
        curl(&["-H", &bearer(&alice), &under.url("/jmap/a%2Fb")]).0,
        400
    );
}

/// Under `server.max_body_bytes`, the session resource tells clients the lower limit: Cyrus's
/// `maxSizeUpload` (1 GiB) and `maxSizeRequest` (10 MiB) become 1 MiB, and an upload past it is
/// refused by tessera (413), never half-sent to Cyrus.
#[test]
fn the_session_resource_tells_clients_the_body_limit() {
    let cyrus = Cyrus::start();
    let t = in_front_of_with(cyrus.http_port, &[("server", "max_body_bytes = 1048576")]);
    let alice = token_of(login_at(&t, "alice", "alice-secret-1"));
    let (code, body) = curl(&["-H", &bearer(&alice), &t.url("/jmap/")]);
    assert_eq!(code, 200, "{body}");
    let session: serde_json::Value = serde_json::from_str(&body).unwrap();
    let core = &session["capabilities"]["urn:ietf:params:jmap:core"];
    assert_eq!(core["maxSizeUpload"], 1048576, "{body}");
    assert_eq!(core["maxSizeRequest"], 1048576, "{body}");
    assert_eq!(core["maxCallsInRequest"], 50, "{body}");
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big");
    std::fs::write(&big, vec![b'x'; 1048577]).unwrap();
    let (code, _) = curl(&[
        "-H",
        &bearer(&alice),
        "-H",
        "Content-Type: application/octet-stream",
        "--data-binary",
        &format!("@{}", big.display()),
        &t.url("/jmap/upload/alice/"),
    ]);
    assert_eq!(code, 413);
}

const USING: &str = r#"["urn:ietf:params:jmap:core","urn:ietf:params:jmap:mail"]"#;

fn query_subjects(t: &Tessera, token: &str, account: &str) -> (u16, serde_json::Value) {
    let body = format!(
        r##"{{"using":{USING},"methodCalls":[["Mailbox/get",{{"accountId":"{account}","properties":["name","role","totalEmails"]}},"m"],["Email/query",{{"accountId":"{account}"}},"q"],["Email/get",{{"accountId":"{account}","#ids":{{"resultOf":"q","name":"Email/query","path":"/ids"}},"properties":["subject"]}},"g"]]}}"##
    );
    let (code, out) = curl(&[
        "-H",
        &bearer(token),
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        &body,
        &t.url("/jmap/"),
    ]);
    (
        code,
        serde_json::from_str(&out).unwrap_or(serde_json::Value::Null),
    )
}

/// Users log in with their Cyrus passwords (a wrong one: 401, no session) and read their own
/// mail through tessera, never another's; the session resource's URLs are absolute (the JMAP
/// mode); Cyrus's hop-by-hop and `Alt-Svc` fields stay behind; Cyrus sees Basic credentials only,
/// never a token.
#[test]
fn jmap_through_tessera_with_real_cyrus() {
    let cyrus = Cyrus::start_compressing();
    let (relay_port, seen_by_cyrus) = recording_relay(cyrus.http_port);
    let t = in_front_of(relay_port);
    // Cyrus refuses a wrong password: 401 and no session.
    let (code, body) = login_at(&t, "alice", "wrong-password");
    assert_eq!(code, 401, "{body}");
    let alice = token_of(login_at(&t, "alice", "alice-secret-1"));
    let bob = token_of(login_at(&t, "bob", "bob-secret-2"));

    // The JMAP session resource, asked for compressed as browsers, fetch and requests do.
    let (code, body) = curl(&["--compressed", "-H", &bearer(&alice), &t.url("/jmap/")]);
    assert_eq!(code, 200, "{body}");
    let session: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(session["username"], "alice");
    assert!(session["accounts"].get("alice").is_some(), "{body}");
    // The JMAP mode: Cyrus's relative URLs made absolute on the origin the client used, with
    // their templates kept.
    let origin = format!("http://127.0.0.1:{}", t.port);
    assert_eq!(session["apiUrl"], format!("{origin}/jmap/"), "{body}");
    for member in ["downloadUrl", "uploadUrl", "eventSourceUrl"] {
        let url = session[member].as_str().unwrap_or_default();
        assert!(
            url.starts_with(&format!("{origin}/jmap/")),
            "{member}: {body}"
        );
    }
    assert!(
        session["downloadUrl"]
            .as_str()
            .unwrap()
            .contains("{accountId}"),
        "{body}"
    );

    // A HEAD of it does not report the length of Cyrus's body, which the GET's rewritten one
    // does not have (a client sizing a buffer by it would cut the GET's short).
    let (code, head) = curl(&["-I", "-H", &bearer(&alice), &t.url("/jmap/")]);
    assert_eq!(code, 200, "{head}");
    let length = head.lines().find_map(|l| {
        l.to_ascii_lowercase()
            .strip_prefix("content-length:")
            .map(|v| v.trim().to_string())
    });
    assert!(
        length.is_none() || length == Some(body.len().to_string()),
        "HEAD said {length:?}, the GET's body is {} bytes",
        body.len()
    );

    // Mailbox/get + Email/query + Email/get find the seeded INBOX message.
    let (code, v) = query_subjects(&t, &alice, "alice");
    assert_eq!(code, 200);
    let text = v.to_string();
    assert!(
        text.contains("\"Inbox\"") || text.contains("\"INBOX\""),
        "{text}"
    );
    assert!(text.contains("tessera e2e alice"), "{text}");

    // Bob's token reaches Bob's mail and never Alice's account.
    let (_, v) = query_subjects(&t, &bob, "bob");
    assert!(v.to_string().contains("tessera e2e bob"), "{v}");
    let (_, v) = query_subjects(&t, &bob, "alice");
    let text = v.to_string();
    assert!(
        !text.contains("tessera e2e alice"),
        "bob read alice's mail: {text}"
    );
    assert!(
        text.contains("accountNotFound") || text.contains("forbidden"),
        "{text}"
    );

    // Cyrus's own hop-by-hop / Alt-Svc headers are not passed on.
    let (_, head) = curl(&["-i", "-H", &bearer(&alice), &t.url("/jmap/")]);
    let lower = head.to_lowercase();
    assert!(
        !lower.contains("upgrade: h2c") && !lower.contains("alt-svc:"),
        "{head}"
    );

    // Cyrus saw Basic credentials for both users and never a token.
    let raw = String::from_utf8_lossy(&seen_by_cyrus.lock().unwrap()).to_string();
    assert!(
        raw.contains(&basic("alice", "alice-secret-1"))
            && raw.contains(&basic("bob", "bob-secret-2"))
    );
    for token in [&alice, &bob] {
        assert!(!raw.contains(token.as_str()), "a token reached Cyrus");
        let signature = token.rsplit('.').next().unwrap();
        assert!(!raw.contains(signature));
    }
    assert!(
        !raw.to_lowercase().contains("bearer"),
        "no bearer header reached Cyrus"
    );
}

/// A stored password Cyrus no longer accepts (changed elsewhere): Cyrus's 401 becomes a Bearer
/// challenge saying why, and the session is deleted; a logout ends only its own session.
#[test]
fn cyrus_refusing_stored_credentials_deletes_the_session_and_logout_ends_only_its_own() {
    let cyrus = Cyrus::start();
    let t = in_front_of(cyrus.http_port);
    let alice = token_of(login_at(&t, "alice", "alice-secret-1"));
    let bob = token_of(login_at(&t, "bob", "bob-secret-2"));
    let (wrong_sid, wrong) = t.create_session("alice", "not-the-password");
    let (code, head) = curl(&["-i", "-H", &bearer(&wrong), &t.url("/jmap/")]);
    assert_eq!(code, 401);
    let lower = head.to_lowercase();
    assert!(
        lower.contains("upstream rejected credentials")
            && !lower.contains("www-authenticate: basic"),
        "{head}"
    );
    assert_eq!(curl(&["-H", &bearer(&wrong), &t.url("/jmap/")]).0, 401);
    let log = t.log_when(|l| l.contains("session deleted"));
    assert!(log.contains("session deleted"), "{log}");
    t.revoke(&wrong_sid); // already gone: revoke is idempotent

    // Logout.
    let (code, _) = curl(&["-X", "POST", "-H", &bearer(&alice), &t.url("/auth/logout")]);
    assert_eq!(code, 204);
    assert_eq!(curl(&["-H", &bearer(&alice), &t.url("/jmap/")]).0, 401);
    assert_eq!(
        curl(&["-H", &bearer(&bob), &t.url("/jmap/")]).0,
        200,
        "other sessions unaffected"
    );
}

/// jmap-jam 0.13.1 (`tests/jmap/jam.mjs`, under Node.js), a JMAP client library that refuses
/// relative session URLs, works against the real Cyrus through tessera's JMAP mode with no
/// client-side URL fix-up: the session from `/.well-known/jmap` (Cyrus's redirect followed),
/// Mailbox/get, Email/query + Email/get of the seeded message, Email/set of a draft, and a
/// 30 MiB blob uploaded and downloaded whole.
#[test]
fn jmap_jam_works_through_the_jmap_mode() {
    require("node");
    let cyrus = Cyrus::start();
    let t = in_front_of(cyrus.http_port);
    let token = token_of(login_at(&t, "alice", "alice-secret-1"));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/jmap/jam.mjs");
    let mut cmd = Command::new("node");
    cmd.arg(script)
        .env("SESSION_URL", t.url("/.well-known/jmap"))
        .env("TOKEN", &token)
        .env("BLOB_MIB", "30");
    let api_url = format!("http://127.0.0.1:{}/jmap/", t.port);
    client_saw_everything(cmd, "jam.mjs", &t, &api_url);
}
