//! An upstream response head kept as the bytes it arrived in: each field is a pair of offsets
//! into the frozen head. Fields are screened in place (dropped from the list) and written
//! downstream as they are, so a response leaving through the HTTP/1.1 fast path never becomes a
//! `HeaderMap` (no name lookup, hashing or map allocation per response). The hyper paths and
//! library callers get a `HeaderMap` built on demand ([`super::materialize`]).
//!
//! Field names and values were validated by `httparse` (RFC 9110 section 5: a token, then
//! visible characters, spaces, tabs and obs-text); names compare ASCII case-insensitively.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

/// The fields of one response head, in the order the upstream sent them.
pub struct RawHead {
    /// The whole head as received (status line included).
    bytes: Bytes,
    /// Per field: name start, name end, value start, value end (offsets into `bytes`).
    fields: Vec<[u32; 4]>,
    /// Bit `i` clear: no field named `TRACKED[i]` (a set bit may outlive a removal).
    seen: u8,
    /// A field tessera adds after the upstream's ([`RawHead::add`]): kept beside the bytes
    /// rather than in a `HeaderMap`, which a response would allocate for it.
    added: Option<&'static Added>,
}

/// A field tessera adds to an upstream answer ([`RawHead::add`]).
#[derive(Debug, Clone, Copy)]
pub struct Added {
    /// The name, lowercase.
    pub name: &'static str,
    /// The value.
    pub value: &'static str,
    /// `name: value` and CRLF, as written (one copy per answer).
    pub line: &'static str,
}

/// `Cache-Control: private` (`server.private_responses`).
pub static CACHE_CONTROL_PRIVATE: Added = Added {
    name: "cache-control",
    value: "private",
    line: "cache-control: private\r\n",
};

/// Names every response is asked for (framing and `Connection`), recorded in the one pass of
/// [`RawHead::new`] so that asking for an absent one costs no scan.
const TRACKED: [&[u8]; 3] = [b"connection", b"transfer-encoding", b"content-length"];

/// The bit of `seen` set when a field names a URL the proxy may repoint ([`is_redirect_field`]).
const REDIRECT_SEEN: u8 = 1 << TRACKED.len();

/// Whether a field name is `Location`, `Content-Location` or `Refresh`: the fields whose URL
/// may name the upstream (told apart by length first: every field of every response is asked).
pub fn is_redirect_field(name: &[u8]) -> bool {
    match name.len() {
        7 => name.eq_ignore_ascii_case(b"refresh"),
        8 => name.eq_ignore_ascii_case(b"location"),
        16 => name.eq_ignore_ascii_case(b"content-location"),
        _ => false,
    }
}

impl RawHead {
    /// Fields at `spans` of `bytes` (offsets must lie within `bytes`; a head is at most
    /// 64 KiB).
    pub fn new(bytes: Bytes, spans: Vec<[u32; 4]>) -> Self {
        debug_assert!(spans
            .iter()
            .all(|s| s[1] as usize <= bytes.len() && s[3] as usize <= bytes.len()));
        let mut seen = 0;
        for s in &spans {
            let name = &bytes[s[0] as usize..s[1] as usize];
            for (i, t) in TRACKED.iter().enumerate() {
                if name.eq_ignore_ascii_case(t) {
                    seen |= 1 << i;
                }
            }
            if is_redirect_field(name) {
                seen |= REDIRECT_SEEN;
            }
        }
        Self {
            bytes,
            fields: spans,
            seen,
            added: None,
        }
    }

    /// Adds `field` (not a framing field or `Connection`) after the upstream's, replacing one
    /// added before. Written ([`RawHead::write_lines`]), moved to a map
    /// ([`RawHead::append_to`]) and screened ([`RawHead::retain`]) with them; not among the
    /// upstream's own that [`RawHead::iter`] and [`RawHead::get_all`] read (asked of every
    /// answer, they stay one plain scan).
    pub fn add(&mut self, field: &'static Added) {
        debug_assert!(!TRACKED
            .iter()
            .any(|t| t.eq_ignore_ascii_case(field.name.as_bytes())));
        self.added = Some(field);
    }

