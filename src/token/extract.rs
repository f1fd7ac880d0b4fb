//! The extract phase: find the token in the request, from the configured sources in order.
//!
//! Must never: decode or trust the token (that is `verify`), or keep it past the request.

use std::borrow::Cow;

use base64::Engine;
use http::header::{AUTHORIZATION, COOKIE};
use http::{HeaderMap, HeaderValue};

/// One place a token may be carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// `Authorization: Bearer <token>` (RFC 6750 section 2.1; scheme case-insensitive).
    Bearer,
    /// Cookie `NAME` holding the JWT itself.
    Cookie(String),
    /// Cookie `NAME` holding base64 of the JWT, optionally in double quotes (the published
    /// hyper-auth-proxy form, cookie `Authorization`).
    CookieB64(String),
}

impl TokenSource {
    /// `token.sources` when not listed: bearer, cookie `tessera`, and the published
    /// hyper-auth-proxy's base64 cookie `Authorization`.
    pub fn defaults() -> [Self; 3] {
        [
            Self::Bearer,
            Self::Cookie("tessera".into()),
            Self::CookieB64("Authorization".into()),
        ]
    }

    /// Parses `bearer`, `cookie:NAME` or `cookie-b64:NAME`.
    pub fn parse(s: &str) -> Option<Self> {
        if s == "bearer" {
            Some(Self::Bearer)
        } else if let Some(name) = s.strip_prefix("cookie-b64:") {
            valid_cookie_name(name).then(|| Self::CookieB64(name.to_string()))
        } else if let Some(name) = s.strip_prefix("cookie:") {
            valid_cookie_name(name).then(|| Self::Cookie(name.to_string()))
        } else {
            None
        }
    }

    fn cookie_name(&self) -> Option<&str> {
        match self {
            Self::Bearer => None,
            Self::Cookie(n) | Self::CookieB64(n) => Some(n),
        }
    }
}

fn valid_cookie_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b))
}

/// Why no usable token came out of the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtractError {
    /// No configured source carried anything.
    Missing,
    /// A source carried something that is not a token (bad base64, non-ASCII, empty).
    Malformed,
}

/// A token as its source carried it. A base64 cookie's value is decoded only when its text is
/// needed ([`Carried::text`]): the verified-token cache keys on the carried bytes, so a warm
/// request skips the decode (about 2,000 instructions for a 600-byte cookie).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carried<'a> {
    /// The JWT itself (`bearer`, `cookie:NAME`).
    Text(&'a str),
    /// A `cookie-b64:NAME` value, without its double quotes: base64 of the JWT.
    Base64(&'a [u8]),
}

impl<'a> Carried<'a> {
    /// The JWT. Errors: a base64 value that is not base64 (padded or not) of UTF-8, or only
    /// whitespace once decoded: [`ExtractError::Malformed`].
    pub fn text(&self) -> Result<Cow<'a, str>, ExtractError> {
        match *self {
            Self::Text(t) => Ok(Cow::Borrowed(t)),
            Self::Base64(b) => decode_b64_cookie(b).map(Cow::Owned),
        }
    }
}

/// Returns the token from the first configured source that carries one, decoded.
///
/// The first present source decides: a malformed value there is an error even if a later
/// source would have a token (RFC 6750 section 2: one method per request). The token is borrowed
/// from the header when it is carried as is, decoded into an owned string from a base64 cookie.
pub fn extract<'a>(
    headers: &'a HeaderMap,
    sources: &[TokenSource],
) -> Result<Cow<'a, str>, ExtractError> {
    extract_carried(headers, sources)?.text()
}

/// Like [`extract`], but a base64 cookie is left undecoded ([`Carried`]); its decoding errors
/// come from [`Carried::text`].
pub fn extract_carried<'a>(
    headers: &'a HeaderMap,
    sources: &[TokenSource],
) -> Result<Carried<'a>, ExtractError> {
    for source in sources {
        let found = match source {
            TokenSource::Bearer => bearer(headers),
            // A cookie-value may be in double quotes (RFC 6265 section 4.1.1).
            TokenSource::Cookie(name) => cookie(headers, name).map(|v| {
                let v = match v {
                    [b'"', inner @ .., b'"'] => inner,
                    other => other,
                };
                std::str::from_utf8(v)
                    .map(Carried::Text)
                    .map_err(|_| ExtractError::Malformed)
            }),
            TokenSource::CookieB64(name) => cookie(headers, name).map(|v| match v {
                [b'"', inner @ .., b'"'] => Ok(Carried::Base64(inner)),
                other => Ok(Carried::Base64(other)),
            }),
        };
        if let Some(result) = found {
            return result.and_then(|t| match t {
                Carried::Text("") | Carried::Base64([]) => Err(ExtractError::Malformed),
                t => Ok(t),
            });
        }
    }
    Err(ExtractError::Missing)
}

