//! Token keys: which key verifies a token (by `kid`), which key signs new ones; the JWKS of an
//! external identity provider is kept in [`super::jwks`].
//!
//! Owns key rotation: several keys verify, exactly one (`token.active_kid`) signs. A key not
//! listed is retired: its tokens are refused. Every key is bound to its algorithm(s), so a
//! token's `alg` can never make an RSA public key act as an HMAC secret (RFC 8725 2.1).
//! Must never: fetch a key named by the token itself (`jku`/`x5u` are refused in verify), or
//! refresh the JWKS more than once per `token.jwks_min_refresh_seconds` because of unknown `kid`s.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use jsonwebtoken::{DecodingKey, EncodingKey};
use zeroize::Zeroizing;

use super::hmac::HmacKey;
use super::Algorithm;

use super::jwks::Jwks;
pub use super::jwks::{check_jwks, jwks_tls, JwksConfig, JwksSource};

/// Key material as configured (secrets already resolved from `env:`/`file:`/literal).
#[derive(Clone)]
pub enum KeyMaterial {
    /// HMAC secret, raw bytes (HS256/384/512).
    Secret(Zeroizing<Vec<u8>>),
    /// PEM public key (`-----BEGIN PUBLIC KEY-----`): verifies only.
    Public(Vec<u8>),
    /// PEM private key (PKCS#8) plus its PEM public key: signs and verifies.
    KeyPair {
        /// `-----BEGIN PRIVATE KEY-----` (or `RSA PRIVATE KEY` / `EC PRIVATE KEY`).
        private: Zeroizing<Vec<u8>>,
        /// `-----BEGIN PUBLIC KEY-----`.
        public: Vec<u8>,
    },
}

/// One configured key: `[[token.keys]]`, or the single legacy `token.secret` (no `kid`).
#[derive(Clone)]
pub struct KeySpec {
    /// Key id matched against the token header's `kid`; `None` only for `token.secret`.
    pub kid: Option<String>,
    /// Algorithms this key verifies. One for `[[token.keys]]`; every configured HMAC algorithm
    /// for the legacy secret.
    pub algs: Vec<Algorithm>,
    /// The key itself.
    pub material: KeyMaterial,
}

impl std::fmt::Debug for KeySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeySpec")
            .field("kid", &self.kid)
            .field("algs", &self.algs)
            .field("material", &"<redacted>")
            .finish()
    }
}

/// A key ready to verify.
pub(super) struct VerifyKey {
    pub(super) algs: Vec<Algorithm>,
    pub(super) key: DecodingKey,
    /// A secret keyed once for its HMAC algorithms (`None`: jsonwebtoken verifies).
    pub(super) hmac: Option<HmacKey>,
}

/// The key that signs tokens tessera issues.
pub struct Signer {
    kid: Option<String>,
    alg: Algorithm,
    key: EncodingKey,
}

impl Signer {
    /// The `kid` put in issued tokens' headers, if any.
    pub fn kid(&self) -> Option<&str> {
        self.kid.as_deref()
    }

    /// Issues a token for session `sid` of user `sub`: claims `sub`, `sid`, `iat`, `exp` (seconds
    /// since the Unix epoch) and the configured `iss`/`aud`.
    ///
    /// Errors: as [`Signer::sign`].
    pub fn issue(
        &self,
        cfg: &super::TokenConfig,
        sub: &str,
        sid: &str,
        iat: u64,
        exp: u64,
    ) -> Result<String, SignError> {
        self.sign(&super::Claims {
            sub: sub.to_owned(),
            sid: sid.to_owned(),
            iat,
            exp,
            iss: cfg.issuer.clone(),
            aud: cfg.audience.clone(),
        })
    }

    /// Signs `claims` as a compact JWS with header `{"typ":"JWT","alg":..,"kid":..}`.
    ///
    /// Errors: the crypto backend refused the key (not expected for a validated config).
    pub fn sign<T: serde::Serialize>(&self, claims: &T) -> Result<String, SignError> {
        let mut header = jsonwebtoken::Header::new(self.alg.jwt());
        header.kid = self.kid.clone();
        jsonwebtoken::encode(&header, claims, &self.key).map_err(SignError)
    }
}

