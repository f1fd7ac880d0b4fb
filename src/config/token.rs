//! `[token]` and `[[token.keys]]` -> [`TokenConfig`].

use zeroize::Zeroizing;

use crate::token::keys::{KeyMaterial, KeySpec, Keys};
use crate::token::{Algorithm, TokenSource};

use super::jwks::jwks_config;
use super::raw::{RawKey, RawToken};
use super::{resolve_secret, ConfigError};
use crate::token::TokenConfig;

fn parse_alg(key: &str, name: &str) -> Result<Algorithm, ConfigError> {
    Algorithm::parse(name).ok_or_else(|| {
        ConfigError::new(
            key,
            format!("`{name}` is not supported; use one of HS256 HS384 HS512 RS256 RS384 RS512 PS256 PS384 PS512 ES256 ES384 EdDSA"),
        )
    })
}

/// The environment lookup for `env:` secrets.
type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

pub(super) fn validate_token(mut t: RawToken, env: Env) -> Result<TokenConfig, ConfigError> {
    let explicit_algs = explicit_algorithms(t.algorithms.as_deref())?;
    let mut keys = Vec::new();
    if let Some(secret_ref) = &t.secret {
        keys.push(secret_key(secret_ref, explicit_algs.as_deref(), env)?);
    }
    let mut signable = Vec::new();
    for (i, k) in t.keys.take().unwrap_or_default().into_iter().enumerate() {
        let (spec, signs) = listed_key(i, k, explicit_algs.as_deref(), &keys, env)?;
        if signs {
            signable.extend(spec.kid.clone());
        }
        keys.push(spec);
    }
    let jwks = jwks_config(&t)?;
    if keys.is_empty() && jwks.is_none() {
        return Err(ConfigError::new(
            "token.secret",
            "is required (or [[token.keys]], or token.jwks): \"env:NAME\", \"file:PATH\" or a literal; `tessera keygen` makes one",
        ));
    }
    let algorithms = match explicit_algs {
        Some(a) => a,
        None => implied_algorithms(&keys, jwks.is_some()),
    };
    let active_kid = active_kid(&t, signable)?;
    Keys::new(&keys, active_kid.as_deref(), None, &algorithms)
        .map_err(|e| ConfigError::new("token.keys", e.0))?;
    let leeway_seconds = t.leeway_seconds.unwrap_or(5);
    if leeway_seconds > MAX_LEEWAY_SECONDS {
        // Seconds, not milliseconds: a leeway serves expired tokens for that long.
        return Err(ConfigError::new(
            "token.leeway_seconds",
            format!("must be at most {MAX_LEEWAY_SECONDS} (seconds of clock skew; default 5)"),
        ));
    }
    let max_token_bytes = t.max_token_bytes.unwrap_or(8192);
    if !(64..=65536).contains(&max_token_bytes) {
        return Err(ConfigError::new(
            "token.max_token_bytes",
            "must be between 64 and 65536",
        ));
    }
    Ok(TokenConfig {
        algorithms,
        keys,
        active_kid,
        jwks,
        cache_max_entries: t.cache_max_entries.unwrap_or(100_000),
        cache_hmac: t.cache_hmac.unwrap_or(true),
        sources: token_sources(t.sources.take())?,
        sid_claim: t.sid_claim.unwrap_or_else(|| "sid".into()),
        leeway_seconds,
        issuer: t.issuer,
        audience: t.audience,
        max_token_bytes,
    })
}

/// Largest `token.leeway_seconds`: clocks a few minutes apart are broken, and a longer leeway
/// (`5000` meant as milliseconds) serves every expired token that much longer.
const MAX_LEEWAY_SECONDS: u64 = 300;
/// `token.algorithms`, when listed (at least one).
fn explicit_algorithms(names: Option<&[String]>) -> Result<Option<Vec<Algorithm>>, ConfigError> {
    let Some(names) = names else { return Ok(None) };
    let algs = names
        .iter()
        .map(|name| parse_alg("token.algorithms", name))
        .collect::<Result<Vec<_>, _>>()?;
    if algs.is_empty() {
        return Err(ConfigError::new(
            "token.algorithms",
            "must list at least one algorithm, e.g. [\"HS512\"]",
        ));
    }
    Ok(Some(algs))
}

