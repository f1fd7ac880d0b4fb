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
}

impl RawHead {
    /// Fields at `spans` of `bytes` (offsets must lie within `bytes`; a head is at most
    /// 64 KiB).
    pub fn new(bytes: Bytes, spans: Vec<[u32; 4]>) -> Self {
        debug_assert!(spans
            .iter()
            .all(|s| s[1] as usize <= bytes.len() && s[3] as usize <= bytes.len()));
        Self {
            bytes,
            fields: spans,
        }
    }

    /// Every field as `(name, value)`, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.fields.iter().map(|s| self.field(s))
    }

    /// The values of the fields named `name` (lowercase), in order.
    pub fn get_all<'a>(&'a self, name: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
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
        let bytes = &self.bytes;
        self.fields.retain(|s| {
            keep(
                &bytes[s[0] as usize..s[1] as usize],
                &bytes[s[2] as usize..s[3] as usize],
            )
        });
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

    #[test]
    fn lookups_are_case_insensitive_and_ordered_and_the_map_matches() {
        let mut h = from_pairs(&[("Set-Cookie", "a=1"), ("X-A", "x"), ("set-cookie", "b=2")]);
        assert_eq!(
            h.get_all(b"set-cookie").collect::<Vec<_>>(),
            [b"a=1", b"b=2"]
        );
        assert!(h.contains(b"x-a") && !h.contains(b"x-b"));
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
}
