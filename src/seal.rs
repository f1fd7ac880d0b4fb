//! Sealing of stored upstream credentials with AES-256-GCM (NIST SP 800-38D).
//!
//! Sealed form (ASCII, fits any store): `tsl1.<key id>.<base64url(nonce[12] || ciphertext || tag[16])>`.
//! A fresh random 96-bit nonce per seal; the session id is the associated data, so a sealed value
//! copied under another sid does not unseal. Owns: key ids and rotation (new seals use the active
//! key, every listed key unseals). Must never: log plaintext or reuse a nonce deliberately.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use http::HeaderValue;
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

/// Prefix of every sealed value (format version 1).
pub const SEALED_PREFIX: &str = "tsl1.";

/// Why a sealed value could not be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// Not `tsl1.<kid>.<base64url>` or too short to hold nonce + tag.
    #[error("sealed value malformed")]
    Format,
    /// The key id is not in `credentials.keys` (retired key).
    #[error("sealing key id unknown")]
    UnknownKey,
    /// Authentication failed: wrong key, wrong sid, or tampered data.
    #[error("sealed value does not authenticate")]
    Decrypt,
}

/// Seals and unseals with the configured keys.
pub struct Sealer {
    /// `credentials.keys` and `credentials.active`; replaced whole when the configuration is
    /// reloaded (SIGHUP, [`Sealer::replace`]). Read at every seal (login, reseal) and every
    /// unseal (a session cache miss), never on a warm request.
    keys: RwLock<Arc<SealKeys>>,
}

/// One generation of sealing keys.
struct SealKeys {
    ciphers: HashMap<String, Aes256Gcm>,
    active: String,
}

impl SealKeys {
    fn new(cfg: &CredentialsConfig) -> Self {
        Self {
            ciphers: cfg
                .keys
                .iter()
                .map(|(id, key)| (id.clone(), Aes256Gcm::new(key.as_slice().into())))
                .collect(),
            active: cfg.active.clone(),
        }
    }
}

impl Sealer {
    /// Builds ciphers for every configured key.
    pub fn new(cfg: &CredentialsConfig) -> Self {
        Self {
            keys: RwLock::new(Arc::new(SealKeys::new(cfg))),
        }
    }

    /// Puts the keys of `cfg` in place of the current ones (a configuration reload): new seals
    /// use its `active` key, and only its keys unseal from then on.
    pub fn replace(&self, cfg: &CredentialsConfig) {
        let keys = Arc::new(SealKeys::new(cfg));
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = keys;
    }

    fn keys(&self) -> Arc<SealKeys> {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Seals `plaintext` under the active key with `sid` as associated data.
    pub fn seal(&self, sid: &str, plaintext: &[u8]) -> String {
        let keys = self.keys();
        let cipher = &keys.ciphers[&keys.active];
        let mut nonce = [0u8; 12];
        getrandom::getrandom(&mut nonce).expect("OS random source unavailable");
        let ct = cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: plaintext,
                    aad: sid.as_bytes(),
                },
            )
            .expect("AES-GCM encryption of a bounded message cannot fail");
        let mut blob = Vec::with_capacity(12 + ct.len());
        blob.extend_from_slice(&nonce);
        blob.extend_from_slice(&ct);
        format!(
            "{SEALED_PREFIX}{}.{}",
            keys.active,
            URL_SAFE_NO_PAD.encode(blob)
        )
    }

    /// Opens a value made by [`Sealer::seal`] for the same `sid`.
    ///
    /// Errors: [`SealError`]; never says which byte was wrong.
    pub fn unseal(&self, sid: &str, sealed: &str) -> Result<Zeroizing<Vec<u8>>, SealError> {
        let rest = sealed
            .strip_prefix(SEALED_PREFIX)
            .ok_or(SealError::Format)?;
        let (kid, b64) = rest.split_once('.').ok_or(SealError::Format)?;
        let keys = self.keys();
        let cipher = keys.ciphers.get(kid).ok_or(SealError::UnknownKey)?;
        let blob = URL_SAFE_NO_PAD.decode(b64).map_err(|_| SealError::Format)?;
        if blob.len() < 12 + 16 {
            return Err(SealError::Format);
        }
        let (nonce, ct) = blob.split_at(12);
        cipher
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: ct,
                    aad: sid.as_bytes(),
                },
            )
            .map(Zeroizing::new)
            .map_err(|_| SealError::Decrypt)
    }

    /// Id of the key new seals use (now: a reload may change it).
    pub fn active_key_id(&self) -> String {
        self.keys().active.clone()
    }
}

/// Upstream credentials (RFC 7617 user-id and password), wiped from memory on drop.
#[derive(Zeroize, ZeroizeOnDrop)]
pub struct Credentials {
    user: String,
    password: String,
}

