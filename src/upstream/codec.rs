//! Upstream response heads (RFC 9112 sections 4 and 6): parsed with `httparse`, their framing
//! decided per section 6.3, keep-alive per version and `Connection`, and the idle time the
//! upstream announces (`Keep-Alive: timeout`). Must never: accept a head whose framing is
//! ambiguous (two lengths, a length with a coding, a coding other than `chunked` last).

use std::time::Duration;

use bytes::BytesMut;
use http::{Response, StatusCode, Version};

use super::raw::RawHead;
use super::ForwardError;

use super::conn::{broken, Chunk, Framing, Head, MAX_HEAD};

/// Most response header fields accepted (hyper's default is 100).
pub(super) const MAX_HEADERS: usize = 128;

// `screen::screen_response` marks fields in a 128-bit mask.
const _: () = assert!(MAX_HEADERS <= 128);

/// Parses one response head from the buffer, consuming it; `None` when incomplete.
pub(crate) fn parse_head(
    buf: &mut BytesMut,
    head_request: bool,
) -> Result<Option<Head>, ForwardError> {
    let mut headers =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    let config = httparse::ParserConfig::default();
    let len = match config.parse_response_with_uninit_headers(&mut parsed, &*buf, &mut headers) {
        Ok(httparse::Status::Complete(len)) if len <= MAX_HEAD => len,
        Ok(httparse::Status::Partial) if buf.len() <= MAX_HEAD => return Ok(None),
        Ok(_) => {
            return Err(broken(format!(
                "invalid response head: larger than {MAX_HEAD} bytes"
            )))
        }
        Err(e) => return Err(broken(format!("invalid response head: {e}"))),
    };
    let status = StatusCode::from_u16(parsed.code.unwrap_or(0))
        .map_err(|_| broken("invalid response status"))?;
    let version = if parsed.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    // The fields stay in the frozen head as offsets (see `raw.rs`).
    let base = buf.as_ptr() as usize;
    let spans = parsed
        .headers
        .iter()
        .map(|h| {
            // Offsets within the head, which is at most MAX_HEAD (64 KiB) long.
            let name = (h.name.as_ptr() as usize - base) as u32;
            let value = (h.value.as_ptr() as usize - base) as u32;
            [
                name,
                name + h.name.len() as u32,
                value,
                value + h.value.len() as u32,
            ]
        })
        .collect();
    let mut fields = RawHead::new(buf.split_to(len).freeze(), spans);
    let mut keep_alive = keep_alive(version, &fields);
    if fields.contains(b"transfer-encoding") {
        // RFC 9112 section 6.1: chunked framing is HTTP/1.1; section 6.3: with both fields,
        // Transfer-Encoding wins, Content-Length must not be forwarded, and the connection
        // is not trusted with another request.
        if version == Version::HTTP_10 {
            return Err(broken(
                "invalid response head: Transfer-Encoding in an HTTP/1.0 response",
            ));
        }
        if fields.contains(b"content-length") {
            fields.remove(b"content-length");
            keep_alive = false;
        }
    }
    let framing = framing(head_request, status, &fields)?;
    let announced_idle = announced_idle(&fields);
    let mut response = Response::new(());
    *response.status_mut() = status;
    *response.version_mut() = version;
    Ok(Some(Head {
        response,
        fields,
        framing,
        keep_alive: keep_alive && framing != Framing::Close,
        announced_idle,
    }))
}

/// See [`super::conn::H1::idle_limit`].
pub(super) fn idle_limit(pool_idle: Duration, announced: Option<Duration>) -> Duration {
    match announced {
        None => pool_idle,
        Some(n) if n <= Duration::from_secs(2) => pool_idle.min(n / 2),
        Some(n) => pool_idle.min(n - Duration::from_secs(1)),
    }
}