/// The algorithms of the configured keys, in order, plus every asymmetric one when a JWKS is
/// used (its keys are not known in advance).
fn implied_algorithms(keys: &[KeySpec], jwks: bool) -> Vec<Algorithm> {
    let mut algorithms: Vec<Algorithm> = Vec::new();
    for alg in keys.iter().flat_map(|k| k.algs.iter().copied()) {
        if !algorithms.contains(&alg) {
            algorithms.push(alg);
        }
    }
    if jwks {
        for a in Algorithm::ALL.into_iter().filter(|a| !a.is_hmac()) {
            if !algorithms.contains(&a) {
                algorithms.push(a);
            }
        }
    }
    algorithms
}

/// `token.secret`: the key without a kid, for the HS* algorithms allowed (HS512 by default).
fn secret_key(
    secret_ref: &str,
    explicit: Option<&[Algorithm]>,
    env: Env,
) -> Result<KeySpec, ConfigError> {
    let secret = resolve_secret("token.secret", secret_ref, env)?;
    let algs: Vec<Algorithm> = match explicit {
        Some(a) => a.iter().copied().filter(|a| a.is_hmac()).collect(),
        None => vec![Algorithm::HS512],
    };
    if algs.is_empty() {
        return Err(ConfigError::new(
            "token.secret",
            "token.algorithms lists no HS256/HS384/HS512 algorithm for it; add one or use [[token.keys]]",
        ));
    }
    let needed = algs
        .iter()
        .map(|a| a.min_secret_bytes())
        .max()
        .unwrap_or(32);
    if secret.len() < needed {
        return Err(ConfigError::new(
            "token.secret",
            format!("is {} bytes; the configured algorithms need at least {needed} (RFC 7518 3.2); `tessera keygen` makes one", secret.len()),
        ));
    }
    Ok(KeySpec {
        kid: None,
        algs,
        material: KeyMaterial::Secret(Zeroizing::new(secret.as_bytes().to_vec())),
    })
}

/// `[[token.keys]]` entry `i`, and whether it can sign. `earlier` are the keys before it.
fn listed_key(
    i: usize,
    k: RawKey,
    explicit: Option<&[Algorithm]>,
    earlier: &[KeySpec],
    env: Env,
) -> Result<(KeySpec, bool), ConfigError> {
    let at = |field: &str| format!("token.keys[{i}].{field}");
    let kid = k.kid.clone().filter(|s| !s.is_empty()).ok_or_else(|| {
        ConfigError::new(
            &at("kid"),
            "is required: a short unique key id, e.g. \"2026-11\"",
        )
    })?;
    if earlier
        .iter()
        .any(|s| s.kid.as_deref() == Some(kid.as_str()))
    {
        return Err(ConfigError::new(
            &at("kid"),
            format!("`{kid}` is listed twice"),
        ));
    }
    let alg_name = k
        .alg
        .clone()
        .ok_or_else(|| ConfigError::new(&at("alg"), "is required, e.g. \"HS512\" or \"EdDSA\""))?;
    let alg = parse_alg(&at("alg"), &alg_name)?;
    if explicit.is_some_and(|a| !a.contains(&alg)) {
        return Err(ConfigError::new(
            &at("alg"),
            format!("`{alg_name}` is not in token.algorithms; add it there or remove this key"),
        ));
    }
    let (material, signs) = if alg.is_hmac() {
        (hmac_material(&at, &alg_name, alg, k, env)?, true)
    } else {
        pem_material(&at, &alg_name, k, env)?
    };
    let spec = KeySpec {
        kid: Some(kid),
        algs: vec![alg],
        material,
    };
    Ok((spec, signs))
}