/// A token could not be signed: the crypto backend refused the key or the claims (not expected
/// for a validated configuration); the backend's error is the source.
#[derive(Debug, thiserror::Error)]
#[error("cannot sign the token")]
pub struct SignError(#[source] pub jsonwebtoken::errors::Error);

/// Why a key could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct KeyError(pub String);

/// Every verification key (configured + JWKS) and the signing key.
pub struct Keys {
    /// The `[token]` keys; replaced whole when the configuration is reloaded (SIGHUP,
    /// [`Keys::replace`]). Read on every signature check and every login, never on a
    /// verified-token cache hit.
    configured: RwLock<Arc<ConfiguredKeys>>,
    jwks: Option<Arc<Jwks>>,
}

/// The keys of `[token]` (`secret`, `[[token.keys]]`, `active_kid`), checked and ready.
pub struct ConfiguredKeys {
    by_kid: HashMap<String, VerifyKey>,
    no_kid: Option<VerifyKey>,
    signer: Option<Arc<Signer>>,
}

fn decoding_key(alg: Algorithm, material: &KeyMaterial) -> Result<DecodingKey, KeyError> {
    let pem = match material {
        KeyMaterial::Secret(s) if alg.is_hmac() => return Ok(DecodingKey::from_secret(s)),
        KeyMaterial::Secret(_) => {
            return Err(KeyError(format!(
                "{} needs public_key (PEM), not secret",
                alg.name()
            )))
        }
        _ if alg.is_hmac() => {
            return Err(KeyError(format!(
                "{} needs secret, not a PEM key",
                alg.name()
            )))
        }
        KeyMaterial::Public(p) | KeyMaterial::KeyPair { public: p, .. } => p,
    };
    use Algorithm as A;
    let r = match alg {
        A::RS256 | A::RS384 | A::RS512 | A::PS256 | A::PS384 | A::PS512 => {
            DecodingKey::from_rsa_pem(pem)
        }
        A::ES256 | A::ES384 => DecodingKey::from_ec_pem(pem),
        A::EdDSA => DecodingKey::from_ed_pem(pem),
        A::HS256 | A::HS384 | A::HS512 => unreachable!("handled above"),
    };
    r.map_err(|e| {
        KeyError(format!(
            "public_key is not a PEM {} public key: {e}",
            alg.name()
        ))
    })
}

fn encoding_key(alg: Algorithm, material: &KeyMaterial) -> Result<Option<EncodingKey>, KeyError> {
    let pem = match material {
        KeyMaterial::Secret(s) => return Ok(Some(EncodingKey::from_secret(s))),
        KeyMaterial::Public(_) => return Ok(None),
        KeyMaterial::KeyPair { private, .. } => private,
    };
    use Algorithm as A;
    let r = match alg {
        A::RS256 | A::RS384 | A::RS512 | A::PS256 | A::PS384 | A::PS512 => {
            EncodingKey::from_rsa_pem(pem)
        }
        A::ES256 | A::ES384 => EncodingKey::from_ec_pem(pem),
        A::EdDSA => EncodingKey::from_ed_pem(pem),
        A::HS256 | A::HS384 | A::HS512 => unreachable!("secret handled above"),
    };
    r.map(Some).map_err(|e| {
        KeyError(format!(
            "private_key is not a PEM {} private key: {e}",
            alg.name()
        ))
    })
}

impl ConfiguredKeys {
    /// Loads the configured keys; `active_kid` names the signing key (`None` with only the legacy
    /// secret: it signs, without a `kid`).
    ///
    /// Errors: a PEM does not parse for its algorithm, or the active key cannot sign; the message
    /// names the kid.
    pub fn load(specs: &[KeySpec], active_kid: Option<&str>) -> Result<Self, KeyError> {
        let mut by_kid = HashMap::new();
        let mut no_kid = None;
        let mut signer = None;
        for spec in specs {
            let name = spec.kid.as_deref().unwrap_or("(token.secret)");
            let primary = spec.algs[0];
            let key = decoding_key(primary, &spec.material)
                .map_err(|e| KeyError(format!("key `{name}`: {e}")))?;
            let hmac = match &spec.material {
                KeyMaterial::Secret(s) => Some(HmacKey::new(s, &spec.algs)),
                _ => None,
            };
            let vk = VerifyKey {
                algs: spec.algs.clone(),
                key,
                hmac,
            };
            if spec.kid.as_deref() == active_kid {
                let key = encoding_key(primary, &spec.material)
                    .map_err(|e| KeyError(format!("key `{name}`: {e}")))?
                    .ok_or_else(|| {
                        KeyError(format!(
                            "key `{name}` is active but has only a public key; give private_key too"
                        ))
                    })?;
                let s = Signer {
                    kid: spec.kid.clone(),
                    alg: primary,
                    key,
                };
                // A private key that does not match its public key would issue tokens nobody
                // accepts: sign and verify a probe now.
                let probe = b"tessera key probe";
                let sig = jsonwebtoken::crypto::sign(probe, &s.key, primary.jwt())
                    .map_err(|e| KeyError(format!("key `{name}`: cannot sign: {e}")))?;
                if !jsonwebtoken::crypto::verify(&sig, probe, &vk.key, primary.jwt())
                    .unwrap_or(false)
                {
                    return Err(KeyError(format!(
                        "key `{name}`: private_key and public_key are not a pair"
                    )));
                }
                signer = Some(Arc::new(s));
            }
            match &spec.kid {
                Some(kid) => {
                    by_kid.insert(kid.clone(), vk);
                }
                None => no_kid = Some(vk),
            }
        }
        Ok(Self {
            by_kid,
            no_kid,
            signer,
        })
    }

    /// True when one of these keys can sign (tokens issued at login).
    pub fn can_sign(&self) -> bool {
        self.signer.is_some()
    }

    /// The `kid` of the signing key, `token.secret` for the legacy secret (no `kid`); `None`
    /// when none signs: for logs.
    pub fn signing_kid(&self) -> Option<&str> {
        self.signer
            .as_ref()
            .map(|s| s.kid().unwrap_or("token.secret"))
    }

    /// The `kid`s of these keys, sorted (`token.secret`, which has none, is left out): for logs.
    pub fn kids(&self) -> Vec<&str> {
        let mut kids: Vec<&str> = self.by_kid.keys().map(String::as_str).collect();
        kids.sort_unstable();
        kids
    }
}

impl Keys {
    /// Loads the configured keys ([`ConfiguredKeys::load`]) beside an optional JWKS source whose
    /// keys must verify one of `allowed`.
    ///
    /// Errors: as [`ConfiguredKeys::load`].
    pub fn new(
        specs: &[KeySpec],
        active_kid: Option<&str>,
        jwks: Option<JwksConfig>,
        allowed: &[Algorithm],
    ) -> Result<Self, KeyError> {
        Ok(Self {
            configured: RwLock::new(Arc::new(ConfiguredKeys::load(specs, active_kid)?)),
            jwks: jwks.map(|cfg| Arc::new(Jwks::new(cfg, allowed))),
        })
    }

    /// Puts `keys` in place of the configured keys (a configuration reload); the JWKS keys stay.
    /// A verification already under way finishes with the keys it began with (see
    /// [`Verifier::install_keys`](super::Verifier::install_keys) for the verified-token cache).
    pub fn replace(&self, keys: ConfiguredKeys) {
        *self.configured.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
    }

    /// The configured keys in place now (a snapshot: the lock is not held while they are used).
    fn configured(&self) -> Arc<ConfiguredKeys> {
        self.configured
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The signing key, when one is configured (the one in place now: a reload may change it).
    pub fn signer(&self) -> Option<Arc<Signer>> {
        self.configured().signer.clone()
    }

    /// Calls `f` with the key for `kid` if it verifies `alg`. `Err(true)`: no key with this kid
    /// (a JWKS refresh may help); `Err(false)`: the key exists but is bound to another algorithm.
    pub(super) fn with_key<R>(
        &self,
        kid: Option<&str>,
        alg: Algorithm,
        f: impl FnOnce(&VerifyKey) -> R,
    ) -> Result<R, bool> {
        let pick = |k: &VerifyKey| k.algs.contains(&alg);
        let configured = self.configured();
        match kid {
            Some(kid) => {
                if let Some(k) = configured.by_kid.get(kid) {
                    return if pick(k) { Ok(f(k)) } else { Err(false) };
                }
                let jwks = self.jwks.as_ref().ok_or(true)?;
                let snapshot = jwks.keys.read().unwrap_or_else(|p| p.into_inner()).clone();
                match snapshot.get(kid) {
                    Some(k) if pick(k) => Ok(f(k)),
                    Some(_) => Err(false),
                    None => Err(true),
                }
            }
            None => {
                // RFC 7515 4.1.4: kid is optional. Without one, only an unambiguous key applies.
                let only = configured.no_kid.as_ref().or_else(|| {
                    (configured.by_kid.len() == 1 && self.jwks.is_none())
                        .then(|| configured.by_kid.values().next())
                        .flatten()
                });
                match only {
                    Some(k) if pick(k) => Ok(f(k)),
                    Some(_) => Err(false),
                    None => Err(true),
                }
            }
        }
    }

    /// True when a JWKS source is configured.
    pub fn has_jwks(&self) -> bool {
        self.jwks.is_some()
    }

    /// Refreshes the JWKS because a token named an unknown `kid`, unless the last refresh was
    /// less than `token.jwks_min_refresh_seconds` ago (waiting for one under way). Returns
    /// whether the keys changed.
    pub async fn refresh_for_unknown_kid(&self) -> bool {
        match self.jwks.clone() {
            Some(j) => j.refresh_for_unknown_kid().await,
            None => false,
        }
    }

    /// Loads the JWKS now (at start and every `token.jwks_refresh_seconds`).
    ///
    /// Returns whether the keys changed (false: the same document, or a failure, logged).
    pub async fn refresh_jwks(&self) -> bool {
        match &self.jwks {
            Some(j) => j.refresh_now().await,
            None => false,
        }
    }

    /// Takes the TLS settings of a reloaded configuration's JWKS (`token.jwks_ca` read again)
    /// for the next fetches, when it is fetched from the same `https://` URL; whether it did.
    pub fn replace_jwks_tls(&self, new: Option<&JwksConfig>) -> bool {
        match (&self.jwks, new) {
            (Some(j), Some(new)) => j.replace_tls(new),
            _ => false,
        }
    }

    /// Periodic JWKS refresh interval, when a JWKS is configured.
    pub fn jwks_refresh_interval(&self) -> Option<Duration> {
        self.jwks.as_ref().map(|j| j.cfg.refresh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_bound_to_its_algorithm() {
        let spec = KeySpec {
            kid: Some("a".into()),
            algs: vec![Algorithm::HS512],
            material: KeyMaterial::Secret(Zeroizing::new(vec![1; 64])),
        };
        let keys = Keys::new(&[spec], Some("a"), None, &[Algorithm::HS512]).unwrap();
        assert!(keys.with_key(Some("a"), Algorithm::HS512, |_| ()).is_ok());
        assert_eq!(
            keys.with_key(Some("a"), Algorithm::HS256, |_| ()),
            Err(false)
        );
        assert_eq!(
            keys.with_key(Some("b"), Algorithm::HS512, |_| ()),
            Err(true)
        );
        // a single kid-bearing key also serves tokens without kid
        assert!(keys.with_key(None, Algorithm::HS512, |_| ()).is_ok());
        assert_eq!(keys.signer().unwrap().kid(), Some("a"));
    }

    /// A JWKS fetch for an unknown `kid` takes the rate limit's turn; the request that asked
    /// going away mid-fetch (a reset stream) must not cancel it, or the new key would wait for
    /// the periodic refresh.
    #[tokio::test]
    async fn a_refresh_outlives_the_request_that_asked_for_it() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let doc = r#"{"keys":[{"kty":"OKP","crv":"Ed25519","kid":"ed","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}]}"#;
        let (asked, was_asked) = tokio::sync::oneshot::channel::<()>();
        let (answer, may_answer) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let _ = s.read(&mut [0u8; 4096]).await;
            let _ = asked.send(());
            // Answered only once the asking request is gone.
            let _ = may_answer.await;
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", doc.len());
            s.write_all(format!("{head}{doc}").as_bytes())
                .await
                .unwrap();
        });
        let cfg = JwksConfig {
            source: JwksSource::Url(format!("http://{addr}/jwks").parse().unwrap(), None),
            refresh: Duration::from_secs(300),
            min_refresh: Duration::from_secs(30),
        };
        let keys = Arc::new(Keys::new(&[], None, Some(cfg), &[Algorithm::EdDSA]).unwrap());
        let k = keys.clone();
        let request = tokio::spawn(async move { k.refresh_for_unknown_kid().await });
        was_asked.await.unwrap();
        request.abort();
        let _ = request.await;
        answer.send(()).unwrap();
        let loaded = async {
            while keys.with_key(Some("ed"), Algorithm::EdDSA, |_| ()).is_err() {
                tokio::task::yield_now().await;
            }
        };
        assert!(
            tokio::time::timeout(Duration::from_secs(10), loaded)
                .await
                .is_ok(),
            "the fetch died with its request"
        );
    }
}
