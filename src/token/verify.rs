//! The verify phase: a compact JWS (RFC 7515) checked under RFC 8725.
//!
//! Parsing and policy are ours (the crate's `decode` neither rejects `crit`/`jku`/`x5u`/`jwk` nor
//! checks `iat`, and parses the token twice); the signature itself is checked by `jsonwebtoken`'s
//! crypto. Order: size cap -> exactly three non-empty base64url segments -> header (pinned `alg`,
//! forbidden members) -> signature -> claims (`exp` required, `nbf`, `iat`, `iss`, `aud`, sid).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::keys::{ConfiguredKeys, Keys};
use super::Algorithm;
use super::TokenConfig;

use super::cache::TokenCache;
use super::extract::Carried;
use super::jws::{numeric_date, split3, RawHeader};

/// Why a token was refused. Every variant maps to 401; the variant name goes to the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Longer than `token.max_token_bytes`.
    #[error("token too large")]
    TooLarge,
    /// Not three non-empty segments of strict base64url, or header/claims not JSON objects.
    #[error("malformed token")]
    Malformed,
    /// A `cookie-b64:` source whose value is not base64 of a token.
    #[error("malformed token source")]
    Source,
    /// `alg` is `none` or not one of `token.algorithms`.
    #[error("algorithm not allowed")]
    Algorithm,
    /// Header carries `crit`, `jku`, `x5u`, `jwk` or `x5c` (RFC 8725 3.10 / RFC 7515 4.1.11).
    #[error("forbidden header parameter")]
    ForbiddenHeader,
    /// `kid` names no configured key and no JWKS key (a retired key, or an unknown issuer), or
    /// the token has no `kid` while several keys are configured.
    #[error("unknown key id")]
    UnknownKey,
    /// Signature does not verify, or the key is bound to another algorithm.
    #[error("bad signature")]
    Signature,
    /// `exp` missing or not a number.
    #[error("exp claim missing")]
    MissingExp,
    /// `exp` + leeway is in the past.
    #[error("token expired")]
    Expired,
    /// `nbf` - leeway is in the future.
    #[error("token not yet valid")]
    NotYetValid,
    /// `iat` - leeway is in the future.
    #[error("token issued in the future")]
    IssuedInFuture,
    /// `iss` differs from `token.issuer`.
    #[error("wrong issuer")]
    Issuer,
    /// `aud` does not contain `token.audience`, or `aud` is present while no audience is
    /// configured (RFC 7519 4.1.3: a token for another recipient must be rejected).
    #[error("wrong audience")]
    Audience,
    /// `typ` is present and not `JWT` (RFC 8725 3.11: no cross-JWT confusion).
    #[error("wrong token type")]
    Type,
    /// The session-id claim is missing, not a string, or empty.
    #[error("session id claim missing")]
    MissingSid,
}

/// What a verified token says, the parts tessera uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedToken {
    /// Session id from the configured claim (`sid` by default). Shared with the verified-token
    /// cache entry: a warm request copies no string.
    pub sid: Arc<str>,
    /// `sub`, when present (shared like `sid`).
    pub sub: Option<Arc<str>>,
    /// `exp`, seconds since the Unix epoch.
    pub exp: u64,
}

/// Claims tessera issues (`tessera session create`, later login).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Claims {
    /// Subject: the upstream user name.
    pub sub: String,
    /// Session id.
    pub sid: String,
    /// Issued at, seconds since the Unix epoch.
    pub iat: u64,
    /// Expiry, seconds since the Unix epoch.
    pub exp: u64,
    /// Issuer, when configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iss: Option<String>,
    /// Audience, when configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aud: Option<String>,
}

