//! What makes an HTTP/3 request malformed beyond what the h3 crate checks (RFC 9114 section
//! 4.1.2): connection-specific fields (section 4.2) and a `Content-Length` that is not one
//! number. h2 refuses the same in its own crate; over HTTP/1.1 `Connection` and its kin are
//! legal and stripped as hop-by-hop. Must never: let such a request through to be forwarded.

use http::header::{self, HeaderMap};

/// Fields that only HTTP/1.1 connections have; an HTTP/3 request carrying one is malformed.
const CONNECTION_SPECIFIC: [&str; 5] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
];

/// Why `headers` make an HTTP/3 request malformed, `None` if they do not.
pub(super) fn malformed(headers: &HeaderMap) -> Option<&'static str> {
    if CONNECTION_SPECIFIC.iter().any(|n| headers.contains_key(*n)) {
        return Some("connection-specific field in HTTP/3 (RFC 9114 section 4.2)");
    }
    // TE may only say `trailers` (section 4.2).
    if headers
        .get_all(header::TE)
        .iter()
        .any(|v| !v.as_bytes().eq_ignore_ascii_case(b"trailers"))
    {
        return Some("TE other than trailers in HTTP/3 (RFC 9114 section 4.2)");
    }
    match content_length(headers) {
        Err(()) => Some("bad content-length"),
        Ok(_) => None,
    }
}

/// The request's `Content-Length`: `None` without one; an error unless every value is the same
/// decimal number (RFC 9110 section 8.6).
pub(crate) fn content_length(headers: &HeaderMap) -> Result<Option<u64>, ()> {
    let mut length = None;
    for v in headers.get_all(header::CONTENT_LENGTH) {
        let n = v
            .to_str()
            .ok()
            .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or(())?;
        if length.is_some_and(|l| l != n) {
            return Err(());
        }
        length = Some(n);
    }
    Ok(length)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(fields: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in fields {
            h.append(*n, http::HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn connection_specific_fields_and_odd_lengths_are_malformed() {
        assert_eq!(malformed(&headers(&[("content-length", "10")])), None);
        assert_eq!(malformed(&headers(&[("te", "trailers")])), None);
        for bad in [
            ("connection", "early-data"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("te", "gzip"),
            ("content-length", "+10"),
            ("content-length", ""),
        ] {
            assert!(malformed(&headers(&[bad])).is_some(), "{bad:?}");
        }
        let two = headers(&[("content-length", "10"), ("content-length", "11")]);
        assert_eq!(content_length(&two), Err(()));
        let same = headers(&[("content-length", "10"), ("content-length", "10")]);
        assert_eq!(content_length(&same), Ok(Some(10)));
    }
}
