//! Field-value helpers both sides of the proxy read (RFC 9110 section 5.6): token lists and
//! `Content-Length`. A leaf: it imports nothing of the crate. Must never: accept a length that is
//! not plain digits.

/// Whether a comma-separated field value (RFC 9110 section 5.6.1) lists `token`, ASCII
/// case-insensitively (`Connection: keep-alive, Close` lists `close`).
pub fn has_token(value: &[u8], token: &[u8]) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// A `Content-Length` value, or one item of a comma-separated list of them: 1 to 19 ASCII
/// digits (RFC 9110 section 8.6; 19 digits stay below `u64::MAX`), else `None`.
pub fn content_length(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0, |n, &d| n * 10 + u64::from(d - b'0')))
}

/// Hop-by-hop headers always removed (RFC 9110 7.6.1, plus the legacy `Proxy-Connection` and
/// `Keep-Alive`), and the headers the upstream must not see from a client; lowercase.
///
/// Names are kept as `&str` and compared as such (length first): a `const` array of `HeaderName`
/// (which has drop glue) was built and dropped on every use, once per response field.
pub(crate) const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authorization",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_length_digits_only() {
        assert_eq!(content_length(b"0"), Some(0));
        assert_eq!(content_length(b"65536"), Some(65536));
        for bad in [
            &b""[..],
            b"+5",
            b"-1",
            b"5 ",
            b"5,5",
            b"0x10",
            b"99999999999999999999",
        ] {
            assert_eq!(
                content_length(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn field_value_tokens() {
        assert!(has_token(b"keep-alive, Close", b"close"));
        assert!(has_token(b" close ", b"close"));
        assert!(!has_token(b"closed", b"close"));
    }
}