/// Why reloaded token keys were not put in place ([`Verifier::load_keys`]); the message names
/// the configuration key and the fix.
#[derive(Debug, thiserror::Error)]
pub enum KeyReloadError {
    /// `token.algorithms` would change: they also bind the JWKS keys, so a restart applies them.
    #[error(
        "config key `token.algorithms`: would change from [{from}] to [{to}]; a reload keeps \
         the algorithms tessera started with (restart to change them, or list them in \
         token.algorithms)"
    )]
    Algorithms {
        /// The algorithms in force, comma-separated.
        from: String,
        /// The algorithms of the reloaded file.
        to: String,
    },
    /// A key of the reloaded file does not load.
    #[error("config key `token.keys`: {0}")]
    Keys(#[source] super::keys::KeyError),
}

/// Verifies tokens under one pinned policy (built once from `[token]`).
pub struct Verifier {
    algorithms: Vec<Algorithm>,
    keys: Arc<Keys>,
    /// Verified tokens by a keyed 128-bit hash of their exact text ([`TokenCache`]).
    cache: Option<TokenCache>,
    /// `token.cache_hmac`: HS* tokens are cached too.
    cache_hmac: bool,
    sid_claim: String,
    leeway: u64,
    issuer: Option<String>,
    audience: Option<String>,
    max_bytes: usize,
}

impl Verifier {
    /// Builds the verifier from validated config (keys were checked by validation).
    pub fn new(cfg: &TokenConfig) -> Self {
        let keys = Keys::new(
            &cfg.keys,
            cfg.active_kid.as_deref(),
            cfg.jwks.clone(),
            &cfg.algorithms,
        )
        .expect("token keys were validated with the config");
        let worth_caching = cfg.cache_hmac
            || cfg.jwks.is_some()
            || cfg.keys.iter().any(|k| k.algs.iter().any(|a| !a.is_hmac()));
        let cache = (cfg.cache_max_entries > 0 && worth_caching)
            .then(|| TokenCache::new(cfg.cache_max_entries));
        Self {
            algorithms: cfg.algorithms.clone(),
            keys: Arc::new(keys),
            cache,
            cache_hmac: cfg.cache_hmac,
            sid_claim: cfg.sid_claim.clone(),
            leeway: cfg.leeway_seconds,
            issuer: cfg.issuer.clone(),
            audience: cfg.audience.clone(),
            max_bytes: cfg.max_token_bytes,
        }
    }

    /// The key set (signing key for issued tokens, JWKS refresh).
    pub fn keys(&self) -> &Arc<Keys> {
        &self.keys
    }

    /// Like [`Verifier::verify`], but a token whose `kid` is unknown triggers one JWKS refresh
    /// (at most one per `token.jwks_min_refresh_seconds`) and a second attempt.
    pub async fn verify_refreshing(
        &self,
        token: &Carried<'_>,
        now: u64,
    ) -> Result<VerifiedToken, TokenError> {
        match self.verify_carried(token, now) {
            Err(TokenError::UnknownKey) if self.keys.has_jwks() => {
                // Whether this call refreshed or another one did meanwhile, try again: the key
                // may be there now.
                if self.keys.refresh_for_unknown_kid().await {
                    self.clear_cache();
                }
                self.verify_carried(token, now)
            }
            other => other,
        }
    }

    /// Verifies `token` at time `now` (seconds since the Unix epoch).
    ///
    /// Errors: the first [`TokenError`] found, in the order of the module docs.
    ///
    /// A token verified before is answered from the verified-token cache until its `exp` +
    /// leeway: the signature and claims of a given token text never change, and every
    /// time-dependent check but `exp` only gets easier with time. With `token.cache_hmac =
    /// false`, HS* tokens are checked every time.
    pub fn verify(&self, token: &str, now: u64) -> Result<VerifiedToken, TokenError> {
        self.verify_carried(&Carried::Text(token), now)
    }