/// Why credentials cannot become a Basic header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CredentialsError {
    /// Empty user, `:` in the user (RFC 7617 section 2), a control character, or not UTF-8.
    #[error("credentials not valid for HTTP Basic")]
    Invalid,
}

impl Credentials {
    /// Validates and wraps a user and password.
    ///
    /// Errors: [`CredentialsError::Invalid`] for an empty user, `:` in the user, or any control
    /// character (CR/LF could split headers).
    pub fn new(user: String, password: String) -> Result<Self, CredentialsError> {
        let creds = Self { user, password };
        let bad = |s: &str| s.chars().any(char::is_control);
        if creds.user.is_empty()
            || creds.user.contains(':')
            || bad(&creds.user)
            || bad(&creds.password)
        {
            return Err(CredentialsError::Invalid);
        }
        Ok(creds)
    }

    /// Parses `user:password` bytes (the first `:` separates, as in RFC 7617).
    pub fn from_pair(pair: &[u8]) -> Result<Self, CredentialsError> {
        let text = std::str::from_utf8(pair).map_err(|_| CredentialsError::Invalid)?;
        let (user, password) = text.split_once(':').ok_or(CredentialsError::Invalid)?;
        Self::new(user.to_owned(), password.to_owned())
    }

    /// The user name.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// `user:password` bytes, the plaintext that gets sealed.
    pub fn to_pair(&self) -> Zeroizing<Vec<u8>> {
        let mut v = Zeroizing::new(Vec::with_capacity(
            self.user.len() + 1 + self.password.len(),
        ));
        v.extend_from_slice(self.user.as_bytes());
        v.push(b':');
        v.extend_from_slice(self.password.as_bytes());
        v
    }

    /// The `Authorization: Basic base64(user:password)` value, marked sensitive (RFC 7617).
    ///
    /// Its bytes are wiped when the last clone of the value is dropped (see [`wiped_header`]):
    /// the session cache keeps one per cached session for up to its TTL.
    pub fn basic_header(&self) -> HeaderValue {
        let pair = self.to_pair();
        let mut value = Zeroizing::new(Vec::with_capacity(6 + pair.len().div_ceil(3) * 4));
        value.extend_from_slice(b"Basic ");
        let start = value.len();
        value.resize(
            start + base64::encoded_len(pair.len(), true).unwrap_or(0),
            0,
        );
        let written = STANDARD
            .encode_slice(pair.as_slice(), &mut value[start..])
            .expect("the buffer was sized by encoded_len");
        value.truncate(start + written);
        wiped_header(value).expect("base64 is a valid header value")
    }
}

/// A sensitive header value that owns `bytes` without copying them: every clone shares that one
/// buffer, and it is zeroized when the last clone is dropped. (`HeaderValue::from_bytes` would
/// copy into a buffer that is freed unwiped.) The copy in each upstream request head is wiped
/// separately (src/upstream/h1.rs, `SecretHead`); the kernel's socket buffers are out of reach.
///
/// Errors: `bytes` holds a byte not allowed in a field value (RFC 9110 section 5.5).
pub fn wiped_header(
    bytes: Zeroizing<Vec<u8>>,
) -> Result<HeaderValue, http::header::InvalidHeaderValue> {
    let mut header = HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(bytes))?;
    header.set_sensitive(true);
    Ok(header)
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// `[credentials]`.
#[derive(Clone)]
pub struct CredentialsConfig {
    /// Sealing keys by id: 32 raw bytes each.
    pub keys: BTreeMap<String, Zeroizing<[u8; 32]>>,
    /// Key id used for new seals.
    pub active: String,
    /// Accept base64 plaintext `user:pass` in hyper-auth-proxy records. Default false.
    pub allow_plaintext_legacy: bool,
}

