//! Configuration: the raw TOML shape (`Raw*`, every field optional, unknown keys rejected) and its
//! validated form (`Config`), built once at startup by [`Config::from_toml`].
//!
//! Owns: defaults, secret resolution (`env:NAME`, `file:PATH`, literal) and error messages that name
//! the key and say how to fix it. Must never: log a resolved secret, or accept a config that would
//! make the proxy fail open.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use zeroize::Zeroizing;

mod changes;
mod cors;
mod exposed;
mod extras;
mod hints;
mod jwks;
mod login;
mod raw;
mod server;
mod session;
mod tls;
mod token;
mod upstream;
mod upstream_tls;

use crate::telemetry::LogConfig;
use crate::Config;
pub use changes::{reloaded_from_env, restart_only_changes};
pub use exposed::{exposed_secrets, Exposed};
use extras::{validate_jmap, validate_metrics, validate_websocket};
use hints::type_fix;
use login::validate_login;
use raw::RawConfig;
use server::validate_server;
pub use session::MAX_TTL_SECONDS;
use session::{validate_credentials, validate_session};
use tls::{validate_http3, validate_tls};
use token::validate_token;
use upstream::validate_upstream;

/// A configuration problem: which key, what is wrong, how to fix it.
#[derive(Debug, thiserror::Error)]
#[error("config key `{key}`: {problem}")]
pub struct ConfigError {
    /// Dotted TOML path of the offending key, e.g. `upstream.url`.
    pub key: String,
    /// What is wrong and how to fix it, in one sentence.
    pub problem: String,
}

impl ConfigError {
    fn new(key: &str, problem: impl Into<String>) -> Self {
        Self {
            key: key.to_string(),
            problem: problem.into(),
        }
    }
}

/// Error loading a config file: unreadable, not TOML / unknown key, or invalid value.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// TOML syntax error (the message names the line and column), or a wrong type or unknown key
    /// (the message names the dotted key and the fix, then the line).
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// A value is present but invalid.
    #[error("config file {path}: {source}")]
    Invalid { path: PathBuf, source: ConfigError },
}

impl Config {
    /// Reads and validates a TOML config file.
    ///
    /// Errors: [`LoadError`] naming the file and the key.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml_with(&text, |name| std::env::var(name).ok()).map_err(|e| match e {
            FromTomlError::Parse(message) => LoadError::Parse {
                path: path.to_path_buf(),
                message,
            },
            FromTomlError::Invalid(source) => LoadError::Invalid {
                path: path.to_path_buf(),
                source,
            },
        })
    }

    /// Parses and validates TOML text, resolving `env:` secrets from the process environment.
    pub fn from_toml(text: &str) -> Result<Self, FromTomlError> {
        Self::from_toml_with(text, |name| std::env::var(name).ok())
    }

    /// Like [`Config::from_toml`] with an explicit environment lookup (tests pass a map).
    pub fn from_toml_with(
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, FromTomlError> {
        let raw = parse_raw(text).map_err(FromTomlError::Parse)?;
        validate(raw, &env).map_err(FromTomlError::Invalid)
    }
}

/// Deserializes the file's tables. A syntax error is toml's message with its line and column.
/// A wrong-typed value or an unknown key is led by a line naming the dotted key and the fix,
/// e.g. ``config key `upstream.idle_timeout_ms`: must be a whole number of milliseconds,
/// without quotes``, followed by toml's message. The offending line itself is never quoted: it
/// may hold a literal secret (a misspelt `secret = "..."`).
fn parse_raw(text: &str) -> Result<RawConfig, String> {
    let document = toml::Deserializer::parse(text).map_err(|e| located(text, &e))?;
    serde_path_to_error::deserialize(document).map_err(|e| {
        let key = e.path().to_string();
        let error = e.into_inner();
        format!(
            "config key `{key}`: {}\n{}",
            type_fix(&key, error.message()),
            located(text, &error)
        )
    })
}

/// toml's message for `error` with where it is in `text` (`line L, column C: ...`).
fn located(text: &str, error: &toml::de::Error) -> String {
    let Some(span) = error.span() else {
        return unquoted(error.message()).into_owned();
    };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |n| n + 1) + 1;
    format!(
        "line {line}, column {column}: {}",
        unquoted(error.message())
    )
}

/// serde's message without the value it quotes (`invalid type: string "...", expected a map`):
/// a value given where a table or an array belongs may be a literal secret.
fn unquoted(message: &str) -> std::borrow::Cow<'_, str> {
    let Some(at) = message.find("string \"") else {
        return message.into();
    };
    let rest = &message[at..];
    let end = rest.rfind("\", expected").unwrap_or(rest.len());
    format!(
        "{}a string{}",
        &message[..at],
        &rest[end..].trim_start_matches('"')
    )
    .into()
}

/// Error from [`Config::from_toml`].
#[derive(Debug, thiserror::Error)]
pub enum FromTomlError {
    /// Syntax error (line and column), or a wrong type or unknown key (dotted key and fix, then
    /// where it is); see `parse_raw`.
    #[error("{0}")]
    Parse(String),
    /// A value is invalid.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
}

