//! The JMAP mode (`[jmap]`, RFC 8620): the session resource an upstream such as Cyrus answers
//! names `apiUrl`, `downloadUrl`, `uploadUrl` and `eventSourceUrl` as paths (`/jmap/`), which
//! some JMAP client libraries refuse (jmap-jam: "Failed to parse URL", jmapc: "Invalid URL");
//! with `session_urls = "absolute"` tessera makes them absolute on the scheme and authority the
//! client used. Templates (`{accountId}`) are kept verbatim. The WebSocket capability's `url`
//! (RFC 8887), which Cyrus writes as `wss:/jmap/ws/` (a scheme and a path, no host: a client
//! resolving it takes `jmap` for the host), becomes `wss://` or `ws://` on the client's host, as
//! the client's own scheme is https or http. With `server.max_body_bytes`, the core capability's
//! `maxSizeUpload` and `maxSizeRequest` are lowered to it, so that clients do not send what
//! tessera would refuse (413). Everything else passes untouched.
//! Must never: rewrite a body it did not read whole, or anything but those seven members.

use bytes::Bytes;
use http::header;
use http_body::Body;
use http_body_util::BodyExt;

use crate::upstream::ProxyBody;

/// Largest session resource rewritten, bytes; one that says it is larger passes as the upstream
/// sent it (Cyrus's is about 2.3 KiB).
pub const MAX_SESSION_BYTES: usize = 256 * 1024;

/// The session members that hold URLs (RFC 8620 section 2).
const URL_MEMBERS: [&str; 4] = ["apiUrl", "downloadUrl", "uploadUrl", "eventSourceUrl"];

/// `[jmap]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JmapConfig {
    /// `session_urls = "absolute"`: the session resource's URLs made absolute. (`"as_sent"`, the
    /// default, leaves `[jmap]` with nothing to do, and no `JmapConfig` is made.)
    pub absolute_urls: bool,
    /// Path of the session resource besides `/.well-known/jmap`. Default `/jmap/` (Cyrus's).
    pub session_path: String,
}

impl JmapConfig {
    /// Whether a request for `path` (with `method`, GET or HEAD) asks for the session resource;
    /// a trailing `/` is not told apart (Cyrus redirects `/.well-known/jmap` to `/jmap`, and
    /// serves the session at `/jmap/` too).
    pub fn is_session_request(&self, method: &http::Method, path: &str) -> bool {
        let path = path.trim_end_matches('/');
        self.absolute_urls
            && (method == http::Method::GET || method == http::Method::HEAD)
            && (path == "/.well-known/jmap" || path == self.session_path.trim_end_matches('/'))
    }
}

/// A session request's fields made to ask for the whole resource as the upstream has it, which
/// the rewrite can read: not compressed (Cyrus compresses by default, and browsers, fetch and
/// requests all ask for gzip; it is 2-3 KiB), and no range or condition, whose 206 or 304
/// would answer for the upstream's bytes, not the rewritten ones the client holds.
pub fn ask_whole(fields: &mut http::HeaderMap) {
    for name in [
        header::ACCEPT_ENCODING,
        header::RANGE,
        header::IF_RANGE,
        header::IF_NONE_MATCH,
        header::IF_MODIFIED_SINCE,
    ] {
        fields.remove(name);
    }
}

/// Where the session resource's URLs point: the client's side of the proxy.
#[derive(Debug, Clone, Copy)]
pub struct Origin<'a> {
    /// `scheme://authority` as the client used it, no trailing `/`.
    pub client: &'a str,
    /// `upstream.url`'s path (no trailing `/`; empty for `/`), which the upstream's own paths
    /// start with and the client's do not.
    pub base_path: &'a str,
}

/// The core capability's limits on what a client sends (RFC 8620 section 2), in bytes.
const SIZE_LIMITS: [&str; 2] = ["maxSizeUpload", "maxSizeRequest"];

