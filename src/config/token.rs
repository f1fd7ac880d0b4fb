//! `[token]` and `[[token.keys]]` -> [`TokenConfig`].

use std::path::PathBuf;
use std::time::Duration;

use zeroize::Zeroizing;

use crate::token::keys::{JwksConfig, JwksSource, KeyMaterial, KeySpec, Keys};
use crate::token::{Algorithm, TokenSource};

use super::raw::RawToken;
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

pub(super) fn validate_token(
    t: RawToken,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<TokenConfig, ConfigError> {
    let explicit_algs = match &t.algorithms {
        Some(names) => {
            let mut v = Vec::new();
            for name in names {
                v.push(parse_alg("token.algorithms", name)?);
            }
            if v.is_empty() {
                return Err(ConfigError::new(
                    "token.algorithms",
                    "must list at least one algorithm, e.g. [\"HS512\"]",
                ));
            }
            Some(v)
        }
        None => None,
    };
    let mut keys = Vec::new();
    let mut algorithms: Vec<Algorithm> = Vec::new();
    if let Some(secret_ref) = &t.secret {
        let secret = resolve_secret("token.secret", secret_ref, env)?;
        let algs: Vec<Algorithm> = match &explicit_algs {
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
        algorithms.extend(&algs);
        keys.push(KeySpec {
            kid: None,
            algs,
            material: KeyMaterial::Secret(Zeroizing::new(secret.as_bytes().to_vec())),
        });
    }
    let mut signable = Vec::new();
    for (i, k) in t.keys.unwrap_or_default().into_iter().enumerate() {
        let at = |field: &str| format!("token.keys[{i}].{field}");
        let kid = k.kid.filter(|s| !s.is_empty()).ok_or_else(|| {
            ConfigError::new(
                &at("kid"),
                "is required: a short unique key id, e.g. \"2026-11\"",
            )
        })?;
        if keys
            .iter()
            .any(|s: &KeySpec| s.kid.as_deref() == Some(kid.as_str()))
        {
            return Err(ConfigError::new(
                &at("kid"),
                format!("`{kid}` is listed twice"),
            ));
        }
        let alg_name = k.alg.ok_or_else(|| {
            ConfigError::new(&at("alg"), "is required, e.g. \"HS512\" or \"EdDSA\"")
        })?;
        let alg = parse_alg(&at("alg"), &alg_name)?;
        if explicit_algs.as_ref().is_some_and(|a| !a.contains(&alg)) {
            return Err(ConfigError::new(
                &at("alg"),
                format!("`{alg_name}` is not in token.algorithms; add it there or remove this key"),
            ));
        }
        let material = if alg.is_hmac() {
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
            signable.push(kid.clone());
            KeyMaterial::Secret(Zeroizing::new(secret.as_bytes().to_vec()))
        } else {
            if k.secret.is_some() {
                return Err(ConfigError::new(
                    &at("secret"),
                    format!(
                        "{alg_name} keys take public_key (and private_key to sign), not secret"
                    ),
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
            match k.private_key {
                Some(p) => {
                    let private = resolve_secret(&at("private_key"), &p, env)?;
                    signable.push(kid.clone());
                    KeyMaterial::KeyPair {
                        private: Zeroizing::new(private.as_bytes().to_vec()),
                        public,
                    }
                }
                None => KeyMaterial::Public(public),
            }
        };
        if !algorithms.contains(&alg) {
            algorithms.push(alg);
        }
        keys.push(KeySpec {
            kid: Some(kid),
            algs: vec![alg],
            material,
        });
    }
    let jwks = match t.jwks {
        None => None,
        Some(src) => {
            let url = |src: &str| -> Result<http::Uri, ConfigError> {
                let uri: http::Uri = src.parse().map_err(|e| {
                    ConfigError::new("token.jwks", format!("`{src}` is not a URL: {e}"))
                })?;
                if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
                    return Err(ConfigError::new(
                        "token.jwks",
                        "must not carry user:password@ (it would be sent as Host and logged)",
                    ));
                }
                match uri.host() {
                    Some(h) if !h.is_empty() => Ok(uri),
                    _ => Err(ConfigError::new(
                        "token.jwks",
                        format!("`{src}` names no host"),
                    )),
                }
            };
            let source = if let Some(path) = src.strip_prefix("file:") {
                JwksSource::File(PathBuf::from(path))
            } else if src.starts_with("http://") {
                JwksSource::Url(url(&src)?, None)
            } else if src.starts_with("https://") {
                let uri = url(&src)?;
                let ca =
                    match t.jwks_ca.as_deref() {
                        None => None,
                        Some(ca) => Some(PathBuf::from(ca.strip_prefix("file:").ok_or_else(
                            || {
                                ConfigError::new(
                            "token.jwks_ca",
                            format!("`{ca}` is not \"file:PATH\" (a PEM file of CA certificates)"),
                        )
                            },
                        )?)),
                    };
                let tls = crate::token::keys::jwks_tls(ca.as_deref()).map_err(|e| {
                    let key = if ca.is_some() {
                        "token.jwks_ca"
                    } else {
                        "token.jwks"
                    };
                    ConfigError::new(key, e)
                })?;
                JwksSource::Url(uri, Some(tls))
            } else {
                return Err(ConfigError::new(
                    "token.jwks",
                    format!("`{src}` is none of \"file:PATH\", \"https://HOST/PATH\" or \"http://HOST/PATH\""),
                ));
            };
            let secs = |key: &str, v: Option<u64>, d: u64| match v.unwrap_or(d) {
                0 => Err(ConfigError::new(key, "must be greater than 0 (seconds)")),
                n => Ok(Duration::from_secs(n)),
            };
            Some(JwksConfig {
                source,
                refresh: secs("token.jwks_refresh_seconds", t.jwks_refresh_seconds, 300)?,
                min_refresh: secs(
                    "token.jwks_min_refresh_seconds",
                    t.jwks_min_refresh_seconds,
                    30,
                )?,
            })
        }
    };
    let fetched_over_tls = |j: &JwksConfig| matches!(j.source, JwksSource::Url(_, Some(_)));
    if t.jwks_ca.is_some() && !jwks.as_ref().is_some_and(fetched_over_tls) {
        return Err(ConfigError::new(
            "token.jwks_ca",
            "is only used with an \"https://\" token.jwks: remove it, or fetch the JWKS over https",
        ));
    }
    if keys.is_empty() && jwks.is_none() {
        return Err(ConfigError::new(
            "token.secret",
            "is required (or [[token.keys]], or token.jwks): \"env:NAME\", \"file:PATH\" or a literal; `tessera keygen` makes one",
        ));
    }
    let algorithms = match explicit_algs {
        Some(a) => a,
        None => {
            if jwks.is_some() {
                for a in Algorithm::ALL.into_iter().filter(|a| !a.is_hmac()) {
                    if !algorithms.contains(&a) {
                        algorithms.push(a);
                    }
                }
            }
            algorithms
        }
    };
    let active_kid = match t.active_kid {
        Some(kid) => {
            if !signable.contains(&kid) {
                return Err(ConfigError::new(
                    "token.active_kid",
                    format!("`{kid}` is not the kid of a [[token.keys]] entry with `secret` or `private_key`"),
                ));
            }
            Some(kid)
        }
        None if t.secret.is_none() && signable.len() == 1 => signable.pop(),
        None => None,
    };
    Keys::new(&keys, active_kid.as_deref(), None, &algorithms)
        .map_err(|e| ConfigError::new("token.keys", e.0))?;
    let mut sources = Vec::new();
    for s in t.sources.unwrap_or_else(|| {
        vec![
            "bearer".into(),
            "cookie:tessera".into(),
            "cookie-b64:Authorization".into(),
        ]
    }) {
        sources.push(TokenSource::parse(&s).ok_or_else(|| {
            ConfigError::new(
                "token.sources",
                format!("`{s}` is not `bearer`, `cookie:NAME` or `cookie-b64:NAME`"),
            )
        })?);
    }
    if sources.is_empty() {
        return Err(ConfigError::new(
            "token.sources",
            "must list at least one source",
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
        sources,
        sid_claim: t.sid_claim.unwrap_or_else(|| "sid".into()),
        leeway_seconds: t.leeway_seconds.unwrap_or(5),
        issuer: t.issuer,
        audience: t.audience,
        max_token_bytes,
    })
}