    /// [`Verifier::verify`] of a token as its source carried it: a base64 cookie is decoded
    /// only on a cache miss (undecodable: [`TokenError::Source`]).
    pub fn verify_carried(
        &self,
        carried: &Carried<'_>,
        now: u64,
    ) -> Result<VerifiedToken, TokenError> {
        let text = || carried.text().map_err(|_| TokenError::Source);
        let Some(cache) = &self.cache else {
            return self.verify_inner(&text()?, now, true).map(|(v, _)| v);
        };
        let key = cache.key(carried);
        if let Some(hit) = cache.entries.get(&key) {
            if hit.exp.saturating_add(self.leeway) > now {
                return Ok(hit);
            }
            cache.entries.remove(&key); // expired: answered below (401) and not kept
        }
        let generation = cache.generation.load(std::sync::atomic::Ordering::Acquire);
        let (verified, alg) = self.verify_inner(&text()?, now, true)?;
        // Refused tokens are never remembered: a flood of bad tokens cannot evict good ones.
        let unchanged =
            || cache.generation.load(std::sync::atomic::Ordering::Acquire) == generation;
        if (self.cache_hmac || !alg.is_hmac()) && unchanged() {
            cache.entries.insert(key, verified.clone());
            // A clear between the check and the insert (a key withdrawn meanwhile) bumped the
            // generation before it emptied the cache: the entry goes, and the token is verified
            // again under the keys in place on its next request.
            if !unchanged() {
                cache.entries.remove(&key);
            }
        }
        Ok(verified)
    }

    /// Loads the keys of `cfg` for a configuration reload, to be put in place with
    /// [`Verifier::install_keys`]. Only the keys change (`token.secret`, `[[token.keys]]`,
    /// `token.active_kid`); the rest of the policy stays as started.
    ///
    /// Errors, as a sentence naming the key: the pinned algorithms would change (they bind the
    /// JWKS keys too: a restart applies them), or a key does not load ([`ConfiguredKeys::load`]).
    pub fn load_keys(&self, cfg: &TokenConfig) -> Result<ConfiguredKeys, KeyReloadError> {
        // Compared as sets: keys listed in another order (a new key moved to the front) pin
        // the same algorithms.
        let within = |a: &[Algorithm], b: &[Algorithm]| a.iter().all(|x| b.contains(x));
        if !within(&cfg.algorithms, &self.algorithms) || !within(&self.algorithms, &cfg.algorithms)
        {
            let names = |a: &[Algorithm]| a.iter().map(|a| a.name()).collect::<Vec<_>>().join(", ");
            return Err(KeyReloadError::Algorithms {
                from: names(&self.algorithms),
                to: names(&cfg.algorithms),
            });
        }
        ConfiguredKeys::load(&cfg.keys, cfg.active_kid.as_deref()).map_err(KeyReloadError::Keys)
    }

    /// Puts reloaded keys in place and forgets every cached verification: a token of a key
    /// removed is refused from the next request on.
    pub fn install_keys(&self, keys: ConfiguredKeys) {
        self.keys.replace(keys);
        self.clear_cache();
    }

    /// Verified tokens in the cache now (`None` when the cache is off).
    pub fn cache_entries(&self) -> Option<u64> {
        self.cache.as_ref().map(|c| c.entries.len() as u64)
    }

    /// Forgets every cached verification (the key set changed).
    pub fn clear_cache(&self) {
        if let Some(c) = &self.cache {
            c.generation
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            c.entries.clear();
        }
    }

    /// Like [`Verifier::verify`] without the `exp` check (logout of an expired token's session).
    pub fn verify_ignoring_expiry(
        &self,
        token: &str,
        now: u64,
    ) -> Result<VerifiedToken, TokenError> {
        self.verify_inner(token, now, false).map(|(v, _)| v)
    }

