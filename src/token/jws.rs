//! The pieces of a compact JWS as tessera reads them: exactly three non-empty segments, the
//! protected header's members that matter (RFC 7515 4.1, RFC 8725 3.1), NumericDate claims.

use serde::Deserialize;

#[derive(Deserialize)]
pub(super) struct RawHeader<'a> {
    #[serde(borrow)]
    pub(super) alg: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    pub(super) typ: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    pub(super) kid: Option<std::borrow::Cow<'a, str>>,
    // Present with any value, `null` included (an `Option` would read `null` as absent).
    #[serde(default, deserialize_with = "present")]
    pub(super) crit: bool,
    #[serde(default, deserialize_with = "present")]
    pub(super) jku: bool,
    #[serde(default, deserialize_with = "present")]
    pub(super) x5u: bool,
    #[serde(default, deserialize_with = "present")]
    pub(super) jwk: bool,
    #[serde(default, deserialize_with = "present")]
    pub(super) x5c: bool,
}

/// `true` for a header member that is there at all, whatever its value.
pub(super) fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    serde::de::IgnoredAny::deserialize(d).map(|_| true)
}

/// NumericDate (RFC 7519 section 2): a non-negative JSON number; fractions are truncated.
pub(super) fn numeric_date(v: Option<&serde_json::Value>) -> Option<u64> {
    let n = v?.as_number()?;
    n.as_u64().or_else(|| {
        n.as_f64()
            .filter(|f| f.is_finite() && *f >= 0.0)
            .map(|f| f as u64)
    })
}

/// Splits a compact JWS into exactly three non-empty base64url segments.
pub(super) fn split3(token: &str) -> Option<(&str, &str, &str)> {
    if !token
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    {
        return None;
    }
    let mut parts = token.split('.');
    let (h, p, s) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || h.is_empty() || p.is_empty() || s.is_empty() {
        return None;
    }
    Some((h, p, s))
}
