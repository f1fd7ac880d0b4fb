//! `[session]` and `[credentials]` -> [`SessionConfig`], [`CredentialsConfig`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use base64::Engine;
use zeroize::Zeroizing;

use super::raw::{RawCredentials, RawSession};
use super::{ms, resolve_secret, ConfigError};
use crate::seal::CredentialsConfig;
use crate::session::{SessionConfig, SessionFormat, SessionQuery, StoreSpec};

/// `session.store` by its scheme, with `query` if it is PostgreSQL's (the only store that reads
/// one).
fn store_spec(store_text: String, query: Option<SessionQuery>) -> Result<StoreSpec, ConfigError> {
    let spec = scheme_spec(store_text)?;
    match (spec, query) {
        (StoreSpec::Postgres(url, None), query) => Ok(StoreSpec::Postgres(url, query)),
        (_, Some(_)) => Err(ConfigError::new(
            "session.query",
            "is read from PostgreSQL only: set session.store = \"postgres://...\" or remove it",
        )),
        (spec, None) => Ok(spec),
    }
}

/// `session.store` by its scheme.
fn scheme_spec(store_text: String) -> Result<StoreSpec, ConfigError> {
    let has = |schemes: &[&str]| schemes.iter().any(|s| store_text.starts_with(s));
    Ok(if let Some(path) = store_text.strip_prefix("embedded:") {
        if path.is_empty() {
            return Err(ConfigError::new(
                "session.store",
                "embedded: needs a path, e.g. \"embedded:./tessera-sessions\"",
            ));
        }
        StoreSpec::Embedded(PathBuf::from(path))
    } else if has(&[
        "redis://",
        "rediss://",
        "redis+sentinel://",
        "rediss+sentinel://",
        "redis+cluster://",
        "rediss+cluster://",
    ]) {
        StoreSpec::Redis(store_text)
    } else if has(&["postgres://", "postgresql://"]) {
        StoreSpec::Postgres(store_text, None)
    } else if has(&["mysql://", "mariadb://"]) {
        StoreSpec::Mysql(store_text)
    } else {
        return Err(ConfigError::new(
            "session.store",
            format!(
                "`{}` is none of \"embedded:PATH\", \"redis://HOST:PORT/DB\", \
                 \"redis+sentinel://HOST:PORT/MASTER\", \"redis+cluster://HOST:PORT,...\", \
                 \"postgres://USER@HOST:PORT/DB\", \"mysql://USER@HOST:PORT/DB\"",
                crate::session::redacted_url(&store_text)
            ),
        ));
    })
}

/// `session.query` and `session.notify_channel`, the channel a plain identifier (it is named in
/// `LISTEN`, which takes no parameter).
fn session_query(
    query: Option<String>,
    channel: Option<String>,
) -> Result<Option<SessionQuery>, ConfigError> {
    let identifier = |c: &str| {
        c.len() <= 63
            && c.starts_with(|ch: char| ch.is_ascii_lowercase() || ch == '_')
            && c.chars()
                .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '_')
    };
    match (query, channel) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(ConfigError::new(
            "session.notify_channel",
            "goes with session.query (tessera's own tables notify on their own); remove it",
        )),
        (Some(q), _) if !q.contains("$1") => Err(ConfigError::new(
            "session.query",
            "must take the session key as $1, e.g. \"SELECT record FROM app.sessions WHERE key = $1\"",
        )),
        (Some(_), Some(c)) if !identifier(&c) => Err(ConfigError::new(
            "session.notify_channel",
            format!("`{c}` is not a plain identifier: lower-case letters, digits and _, at most 63"),
        )),
        (Some(query), channel) => Ok(Some(SessionQuery { query, channel })),
    }
}

/// Longest `session.ttl_seconds`: ten years.
pub const MAX_TTL_SECONDS: u64 = 10 * 365 * 24 * 3600;

