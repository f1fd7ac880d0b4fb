//! The parts of `redis+sentinel://` and `redis+cluster://` URLs, which list several hosts (the
//! `url` crate parses one).

use percent_encoding::percent_decode_str;

/// `USER:PASS` (either may be empty) percent-decoded.
pub(super) fn credentials(userinfo: Option<&str>) -> (Option<String>, Option<String>) {
    let Some(userinfo) = userinfo else {
        return (None, None);
    };
    let (user, pass) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let some = |s: &str| (!s.is_empty()).then(|| decode(s));
    (some(user), some(pass))
}

/// `s` percent-decoded (invalid UTF-8 replaced).
pub(super) fn decode(s: &str) -> String {
    percent_decode_str(s).decode_utf8_lossy().into_owned()
}

/// `HOST[:PORT]` or `[IPV6][:PORT]`, `default_port` when none is given; `None` when the port is
/// no number.
pub(super) fn host_port(s: &str, default_port: u16) -> Option<(String, u16)> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        (host, after.strip_prefix(':'))
    } else {
        match s.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default_port,
    };
    Some((host.to_owned(), port))
}