/// Resolves a secret reference: `env:NAME` (environment variable), `file:PATH` (file contents,
/// one trailing newline removed) or the literal string.
///
/// Errors: the variable is unset or the file unreadable, naming `key`.
pub fn resolve_secret(
    key: &str,
    value: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Zeroizing<String>, ConfigError> {
    if let Some(name) = value.strip_prefix("env:") {
        env(name).map(Zeroizing::new).ok_or_else(|| {
            ConfigError::new(
                key,
                format!("environment variable {name} is not set; export it or use file:PATH"),
            )
        })
    } else if let Some(path) = value.strip_prefix("file:") {
        let mut text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new(key, format!("cannot read secret file {path}: {e}")))?;
        if text.ends_with('\n') {
            text.pop();
            if text.ends_with('\r') {
                text.pop();
            }
        }
        Ok(Zeroizing::new(text))
    } else {
        Ok(Zeroizing::new(value.to_string()))
    }
}

/// [`resolve_secret`] for a PEM value (certificate, private key, CA certificates): a literal
/// that holds no PEM block is refused, naming the `file:` form a path given bare needs
/// (`ca = "/etc/ca.pem"`), where the parser's own message would blame the contents.
///
/// Errors: as [`resolve_secret`], or a literal without `-----BEGIN`.
pub(super) fn resolve_pem(
    key: &str,
    value: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Zeroizing<String>, ConfigError> {
    let text = resolve_secret(key, value, env)?;
    let literal = !value.starts_with("env:") && !value.starts_with("file:");
    if literal && !text.contains("-----BEGIN") {
        let fix = match Path::new(value).is_file() {
            // A file's path is no secret: named, so the fix can be copied. Anything else may be
            // key material pasted without its PEM lines, never repeated.
            true => format!("to read the file at that path, write \"file:{value}\""),
            false => "give \"file:PATH\", \"env:NAME\" or the PEM text itself".to_string(),
        };
        return Err(ConfigError::new(key, format!("holds no PEM block; {fix}")));
    }
    Ok(text)
}

pub(super) fn ms(key: &str, v: Option<u64>, default_ms: u64) -> Result<Duration, ConfigError> {
    match v.unwrap_or(default_ms) {
        0 => Err(ConfigError::new(
            key,
            "must be greater than 0 (milliseconds)",
        )),
        n => Ok(Duration::from_millis(n)),
    }
}

/// `v` (or `default` when left out) if within `range`, else an error naming `key`, the range and
/// the default.
pub(super) fn in_range<T>(
    key: &str,
    v: Option<T>,
    default: T,
    range: std::ops::RangeInclusive<T>,
) -> Result<T, ConfigError>
where
    T: PartialOrd + std::fmt::Display,
{
    match v {
        None => Ok(default),
        Some(n) if range.contains(&n) => Ok(n),
        Some(_) => Err(ConfigError::new(
            key,
            format!(
                "must be between {} and {} (leave it out for {default})",
                range.start(),
                range.end()
            ),
        )),
    }
}

/// `text` as IP:PORT, or an error naming `key` with `example`.
pub(super) fn socket_addr(key: &str, text: &str, example: &str) -> Result<SocketAddr, ConfigError> {
    text.parse()
        .map_err(|_| ConfigError::new(key, format!("`{text}` is not IP:PORT, e.g. \"{example}\"")))
}

fn validate(raw: RawConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let tls = raw.tls.map(|t| validate_tls(t, env)).transpose()?;
    let http3 = raw
        .http3
        .map(|h| validate_http3(h, tls.as_ref(), env))
        .transpose()?;
    let server = validate_server(raw.server.unwrap_or_default(), tls.as_ref())?;
    let upstream = validate_upstream(raw.upstream.unwrap_or_default(), env)?;
    if let Some(id) = &upstream.request_id_header {
        if server.response_headers.iter().any(|(name, _)| name == id) {
            return Err(ConfigError::new(
                "upstream.request_id_header",
                "is also in server.response_headers, whose value the id would replace; keep one",
            ));
        }
    }
    let sources_listed = raw.token.as_ref().is_some_and(|t| t.sources.is_some());
    let token = validate_token(raw.token.unwrap_or_default(), env)?;
    let session = validate_session(raw.session.unwrap_or_default(), env)?;
    let credentials = validate_credentials(raw.credentials.unwrap_or_default(), env)?;
    let mut token = token;
    let login = match raw.login {
        Some(l) if l.enabled != Some(false) => {
            Some(validate_login(l, &mut token, sources_listed, &session)?)
        }
        _ => None,
    };
    let log = raw.log.unwrap_or_default();
    let websocket = validate_websocket(raw.websocket.unwrap_or_default(), &upstream)?;
    let metrics = raw
        .metrics
        .map(|m| validate_metrics(m, [server.listen, tls.as_ref().map(|t| t.listen)]))
        .transpose()?;
    let cors = raw.cors.map(cors::validate_cors).transpose()?;
    let set_by_cors = |name: &http::HeaderName| crate::cors::UPSTREAM_FIELDS.contains(name);
    if let Some((name, _)) =
        (server.response_headers.iter()).find(|(name, _)| cors.is_some() && set_by_cors(name))
    {
        return Err(ConfigError::new(
            &format!("server.response_headers.\"{name}\""),
            "is set by [cors] for the origins it allows; remove it here",
        ));
    }
    Ok(Config {
        server,
        upstream,
        token,
        session,
        credentials,
        login,
        log: LogConfig {
            level: extras::validate_log_level(log.level)?,
            access_log: log.access_log.unwrap_or(true),
            format: extras::validate_log_format(log.format)?,
        },
        metrics,
        websocket,
        jmap: validate_jmap(raw.jmap.unwrap_or_default())?,
        cors,
        tls,
        http3,
    })
}
