//! Request paths an upstream could resolve outside `upstream.url`'s base path.
//!
//! tessera forwards the path as the client sent it, under the base path. An upstream then
//! decodes it and resolves dot segments (RFC 3986 5.2.4) in its own way: nginx and Apache decode
//! `%2e`, `%2f` and `%5c` before resolving; IIS also reads `\` as a separator, decodes twice
//! and maps `%uXXXX`, overlong UTF-8 and full-width forms; Tomcat drops `;` path parameters
//! first. So this module reads a path the way the most lenient of them would and refuses every
//! path in which any of them could find a `.` or `..` segment. Must never: rewrite a path (what
//! is forwarded is the client's own bytes, or nothing).
//!
//! A path whose bytes are plain ASCII without `%` or `\` (nearly every request) is checked in
//! one pass without allocating; any other is decoded into a copy first.

/// Why a path is refused (static text, safe to log and answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathError {
    /// A segment that is `.` or `..` once decoded (or made only of dots, or dots followed by
    /// spaces, which Windows servers trim).
    DotSegment,
    /// An encoded `/` or `\` (`%2F`, `%5C`, `%u2215`, overlong and full-width forms) or a literal
    /// `\`, with `server.allow_encoded_slashes = false` (the default, as Tomcat's and Apache's).
    EncodedSlash,
    /// A control character once decoded (`%00`, `%0a`, ...): C and Java decoders stop at a NUL,
    /// so `..%00` is `..` to them, and no real path holds one.
    ControlByte,
}

impl PathError {
    /// The reason logged and counted for a 400.
    pub fn reason(self) -> &'static str {
        match self {
            Self::DotSegment => "dot segment in path",
            Self::EncodedSlash => "encoded slash or backslash in path",
            Self::ControlByte => "control character in path",
        }
    }
}

/// How many times a path is percent-decoded at most (IIS decoded twice; a third pass costs
/// nothing for a real path and catches one more level).
const DECODE_PASSES: usize = 3;

/// Checks `path` (the request's path, without its query). With `allow_encoded_slashes`, an
/// encoded slash or a backslash outside a dot segment is let through (forwarded as sent), but
/// it still separates segments for the dot-segment rule, so `/..%2f` is always refused.
///
/// Errors: [`PathError`].
pub fn check(path: &str, allow_encoded_slashes: bool) -> Result<(), PathError> {
    let bytes = path.as_bytes();
    if !bytes
        .iter()
        .any(|&b| matches!(b, b'.' | b'%' | b'\\') || !b.is_ascii())
    {
        // Nothing that is or decodes to a dot or a separator other than `/`.
        return Ok(());
    }
    if bytes
        .iter()
        .all(|&b| b.is_ascii() && b != b'%' && b != b'\\')
    {
        return scan(bytes.iter().map(|&b| (b, false)), allow_encoded_slashes);
    }
    let mut units: Vec<(u8, bool)> = bytes.iter().map(|&b| (b, false)).collect();
    for _ in 0..DECODE_PASSES {
        match decode_once(&units) {
            Some(decoded) => units = decoded,
            None => break,
        }
    }
    scan(fold_lookalikes(&units).into_iter(), allow_encoded_slashes)
}

/// The segment rule over a path's units (a byte and whether it came from an escape).
fn scan(
    units: impl Iterator<Item = (u8, bool)>,
    allow_encoded_slashes: bool,
) -> Result<(), PathError> {
    // Per segment: dots seen, spaces after them, and whether anything else was.
    let (mut dots, mut spaced, mut other, mut params) = (0usize, false, false, false);
    for (b, escaped) in units.chain(std::iter::once((b'/', false))) {
        if b < 0x20 || b == 0x7f {
            return Err(PathError::ControlByte);
        }
        match b {
            b'/' | b'\\' => {
                if (escaped || b == b'\\') && !allow_encoded_slashes {
                    return Err(PathError::EncodedSlash);
                }
                if dots > 0 && !other {
                    return Err(PathError::DotSegment);
                }
                (dots, spaced, other, params) = (0, false, false, false);
            }
            // Servlet containers drop path parameters before they resolve dot segments.
            _ if params => {}
            b';' => params = true,
            b'.' if !spaced => dots += 1,
            b' ' if dots > 0 => spaced = true,
            _ => other = true,
        }
    }
    Ok(())
}

