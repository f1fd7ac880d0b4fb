//! The screen of an upstream response head: hop-by-hop fields, those named in `Connection`, and
//! `upstream.strip_response_headers` (default `Alt-Svc`) removed, the rest kept as received and
//! in order. Must never: pass on a field the upstream marked hop-by-hop.

use http::header::HeaderName;

use crate::fields::has_token;
use crate::upstream::RawHead;

use super::HOP_BY_HOP;

/// Cleans an upstream response head, its fields as received ([`RawHead`]): hop-by-hop fields,
/// those named in `Connection`, and the configured extras (`Alt-Svc` by default: Cyrus advertises
/// its own h2c/h3, which is not ours); names compare ASCII case-insensitively.
pub fn screen_response(fields: &mut RawHead, strip: &[HeaderName]) {
    // The tokens of `Connection` (nginx and Cyrus send one, `keep-alive`); past 8, the slow way.
    let mut listed: [&[u8]; 8] = [&[]; 8];
    let mut count = 0;
    for value in fields.get_all(b"connection") {
        for token in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
            if let Some(slot) = listed.get_mut(count) {
                *slot = token;
            }
            count += 1;
        }
    }
    let in_connection = |name: &[u8]| {
        if count <= listed.len() {
            listed[..count].iter().any(|t| t.eq_ignore_ascii_case(name))
        } else {
            fields.get_all(b"connection").any(|v| has_token(v, name))
        }
    };
    // The lengths of every name that may be screened out (bit n: length n; 63: 63 or more): a
    // field whose length is not among them is kept without a comparison, which most are
    // (`Content-Type`, `Date`, `ETag`...): 8 fields x 10 names compared was 1,200 instructions
    // of a warm request.
    let bit = |n: usize| 1u64 << n.min(63);
    let mut lengths = HOP_BY_HOP.iter().fold(0, |m, n| m | bit(n.len()));
    lengths = strip.iter().fold(lengths, |m, n| m | bit(n.as_str().len()));
    lengths = if count <= listed.len() {
        listed[..count]
            .iter()
            .fold(lengths, |m, t| m | bit(t.len()))
    } else {
        u64::MAX
    };
    let mut drop = 0u128;
    for (i, (name, _)) in fields.iter().enumerate() {
        if lengths & bit(name.len()) == 0 {
            continue;
        }
        let screened = HOP_BY_HOP
            .iter()
            .any(|n| n.as_bytes().eq_ignore_ascii_case(name))
            || strip
                .iter()
                .any(|n| n.as_str().as_bytes().eq_ignore_ascii_case(name))
            || in_connection(name);
        // A head has at most 128 fields (the upstream parser's limit).
        if screened && i < 128 {
            drop |= 1 << i;
        }
    }
    if drop != 0 {
        let mut i = 0;
        fields.retain(|_, _| {
            let keep = drop & (1 << i) == 0;
            i += 1;
            keep
        });
    }
}

/// The name a browser sends back for the cookie a `Set-Cookie` `value` sets: before its first
/// `=` (or `;`), trimmed; for a nameless one (`=NAME=VALUE`), its value's own.
fn cookie_name(value: &[u8]) -> &[u8] {
    let end = value.iter().position(|&b| b == b'=' || b == b';');
    let name = value[..end.unwrap_or(value.len())].trim_ascii();
    match end {
        Some(at) if name.is_empty() && value[at] == b'=' => {
            let rest = &value[at + 1..];
            let end = rest.iter().position(|&b| b == b'=' || b == b';');
            rest[..end.unwrap_or(rest.len())].trim_ascii()
        }
        _ => name,
    }
}

