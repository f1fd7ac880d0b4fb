//! HMAC signatures (JWS `HS256`/`HS384`/`HS512`, RFC 7518 section 3.2) checked with the key's
//! inner and outer pads hashed once, when the key is loaded. jsonwebtoken keys its MAC on every
//! verification: two of the five SHA-512 compressions of a typical token, on a path where
//! SHA-512 was 23 % of a request's instructions (the token cache off or missed).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::{Sha256, Sha384, Sha512};

use super::keys::VerifyKey;
use super::Algorithm;

/// One secret keyed for each HMAC algorithm it verifies.
#[derive(Clone, Default)]
pub(super) struct HmacKey {
    hs256: Option<Hmac<Sha256>>,
    hs384: Option<Hmac<Sha384>>,
    hs512: Option<Hmac<Sha512>>,
}

impl HmacKey {
    /// `secret` keyed for the HMAC algorithms among `algs` (none for the others).
    pub(super) fn new(secret: &[u8], algs: &[Algorithm]) -> Self {
        let mut key = Self::default();
        for alg in algs {
            match alg {
                Algorithm::HS256 => key.hs256 = Hmac::new_from_slice(secret).ok(),
                Algorithm::HS384 => key.hs384 = Hmac::new_from_slice(secret).ok(),
                Algorithm::HS512 => key.hs512 = Hmac::new_from_slice(secret).ok(),
                _ => {}
            }
        }
        key
    }

    /// Whether `sig_b64` (base64url, no padding) is the MAC of `signed` under `alg`, compared in
    /// constant time; `None` when this key is not keyed for `alg`.
    pub(super) fn verify(&self, alg: Algorithm, signed: &[u8], sig_b64: &str) -> Option<bool> {
        let mut buf = [0u8; 64];
        let sig = URL_SAFE_NO_PAD.decode_slice(sig_b64, &mut buf).ok();
        let sig = sig.map(|n| &buf[..n]);
        Some(match alg {
            Algorithm::HS256 => tag(self.hs256.as_ref()?, signed, sig),
            Algorithm::HS384 => tag(self.hs384.as_ref()?, signed, sig),
            Algorithm::HS512 => tag(self.hs512.as_ref()?, signed, sig),
            _ => return None,
        })
    }
}

impl VerifyKey {
    /// Whether `sig_b64` is `signed`'s signature under `alg`: with the secret keyed at load when
    /// this is a configured HMAC key, else through jsonwebtoken.
    pub(super) fn verify(&self, alg: Algorithm, signed: &[u8], sig_b64: &str) -> bool {
        self.hmac
            .as_ref()
            .and_then(|k| k.verify(alg, signed, sig_b64))
            .unwrap_or_else(|| {
                jsonwebtoken::crypto::verify(sig_b64, signed, &self.key, alg.jwt()).unwrap_or(false)
            })
    }
}

/// `sig` (`None`: not base64url) is `signed`'s MAC under the keyed `mac` (cloned: the pads stay
/// hashed).
fn tag<M: Mac + Clone>(mac: &M, signed: &[u8], sig: Option<&[u8]>) -> bool {
    sig.is_some_and(|sig| mac.clone().chain_update(signed).verify_slice(sig).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prekeyed_mac_agrees_with_jsonwebtoken() {
        let secret = b"0123456789abcdef0123456789abcdef";
        for alg in [Algorithm::HS256, Algorithm::HS384, Algorithm::HS512] {
            let key = HmacKey::new(secret, &[alg]);
            let signed = b"eyJhbGciOiJIUzI1NiJ9.eyJzaWQiOiJzIn0";
            let enc = jsonwebtoken::EncodingKey::from_secret(secret);
            let sig = jsonwebtoken::crypto::sign(signed, &enc, alg.jwt()).unwrap();
            assert_eq!(key.verify(alg, signed, &sig), Some(true));
            assert_eq!(key.verify(alg, b"other", &sig), Some(false));
            assert_eq!(key.verify(alg, signed, "!!"), Some(false));
            assert_eq!(key.verify(alg, signed, &sig[..sig.len() - 2]), Some(false));
            assert_eq!(key.verify(Algorithm::RS256, signed, &sig), None);
        }
        let only_512 = HmacKey::new(secret, &[Algorithm::HS512]);
        assert_eq!(only_512.verify(Algorithm::HS256, b"x", "AA"), None);
    }
}