fn bearer(headers: &HeaderMap) -> Option<Result<Carried<'_>, ExtractError>> {
    for value in headers.get_all(AUTHORIZATION) {
        let bytes = value.as_bytes();
        if bytes.len() > 7 && bytes[..7].eq_ignore_ascii_case(b"bearer ") {
            let token = bytes[7..].trim_ascii();
            return Some(
                std::str::from_utf8(token)
                    .map(Carried::Text)
                    .map_err(|_| ExtractError::Malformed),
            );
        }
    }
    None
}

/// The `name=value` pairs of one `Cookie` field value, each part trimmed; a pair without `=`
/// is skipped. Split with `memchr`: a hyper-auth-proxy cookie is 600 bytes of base64, which a
/// byte-at-a-time split walked twice per request (extract, then strip).
struct Pairs<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        while !self.rest.is_empty() {
            let end = memchr::memchr(b';', self.rest).unwrap_or(self.rest.len());
            let pair = &self.rest[..end];
            self.rest = self.rest.get(end + 1..).unwrap_or_default();
            let pair = pair.trim_ascii();
            if let Some(eq) = memchr::memchr(b'=', pair) {
                return Some((pair[..eq].trim_ascii(), pair[eq + 1..].trim_ascii()));
            }
        }
        None
    }
}

/// Iterates `name=value` pairs over every `Cookie` header (HTTP/2 may split them).
fn cookie_pairs(headers: &HeaderMap) -> impl Iterator<Item = (&[u8], &[u8])> {
    headers
        .get_all(COOKIE)
        .iter()
        .flat_map(|v| Pairs { rest: v.as_bytes() })
}

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a [u8]> {
    cookie_pairs(headers)
        .find(|(n, _)| *n == name.as_bytes())
        .map(|(_, v)| v)
}

fn decode_b64_cookie(value: &[u8]) -> Result<String, ExtractError> {
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(value)
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(value))
        .map_err(|_| ExtractError::Malformed)?;
    let text = String::from_utf8(decoded).map_err(|_| ExtractError::Malformed)?;
    // One line ending allowed (`echo $JWT | base64` adds it), no other whitespace: the
    // verified-token cache keys on the cookie as carried, and each spelling of one token with
    // spaces around it would verify and take an entry of its own (one user could churn the
    // cache with a valid token).
    let token = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(&text);
    // The published hyper-auth-proxy also takes the JWT quoted inside the base64.
    let token = token
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(token);
    match token {
        "" => Err(ExtractError::Malformed),
        t if t.trim().len() != t.len() => Err(ExtractError::Malformed),
        t if t.len() == text.len() => Ok(text),
        t => Ok(t.to_owned()),
    }
}