    fn verify_inner(
        &self,
        token: &str,
        now: u64,
        check_exp: bool,
    ) -> Result<(VerifiedToken, Algorithm), TokenError> {
        if token.len() > self.max_bytes {
            return Err(TokenError::TooLarge);
        }
        let (header_b64, payload_b64, sig_b64) = split3(token).ok_or(TokenError::Malformed)?;
        let header_json = URL_SAFE_NO_PAD
            .decode(header_b64)
            .map_err(|_| TokenError::Malformed)?;
        // UTF-8 first (RFC 8259 section 8.1): serde_json skips the strings of members a struct
        // ignores without checking them (found by fuzz/ `token`).
        let header_json = std::str::from_utf8(&header_json).map_err(|_| TokenError::Malformed)?;
        let header: RawHeader<'_> =
            serde_json::from_str(header_json).map_err(|_| TokenError::Malformed)?;
        let alg = Algorithm::parse(&header.alg)
            .filter(|a| self.algorithms.contains(a))
            .ok_or(TokenError::Algorithm)?;
        if header.crit || header.jku || header.x5u || header.jwk || header.x5c {
            return Err(TokenError::ForbiddenHeader);
        }
        if header
            .typ
            .as_deref()
            .is_some_and(|t| !t.eq_ignore_ascii_case("JWT"))
        {
            return Err(TokenError::Type);
        }
        let signed = &token[..header_b64.len() + 1 + payload_b64.len()];
        let ok = self
            .keys
            .with_key(header.kid.as_deref(), alg, |vk| {
                vk.verify(alg, signed.as_bytes(), sig_b64)
            })
            .map_err(|unknown| {
                if unknown {
                    TokenError::UnknownKey
                } else {
                    TokenError::Signature
                }
            })?;
        if !ok {
            return Err(TokenError::Signature);
        }
        let payload = URL_SAFE_NO_PAD
            .decode(payload_b64)
            .map_err(|_| TokenError::Malformed)?;
        let claims: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&payload).map_err(|_| TokenError::Malformed)?;
        self.check_claims(&claims, now, check_exp).map(|v| (v, alg))
    }

    fn check_claims(
        &self,
        claims: &serde_json::Map<String, serde_json::Value>,
        now: u64,
        check_exp: bool,
    ) -> Result<VerifiedToken, TokenError> {
        let exp = numeric_date(claims.get("exp")).ok_or(TokenError::MissingExp)?;
        if check_exp && exp.saturating_add(self.leeway) <= now {
            return Err(TokenError::Expired);
        }
        if let Some(v) = claims.get("nbf") {
            let nbf = numeric_date(Some(v)).ok_or(TokenError::Malformed)?;
            if nbf > now.saturating_add(self.leeway) {
                return Err(TokenError::NotYetValid);
            }
        }
        if let Some(v) = claims.get("iat") {
            let iat = numeric_date(Some(v)).ok_or(TokenError::Malformed)?;
            if iat > now.saturating_add(self.leeway) {
                return Err(TokenError::IssuedInFuture);
            }
        }
        if let Some(want) = &self.issuer {
            if claims.get("iss").and_then(|v| v.as_str()) != Some(want.as_str()) {
                return Err(TokenError::Issuer);
            }
        }
        let aud_ok = match (&self.audience, claims.get("aud")) {
            (None, None) => true,
            (None, Some(_)) | (Some(_), None) => false,
            (Some(want), Some(serde_json::Value::String(s))) => s == want,
            (Some(want), Some(serde_json::Value::Array(a))) => {
                a.iter().any(|v| v.as_str() == Some(want))
            }
            (Some(_), Some(_)) => false,
        };
        if !aud_ok {
            return Err(TokenError::Audience);
        }
        let sid = claims
            .get(&self.sid_claim)
            .and_then(|v| v.as_str())
            .filter(|s| !s.is_empty())
            .ok_or(TokenError::MissingSid)?;
        Ok(VerifiedToken {
            sid: sid.into(),
            sub: claims.get("sub").and_then(|v| v.as_str()).map(Arc::from),
            exp,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::keys::{KeyMaterial, KeySpec};
    use crate::token::TokenSource;
    use jsonwebtoken::EncodingKey;
    use zeroize::Zeroizing;

    const NOW: u64 = 1_800_000_000;

    fn cfg() -> TokenConfig {
        TokenConfig {
            algorithms: vec![Algorithm::HS512],
            keys: vec![KeySpec {
                kid: None,
                algs: vec![Algorithm::HS512],
                material: KeyMaterial::Secret(Zeroizing::new(vec![7u8; 64])),
            }],
            active_kid: None,
            jwks: None,
            cache_max_entries: 100,
            cache_hmac: false,
            sources: vec![TokenSource::Bearer],
            sid_claim: "sid".into(),
            leeway_seconds: 5,
            issuer: Some("tessera".into()),
            audience: Some("webmail".into()),
            max_token_bytes: 8192,
        }
    }

    fn raw(header: &str, claims: &str, secret: &[u8], alg: Algorithm) -> String {
        let h = URL_SAFE_NO_PAD.encode(header);
        let c = URL_SAFE_NO_PAD.encode(claims);
        let msg = format!("{h}.{c}");
        let sig = jsonwebtoken::crypto::sign(
            msg.as_bytes(),
            &EncodingKey::from_secret(secret),
            alg.jwt(),
        )
        .unwrap();
        format!("{msg}.{sig}")
    }

    fn good_claims() -> String {
        format!(
            r#"{{"sub":"alice","sid":"s1","iat":{NOW},"exp":{},"iss":"tessera","aud":["x","webmail"]}}"#,
            NOW + 60
        )
    }

    fn v() -> Verifier {
        Verifier::new(&cfg())
    }

    /// A valid HS512 token with [`good_claims`].
    fn good_token() -> String {
        raw(
            r#"{"alg":"HS512","typ":"JWT"}"#,
            &good_claims(),
            &[7; 64],
            Algorithm::HS512,
        )
    }

    #[test]
    fn reloaded_keys_replace_the_old_ones_and_the_cached_verifications() {
        let mut c = cfg();
        c.cache_hmac = true;
        let v = Verifier::new(&c);
        let old = good_token();
        assert!(v.verify(&old, NOW).is_ok());
        assert_eq!(v.cache_entries(), Some(1));
        // The secret replaced: the old token is refused at once although it was cached.
        let mut next = c.clone();
        next.keys[0].material = KeyMaterial::Secret(Zeroizing::new(vec![8u8; 64]));
        v.install_keys(v.load_keys(&next).unwrap());
        assert_eq!(v.cache_entries(), Some(0));
        assert_eq!(v.verify(&old, NOW).unwrap_err(), TokenError::Signature);
        let new = raw(
            r#"{"alg":"HS512"}"#,
            &good_claims(),
            &[8; 64],
            Algorithm::HS512,
        );
        assert!(v.verify(&new, NOW).is_ok());
        assert!(v.keys().signer().is_some(), "token.secret signs");
        // A reload may not change the pinned algorithms; nothing changes then.
        let mut other = next.clone();
        other.algorithms = vec![Algorithm::HS512, Algorithm::HS256];
        let err = v.load_keys(&other).err().unwrap().to_string();
        assert!(
            err.contains("token.algorithms") && err.contains("[HS512, HS256]"),
            "{err}"
        );
        assert!(v.verify(&new, NOW).is_ok());
        // The same algorithms in another order (keys listed in another order) are the same pin.
        let mut two = c.clone();
        two.algorithms = vec![Algorithm::HS512, Algorithm::HS256];
        let pinned = Verifier::new(&two);
        two.algorithms.reverse();
        assert!(pinned.load_keys(&two).is_ok());
    }

    #[test]
    fn verified_tokens_are_cached_by_exact_text_until_exp() {
        let t = good_token();
        let mut c = cfg();
        c.cache_hmac = true;
        let v = Verifier::new(&c);
        let cache = v
            .cache
            .as_ref()
            .expect("HS* tokens are cached with cache_hmac");
        assert_eq!(v.verify(&t, NOW).unwrap().sid.as_ref(), "s1");
        assert_eq!(cache.entries.len(), 1);
        // A hit is served from the cache: plant another answer under the token's key.
        let planted = VerifiedToken {
            sid: "from-cache".into(),
            sub: None,
            exp: NOW + 60,
        };
        cache.entries.insert(cache.key(&Carried::Text(&t)), planted);
        assert_eq!(v.verify(&t, NOW).unwrap().sid.as_ref(), "from-cache");
        // One character more or less is another key, verified in full (and refused).
        let longer = format!("{t}A");
        assert_eq!(v.verify(&longer, NOW), Err(TokenError::Signature));
        assert_eq!(v.verify(&t[..t.len() - 1], NOW), Err(TokenError::Signature));
        assert_ne!(
            cache.key(&Carried::Text(&t)),
            cache.key(&Carried::Text(&longer))
        );
        // Two caches key the same text differently (random per-process key).
        assert_ne!(
            cache.key(&Carried::Text(&t)),
            Verifier::new(&c).cache.unwrap().key(&Carried::Text(&t))
        );
        // After exp + leeway the hit is refused and dropped.
        assert_eq!(v.verify(&t, NOW + 60 + 5), Err(TokenError::Expired));
        assert!(cache.entries.get(&cache.key(&Carried::Text(&t))).is_none());
        // Without cache_hmac, an HS*-only key set has no cache at all.
        assert!(self::v().cache.is_none());
    }

    #[test]
    fn a_base64_cookie_is_cached_by_its_carried_bytes_and_decoded_only_on_a_miss() {
        use base64::engine::general_purpose::STANDARD;
        let t = good_token();
        let mut c = cfg();
        c.cache_hmac = true;
        let v = Verifier::new(&c);
        let cache = v.cache.as_ref().expect("cached");
        let b64 = STANDARD.encode(&t);
        let carried = Carried::Base64(b64.as_bytes());
        assert_eq!(v.verify_carried(&carried, NOW).unwrap().sid.as_ref(), "s1");
        // Its own key, apart from the same token carried as text.
        assert_ne!(cache.key(&carried), cache.key(&Carried::Text(&t)));
        let planted = VerifiedToken {
            sid: "from-cache".into(),
            sub: None,
            exp: NOW + 60,
        };
        cache.entries.insert(cache.key(&carried), planted);
        assert_eq!(
            v.verify_carried(&carried, NOW).unwrap().sid.as_ref(),
            "from-cache"
        );
        // Not base64 of a token: refused as a malformed source, and not remembered.
        let before = cache.entries.len();
        assert_eq!(
            v.verify_carried(&Carried::Base64(b"!!!notb64"), NOW),
            Err(TokenError::Source)
        );
        assert_eq!(cache.entries.len(), before);
    }

    #[test]
    fn good_token_verifies_and_sign_roundtrips() {
        let t = good_token();
        let out = v().verify(&t, NOW).unwrap();
        assert_eq!(
            out,
            VerifiedToken {
                sid: "s1".into(),
                sub: Some("alice".into()),
                exp: NOW + 60
            }
        );
        let claims = Claims {
            sub: "bob".into(),
            sid: "s2".into(),
            iat: NOW,
            exp: NOW + 10,
            iss: Some("tessera".into()),
            aud: Some("webmail".into()),
        };
        let t = v().keys().signer().unwrap().sign(&claims).unwrap();
        assert_eq!(v().verify(&t, NOW).unwrap().sid.as_ref(), "s2");
    }

    #[test]
    fn alg_none_and_unpinned_rejected() {
        let t = format!(
            "{}.{}.",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"none"}"#),
            URL_SAFE_NO_PAD.encode(good_claims())
        );
        assert_eq!(v().verify(&t, NOW), Err(TokenError::Malformed)); // empty signature segment
        let t = format!(
            "{}.{}.AAAA",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"none"}"#),
            URL_SAFE_NO_PAD.encode(good_claims())
        );
        assert_eq!(v().verify(&t, NOW), Err(TokenError::Algorithm));
        let t = raw(
            r#"{"alg":"HS256"}"#,
            &good_claims(),
            &[7; 64],
            Algorithm::HS256,
        );
        assert_eq!(v().verify(&t, NOW), Err(TokenError::Algorithm));
    }

    #[test]
    fn forbidden_header_members_rejected() {
        for extra in [
            r#""crit":["x"]"#,
            r#""jku":"http://x""#,
            r#""x5u":"http://x""#,
            r#""jwk":{}"#,
            r#""x5c":[]"#,
            r#""crit":null"#,
            r#""jku":null"#,
        ] {
            let t = raw(
                &format!(r#"{{"alg":"HS512",{extra}}}"#),
                &good_claims(),
                &[7; 64],
                Algorithm::HS512,
            );
            assert_eq!(
                v().verify(&t, NOW),
                Err(TokenError::ForbiddenHeader),
                "{extra}"
            );
        }
    }

    #[test]
    fn a_header_that_is_not_utf8_is_malformed_even_in_an_ignored_member() {
        let header = b"{\"alg\":\"HS512\",\"x\":\"\xfd\"}";
        let msg = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header),
            URL_SAFE_NO_PAD.encode(good_claims())
        );
        let sig = jsonwebtoken::crypto::sign(
            msg.as_bytes(),
            &EncodingKey::from_secret(&[7; 64]),
            Algorithm::HS512.jwt(),
        )
        .unwrap();
        assert_eq!(
            v().verify(&format!("{msg}.{sig}"), NOW),
            Err(TokenError::Malformed)
        );
    }

    #[test]
    fn structure_rules() {
        let t = raw(
            r#"{"alg":"HS512"}"#,
            &good_claims(),
            &[7; 64],
            Algorithm::HS512,
        );
        assert_eq!(
            v().verify(&format!("{t}.x"), NOW),
            Err(TokenError::Malformed)
        );
        assert_eq!(
            v().verify(&t.replacen('.', "..", 1), NOW),
            Err(TokenError::Malformed)
        );
        assert_eq!(
            v().verify(&format!("{t}="), NOW),
            Err(TokenError::Malformed)
        );
        assert_eq!(
            v().verify(&t.replacen('.', ".+", 1), NOW),
            Err(TokenError::Malformed),
            "standard-alphabet char"
        );
        assert_eq!(
            v().verify(&"a".repeat(9000), NOW),
            Err(TokenError::TooLarge)
        );
        // 16-byte header -> 22 base64url chars; the last one carries 4 unused bits that must be 0.
        let t = raw(
            r#"{"alg":"HS512" }"#,
            &good_claims(),
            &[7; 64],
            Algorithm::HS512,
        );
        assert!(v().verify(&t, NOW).is_ok());
        let (h, rest) = t.split_once('.').unwrap();
        assert_eq!(h.len(), 22);
        let last = h.as_bytes()[21];
        let bumped = (last + 1) as char; // same 2 data bits, non-zero padding bits
        let bad = format!("{}{bumped}.{rest}", &h[..21]);
        assert_eq!(
            v().verify(&bad, NOW),
            Err(TokenError::Malformed),
            "non-canonical base64url"
        );
    }

    #[test]
    fn signature_and_time_claims() {
        let t = raw(
            r#"{"alg":"HS512"}"#,
            &good_claims(),
            &[8; 64],
            Algorithm::HS512,
        );
        assert_eq!(v().verify(&t, NOW), Err(TokenError::Signature));
        let mk = |c: String| raw(r#"{"alg":"HS512"}"#, &c, &[7; 64], Algorithm::HS512);
        let base = r#""sid":"s","iss":"tessera","aud":"webmail""#;
        assert_eq!(
            v().verify(&mk(format!("{{{base}}}")), NOW),
            Err(TokenError::MissingExp)
        );
        assert_eq!(
            v().verify(&mk(format!(r#"{{{base},"exp":"soon"}}"#)), NOW),
            Err(TokenError::MissingExp)
        );
        assert_eq!(
            v().verify(&mk(format!(r#"{{{base},"exp":{}}}"#, NOW - 6)), NOW),
            Err(TokenError::Expired)
        );
        assert!(
            v().verify(&mk(format!(r#"{{{base},"exp":{}}}"#, NOW - 4)), NOW)
                .is_ok(),
            "within leeway"
        );
        assert_eq!(
            v().verify(
                &mk(format!(
                    r#"{{{base},"exp":{},"nbf":{}}}"#,
                    NOW + 99,
                    NOW + 60
                )),
                NOW
            ),
            Err(TokenError::NotYetValid)
        );
        assert_eq!(
            v().verify(
                &mk(format!(
                    r#"{{{base},"exp":{},"iat":{}}}"#,
                    NOW + 99,
                    NOW + 60
                )),
                NOW
            ),
            Err(TokenError::IssuedInFuture)
        );
    }

    #[test]
    fn aud_without_configured_audience_and_typ() {
        let mut c = cfg();
        c.audience = None;
        c.issuer = None;
        let v = Verifier::new(&c);
        let exp = NOW + 60;
        let mk = |h: &str, c: String| raw(h, &c, &[7; 64], Algorithm::HS512);
        assert!(v
            .verify(
                &mk(
                    r#"{"alg":"HS512"}"#,
                    format!(r#"{{"sid":"s","exp":{exp}}}"#)
                ),
                NOW
            )
            .is_ok());
        let other = mk(
            r#"{"alg":"HS512"}"#,
            format!(r#"{{"sid":"s","exp":{exp},"aud":"billing"}}"#),
        );
        assert_eq!(
            v.verify(&other, NOW),
            Err(TokenError::Audience),
            "token for another recipient"
        );
        let at = mk(
            r#"{"alg":"HS512","typ":"at+jwt"}"#,
            format!(r#"{{"sid":"s","exp":{exp}}}"#),
        );
        assert_eq!(v.verify(&at, NOW), Err(TokenError::Type));
        assert!(v
            .verify(
                &mk(
                    r#"{"alg":"HS512","typ":"jwt"}"#,
                    format!(r#"{{"sid":"s","exp":{exp}}}"#)
                ),
                NOW
            )
            .is_ok());
    }

    #[test]
    fn issuer_audience_and_sid() {
        let mk = |c: String| raw(r#"{"alg":"HS512"}"#, &c, &[7; 64], Algorithm::HS512);
        let exp = NOW + 60;
        assert_eq!(
            v().verify(
                &mk(format!(
                    r#"{{"sid":"s","exp":{exp},"iss":"evil","aud":"webmail"}}"#
                )),
                NOW
            ),
            Err(TokenError::Issuer)
        );
        assert_eq!(
            v().verify(
                &mk(format!(
                    r#"{{"sid":"s","exp":{exp},"iss":"tessera","aud":"other"}}"#
                )),
                NOW
            ),
            Err(TokenError::Audience)
        );
        assert_eq!(
            v().verify(
                &mk(format!(
                    r#"{{"sid":"","exp":{exp},"iss":"tessera","aud":"webmail"}}"#
                )),
                NOW
            ),
            Err(TokenError::MissingSid)
        );
        assert_eq!(
            v().verify(
                &mk(format!(
                    r#"{{"sid":5,"exp":{exp},"iss":"tessera","aud":"webmail"}}"#
                )),
                NOW
            ),
            Err(TokenError::MissingSid)
        );
    }
}
