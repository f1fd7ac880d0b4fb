//! `[login]` -> [`LoginConfig`].

use std::time::Duration;

use crate::token::keys::KeyMaterial;
use crate::token::TokenSource;

use super::raw::RawLogin;
use super::ConfigError;
use crate::login::{LoginConfig, SameSite};
use crate::session::SessionConfig;
use crate::token::TokenConfig;

/// Longest `login.failure_window_seconds`: one week. A counter's expiry must stay a valid
/// Redis `EXPIRE` and SQLite integer.
const MAX_FAILURE_WINDOW_SECONDS: u64 = 7 * 24 * 3600;

pub(super) fn validate_login(
    mut l: RawLogin,
    token: &mut TokenConfig,
    sources_listed: bool,
    session: &SessionConfig,
) -> Result<LoginConfig, ConfigError> {
    let (prefix, verify_path) = login_paths(l.path_prefix.take(), l.verify_path.take())?;
    let (cookie_secure, cookie_name, cookie_same_site) = login_cookie(&l)?;
    if let crate::session::StoreSpec::Postgres(_, Some(_)) = session.store {
        return Err(ConfigError::new(
            "login",
            "needs a store tessera writes, and session.query makes it read-only: remove [login] \
             (the application signs its users in) or session.query",
        ));
    }
    let token_ttl_seconds = l.token_ttl_seconds.unwrap_or(session.ttl_seconds);
    if token_ttl_seconds == 0 || token_ttl_seconds > session.ttl_seconds {
        return Err(ConfigError::new(
            "login.token_ttl_seconds",
            format!(
                "must be between 1 and session.ttl_seconds ({})",
                session.ttl_seconds
            ),
        ));
    }
    let positive = |key: &str, v: Option<u32>, d: u32| match v.unwrap_or(d) {
        0 => Err(ConfigError::new(key, "must be greater than 0")),
        n => Ok(n),
    };
    let window = l.failure_window_seconds.unwrap_or(300);
    if !(1..=MAX_FAILURE_WINDOW_SECONDS).contains(&window) {
        return Err(ConfigError::new(
            "login.failure_window_seconds",
            "must be between 1 and 604800 (one week)",
        ));
    }
    token_for_login(token)?;
    login_cookie_first(&mut token.sources, &cookie_name, sources_listed);
    Ok(LoginConfig {
        path_prefix: prefix,
        verify_path,
        cookie_name,
        cookie_secure,
        cookie_same_site,
        token_ttl_seconds,
        max_failures_per_ip: positive("login.max_failures_per_ip", l.max_failures_per_ip, 20)?,
        max_failures_per_user: positive(
            "login.max_failures_per_user",
            l.max_failures_per_user,
            20,
        )?,
        failure_window: Duration::from_secs(window),
        device_cookie_max_age: match l.device_cookie_max_age_seconds.unwrap_or(30 * 24 * 3600) {
            age @ 0..=MAX_DEVICE_COOKIE_AGE => age,
            _ => {
                return Err(ConfigError::new(
                    "login.device_cookie_max_age_seconds",
                    "must be at most 31536000 (one year); 0 turns device cookies off",
                ))
            }
        },
        page_title: l.page_title.unwrap_or_else(|| "Sign in".into()),
    })
}

/// Longest `login.device_cookie_max_age_seconds`: one year.
const MAX_DEVICE_COOKIE_AGE: u64 = 365 * 24 * 3600;