/// One percent-decoding pass (`%XX`, and IIS's `%uXXXX` as UTF-8); `None` when nothing
/// decodes. A decoded unit is marked as escaped.
fn decode_once(units: &[(u8, bool)]) -> Option<Vec<(u8, bool)>> {
    let hex = |i: usize| units.get(i).and_then(|&(b, _)| (b as char).to_digit(16));
    let mut out = Vec::with_capacity(units.len());
    let mut changed = false;
    let mut i = 0;
    while i < units.len() {
        let (b, escaped) = units[i];
        if b == b'%' {
            if let (Some(h), Some(l)) = (hex(i + 1), hex(i + 2)) {
                out.push(((h * 16 + l) as u8, true));
                (i, changed) = (i + 3, true);
                continue;
            }
            if matches!(units.get(i + 1), Some((b'u' | b'U', _))) {
                let digits: Option<u32> = (2..6).try_fold(0, |n, k| Some(n * 16 + hex(i + k)?));
                if let Some(c) = digits.and_then(char::from_u32) {
                    let mut buf = [0; 4];
                    out.extend(c.encode_utf8(&mut buf).bytes().map(|b| (b, true)));
                    (i, changed) = (i + 6, true);
                    continue;
                }
            }
        }
        out.push((b, escaped));
        i += 1;
    }
    changed.then_some(out)
}

/// Byte sequences that some server reads as `.`, `/` or `\`: overlong UTF-8 (old IIS and
/// Tomcat decoders), full-width forms and the division slash (IIS "best fit" mapping).
const LOOKALIKES: [(&[u8], u8); 13] = [
    (&[0xc0, 0xae], b'.'),
    (&[0xe0, 0x80, 0xae], b'.'),
    (&[0xf0, 0x80, 0x80, 0xae], b'.'),
    (&[0xef, 0xbc, 0x8e], b'.'),
    (&[0xc0, 0xaf], b'/'),
    (&[0xe0, 0x80, 0xaf], b'/'),
    (&[0xf0, 0x80, 0x80, 0xaf], b'/'),
    (&[0xef, 0xbc, 0x8f], b'/'),
    (&[0xe2, 0x88, 0x95], b'/'),
    (&[0xc1, 0x9c], b'\\'),
    (&[0xe0, 0x81, 0x9c], b'\\'),
    (&[0xf0, 0x80, 0x81, 0x9c], b'\\'),
    (&[0xef, 0xbc, 0xbc], b'\\'),
];

/// `units` with every [`LOOKALIKES`] sequence replaced by the ASCII byte it stands for (marked
/// as escaped: the client did not send that byte as such).
fn fold_lookalikes(units: &[(u8, bool)]) -> Vec<(u8, bool)> {
    let mut out = Vec::with_capacity(units.len());
    let mut i = 0;
    'next: while i < units.len() {
        if units[i].0 >= 0x80 {
            for (seq, ascii) in LOOKALIKES {
                let here = units[i..].iter().map(|u| u.0).take(seq.len());
                if here.eq(seq.iter().copied()) {
                    out.push((ascii, true));
                    i += seq.len();
                    continue 'next;
                }
            }
        }
        out.push(units[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const REFUSED: [&str; 30] = [
        "/../x",
        "/a/./b",
        "/a/..",
        "/..%2fsecret",
        "/a/..%2f..%2fsecret",
        "/%2e%2e%2fsecret",
        "/.%2e%2fsecret",
        "/..%2Fsecret",
        "/%2E%2e/b",
        "/..%5csecret",
        "/%5c..%5csecret",
        "/..\\x",
        "/..;/admin",
        "/%2e%2e;/admin",
        "/..%3b/admin",
        "/%252e%252e/secret",
        "/%25252e%25252e/secret",
        "/%c0%ae%c0%ae/secret",
        "/%e0%80%ae./secret",
        "/%u002e%u002e/secret",
        "/%U002E./secret",
        "/%ef%bc%8e%ef%bc%8e/secret",
        "/..%c0%afsecret",
        "/..%e2%88%95secret",
        "/.../x",
        "/..%20/x",
        "/%2e%2e%20%20/x",
        "/..",
        "/..%00/x",
        "/a%0a/b",
    ];

    #[test]
    fn every_encoding_of_a_dot_segment_is_refused_even_with_encoded_slashes_allowed() {
        for path in REFUSED {
            assert!(check(path, false).is_err(), "{path} passed");
            assert!(
                check(path, true).is_err(),
                "{path} passed with slashes allowed"
            );
        }
    }

    #[test]
    fn encoded_slashes_and_backslashes_elsewhere_follow_the_setting() {
        for path in [
            "/a%2Fb",
            "/a%2fb",
            "/a%5cb",
            "/a\\b",
            "/a%252fb",
            "/a%c0%afb",
            "/a%u2215b",
            "/a%ef%bc%8fb",
        ] {
            assert_eq!(check(path, false), Err(PathError::EncodedSlash), "{path}");
            assert_eq!(check(path, true), Ok(()), "{path}");
        }
    }

    #[test]
    fn ordinary_paths_pass() {
        for path in [
            "/",
            "/jmap/",
            "/a/.well-known/..x/b.",
            "/a;v=1/..x;/b",
            "/dav/calendars/alice%40example.com/home/",
            "/files/100%25.txt",
            "/files/%e2%82%ac.txt",
            "/x/%zz/%u12/%",
            "/a..b/c.",
            "/. a/",
            "*",
        ] {
            assert_eq!(check(path, false), Ok(()), "{path}");
        }
    }
}