    /// Every field the upstream sent (and screening kept) as `(name, value)`, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.fields.iter().map(|s| self.field(s))
    }

    /// The values of the upstream's fields named `name` (lowercase), in order.
    pub fn get_all<'a>(&'a self, name: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
        let absent = TRACKED
            .iter()
            .position(|t| *t == name)
            .is_some_and(|i| self.seen & (1 << i) == 0);
        let fields = if absent { &[][..] } else { &self.fields[..] };
        fields
            .iter()
            .map(|s| self.field(s))
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }

    /// Whether a `Location`, `Content-Location` or `Refresh` field may be present (recorded when
    /// the head was read; it may outlive a removal).
    pub fn may_redirect(&self) -> bool {
        self.seen & REDIRECT_SEEN != 0
    }

    /// Whether a field named `name` (lowercase) is present.
    pub fn contains(&self, name: &[u8]) -> bool {
        self.get_all(name).next().is_some()
    }

    /// Drops every field named `name` (lowercase).
    pub fn remove(&mut self, name: &[u8]) {
        self.retain(|n, _| !n.eq_ignore_ascii_case(name));
    }

    /// Keeps the fields for which `keep(name, value)` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(&[u8], &[u8]) -> bool) {
        if let Some(a) = self.added {
            if !keep(a.name.as_bytes(), a.value.as_bytes()) {
                self.added = None;
            }
        }
        let bytes = &self.bytes;
        self.fields.retain(|s| {
            keep(
                &bytes[s[0] as usize..s[1] as usize],
                &bytes[s[2] as usize..s[3] as usize],
            )
        });
    }

    /// Appends the fields whose name `keep` accepts to `out` as field lines (`name:value` as
    /// received, the colon and any whitespace after it included (RFC 9112 section 5; for a value
    /// of only whitespace, that whitespace), then CRLF). Lines that were adjacent in the head are
    /// copied together.
    pub fn write_lines(&self, out: &mut Vec<u8>, mut keep: impl FnMut(&[u8]) -> bool) {
        let b = &self.bytes[..];
        // Kept lines not yet written: `b[start..end]`, ending at a value whose CRLF is not.
        let mut run: Option<(usize, usize)> = None;
        for s in &self.fields {
            let (ns, ne, ve) = (s[0] as usize, s[1] as usize, s[3] as usize);
            if !keep(&b[ns..ne]) {
                continue;
            }
            run = match run {
                // Only a bare CRLF between the two: the next line follows on.
                Some((start, end)) if b.get(end..ns) == Some(b"\r\n") => Some((start, ve)),
                Some((start, end)) => {
                    out.extend_from_slice(&b[start..end]);
                    out.extend_from_slice(b"\r\n");
                    Some((ns, ve))
                }
                None => Some((ns, ve)),
            };
        }
        if let Some((start, end)) = run {
            out.extend_from_slice(&b[start..end]);
            out.extend_from_slice(b"\r\n");
        }
        if let Some(a) = self.added.filter(|a| keep(a.name.as_bytes())) {
            out.extend_from_slice(a.line.as_bytes());
        }
    }

    /// Appends the fields to `map` (values share the head's bytes). A field `http` refuses,
    /// which `httparse` already ruled out, is skipped.
    pub fn append_to(&self, map: &mut HeaderMap) {
        map.reserve(self.fields.len());
        for s in &self.fields {
            let name = HeaderName::from_bytes(&self.bytes[s[0] as usize..s[1] as usize]);
            let value =
                HeaderValue::from_maybe_shared(self.bytes.slice(s[2] as usize..s[3] as usize));
            if let (Ok(name), Ok(value)) = (name, value) {
                map.append(name, value);
            }
        }
        if let Some(a) = self.added {
            map.append(
                HeaderName::from_static(a.name),
                HeaderValue::from_static(a.value),
            );
        }
    }

    fn field(&self, s: &[u32; 4]) -> (&[u8], &[u8]) {
        (
            &self.bytes[s[0] as usize..s[1] as usize],
            &self.bytes[s[2] as usize..s[3] as usize],
        )
    }
}