/// `login.path_prefix` (default `/auth`) and `login.verify_path` (required).
fn login_paths(
    prefix: Option<String>,
    verify: Option<String>,
) -> Result<(String, http::uri::PathAndQuery), ConfigError> {
    let prefix = prefix.unwrap_or_else(|| "/auth".into());
    // Visible ASCII only: a request path carries nothing else (other characters arrive
    // %-encoded, so a prefix holding them would never match), and the prefix is written into
    // `Location` fields.
    if !prefix.starts_with('/')
        || prefix.len() < 2
        || prefix.ends_with('/')
        || prefix.contains(['?', '#'])
        || !prefix.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(ConfigError::new(
            "login.path_prefix",
            format!(
                "`{}` must be an absolute path of visible ASCII characters (%-encode others) \
                 without trailing `/`, e.g. \"/auth\"",
                prefix.escape_debug()
            ),
        ));
    }
    // No default: many upstreams answer 2xx to `GET /` without credentials, and then any
    // password would log in.
    let verify = verify.ok_or_else(|| {
        ConfigError::new(
            "login.verify_path",
            "is required: an upstream path that answers 2xx only to valid credentials (Cyrus JMAP: \"/jmap/\")",
        )
    })?;
    let verify_path: http::uri::PathAndQuery = verify
        .parse()
        .ok()
        .filter(|_| verify.starts_with('/'))
        .ok_or_else(|| {
            ConfigError::new(
                "login.verify_path",
                format!("`{verify}` is not an absolute path, e.g. \"/jmap/\""),
            )
        })?;
    Ok((prefix, verify_path))
}

/// `login.cookie_secure`, `login.cookie_name` and `login.cookie_same_site`.
fn login_cookie(l: &RawLogin) -> Result<(bool, String, SameSite), ConfigError> {
    let cookie_secure = l.cookie_secure.unwrap_or(true);
    let cookie_name = l.cookie_name.clone().unwrap_or_else(|| {
        if cookie_secure {
            "__Host-tessera"
        } else {
            "tessera"
        }
        .into()
    });
    if cookie_name.is_empty()
        || !cookie_name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(ConfigError::new(
            "login.cookie_name",
            "must be letters, digits, `-`, `_` or `.`",
        ));
    }
    if !cookie_secure
        && (cookie_name.starts_with("__Host-") || cookie_name.starts_with("__Secure-"))
    {
        return Err(ConfigError::new(
            "login.cookie_name",
            "a __Host-/__Secure- cookie needs cookie_secure = true (browsers drop it otherwise); rename it for http development",
        ));
    }
    let cookie_same_site = match l.cookie_same_site.as_deref().unwrap_or("Strict") {
        "Strict" | "strict" => SameSite::Strict,
        "Lax" | "lax" => SameSite::Lax,
        "None" | "none" if cookie_secure => SameSite::None,
        "None" | "none" => {
            return Err(ConfigError::new(
                "login.cookie_same_site",
                "None requires cookie_secure = true",
            ))
        }
        other => {
            return Err(ConfigError::new(
                "login.cookie_same_site",
                format!("`{other}` is not Strict, Lax or None"),
            ))
        }
    };
    Ok((cookie_secure, cookie_name, cookie_same_site))
}

/// What login needs of `[token]`: a signing key and the `sid` claim.
fn token_for_login(token: &TokenConfig) -> Result<(), ConfigError> {
    let has_signer = token
        .keys
        .iter()
        .any(|k| k.kid == token.active_kid && !matches!(k.material, KeyMaterial::Public(_)));
    if !has_signer {
        return Err(ConfigError::new(
            "token.active_kid",
            "login issues tokens and needs a signing key: set token.secret, or token.active_kid naming a key with secret/private_key",
        ));
    }
    if token.sid_claim != "sid" {
        return Err(ConfigError::new(
            "token.sid_claim",
            "login issues tokens with `sid`; remove token.sid_claim or disable [login]",
        ));
    }
    Ok(())
}

/// Puts the login cookie, the one cookie tessera sets itself, before every other cookie source
/// (after `bearer`, which no other site can set): a cookie planted from a sibling subdomain or
/// over plain http cannot carry the `__Host-` prefix, and read first it would sign the browser
/// into the planter's session (or hold it at a 401 that signing in does not cure). With
/// `token.sources` not listed, the other default cookies go: a login deployment sets none.
fn login_cookie_first(sources: &mut Vec<TokenSource>, cookie_name: &str, listed: bool) {
    let login = TokenSource::Cookie(cookie_name.to_owned());
    sources.retain(|s| *s != login && (listed || *s == TokenSource::Bearer));
    let at = sources
        .iter()
        .position(|s| *s != TokenSource::Bearer)
        .unwrap_or(sources.len());
    sources.insert(at, login);
}