/// Removes every cookie named by a cookie source from the `Cookie` headers (so the token never
/// reaches the upstream), and joins several `Cookie` fields into one with `"; "` (RFC 9113
/// section 8.2.3: an HTTP/2 client may send each cookie as a field of its own, and HTTP/1.1
/// allows only one, RFC 6265 section 5.4); drops a `Cookie` header left empty.
pub fn strip_token_cookies(headers: &mut HeaderMap, sources: &[TokenSource]) {
    let mut fields = headers.get_all(COOKIE).iter();
    if fields.next().is_none() {
        return;
    }
    let several = fields.next().is_some();
    let names: Vec<&str> = sources
        .iter()
        .filter_map(TokenSource::cookie_name)
        .collect();
    if names.is_empty() && !several {
        return;
    }
    let mut changed = several;
    let mut out: Vec<u8> = Vec::new();
    for value in headers.get_all(COOKIE) {
        let mut rest = value.as_bytes();
        while !rest.is_empty() {
            let end = memchr::memchr(b';', rest).unwrap_or(rest.len());
            let trimmed = rest[..end].trim_ascii();
            rest = rest.get(end + 1..).unwrap_or_default();
            let name =
                trimmed[..memchr::memchr(b'=', trimmed).unwrap_or(trimmed.len())].trim_ascii();
            if names.iter().any(|n| n.as_bytes() == name) {
                changed = true;
                continue;
            }
            if trimmed.is_empty() {
                continue;
            }
            if !out.is_empty() {
                out.extend_from_slice(b"; ");
            }
            out.extend_from_slice(trimmed);
        }
    }
    if changed {
        headers.remove(COOKIE);
        if let Ok(v) = HeaderValue::from_bytes(&out) {
            if !out.is_empty() {
                headers.insert(COOKIE, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        m
    }

    fn all() -> Vec<TokenSource> {
        ["bearer", "cookie:tessera", "cookie-b64:Authorization"]
            .iter()
            .map(|s| TokenSource::parse(s).unwrap())
            .collect()
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        assert_eq!(
            extract(&h(&[("authorization", "bEaReR a.b.c")]), &all()).unwrap(),
            "a.b.c"
        );
    }

    #[test]
    fn basic_authorization_is_not_a_token() {
        assert_eq!(
            extract(&h(&[("authorization", "Basic eDp5")]), &all()),
            Err(ExtractError::Missing)
        );
    }

    #[test]
    fn cookie_and_quoted_b64_cookie() {
        assert_eq!(
            extract(&h(&[("cookie", "a=1; tessera=x.y.z; b=2")]), &all()).unwrap(),
            "x.y.z"
        );
        // In quotes, as RFC 6265's cookie-value allows.
        let hm = h(&[("cookie", "tessera=\"x.y.z\"")]);
        assert_eq!(extract(&hm, &all()).unwrap(), "x.y.z");
        // base64("x.y.z") = eC55Lno=
        let hm = h(&[("cookie", "Authorization=\"eC55Lno=\"")]);
        assert_eq!(extract(&hm, &all()).unwrap(), "x.y.z");
        let hm = h(&[("cookie", "Authorization=eC55Lno")]);
        assert_eq!(extract(&hm, &all()).unwrap(), "x.y.z");
        // base64("x.y.z\n") = eC55LnoK: a line ending is dropped; base64(" x.y.z") =
        // IHgueS56 and base64("x.y.z  ") = eC55LnogIA==: other whitespace is refused.
        let hm = h(&[("cookie", "Authorization=eC55LnoK")]);
        assert_eq!(extract(&hm, &all()).unwrap(), "x.y.z");
        // base64("\"x.y.z\"") = IngueS56Ig==: quoted inside, as hyper-auth-proxy takes it.
        let hm = h(&[("cookie", "Authorization=IngueS56Ig==")]);
        assert_eq!(extract(&hm, &all()).unwrap(), "x.y.z");
        for padded in ["IHgueS56", "eC55LnogIA=="] {
            let hm = h(&[("cookie", &*format!("Authorization={padded}"))]);
            assert_eq!(
                extract(&hm, &all()),
                Err(ExtractError::Malformed),
                "{padded}"
            );
        }
    }

    #[test]
    fn first_present_source_decides() {
        let hm = h(&[
            ("authorization", "Bearer first"),
            ("cookie", "tessera=second"),
        ]);
        assert_eq!(extract(&hm, &all()).unwrap(), "first");
        let hm = h(&[("cookie", "Authorization=!!!notb64")]);
        assert_eq!(extract(&hm, &all()), Err(ExtractError::Malformed));
        assert_eq!(extract(&h(&[]), &all()), Err(ExtractError::Missing));
    }

    #[test]
    fn strip_removes_only_token_cookies_across_headers() {
        let mut hm = h(&[
            ("cookie", "a=1; tessera=t"),
            ("cookie", "Authorization=x; b=2"),
        ]);
        strip_token_cookies(&mut hm, &all());
        let v: Vec<_> = hm
            .get_all(COOKIE)
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect();
        assert_eq!(v, vec!["a=1; b=2"]);
        // HTTP/2 cookie crumbs are joined even with no token cookie among them.
        let mut hm = h(&[("cookie", "a=1"), ("cookie", "b=2"), ("cookie", "c=3")]);
        strip_token_cookies(&mut hm, &[TokenSource::Bearer]);
        assert_eq!(hm.get_all(COOKIE).iter().count(), 1);
        assert_eq!(hm[COOKIE], "a=1; b=2; c=3");
        let mut hm = h(&[("cookie", "tessera=t")]);
        strip_token_cookies(&mut hm, &all());
        assert!(hm.get(COOKIE).is_none());
    }

    #[test]
    fn source_parse_rejects_bad_names() {
        assert!(TokenSource::parse("cookie:").is_none());
        assert!(TokenSource::parse("cookie:a;b").is_none());
        assert!(TokenSource::parse("header:x").is_none());
    }
}
