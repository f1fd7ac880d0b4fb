//! A JWKS document (RFC 7517) read into verification keys by `kid`: only signing keys of the
//! pinned asymmetric algorithms, each checked to fit its algorithm. Must never: accept a
//! symmetric key from a published set, or guess which of two keys under one `kid` is meant.

use std::collections::{HashMap, HashSet};

use jsonwebtoken::jwk::Jwk;
use jsonwebtoken::DecodingKey;

use super::keys::{KeyError, VerifyKey};
use super::Algorithm;

/// Parses a JWKS document into verification keys by `kid`. Keys without `kid`, with `use` other
/// than `sig`, or with an algorithm outside `allowed` are skipped. When a JWK has no `alg`, it is
/// inferred from its type (RSA -> RS256, P-256 -> ES256, P-384 -> ES384, Ed25519 -> EdDSA). A
/// `kid` that two different usable keys share is skipped (warned): which of them signed a token
/// cannot be told; a key listed twice alike is one key.
///
/// Errors: not a JWKS JSON document.
pub(super) fn parse_jwks(
    doc: &[u8],
    allowed: &[Algorithm],
) -> Result<HashMap<String, VerifyKey>, KeyError> {
    #[derive(serde::Deserialize)]
    struct Doc {
        keys: Vec<serde_json::Value>,
    }
    let doc: Doc =
        serde_json::from_slice(doc).map_err(|e| KeyError(format!("not a JWKS document: {e}")))?;
    let mut out = HashMap::new();
    let mut first: HashMap<String, &serde_json::Value> = HashMap::new();
    let mut ambiguous = HashSet::new();
    for raw in &doc.keys {
        // Each key on its own: one key this crate cannot represent must not void the others.
        let Ok(jwk) = serde_json::from_value::<Jwk>(raw.clone()) else {
            continue;
        };
        let Some((kid, key)) = usable(&jwk, allowed) else {
            continue;
        };
        match first.get(&kid) {
            Some(seen) if *seen != raw => {
                if ambiguous.insert(kid.clone()) {
                    tracing::warn!(kid, "JWKS keys skipped: one kid names two different keys");
                }
            }
            Some(_) => {}
            None => {
                first.insert(kid.clone(), raw);
                out.insert(kid, key);
            }
        }
    }
    out.retain(|kid, _| !ambiguous.contains(kid));
    Ok(out)
}

/// `jwk` as a verification key with its `kid`, when it is a signing key of an algorithm in
/// `allowed` (never a symmetric one: in a published JWKS it would be a secret in the open)
/// whose type and size fit that algorithm (a short Ed25519 `x` would otherwise reach the
/// verifier).
fn usable(jwk: &Jwk, allowed: &[Algorithm]) -> Option<(String, VerifyKey)> {
    use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, PublicKeyUse};
    let kid = jwk.common.key_id.clone()?;
    if matches!(&jwk.common.public_key_use, Some(u) if *u != PublicKeyUse::Signature) {
        return None;
    }
    let alg = jwk_algorithm(jwk).filter(|a| allowed.contains(a) && !a.is_hmac())?;
    let fits = match (&jwk.algorithm, alg) {
        (AlgorithmParameters::RSA(_), a) => {
            a.name().starts_with("RS") || a.name().starts_with("PS")
        }
        (AlgorithmParameters::EllipticCurve(p), Algorithm::ES256) => p.curve == EllipticCurve::P256,
        (AlgorithmParameters::EllipticCurve(p), Algorithm::ES384) => p.curve == EllipticCurve::P384,
        (AlgorithmParameters::OctetKeyPair(p), Algorithm::EdDSA) => {
            p.curve == EllipticCurve::Ed25519
                && base64::Engine::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, &p.x)
                    .is_ok_and(|x| x.len() == 32)
        }
        _ => false,
    };
    if !fits {
        tracing::warn!(
            kid,
            "JWKS key skipped: type or size does not fit its algorithm"
        );
        return None;
    }
    match DecodingKey::from_jwk(jwk) {
        Ok(key) => Some((
            kid,
            VerifyKey {
                algs: vec![alg],
                key,
                hmac: None,
            },
        )),
        Err(e) => {
            tracing::warn!(kid, error = %e, "JWKS key skipped");
            None
        }
    }
}