impl std::fmt::Debug for CredentialsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialsConfig")
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("active", &self.active)
            .field("allow_plaintext_legacy", &self.allow_plaintext_legacy)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn sealer(ids: &[(&str, u8)], active: &str) -> Sealer {
        let keys: BTreeMap<_, _> = ids
            .iter()
            .map(|(id, b)| (id.to_string(), Zeroizing::new([*b; 32])))
            .collect();
        Sealer::new(&CredentialsConfig {
            keys,
            active: active.into(),
            allow_plaintext_legacy: false,
        })
    }

    #[test]
    fn replaced_keys_seal_with_the_new_active_and_a_removed_key_no_longer_unseals() {
        let s = sealer(&[("k1", 1)], "k1");
        let by_k1 = s.seal("sid-1", b"alice:pw");
        let two = sealer(&[("k1", 1), ("k2", 2)], "k2");
        let keys = |ids: &[(&str, u8)], active: &str| CredentialsConfig {
            keys: ids
                .iter()
                .map(|(id, b)| (id.to_string(), Zeroizing::new([*b; 32])))
                .collect(),
            active: active.into(),
            allow_plaintext_legacy: false,
        };
        s.replace(&keys(&[("k1", 1), ("k2", 2)], "k2"));
        assert_eq!(s.active_key_id(), "k2");
        let by_k2 = s.seal("sid-1", b"bob:pw");
        assert!(by_k2.starts_with("tsl1.k2."), "{by_k2}");
        assert_eq!(two.unseal("sid-1", &by_k2).unwrap().as_slice(), b"bob:pw");
        assert_eq!(s.unseal("sid-1", &by_k1).unwrap().as_slice(), b"alice:pw");
        s.replace(&keys(&[("k2", 2)], "k2"));
        assert_eq!(s.unseal("sid-1", &by_k1), Err(SealError::UnknownKey));
        assert_eq!(s.unseal("sid-1", &by_k2).unwrap().as_slice(), b"bob:pw");
    }

    #[test]
    fn roundtrip_and_fresh_nonce() {
        let s = sealer(&[("k1", 1)], "k1");
        let a = s.seal("sid-1", b"alice:pw");
        let b = s.seal("sid-1", b"alice:pw");
        assert_ne!(a, b, "nonce must differ per seal");
        assert!(a.starts_with("tsl1.k1."));
        assert_eq!(s.unseal("sid-1", &a).unwrap().as_slice(), b"alice:pw");
    }

    #[test]
    fn sid_is_bound_and_tamper_detected() {
        let s = sealer(&[("k1", 1)], "k1");
        let a = s.seal("sid-1", b"alice:pw");
        assert_eq!(s.unseal("sid-2", &a), Err(SealError::Decrypt));
        let mut t = a.clone().into_bytes();
        let i = t.len() - 3;
        t[i] = if t[i] == b'A' { b'B' } else { b'A' };
        assert_eq!(
            s.unseal("sid-1", std::str::from_utf8(&t).unwrap()),
            Err(SealError::Decrypt)
        );
        assert_eq!(s.unseal("sid-1", "tsl1.k1.AAAA"), Err(SealError::Format));
        assert_eq!(s.unseal("sid-1", "plain"), Err(SealError::Format));
    }

    #[test]
    fn rotation_old_key_unseals_retired_key_does_not() {
        let old = sealer(&[("k1", 1)], "k1");
        let sealed = old.seal("s", b"u:p");
        let rotated = sealer(&[("k1", 1), ("k2", 2)], "k2");
        assert_eq!(rotated.unseal("s", &sealed).unwrap().as_slice(), b"u:p");
        assert!(rotated.seal("s", b"u:p").starts_with("tsl1.k2."));
        let retired = sealer(&[("k2", 2)], "k2");
        assert_eq!(retired.unseal("s", &sealed), Err(SealError::UnknownKey));
    }

    #[test]
    fn credentials_validation_and_basic_header() {
        let c = Credentials::new("alice".into(), "p:w d".into()).unwrap();
        // base64("alice:p:w d")
        assert_eq!(c.basic_header().to_str().unwrap(), "Basic YWxpY2U6cDp3IGQ=");
        assert!(c.basic_header().is_sensitive());
        assert!(Credentials::new("a:b".into(), "x".into()).is_err());
        assert!(Credentials::new("".into(), "x".into()).is_err());
        assert!(Credentials::new("a".into(), "x\r\nX-Evil: 1".into()).is_err());
        assert!(Credentials::from_pair(b"nocolon").is_err());
        assert_eq!(Credentials::from_pair(b"u:p:q").unwrap().user(), "u");
        assert!(!format!("{c:?}").contains("p:w"));
    }

    #[test]
    fn a_wiped_header_shares_the_zeroizing_buffer_it_was_given() {
        let bytes = Zeroizing::new(b"Basic YWxpY2U6cHc=".to_vec());
        let at = bytes.as_ptr();
        let header = wiped_header(bytes).unwrap();
        // The same heap buffer, so dropping the last clone drops (and zeroizes) it: a copy here
        // would leave the credential in freed memory.
        assert_eq!(header.as_bytes().as_ptr(), at);
        assert_eq!(header.clone().as_bytes().as_ptr(), at);
        assert!(header.is_sensitive());
        assert_eq!(header, "Basic YWxpY2U6cHc=");
        assert!(wiped_header(Zeroizing::new(b"Basic \r\nX-Evil: 1".to_vec())).is_err());
        let basic = Credentials::new("alice".into(), "pw".into())
            .unwrap()
            .basic_header();
        assert_eq!(basic, "Basic YWxpY2U6cHc=");
    }
}
