//! Token keys: which key verifies a token (by `kid`), which key signs new ones, and the JWKS
//! document of an external identity provider (RFC 7517), cached and refreshed.
//!
//! Owns key rotation: several keys verify, exactly one (`token.active_kid`) signs. A key not
//! listed is retired: its tokens are refused. Every key is bound to its algorithm(s), so a
//! token's `alg` can never make an RSA public key act as an HMAC secret (RFC 8725 2.1).
//! Must never: fetch a key named by the token itself (`jku`/`x5u` are refused in verify), or
//! refresh the JWKS more than once per `token.jwks_min_refresh_seconds` because of unknown `kid`s.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use jsonwebtoken::{DecodingKey, EncodingKey};
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use zeroize::Zeroizing;

use super::Algorithm;

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

/// Where the JWKS document comes from.
#[derive(Debug, Clone)]
pub enum JwksSource {
    /// `file:PATH`, re-read on refresh.
    File(PathBuf),
    /// `https://host[:port]/path` (with the TLS client settings of [`jwks_tls`]) or
    /// `http://host[:port]/path` (`None`: plain HTTP, for loopback or a sidecar).
    Url(http::Uri, Option<Arc<ClientConfig>>),
}

/// TLS client settings for fetching a JWKS over https: TLS 1.2 and 1.3 (rustls' safe defaults,
/// ring provider), ALPN `http/1.1`, the server's certificate checked against the CA certificates
/// in the PEM file `ca` (they alone are trusted) or, without it, the system's trust store
/// (`rustls-native-certs`: `SSL_CERT_FILE`/`SSL_CERT_DIR`, else the distribution's bundle).
///
/// Errors, as a sentence for the config key: `ca` unreadable or holding no certificate; no
/// usable root certificate in the system store.
pub fn jwks_tls(ca: Option<&Path>) -> Result<Arc<ClientConfig>, String> {
    use tokio_rustls::rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut roots = RootCertStore::empty();
    match ca {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("cannot read CA certificates from {}: {e}", path.display()))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(format!(
                    "{} holds no usable CA certificate (PEM, \"-----BEGIN CERTIFICATE-----\")",
                    path.display()
                ));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                let why = found
                    .errors
                    .first()
                    .map_or(String::new(), |e| format!(" ({e})"));
                return Err(format!("no trusted root certificate in the system store{why}: install the ca-certificates package, or set token.jwks_ca to the provider's CA file"));
            }
        }
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS settings: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// `token.jwks*` settings.
#[derive(Debug, Clone)]
pub struct JwksConfig {
    /// The document's location.
    pub source: JwksSource,
    /// Periodic refresh interval. Default 300 s.
    pub refresh: Duration,
    /// Least time between two refreshes caused by an unknown `kid`. Default 30 s.
    pub min_refresh: Duration,
}

/// A key ready to verify.
struct VerifyKey {
    algs: Vec<Algorithm>,
    key: DecodingKey,
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
    ) -> Result<String, String> {
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
    pub fn sign<T: serde::Serialize>(&self, claims: &T) -> Result<String, String> {
        let mut header = jsonwebtoken::Header::new(self.alg.jwt());
        header.kid = self.kid.clone();
        jsonwebtoken::encode(&header, claims, &self.key).map_err(|e| e.to_string())
    }
}

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
    jwks: Option<Jwks>,
}

/// The keys of `[token]` (`secret`, `[[token.keys]]`, `active_kid`), checked and ready.
pub struct ConfiguredKeys {
    by_kid: HashMap<String, VerifyKey>,
    no_kid: Option<VerifyKey>,
    signer: Option<Arc<Signer>>,
}