/// `session` (a JMAP session object, JSON) with each relative URL member made absolute on
/// `origin`, less the upstream's base path (as redirects are), and the core capability's size
/// limits lowered to `max_body_bytes` (0: no limit); `None` when it is no JSON object or has
/// nothing to change (then it passes as it is).
pub fn absolute_session(
    session: &[u8],
    origin: Origin<'_>,
    max_body_bytes: u64,
) -> Option<Vec<u8>> {
    let mut value: serde_json::Value = serde_json::from_slice(session).ok()?;
    let object = value.as_object_mut()?;
    let mut changed = lower_size_limits(object, max_body_bytes);
    for member in URL_MEMBERS {
        if let Some(serde_json::Value::String(url)) = object.get_mut(member) {
            if let Some(absolute) = on_client_side(url, origin, false) {
                *url = absolute;
                changed = true;
            }
        }
    }
    let websocket = object
        .get_mut("capabilities")
        .and_then(|c| c.get_mut("urn:ietf:params:jmap:websocket"))
        .and_then(|w| w.get_mut("url"));
    if let Some(serde_json::Value::String(url)) = websocket {
        if let Some(absolute) = on_client_side(url, origin, true) {
            *url = absolute;
            changed = true;
        }
    }
    changed.then(|| serde_json::to_vec(&value).ok()).flatten()
}

/// `url` made absolute on `origin`, less the upstream's base path, when it names no host: a
/// path (`/jmap/`), or for a WebSocket (`ws`) also a path after `ws:` or `wss:` (Cyrus's
/// `wss:/jmap/ws/`), whose scheme then follows the client's (`wss` for https, `ws` for http).
/// `None` for a URL with a host (`https://up/`, `//up/`), or anything else.
fn on_client_side(url: &str, origin: Origin<'_>, ws: bool) -> Option<String> {
    let path = match ws {
        true => url
            .strip_prefix("wss:")
            .or_else(|| url.strip_prefix("ws:"))
            .unwrap_or(url),
        false => url,
    };
    if !path.starts_with('/') || path.starts_with("//") {
        return None;
    }
    let path = match path.strip_prefix(origin.base_path) {
        _ if origin.base_path.is_empty() => path,
        Some("") => "/",
        Some(rest) if rest.starts_with(['/', '?']) => rest,
        _ => path,
    };
    match ws {
        // `http://` -> `ws://`, `https://` -> `wss://` (RFC 6455 section 3).
        true => Some(format!("ws{}{path}", origin.client.strip_prefix("http")?)),
        false => Some(format!("{}{path}", origin.client)),
    }
}

/// `urn:ietf:params:jmap:core`'s [`SIZE_LIMITS`] above `max` (when not 0) set to `max`;
/// whether any was.
fn lower_size_limits(session: &mut serde_json::Map<String, serde_json::Value>, max: u64) -> bool {
    let core = session
        .get_mut("capabilities")
        .and_then(|c| c.get_mut("urn:ietf:params:jmap:core"))
        .and_then(serde_json::Value::as_object_mut);
    let (Some(core), true) = (core, max > 0) else {
        return false;
    };
    let mut lowered = false;
    for limit in SIZE_LIMITS {
        if let Some(n) = core
            .get_mut(limit)
            .filter(|n| n.as_u64().is_some_and(|n| n > max))
        {
            *n = max.into();
            lowered = true;
        }
    }
    lowered
}

/// Removes the fields that describe the upstream's bytes of a session resource, which a
/// rewritten one would not match: its length, validators a cache would apply to the new bytes,
/// and the digest Cyrus sends with `httpcontentmd5: yes` (RFC 1864).
fn drop_validators(fields: &mut http::HeaderMap) {
    let md5 = header::HeaderName::from_static("content-md5");
    for name in [
        header::CONTENT_LENGTH,
        header::ETAG,
        header::LAST_MODIFIED,
        md5,
    ] {
        fields.remove(name);
    }
}