#[cfg(test)]
pub(crate) fn from_pairs(pairs: &[(&str, &str)]) -> RawHead {
    let mut text = b"HTTP/1.1 200 OK\r\n".to_vec();
    let mut spans = Vec::new();
    for (name, value) in pairs {
        let ns = text.len() as u32;
        text.extend_from_slice(name.as_bytes());
        let ne = text.len() as u32;
        text.extend_from_slice(b": ");
        let vs = text.len() as u32;
        text.extend_from_slice(value.as_bytes());
        spans.push([ns, ne, vs, text.len() as u32]);
        text.extend_from_slice(b"\r\n");
    }
    RawHead::new(Bytes::from(text), spans)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A field added after the upstream's is written, moved to a map and screened as theirs
    /// are, and is not among theirs when they are read.
    #[test]
    fn an_added_field_goes_with_the_upstreams() {
        let mut head = from_pairs(&[("cache-control", "max-age=60"), ("etag", "\"x\"")]);
        head.add(&CACHE_CONTROL_PRIVATE);
        let mut out = Vec::new();
        head.write_lines(&mut out, |_| true);
        assert_eq!(
            out,
            b"cache-control: max-age=60\r\netag: \"x\"\r\ncache-control: private\r\n"
        );
        let values: Vec<_> = head.get_all(b"cache-control").collect();
        assert_eq!(values, [&b"max-age=60"[..]], "the upstream's alone");
        let mut map = HeaderMap::new();
        head.append_to(&mut map);
        assert_eq!(map.get_all("cache-control").iter().count(), 2);
        head.remove(b"cache-control");
        let mut out = Vec::new();
        head.write_lines(&mut out, |_| true);
        assert_eq!(out, b"etag: \"x\"\r\n");
    }

    #[test]
    fn a_head_knows_whether_it_may_name_a_redirect() {
        assert!(!from_pairs(&[("content-type", "text/plain"), ("locations", "x")]).may_redirect());
        for name in ["Location", "content-location", "REFRESH"] {
            assert!(
                from_pairs(&[("date", "x"), (name, "/y")]).may_redirect(),
                "{name}"
            );
        }
    }

    #[test]
    fn lookups_are_case_insensitive_and_ordered_and_the_map_matches() {
        let mut h = from_pairs(&[("Set-Cookie", "a=1"), ("X-A", "x"), ("set-cookie", "b=2")]);
        assert_eq!(
            h.get_all(b"set-cookie").collect::<Vec<_>>(),
            [b"a=1", b"b=2"]
        );
        assert!(h.contains(b"x-a") && !h.contains(b"x-b"));
        assert!(!h.contains(b"connection") && !h.contains(b"content-length"));
        let framed = from_pairs(&[("Content-Length", "1"), ("CONNECTION", "close")]);
        assert!(framed.contains(b"content-length") && framed.contains(b"connection"));
        assert!(!framed.contains(b"transfer-encoding"));
        let mut map = HeaderMap::new();
        h.append_to(&mut map);
        assert_eq!(map.len(), 3);
        assert_eq!(
            map.get_all("set-cookie").iter().collect::<Vec<_>>(),
            ["a=1", "b=2"]
        );
        h.remove(b"set-cookie");
        assert_eq!(h.iter().collect::<Vec<_>>(), [(&b"X-A"[..], &b"x"[..])]);
    }

    /// A head as an upstream may send it: odd spacing, an empty value, a bare-LF line end.
    fn received() -> RawHead {
        let text = b"HTTP/1.1 200 OK\r\nA: 1\r\nB:2  \r\nC:\r\nD:\t4\nE: 5\r\nF: 6\r\n\r\n";
        let mut headers = [httparse::EMPTY_HEADER; 8];
        let mut parsed = httparse::Response::new(&mut headers);
        assert!(parsed.parse(text).unwrap().is_complete());
        let base = text.as_ptr() as usize;
        let spans = parsed
            .headers
            .iter()
            .map(|h| {
                let (n, v) = (
                    h.name.as_ptr() as usize - base,
                    h.value.as_ptr() as usize - base,
                );
                [n, n + h.name.len(), v, v + h.value.len()].map(|o| o as u32)
            })
            .collect();
        RawHead::new(Bytes::from_static(text), spans)
    }

    #[test]
    fn written_lines_keep_each_kept_field_as_received_and_end_every_line_in_crlf() {
        let h = received();
        let mut out = Vec::new();
        h.write_lines(&mut out, |_| true);
        assert_eq!(out, b"A: 1\r\nB:2\r\nC:\r\nD:\t4\r\nE: 5\r\nF: 6\r\n");
        out.clear();
        h.write_lines(&mut out, |n| n != b"B" && n != b"E");
        assert_eq!(out, b"A: 1\r\nC:\r\nD:\t4\r\nF: 6\r\n");
        out.clear();
        h.write_lines(&mut out, |_| false);
        assert!(out.is_empty());
    }
}