struct Jwks {
    cfg: JwksConfig,
    allowed: Vec<Algorithm>,
    keys: RwLock<Arc<HashMap<String, VerifyKey>>>,
    /// Serialises fetches; holds the time of the last attempt.
    last: tokio::sync::Mutex<Option<Instant>>,
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
            let vk = VerifyKey {
                algs: spec.algs.clone(),
                key,
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
            jwks: jwks.map(|cfg| Jwks {
                cfg,
                allowed: allowed.to_vec(),
                keys: RwLock::new(Arc::new(HashMap::new())),
                last: tokio::sync::Mutex::new(None),
            }),
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
    pub(crate) fn with_key<R>(
        &self,
        kid: Option<&str>,
        alg: Algorithm,
        f: impl FnOnce(&DecodingKey) -> R,
    ) -> Result<R, bool> {
        let pick = |k: &VerifyKey| k.algs.contains(&alg);
        let configured = self.configured();
        match kid {
            Some(kid) => {
                if let Some(k) = configured.by_kid.get(kid) {
                    return if pick(k) { Ok(f(&k.key)) } else { Err(false) };
                }
                let jwks = self.jwks.as_ref().ok_or(true)?;
                let snapshot = jwks.keys.read().unwrap_or_else(|p| p.into_inner()).clone();
                match snapshot.get(kid) {
                    Some(k) if pick(k) => Ok(f(&k.key)),
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
                    Some(k) if pick(k) => Ok(f(&k.key)),
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
    /// less than `token.jwks_min_refresh_seconds` ago. Returns whether a fresh document was loaded.
    pub async fn refresh_for_unknown_kid(&self) -> bool {
        match &self.jwks {
            Some(j) => j.refresh(Some(j.cfg.min_refresh)).await,
            None => false,
        }
    }

    /// Loads the JWKS now (at start and every `token.jwks_refresh_seconds`).
    ///
    /// Returns false (and logs why, keeping the previous keys) when the fetch or parse failed.
    pub async fn refresh_jwks(&self) -> bool {
        match &self.jwks {
            Some(j) => j.refresh(None).await,
            None => false,
        }
    }

    /// Periodic JWKS refresh interval, when a JWKS is configured.
    pub fn jwks_refresh_interval(&self) -> Option<Duration> {
        self.jwks.as_ref().map(|j| j.cfg.refresh)
    }
}

impl Jwks {
    async fn refresh(&self, min_gap: Option<Duration>) -> bool {
        let mut last = self.last.lock().await;
        if let (Some(gap), Some(at)) = (min_gap, *last) {
            if at.elapsed() < gap {
                return false;
            }
        }
        *last = Some(Instant::now());
        let doc = match fetch(&self.cfg.source).await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "JWKS refresh failed; keeping the previous keys");
                return false;
            }
        };
        match parse_jwks(&doc, &self.allowed) {
            Ok(keys) => {
                tracing::info!(keys = keys.len(), "JWKS loaded");
                *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "JWKS document rejected; keeping the previous keys");
                false
            }
        }
    }
}

/// Largest JWKS document accepted, bytes.
const MAX_JWKS_BYTES: usize = 1 << 20;

async fn fetch(source: &JwksSource) -> Result<Vec<u8>, KeyError> {
    match source {
        JwksSource::File(path) => tokio::fs::read(path)
            .await
            .map_err(|e| KeyError(format!("cannot read {}: {e}", path.display()))),
        JwksSource::Url(uri, tls) => {
            tokio::time::timeout(Duration::from_secs(5), fetch_http(uri, tls.as_ref()))
                .await
                .map_err(|_| KeyError(format!("{uri}: no answer within 5 s")))?
        }
    }
}

/// GET `uri` (HTTP/1.1; over TLS when `tls` is given, the certificate checked for the URL's
/// host, a name or an IP address): the body of a 2xx answer, at most [`MAX_JWKS_BYTES`].
async fn fetch_http(uri: &http::Uri, tls: Option<&Arc<ClientConfig>>) -> Result<Vec<u8>, KeyError> {
    let err = |e: &dyn std::fmt::Display| KeyError(format!("{uri}: {e}"));
    let auth = uri.authority().ok_or_else(|| err(&"no host"))?;
    let host = auth.host().trim_start_matches('[').trim_end_matches(']');
    let port = auth
        .port_u16()
        .unwrap_or(if tls.is_some() { 443 } else { 80 });
    let tcp = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| err(&e))?;
    match tls {
        None => get(tcp, uri, auth).await.map_err(|e| err(&e)),
        Some(cfg) => {
            let name = ServerName::try_from(host.to_owned()).map_err(|e| err(&e))?;
            let stream = tokio_rustls::TlsConnector::from(cfg.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| err(&format!("TLS: {e}")))?;
            get(stream, uri, auth).await.map_err(|e| err(&e))
        }
    }
}