/// A JWK's algorithm: its `alg`, else inferred from its type (RSA -> RS256, P-256 -> ES256,
/// P-384 -> ES384, Ed25519 -> EdDSA).
fn jwk_algorithm(jwk: &Jwk) -> Option<Algorithm> {
    use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve};
    match jwk.common.key_algorithm {
        Some(a) => Algorithm::parse(&format!("{a:?}")),
        None => match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => Some(Algorithm::RS256),
            AlgorithmParameters::EllipticCurve(p) => match p.curve {
                EllipticCurve::P256 => Some(Algorithm::ES256),
                EllipticCurve::P384 => Some(Algorithm::ES384),
                _ => None,
            },
            AlgorithmParameters::OctetKeyPair(p) if p.curve == EllipticCurve::Ed25519 => {
                Some(Algorithm::EdDSA)
            }
            _ => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jwks_skips_symmetric_unlisted_and_kidless_keys() {
        let doc = br#"{"keys":[
            {"kty":"oct","kid":"h","k":"c2VjcmV0","alg":"HS256"},
            {"kty":"OKP","crv":"Ed25519","kid":"ed","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"},
            {"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"},
            {"kty":"OKP","crv":"Ed25519","kid":"enc","use":"enc","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"},
            {"kty":"OKP","crv":"Ed25519","kid":"short","x":"11qYAYKxCrfVS_7TyWQ"},
            {"kty":"OKP","crv":"X25519","kid":"x","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"},
            {"kty":"weird","kid":"w"}
        ]}"#;
        let keys = parse_jwks(doc, &[Algorithm::EdDSA, Algorithm::HS256]).unwrap();
        assert_eq!(keys.keys().collect::<Vec<_>>(), vec!["ed"]);
        assert!(parse_jwks(doc, &[Algorithm::RS256]).unwrap().is_empty());
        assert!(parse_jwks(b"[]", &[Algorithm::EdDSA]).is_err());
    }

    /// A kid naming two different signing keys names neither (which signed cannot be told); a
    /// key listed twice alike, or beside a key of the same kid that could not verify anyway
    /// (an encryption key, an X25519 key), is kept.
    #[test]
    fn jwks_skips_a_kid_that_names_two_keys() {
        let x = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo";
        let y = "3p7bfXt9wbTTW2HC7OQ1Nz-DQ8hbeGdNrfx-FG-IK08";
        let doc = format!(
            r#"{{"keys":[
            {{"kty":"OKP","crv":"Ed25519","kid":"two","x":"{x}"}},
            {{"kty":"OKP","crv":"Ed25519","kid":"two","x":"{y}"}},
            {{"kty":"OKP","crv":"Ed25519","kid":"same","x":"{x}"}},
            {{"kty":"OKP","crv":"Ed25519","kid":"same","x":"{x}"}},
            {{"kty":"OKP","crv":"Ed25519","kid":"enc","x":"{x}"}},
            {{"kty":"OKP","crv":"X25519","kid":"enc","use":"enc","x":"{y}"}},
            {{"kty":"OKP","crv":"Ed25519","kid":"x255","x":"{x}"}},
            {{"kty":"OKP","crv":"X25519","kid":"x255","x":"{y}"}}
        ]}}"#
        );
        let keys = parse_jwks(doc.as_bytes(), &[Algorithm::EdDSA]).unwrap();
        let mut kids: Vec<_> = keys.keys().map(String::as_str).collect();
        kids.sort_unstable();
        assert_eq!(kids, vec!["enc", "same", "x255"]);
    }
}