/// The `timeout` parameter of a `Keep-Alive` field (`timeout=5, max=100`: seconds the server
/// keeps an idle connection open; RFC 2068 section 19.7.1.1, obsolete but still sent by Apache
/// httpd and Node.js), if there is one and it is a whole number (optionally quoted).
fn announced_idle(fields: &RawHead) -> Option<Duration> {
    fields
        .get_all(b"keep-alive")
        .flat_map(|v| v.split(|&b| b == b','))
        .find_map(|param| {
            let (name, value) = param.split_at(param.iter().position(|&b| b == b'=')?);
            if !name.trim_ascii().eq_ignore_ascii_case(b"timeout") {
                return None;
            }
            let value = value[1..].trim_ascii();
            let value = value
                .strip_prefix(b"\"")
                .and_then(|v| v.strip_suffix(b"\""))
                .unwrap_or(value);
            if value.is_empty() || value.len() > 9 || !value.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let secs = std::str::from_utf8(value).ok()?.parse().ok()?;
            Some(Duration::from_secs(secs))
        })
}

/// Parses response heads from `buf`, consuming them, until a final one (not 1xx, or a 101):
/// interim heads are dropped. `None` when no final head is complete yet. Errors: as
/// [`parse_head`].
pub(crate) fn final_head(
    buf: &mut BytesMut,
    head_request: bool,
) -> Result<Option<Head>, ForwardError> {
    while let Some(head) = parse_head(buf, head_request)? {
        let status = head.response.status();
        if !status.is_informational() || status == StatusCode::SWITCHING_PROTOCOLS {
            return Ok(Some(head));
        }
    }
    Ok(None)
}

/// Whether the buffer may hold a complete response head: a blank line seen, after a CRLF or
/// after the bare LF that the head parser (httparse) also takes as a line end (RFC 9112
/// section 2.2), so that both read a head the same way.
pub(super) fn head_complete(buf: &[u8]) -> bool {
    memchr::memchr_iter(b'\n', buf)
        .any(|i| matches!(&buf[i + 1..], [b'\n', ..] | [b'\r', b'\n', ..]))
}

pub(super) fn find_crlf(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\r\n")
}

/// Persistence after this response (RFC 9112 section 9.3): HTTP/1.1 unless `Connection: close`;
/// HTTP/1.0 only with `Connection: keep-alive`.
fn keep_alive(version: Version, fields: &RawHead) -> bool {
    let has = |token: &str| {
        fields
            .get_all(b"connection")
            .any(|v| crate::fields::has_token(v, token.as_bytes()))
    };
    if version == Version::HTTP_10 {
        has("keep-alive")
    } else {
        !has("close")
    }
}

/// The response body's framing (RFC 9112 section 6.3).
///
/// Errors: `Content-Length` values that are not one non-negative integer, also on a HEAD or 304
/// response (no body, but the field is passed downstream); 1xx and 204 ignore the field.
fn framing(
    head_request: bool,
    status: StatusCode,
    fields: &RawHead,
) -> Result<Framing, ForwardError> {
    if status.is_informational() || status == StatusCode::NO_CONTENT {
        return Ok(Framing::Done);
    }
    if head_request || status == StatusCode::NOT_MODIFIED {
        // No body, but a Content-Length is passed downstream (it describes the representation,
        // RFC 9110 section 8.6), so it must be one a client can trust. (With Transfer-Encoding
        // too, `parse_head` has already removed it.)
        declared_length(fields)?;
        return Ok(Framing::Done);
    }
    if fields.contains(b"transfer-encoding") {
        let codings = fields
            .get_all(b"transfer-encoding")
            .flat_map(|v| v.split(|&b| b == b','))
            .map(<[u8]>::trim_ascii);
        // Any coding but chunked (`gzip, chunked`) would reach the client still coded, with
        // nothing saying so: the downstream side frames bodies itself, and names no coding.
        // chunked takes no parameters (RFC 9112 section 7); `chunked;` or `chunked; a=b` is read
        // as chunked by some parsers and to EOF by others (hyper), so it is refused.
        let chunked = |c: &[u8]| c.eq_ignore_ascii_case(b"chunked");
        let mut last = None;
        for coding in codings {
            if !coding.is_empty() {
                if !transfer_coding(coding) || coding.contains(&b';') && chunked_named(coding) {
                    return Err(broken("invalid transfer-encoding"));
                }
                if !chunked(coding) {
                    return Err(broken(
                        "transfer coding other than chunked (not decoded, so not relayed)",
                    ));
                }
            }
            last = Some(coding);
        }
        // RFC 9110 section 5.6.1.2: empty elements are ignored, but an empty *last* one is
        // refused (hyper reads `chunked,` as not chunked; this does not guess between them).
        if last.is_none_or(<[u8]>::is_empty) {
            return Err(broken("invalid transfer-encoding"));
        }
        return Ok(Framing::Chunked(Chunk::Size));
    }
    Ok(match declared_length(fields)? {
        Some(0) => Framing::Done,
        Some(n) => Framing::Length(n),
        None => Framing::Close,
    })
}