/// The upstream's answer to a session request ([`JmapConfig::is_session_request`]) with its URLs
/// made absolute on `origin`: a 200 of JSON, not content-encoded, read whole within
/// [`MAX_SESSION_BYTES`]. Any other answer passes as it is, one whose `Content-Length` says it is
/// larger too; one whose body turns out larger, or fails while read, becomes a 502 (its start
/// was read, so it cannot pass whole). The answer to a HEAD (`head`) loses the `Content-Length`,
/// `ETag`, `Last-Modified` and `Content-MD5` of the body as sent, which its GET's rewritten body
/// would not match.
pub async fn rewrite_session(
    mut resp: http::Response<ProxyBody>,
    origin: Origin<'_>,
    head: bool,
    max_body_bytes: u64,
) -> http::Response<ProxyBody> {
    crate::upstream::materialize(&mut resp);
    let h = resp.headers();
    let json = h
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.to_ascii_lowercase().starts_with("application/json"));
    let too_large = resp
        .body()
        .size_hint()
        .upper()
        .is_some_and(|n| n > MAX_SESSION_BYTES as u64);
    if resp.status() != http::StatusCode::OK
        || !json
        || h.contains_key(header::CONTENT_ENCODING)
        || too_large
    {
        return resp;
    }
    if head {
        drop_validators(resp.headers_mut());
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let read = http_body_util::Limited::new(body, MAX_SESSION_BYTES)
        .collect()
        .await;
    let Ok(collected) = read else {
        tracing::warn!(
            max_bytes = MAX_SESSION_BYTES,
            "JMAP session resource unreadable or too large; 502"
        );
        return crate::error::ProxyError::Upstream(crate::upstream::ForwardError::Broken(
            "JMAP session resource unreadable or too large".into(),
        ))
        .into_response();
    };
    let bytes = collected.to_bytes();
    let body = match absolute_session(&bytes, origin, max_body_bytes) {
        Some(rewritten) => {
            drop_validators(&mut parts.headers);
            Bytes::from(rewritten)
        }
        None => bytes,
    };
    http::Response::from_parts(parts, ProxyBody::full(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An origin with no base path.
    fn at(client: &str) -> Origin<'_> {
        Origin {
            client,
            base_path: "",
        }
    }

    #[test]
    fn relative_urls_become_absolute_and_templates_stay() {
        let cyrus = br#"{"apiUrl":"/jmap/","downloadUrl":"/jmap/download/{accountId}/{blobId}/{name}?accept={type}","uploadUrl":"/jmap/upload/{accountId}/","eventSourceUrl":"/jmap/eventsource/?types={types}&closeafter={closeafter}&ping={ping}","username":"alice","state":"0"}"#;
        let out = absolute_session(cyrus, at("https://mail.example:8443"), 0).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["apiUrl"], "https://mail.example:8443/jmap/");
        assert_eq!(
            v["downloadUrl"],
            "https://mail.example:8443/jmap/download/{accountId}/{blobId}/{name}?accept={type}"
        );
        assert_eq!(
            v["uploadUrl"],
            "https://mail.example:8443/jmap/upload/{accountId}/"
        );
        assert_eq!(
            v["eventSourceUrl"],
            "https://mail.example:8443/jmap/eventsource/?types={types}&closeafter={closeafter}&ping={ping}"
        );
        assert_eq!(
            (v["username"].as_str(), v["state"].as_str()),
            (Some("alice"), Some("0"))
        );
    }

    #[test]
    fn absolute_urls_other_members_and_non_json_pass_as_they_are() {
        let absolute = br#"{"apiUrl":"https://up.example/jmap/","accounts":{"a":{"name":"/x"}}}"#;
        assert_eq!(absolute_session(absolute, at("http://t"), 0), None);
        assert_eq!(
            absolute_session(br#"{"apiUrl":"//evil.example/"}"#, at("http://t"), 0),
            None
        );
        assert_eq!(absolute_session(b"not json", at("http://t"), 0), None);
        assert_eq!(absolute_session(b"[\"/jmap/\"]", at("http://t"), 0), None);
        let mixed = br#"{"apiUrl":"/jmap/","name":"/keep"}"#;
        let v: serde_json::Value =
            serde_json::from_slice(&absolute_session(mixed, at("http://t"), 0).unwrap()).unwrap();
        assert_eq!(
            (v["apiUrl"].as_str(), v["name"].as_str()),
            (Some("http://t/jmap/"), Some("/keep"))
        );
    }

    /// Under `server.max_body_bytes`, the limits on what a client sends are lowered to it; a
    /// lower one, and every other limit, stays.
    #[test]
    fn size_limits_above_the_body_limit_are_lowered_to_it() {
        let session = br#"{"apiUrl":"https://up/jmap/","capabilities":{"urn:ietf:params:jmap:core":{"maxSizeUpload":1073741824,"maxSizeRequest":1000,"maxCallsInRequest":50},"urn:ietf:params:jmap:mail":{"maxSizeAttachmentsPerEmail":10485760}}}"#;
        assert_eq!(absolute_session(session, at("http://t"), 0), None);
        assert_eq!(absolute_session(session, at("http://t"), 1 << 40), None);
        let v: serde_json::Value =
            serde_json::from_slice(&absolute_session(session, at("http://t"), 4096).unwrap())
                .unwrap();
        let core = &v["capabilities"]["urn:ietf:params:jmap:core"];
        assert_eq!(core["maxSizeUpload"], 4096);
        assert_eq!(core["maxSizeRequest"], 1000);
        assert_eq!(core["maxCallsInRequest"], 50);
        assert_eq!(v["apiUrl"], "https://up/jmap/");
    }

    /// The upstream's own paths start with `upstream.url`'s path, which the client's do not:
    /// tessera adds it to every request.
    #[test]
    fn the_upstream_base_path_is_left_out() {
        let origin = Origin {
            client: "https://t",
            base_path: "/mail",
        };
        let session =
            br#"{"apiUrl":"/mail/jmap/","uploadUrl":"/mailbox/up/","downloadUrl":"/mail"}"#;
        let v: serde_json::Value =
            serde_json::from_slice(&absolute_session(session, origin, 0).unwrap()).unwrap();
        assert_eq!(v["apiUrl"], "https://t/jmap/");
        assert_eq!(v["uploadUrl"], "https://t/mailbox/up/", "another path");
        assert_eq!(v["downloadUrl"], "https://t/", "the base path itself");
    }

    /// Cyrus's `wss:/jmap/ws/` names no host; it gets the client's, with the WebSocket scheme
    /// of the client's own. One that names a host stays.
    #[test]
    fn the_websocket_url_gets_the_clients_host_and_scheme() {
        let cyrus = br#"{"capabilities":{"urn:ietf:params:jmap:websocket":{"url":"wss:/jmap/ws/","supportsPush":true}}}"#;
        let ws_url = |client: &str| {
            let out = absolute_session(cyrus, at(client), 0).unwrap();
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            let ws = &v["capabilities"]["urn:ietf:params:jmap:websocket"];
            assert_eq!(ws["supportsPush"], true);
            ws["url"].as_str().unwrap().to_owned()
        };
        assert_eq!(
            ws_url("https://mail.example:8443"),
            "wss://mail.example:8443/jmap/ws/"
        );
        assert_eq!(
            ws_url("http://127.0.0.1:8080"),
            "ws://127.0.0.1:8080/jmap/ws/"
        );
        let path = br#"{"capabilities":{"urn:ietf:params:jmap:websocket":{"url":"/mail/ws/"}}}"#;
        let origin = Origin {
            client: "https://t",
            base_path: "/mail",
        };
        let v: serde_json::Value =
            serde_json::from_slice(&absolute_session(path, origin, 0).unwrap()).unwrap();
        assert_eq!(
            v["capabilities"]["urn:ietf:params:jmap:websocket"]["url"],
            "wss://t/ws/"
        );
        let hosted =
            br#"{"capabilities":{"urn:ietf:params:jmap:websocket":{"url":"wss://up/ws/"}}}"#;
        assert_eq!(absolute_session(hosted, at("https://t"), 0), None);
    }

    #[tokio::test]
    async fn a_rewritten_session_loses_what_described_the_upstreams_bytes() {
        let resp = http::Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ETAG, "\"1\"")
            .header("content-md5", "Q2hlY2sgSW50ZWdyaXR5IQ==")
            .header(header::CACHE_CONTROL, "no-store")
            .body(ProxyBody::full(r#"{"apiUrl":"/jmap/"}"#))
            .unwrap();
        let resp = rewrite_session(resp, at("https://t"), false, 0).await;
        let h = resp.headers();
        assert!(!h.contains_key("content-md5") && !h.contains_key(header::ETAG));
        assert_eq!(h[header::CACHE_CONTROL], "no-store");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], br#"{"apiUrl":"https://t/jmap/"}"#);
    }

    /// One that says it is larger than the rewrite reads passes as sent (not a 502).
    #[tokio::test]
    async fn a_session_resource_too_large_to_rewrite_passes_as_it_is() {
        let padding = "x".repeat(MAX_SESSION_BYTES);
        let big = format!(r#"{{"apiUrl":"/jmap/","pad":"{padding}"}}"#);
        let resp = http::Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .body(ProxyBody::full(big.clone()))
            .unwrap();
        let resp = rewrite_session(resp, at("https://t"), false, 0).await;
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, big.as_bytes());
    }

    #[test]
    fn only_gets_and_heads_of_the_session_paths_are_session_requests() {
        let c = JmapConfig {
            absolute_urls: true,
            session_path: "/jmap/".into(),
        };
        assert!(c.is_session_request(&http::Method::GET, "/jmap/"));
        assert!(c.is_session_request(&http::Method::GET, "/.well-known/jmap"));
        assert!(c.is_session_request(&http::Method::GET, "/jmap"));
        assert!(c.is_session_request(&http::Method::HEAD, "/jmap/"));
        assert!(!c.is_session_request(&http::Method::POST, "/jmap/"));
        assert!(!c.is_session_request(&http::Method::GET, "/jmap/download/x"));
    }
}
