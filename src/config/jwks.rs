//! `token.jwks`, `token.jwks_ca` and the refresh intervals -> [`JwksConfig`]: an identity
//! provider's keys, fetched from a file or an http(s) URL.

use std::path::PathBuf;
use std::time::Duration;

use crate::token::keys::{JwksConfig, JwksSource};

use super::raw::RawToken;
use super::ConfigError;

/// `token.jwks` with its refresh settings and, for https, its TLS roots (`token.jwks_ca`).
pub(super) fn jwks_config(t: &RawToken) -> Result<Option<JwksConfig>, ConfigError> {
    let fetched_over_tls = |j: &JwksConfig| matches!(j.source, JwksSource::Url(_, Some(_)));
    let jwks = match &t.jwks {
        None => None,
        Some(src) => {
            let secs = |key: &str, v: Option<u64>, d: u64| match v.unwrap_or(d) {
                0 => Err(ConfigError::new(key, "must be greater than 0 (seconds)")),
                n => Ok(Duration::from_secs(n)),
            };
            Some(JwksConfig {
                source: jwks_source(src, t.jwks_ca.as_deref())?,
                refresh: secs("token.jwks_refresh_seconds", t.jwks_refresh_seconds, 300)?,
                min_refresh: secs(
                    "token.jwks_min_refresh_seconds",
                    t.jwks_min_refresh_seconds,
                    30,
                )?,
            })
        }
    };
    if jwks.is_none() {
        // Settings of a JWKS with none to apply to: a typo'd or commented-out `jwks` line.
        for (key, set) in [
            (
                "token.jwks_refresh_seconds",
                t.jwks_refresh_seconds.is_some(),
            ),
            (
                "token.jwks_min_refresh_seconds",
                t.jwks_min_refresh_seconds.is_some(),
            ),
        ] {
            if set {
                return Err(ConfigError::new(
                    key,
                    "is only used with token.jwks: set that, or remove this",
                ));
            }
        }
    }
    if t.jwks_ca.is_some() && !jwks.as_ref().is_some_and(fetched_over_tls) {
        return Err(ConfigError::new(
            "token.jwks_ca",
            "is only used with an \"https://\" token.jwks: remove it, or fetch the JWKS over https",
        ));
    }
    Ok(jwks)
}

/// Where the JWKS comes from: `file:PATH`, `http://` or `https://` (with `ca`'s roots, else the
/// system's).
fn jwks_source(src: &str, ca: Option<&str>) -> Result<JwksSource, ConfigError> {
    if let Some(path) = src.strip_prefix("file:") {
        return Ok(JwksSource::File(PathBuf::from(path)));
    }
    if src.starts_with("http://") {
        return Ok(JwksSource::Url(jwks_url(src)?, None));
    }
    if !src.starts_with("https://") {
        return Err(ConfigError::new(
            "token.jwks",
            format!(
                "`{src}` is none of \"file:PATH\", \"https://HOST/PATH\" or \"http://HOST/PATH\""
            ),
        ));
    }
    let uri = jwks_url(src)?;
    let ca = match ca {
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
    Ok(JwksSource::Url(uri, Some(tls)))
}

/// A JWKS URL with a host and no userinfo.
fn jwks_url(src: &str) -> Result<http::Uri, ConfigError> {
    let uri: http::Uri = src.parse().map_err(|e| {
        let shown = crate::session::redacted_url(src);
        ConfigError::new("token.jwks", format!("`{shown}` is not a URL: {e}"))
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
            format!("`{}` names no host", crate::session::redacted_url(src)),
        )),
    }
}