pub(super) fn validate_session(
    s: RawSession,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<SessionConfig, ConfigError> {
    // `env:` or `file:` keeps a store password out of the configuration file.
    let store_text = match s.store {
        Some(v) if v.starts_with("env:") || v.starts_with("file:") => {
            resolve_secret("session.store", &v, env)?.to_string()
        }
        v => v.unwrap_or_else(|| "embedded:./tessera-sessions".into()),
    };
    let store = store_spec(store_text, session_query(s.query, s.notify_channel)?)?;
    let format = match s.format.as_deref().unwrap_or("tessera") {
        "tessera" => SessionFormat::Tessera,
        "hyper-auth-proxy" => SessionFormat::HyperAuthProxy,
        other => {
            return Err(ConfigError::new(
                "session.format",
                format!("`{other}` is neither \"tessera\" nor \"hyper-auth-proxy\""),
            ))
        }
    };
    let ttl_seconds = s.ttl_seconds.unwrap_or(12 * 3600);
    // Ten years at most: the expiry must stay a valid Redis `EX` and SQL integer past now.
    if !(1..=MAX_TTL_SECONDS).contains(&ttl_seconds) {
        return Err(ConfigError::new(
            "session.ttl_seconds",
            format!("must be between 1 and {MAX_TTL_SECONDS} (ten years)"),
        ));
    }
    if format == SessionFormat::HyperAuthProxy && s.key_prefix.is_some() {
        // That format's keys are the bare sids: a prefix would make every lookup miss.
        return Err(ConfigError::new(
            "session.key_prefix",
            "is not used with session.format = \"hyper-auth-proxy\" (its records are keyed by \
             the bare sid): remove it",
        ));
    }
    Ok(SessionConfig {
        store,
        format,
        key_prefix: s.key_prefix.unwrap_or_else(|| "tessera:session:".into()),
        ttl_seconds,
        timeout: ms("session.timeout_ms", s.timeout_ms, 1_000)?,
        poll_interval: match ms("session.poll_interval_ms", s.poll_interval_ms, 25)? {
            d if d > Duration::from_secs(1) => {
                return Err(ConfigError::new(
                    "session.poll_interval_ms",
                    "must be at most 1000 (ms, default 25): a revocation waits up to this long on other instances",
                ))
            }
            d => d,
        },
        cache: crate::session::CacheConfig {
            max_entries: s.cache_max_entries.unwrap_or(100_000),
            max_bytes: match s.cache_max_bytes.unwrap_or(64 << 20) {
                n if n < 64 << 10 => {
                    return Err(ConfigError::new(
                        "session.cache_max_bytes",
                        "must be at least 65536 (bytes, default 67108864 = 64 MiB); set session.cache_max_entries = 0 to disable the cache",
                    ))
                }
                n => n,
            },
            ttl: Duration::from_secs(match s.cache_ttl_seconds.unwrap_or(300) {
                0 => {
                    return Err(ConfigError::new(
                        "session.cache_ttl_seconds",
                        "must be greater than 0; set session.cache_max_entries = 0 to disable the cache",
                    ))
                }
                n => n,
            }),
            negative_ttl: Duration::from_millis(s.negative_cache_ms.unwrap_or(1_000)),
        },
    })
}

pub(super) fn validate_credentials(
    c: RawCredentials,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<CredentialsConfig, ConfigError> {
    let raw_keys = c.keys.unwrap_or_default();
    if raw_keys.is_empty() {
        return Err(ConfigError::new(
            "credentials.keys",
            "is required: keys = { k1 = \"env:TESSERA_CRED_KEY\" } with base64 of 32 bytes; `tessera keygen` makes one",
        ));
    }
    let mut keys = BTreeMap::new();
    for (id, value) in raw_keys {
        let key = format!("credentials.keys.{id}");
        if id.is_empty() || id.contains('.') || !id.is_ascii() {
            return Err(ConfigError::new(
                &key,
                "key ids must be non-empty ASCII without '.'",
            ));
        }
        let secret = resolve_secret(&key, &value, env)?;
        let bytes = Zeroizing::new(
            base64::engine::general_purpose::STANDARD
                .decode(secret.trim())
                .map_err(|_| {
                    ConfigError::new(&key, "is not base64; `tessera keygen` makes a valid key")
                })?,
        );
        let arr: [u8; 32] = bytes.as_slice().try_into().map_err(|_| {
            ConfigError::new(
                &key,
                format!("decodes to {} bytes; AES-256 needs exactly 32", bytes.len()),
            )
        })?;
        keys.insert(id, Zeroizing::new(arr));
    }
    let active = match c.active {
        Some(a) => a,
        None if keys.len() == 1 => keys.keys().next().cloned().unwrap_or_default(),
        None => {
            return Err(ConfigError::new(
                "credentials.active",
                "is required when several keys are listed",
            ))
        }
    };
    if !keys.contains_key(&active) {
        return Err(ConfigError::new(
            "credentials.active",
            format!("`{active}` is not one of the ids in credentials.keys"),
        ));
    }
    Ok(CredentialsConfig {
        keys,
        active,
        allow_plaintext_legacy: c.allow_plaintext_legacy.unwrap_or(false),
    })
}