/// One GET on a fresh connection `io`.
async fn get<IO>(io: IO, uri: &http::Uri, auth: &http::uri::Authority) -> Result<Vec<u8>, String>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use http_body_util::BodyExt;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
        .await
        .map_err(|e| err(&e))?;
    tokio::spawn(conn);
    let req = http::Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header(http::header::HOST, auth.as_str())
        .header(http::header::ACCEPT, "application/json")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| err(&e))?;
    let resp = send.send_request(req).await.map_err(|e| err(&e))?;
    if !resp.status().is_success() {
        return Err(err(&format!("status {}", resp.status())));
    }
    let body = http_body_util::Limited::new(resp.into_body(), MAX_JWKS_BYTES)
        .collect()
        .await
        .map_err(|e| err(&e))?;
    Ok(body.to_bytes().to_vec())
}

/// Parses a JWKS document into verification keys by `kid`. Keys without `kid`, with `use` other
/// than `sig`, or with an algorithm outside `allowed` are skipped. When a JWK has no `alg`, it is
/// inferred from its type (RSA -> RS256, P-256 -> ES256, P-384 -> ES384, Ed25519 -> EdDSA).
///
/// Errors: not a JWKS JSON document.
fn parse_jwks(doc: &[u8], allowed: &[Algorithm]) -> Result<HashMap<String, VerifyKey>, KeyError> {
    use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, PublicKeyUse};
    #[derive(serde::Deserialize)]
    struct Doc {
        keys: Vec<serde_json::Value>,
    }
    let doc: Doc =
        serde_json::from_slice(doc).map_err(|e| KeyError(format!("not a JWKS document: {e}")))?;
    // Each key on its own: one key this crate cannot represent must not void the others.
    let set = JwkSet {
        keys: doc
            .keys
            .into_iter()
            .filter_map(|v| serde_json::from_value(v).ok())
            .collect(),
    };
    let mut out = HashMap::new();
    for jwk in &set.keys {
        let Some(kid) = jwk.common.key_id.clone() else {
            continue;
        };
        if matches!(&jwk.common.public_key_use, Some(u) if *u != PublicKeyUse::Signature) {
            continue;
        }
        let alg = match jwk.common.key_algorithm {
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
        };
        // Symmetric keys in a published JWKS would be secrets in the open: never accept them.
        let Some(alg) = alg.filter(|a| allowed.contains(a) && !a.is_hmac()) else {
            continue;
        };
        // The key's type and size must fit its algorithm (a short Ed25519 `x` would otherwise
        // reach the verifier).
        let fits = match (&jwk.algorithm, alg) {
            (AlgorithmParameters::RSA(_), a) => {
                a.name().starts_with("RS") || a.name().starts_with("PS")
            }
            (AlgorithmParameters::EllipticCurve(p), Algorithm::ES256) => {
                p.curve == EllipticCurve::P256
            }
            (AlgorithmParameters::EllipticCurve(p), Algorithm::ES384) => {
                p.curve == EllipticCurve::P384
            }
            (AlgorithmParameters::OctetKeyPair(p), Algorithm::EdDSA) => {
                p.curve == EllipticCurve::Ed25519
                    && base64::Engine::decode(
                        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
                        &p.x,
                    )
                    .is_ok_and(|x| x.len() == 32)
            }
            _ => false,
        };
        if !fits {
            tracing::warn!(kid = %kid, "JWKS key skipped: type or size does not fit its algorithm");
            continue;
        }
        match DecodingKey::from_jwk(jwk) {
            Ok(key) => {
                out.insert(
                    kid,
                    VerifyKey {
                        algs: vec![alg],
                        key,
                    },
                );
            }
            Err(e) => tracing::warn!(kid = %kid, error = %e, "JWKS key skipped"),
        }
    }
    Ok(out)
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
}