/// An HS* key's `secret` (no PEM keys), at least as long as its hash (RFC 7518 3.2).
fn hmac_material(
    at: &dyn Fn(&str) -> String,
    alg_name: &str,
    alg: Algorithm,
    k: RawKey,
    env: Env,
) -> Result<KeyMaterial, ConfigError> {
    if k.public_key.is_some() || k.private_key.is_some() {
        return Err(ConfigError::new(
            &at("secret"),
            format!("{alg_name} keys take `secret`, not PEM keys"),
        ));
    }
    let secret_ref = k.secret.ok_or_else(|| {
        ConfigError::new(
            &at("secret"),
            "is required for HS* keys: \"env:NAME\", \"file:PATH\" or a literal",
        )
    })?;
    let secret = resolve_secret(&at("secret"), &secret_ref, env)?;
    if secret.len() < alg.min_secret_bytes() {
        return Err(ConfigError::new(
            &at("secret"),
            format!(
                "is {} bytes; {alg_name} needs at least {} (RFC 7518 3.2)",
                secret.len(),
                alg.min_secret_bytes()
            ),
        ));
    }
    Ok(KeyMaterial::Secret(Zeroizing::new(
        secret.as_bytes().to_vec(),
    )))
}

/// An RS*/PS*/ES*/EdDSA key's PEM `public_key` and optional `private_key`, and whether it can
/// sign (it has the private key).
fn pem_material(
    at: &dyn Fn(&str) -> String,
    alg_name: &str,
    k: RawKey,
    env: Env,
) -> Result<(KeyMaterial, bool), ConfigError> {
    if k.secret.is_some() {
        return Err(ConfigError::new(
            &at("secret"),
            format!("{alg_name} keys take public_key (and private_key to sign), not secret"),
        ));
    }
    let public = k.public_key.ok_or_else(|| {
        ConfigError::new(
            &at("public_key"),
            "is required for RS*/PS*/ES*/EdDSA keys: a PEM public key (\"file:PATH\")",
        )
    })?;
    let public = resolve_secret(&at("public_key"), &public, env)?
        .as_bytes()
        .to_vec();
    Ok(match k.private_key {
        Some(p) => {
            let private = resolve_secret(&at("private_key"), &p, env)?;
            let private = Zeroizing::new(private.as_bytes().to_vec());
            (KeyMaterial::KeyPair { private, public }, true)
        }
        None => (KeyMaterial::Public(public), false),
    })
}

/// `token.active_kid`: a signing key's kid; by default the only signing `[[token.keys]]` entry
/// when there is no `token.secret`.
fn active_kid(t: &RawToken, mut signable: Vec<String>) -> Result<Option<String>, ConfigError> {
    match &t.active_kid {
        Some(kid) if !signable.contains(kid) => Err(ConfigError::new(
            "token.active_kid",
            format!(
                "`{kid}` is not the kid of a [[token.keys]] entry with `secret` or `private_key`"
            ),
        )),
        Some(kid) => Ok(Some(kid.clone())),
        None if t.secret.is_none() && signable.len() == 1 => Ok(signable.pop()),
        None => Ok(None),
    }
}

/// `token.sources`, in order (default: bearer, `cookie:tessera`, `cookie-b64:Authorization`).
fn token_sources(listed: Option<Vec<String>>) -> Result<Vec<TokenSource>, ConfigError> {
    let Some(listed) = listed else {
        return Ok(TokenSource::defaults().to_vec());
    };
    if listed.is_empty() {
        return Err(ConfigError::new(
            "token.sources",
            "must list at least one source",
        ));
    }
    listed
        .iter()
        .map(|s| {
            TokenSource::parse(s).ok_or_else(|| {
                ConfigError::new(
                    "token.sources",
                    format!("`{s}` is not `bearer`, `cookie:NAME` or `cookie-b64:NAME`"),
                )
            })
        })
        .collect()
}