/// Removes each `Set-Cookie` of `fields` that sets one of `names` (tessera's own cookies with
/// `[login]`: the login cookie, its CSRF and device cookies): an upstream, or content it
/// reflects, must not log a browser out, nor into another session, nor plant a device cookie.
/// The cookie's name is what comes before the first `=` (RFC 6265 section 5.2), compared as
/// sent; a nameless cookie's (`=NAME=VALUE`) is what its value starts with, as a browser sends
/// it back as `NAME=VALUE` (RFC 6265bis section 5.7). Nothing is walked unless `names` is set
/// and a `Set-Cookie` is there.
pub fn drop_set_cookies(fields: &mut RawHead, names: &[String]) {
    let own = |value: &[u8]| names.iter().any(|n| n.as_bytes() == cookie_name(value));
    if names.is_empty() || !fields.get_all(b"set-cookie").any(own) {
        return;
    }
    fields.retain(|name, value| !(name.eq_ignore_ascii_case(b"set-cookie") && own(value)));
}

/// The names a response's trailers lose besides the hop-by-hop ones, as its head (`fields`, not
/// yet screened) does: `strip` and the fields its `Connection` names (RFC 9110 section 6.5.1:
/// a trailer field follows the rules of a header field).
pub fn unlisted_in_trailers(fields: &RawHead, strip: &[HeaderName]) -> Vec<HeaderName> {
    let named = fields.get_all(b"connection").flat_map(|v| {
        v.split(|&b| b == b',')
            .filter_map(|t| HeaderName::from_bytes(t.trim_ascii()).ok())
    });
    strip.iter().cloned().chain(named).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_screening_keeps_only_end_to_end_fields_in_order() {
        let mut raw = crate::upstream::raw::from_pairs(&[
            // X-Trace-Hop: a length no hop-by-hop name has, screened only as listed here.
            ("Connection", "keep-alive, X-Internal, X-Trace-Hop"),
            ("Keep-Alive", "timeout=5"),
            ("x-internal", "secret"),
            ("x-trace-hop", "1"),
            ("Transfer-Encoding", "chunked"),
            ("Upgrade", "h2c"),
            ("Alt-Svc", "h2=\":443\""),
            ("Set-Cookie", "a=1"),
            ("Content-Type", "text/plain"),
            ("set-cookie", "b=2"),
        ]);
        screen_response(&mut raw, &[HeaderName::from_static("alt-svc")]);
        let kept: Vec<_> = raw
            .iter()
            .map(|(n, v)| String::from_utf8_lossy(&[n, b": ", v].concat()).into_owned())
            .collect();
        assert_eq!(
            kept,
            [
                "Set-Cookie: a=1",
                "Content-Type: text/plain",
                "set-cookie: b=2"
            ]
        );
        // More `Connection` tokens than the fast path collects: each is still honoured.
        let mut pairs = vec![("connection", "a, b, c, d, e, f, g, h, x-ninth")];
        pairs.extend([("x-ninth", "1"), ("x-a", "2")]);
        let mut raw = crate::upstream::raw::from_pairs(&pairs);
        screen_response(&mut raw, &[]);
        assert_eq!(raw.iter().map(|(n, _)| n).collect::<Vec<_>>(), [b"x-a"]);
        // Long names, named in `Connection` or configured, are compared in full.
        let long = format!("x-{}", "l".repeat(70));
        let strip = HeaderName::from_bytes(format!("{long}-s").as_bytes()).unwrap();
        let pairs = [
            ("connection", long.as_str()),
            (long.as_str(), "1"),
            (strip.as_str(), "2"),
            ("x-b", "3"),
        ];
        let mut raw = crate::upstream::raw::from_pairs(&pairs);
        screen_response(&mut raw, std::slice::from_ref(&strip));
        assert_eq!(raw.iter().map(|(n, _)| n).collect::<Vec<_>>(), [b"x-b"]);
    }

    #[test]
    fn response_hygiene() {
        let mut h = crate::upstream::raw::from_pairs(&[
            ("connection", "Upgrade, x-internal"),
            ("upgrade", "h2c"),
            ("alt-svc", "h3=\":443\""),
            ("x-internal", "1"),
            ("content-type", "a/b"),
        ]);
        screen_response(&mut h, &[HeaderName::from_static("alt-svc")]);
        assert_eq!(
            h.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            [b"content-type"]
        );
    }
}