/// Whether a transfer-coding element (parameters included) names chunked.
fn chunked_named(element: &[u8]) -> bool {
    let name = element.split(|&b| b == b';').next().unwrap_or_default();
    name.trim_ascii().eq_ignore_ascii_case(b"chunked")
}

/// Whether a non-empty `element` of a `Transfer-Encoding` list is a transfer-coding (RFC 9112
/// section 7: a token, then parameters after `;`, which are not looked into) with no byte
/// outside visible ASCII, space and tab. Stricter than the RFC on purpose: a quoted parameter
/// holding obs-text fails too, as does any framing field two parsers could read two ways.
fn transfer_coding(element: &[u8]) -> bool {
    let tchar = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b);
    let name = element
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    !name.is_empty()
        && name.iter().all(tchar)
        && element
            .iter()
            .all(|&b| b == b'\t' || (b' '..=b'~').contains(&b))
}

/// The response's Content-Length (RFC 9110 section 8.6), bytes; `None` without the field. Errors
/// (502) on a value that is not 1*DIGIT within `u64`, and on differing values (RFC 9112 section
/// 6.3 item 5); repeated equal values, in one field line or several, count once.
fn declared_length(fields: &RawHead) -> Result<Option<u64>, ForwardError> {
    let mut length = None;
    for v in fields.get_all(b"content-length") {
        for item in v.split(|&b| b == b',') {
            let n = crate::fields::content_length(item.trim_ascii())
                .ok_or_else(|| broken("invalid content-length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(broken("conflicting content-length values"));
            }
            length = Some(n);
        }
    }
    Ok(length)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::raw::from_pairs;

    /// `Keep-Alive: timeout=N` read from a response, and the idle limit it sets.
    #[test]
    fn announced_keep_alive_timeout() {
        let announced = |v: &str| announced_idle(&from_pairs(&[("keep-alive", v)]));
        assert_eq!(
            announced("timeout=5, max=100"),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            announced("max=100,Timeout = \"7\""),
            Some(Duration::from_secs(7))
        );
        assert_eq!(announced("max=100"), None);
        assert_eq!(announced("timeout=abc"), None);
        assert_eq!(announced("timeout=-1"), None);
        assert_eq!(announced("timeout=9999999999"), None);
        assert_eq!(announced_idle(&from_pairs(&[("x", "timeout=5")])), None);
        let limit = |announced: Option<u64>| {
            idle_limit(Duration::from_secs(30), announced.map(Duration::from_secs))
        };
        assert_eq!(limit(None), Duration::from_secs(30));
        assert_eq!(limit(Some(5)), Duration::from_secs(4));
        assert_eq!(limit(Some(2)), Duration::from_secs(1));
        assert_eq!(limit(Some(0)), Duration::ZERO);
        assert_eq!(limit(Some(75)), Duration::from_secs(30));
    }

    #[test]
    fn content_length_framing_follows_rfc_9112_section_6_3() {
        let ok = StatusCode::OK;
        let f = |head, status, h: &[(&str, &str)]| framing(head, status, &from_pairs(h));
        assert_eq!(
            f(true, ok, &[("content-length", "5")]).unwrap(),
            Framing::Done
        );
        assert_eq!(
            f(false, StatusCode::NO_CONTENT, &[]).unwrap(),
            Framing::Done
        );
        assert_eq!(
            f(false, StatusCode::NOT_MODIFIED, &[("content-length", "5")]).unwrap(),
            Framing::Done
        );
        // HEAD and 304 pass Content-Length on, so a broken one is refused there too; 204 and
        // 1xx drop it (the downstream writer does not send it).
        for bad in [
            &[("content-length", "abc")][..],
            &[("content-length", "5, 6")],
        ] {
            assert!(f(true, ok, bad).is_err());
            assert!(f(false, StatusCode::NOT_MODIFIED, bad).is_err());
            assert_eq!(
                f(false, StatusCode::NO_CONTENT, bad).unwrap(),
                Framing::Done
            );
        }
        assert_eq!(
            f(
                true,
                ok,
                &[("content-length", "5"), ("content-length", "5")]
            )
            .unwrap(),
            Framing::Done
        );
        assert_eq!(
            f(false, ok, &[("content-length", "5")]).unwrap(),
            Framing::Length(5)
        );
        assert_eq!(
            f(false, ok, &[("content-length", "5, 5")]).unwrap(),
            Framing::Length(5)
        );
        assert_eq!(
            f(false, ok, &[("content-length", "0")]).unwrap(),
            Framing::Done
        );
        assert!(f(
            false,
            ok,
            &[("content-length", "5"), ("content-length", "6")]
        )
        .is_err());
        assert!(f(false, ok, &[("content-length", "-1")]).is_err());
        assert!(f(false, ok, &[("content-length", "+5")]).is_err());
        assert!(f(false, ok, &[("content-length", "99999999999999999999")]).is_err());
    }

    #[test]
    fn transfer_codings_follow_rfc_9112_section_6_3() {
        let ok = StatusCode::OK;
        let f = |head, status, h: &[(&str, &str)]| framing(head, status, &from_pairs(h));
        // Transfer-Encoding wins over Content-Length; chunked must be the last coding.
        assert_eq!(
            f(
                false,
                ok,
                &[("transfer-encoding", "chunked"), ("content-length", "5")]
            )
            .unwrap(),
            Framing::Chunked(Chunk::Size)
        );
        // Codings other than chunked are not decoded, so such a body is refused (502) rather
        // than relayed still coded with nothing naming the coding.
        for coded in ["gzip, chunked", "chunked, gzip", "gzip", ", gzip,,chunked"] {
            assert!(
                f(false, ok, &[("transfer-encoding", coded)]).is_err(),
                "{coded}"
            );
        }
        assert!(f(
            false,
            ok,
            &[
                ("transfer-encoding", "gzip ; q=1"),
                ("transfer-encoding", "Chunked")
            ]
        )
        .is_err());
        assert_eq!(f(false, ok, &[]).unwrap(), Framing::Close);
        // Empty elements are ignored (RFC 9110 section 5.6.1.2); fields across lines count.
        assert_eq!(
            f(false, ok, &[("transfer-encoding", ", ,chunked")]).unwrap(),
            Framing::Chunked(Chunk::Size)
        );
        assert_eq!(
            f(
                false,
                ok,
                &[("transfer-encoding", ""), ("transfer-encoding", "Chunked")]
            )
            .unwrap(),
            Framing::Chunked(Chunk::Size)
        );
        // A list two parsers could read two ways fails (found by fuzz/ `upstream`: hyper reads
        // a non-ASCII coding's response to EOF, tessera read it chunked).
        for bad in [
            "\u{9c}p\u{c8}, chunked",
            "chunked,",
            " , ",
            "chun ked",
            "a\u{1}",
            "chunked;",
            "chunked; x=1",
        ] {
            assert!(
                f(false, ok, &[("transfer-encoding", bad)]).is_err(),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn keep_alive_by_version_and_connection_tokens() {
        assert!(keep_alive(Version::HTTP_11, &from_pairs(&[])));
        assert!(!keep_alive(
            Version::HTTP_11,
            &from_pairs(&[("connection", "foo, Close")])
        ));
        assert!(!keep_alive(Version::HTTP_10, &from_pairs(&[])));
        assert!(keep_alive(
            Version::HTTP_10,
            &from_pairs(&[("connection", "Keep-Alive")])
        ));
    }
}
