//! Configuration: the raw TOML shape (`Raw*`, every field optional, unknown keys rejected) and its
//! validated form (`Config`), built once at startup by [`Config::from_toml`].
//!
//! Owns: defaults, secret resolution (`env:NAME`, `file:PATH`, literal) and error messages that name
//! the key and say how to fix it. Must never: log a resolved secret, or accept a config that would
//! make the proxy fail open.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use serde::Deserialize;
use zeroize::Zeroizing;

use crate::token::{Algorithm, TokenSource};

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
    /// TOML syntax error, wrong type or unknown key (the message names the key and line).
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// A value is present but invalid.
    #[error("config file {path}: {source}")]
    Invalid { path: PathBuf, source: ConfigError },
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: Option<RawServer>,
    upstream: Option<RawUpstream>,
    token: Option<RawToken>,
    session: Option<RawSession>,
    credentials: Option<RawCredentials>,
    log: Option<RawLog>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    max_header_bytes: Option<usize>,
    max_uri_bytes: Option<usize>,
    max_body_bytes: Option<u64>,
    header_read_timeout_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    url: Option<String>,
    max_connections: Option<usize>,
    connect_timeout_ms: Option<u64>,
    response_header_timeout_ms: Option<u64>,
    idle_timeout_ms: Option<u64>,
    preserve_host: Option<bool>,
    strip_response_headers: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawToken {
    algorithms: Option<Vec<String>>,
    secret: Option<String>,
    sources: Option<Vec<String>>,
    sid_claim: Option<String>,
    leeway_seconds: Option<u64>,
    issuer: Option<String>,
    audience: Option<String>,
    max_token_bytes: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSession {
    store: Option<String>,
    format: Option<String>,
    key_prefix: Option<String>,
    ttl_seconds: Option<u64>,
    timeout_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCredentials {
    keys: Option<BTreeMap<String, String>>,
    active: Option<String>,
    allow_plaintext_legacy: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLog {
    level: Option<String>,
    access_log: Option<bool>,
}

/// The validated configuration. Every field is ready to use; secrets are resolved.
#[derive(Debug, Clone)]
pub struct Config {
    /// Downstream listener settings and request limits.
    pub server: ServerConfig,
    /// Where requests go and how the pool behaves.
    pub upstream: UpstreamConfig,
    /// How tokens are found and verified.
    pub token: TokenConfig,
    /// Which session store, which record format.
    pub session: SessionConfig,
    /// Sealing keys for stored credentials.
    pub credentials: CredentialsConfig,
    /// Logging.
    pub log: LogConfig,
}

/// `[server]`.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address `tessera serve` binds (plain HTTP/1.1 and h2c). Default `127.0.0.1:8080`.
    pub listen: SocketAddr,
    /// Cap on the sum of request header names + values, bytes; above -> 431. Default 16384.
    pub max_header_bytes: usize,
    /// Cap on the request-target length, bytes; above -> 414. Default 8192.
    pub max_uri_bytes: usize,
    /// Cap on the request body, bytes; above -> 413. `0` = unlimited. Default 0.
    pub max_body_bytes: u64,
    /// Time a client has to send the request head (HTTP/1.1). Default 30 s.
    pub header_read_timeout: Duration,
}

/// `[upstream]`.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Base URL, `http://host:port` (an optional path prefix is prepended to every request path).
    pub url: http::Uri,
    /// Hard cap on open upstream connections (idle + busy); requests beyond it queue FIFO.
    /// Keep it at or below the upstream's own limit (Cyrus `maxchild`). Default 64.
    pub max_connections: usize,
    /// TCP connect + HTTP handshake timeout. Default 5 s.
    pub connect_timeout: Duration,
    /// Longest wait for the upstream's response head with no request-body progress (pool queue
    /// included); past it -> 504. Default 60 s.
    pub response_header_timeout: Duration,
    /// Idle pooled connections older than this are closed; keep it below the upstream's
    /// keep-alive timeout (nginx: 75 s). Default 30 s.
    pub idle_timeout: Duration,
    /// Forward the client's `Host` (true, default) or the upstream URL's authority (false).
    pub preserve_host: bool,
    /// Response headers removed besides hop-by-hop ones. Default `["alt-svc"]`.
    pub strip_response_headers: Vec<http::HeaderName>,
}

/// `[token]`.
#[derive(Clone)]
pub struct TokenConfig {
    /// Accepted JWS algorithms (pinned; the token's `alg` must be one of them). Default `["HS512"]`.
    pub algorithms: Vec<Algorithm>,
    /// HMAC secret (bytes of the configured string). At least as long as the largest hash (RFC 7518 3.2).
    pub secret: Zeroizing<Vec<u8>>,
    /// Where tokens are looked for, in order. Default `bearer`, `cookie:tessera`, `cookie-b64:Authorization`.
    pub sources: Vec<TokenSource>,
    /// Claim holding the session id. Default `sid`.
    pub sid_claim: String,
    /// Clock skew allowed on `exp`/`nbf`/`iat`, seconds. Default 5.
    pub leeway_seconds: u64,
    /// Required `iss`, when set.
    pub issuer: Option<String>,
    /// Required member of `aud`, when set.
    pub audience: Option<String>,
    /// Longest accepted token, bytes. Default 8192.
    pub max_token_bytes: usize,
}

impl std::fmt::Debug for TokenConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenConfig")
            .field("algorithms", &self.algorithms)
            .field("secret", &"<redacted>")
            .field("sources", &self.sources)
            .field("sid_claim", &self.sid_claim)
            .finish_non_exhaustive()
    }
}

/// Where sessions live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// `embedded:PATH` — SQLite file in WAL mode (shared safely by `serve` and the CLI).
    Embedded(PathBuf),
    /// `redis://...` or `rediss://...` URL.
    Redis(String),
}

/// How session records are laid out in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionFormat {
    /// Key `{key_prefix}{sid}`, value `{"sub":..,"credentials":"<sealed>","expires_at":..}`.
    Tessera,
    /// Key `{sid}`, value `{"credentials":"<base64 user:pass or sealed>"}` (hyper-auth-proxy).
    HyperAuthProxy,
}

/// `[session]`.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Default `embedded:./tessera-sessions`.
    pub store: StoreSpec,
    /// Default `tessera`.
    pub format: SessionFormat,
    /// Key prefix for the `tessera` format. Default `tessera:session:`.
    pub key_prefix: String,
    /// Lifetime of sessions created by tessera, seconds. Default 43200 (12 h).
    pub ttl_seconds: u64,
    /// Deadline for one store operation; past it the request gets 503. Default 1000 ms.
    pub timeout: Duration,
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

/// `[log]`.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// `tracing` filter directive. Default `info`.
    pub level: String,
    /// Emit one access line per request on target `tessera::access`. Default true.
    pub access_log: bool,
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
        let raw: RawConfig =
            toml::from_str(text).map_err(|e| FromTomlError::Parse(e.to_string()))?;
        validate(raw, &env).map_err(FromTomlError::Invalid)
    }
}

/// Error from [`Config::from_toml`].
#[derive(Debug, thiserror::Error)]
pub enum FromTomlError {
    /// Syntax, type or unknown-key error; the message names the key and line.
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

fn ms(key: &str, v: Option<u64>, default_ms: u64) -> Result<Duration, ConfigError> {
    match v.unwrap_or(default_ms) {
        0 => Err(ConfigError::new(
            key,
            "must be greater than 0 (milliseconds)",
        )),
        n => Ok(Duration::from_millis(n)),
    }
}

fn validate(raw: RawConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let server = validate_server(raw.server.unwrap_or_default())?;
    let upstream = validate_upstream(raw.upstream.unwrap_or_default())?;
    let token = validate_token(raw.token.unwrap_or_default(), env)?;
    let session = validate_session(raw.session.unwrap_or_default())?;
    let credentials = validate_credentials(raw.credentials.unwrap_or_default(), env)?;
    let log = raw.log.unwrap_or_default();
    Ok(Config {
        server,
        upstream,
        token,
        session,
        credentials,
        log: LogConfig {
            level: log.level.unwrap_or_else(|| "info".into()),
            access_log: log.access_log.unwrap_or(true),
        },
    })
}

fn validate_server(s: RawServer) -> Result<ServerConfig, ConfigError> {
    let listen = s.listen.as_deref().unwrap_or("127.0.0.1:8080");
    let listen = listen.parse().map_err(|_| {
        ConfigError::new(
            "server.listen",
            format!("`{listen}` is not IP:PORT, e.g. \"127.0.0.1:8080\""),
        )
    })?;
    let max_header_bytes = s.max_header_bytes.unwrap_or(16 * 1024);
    if !(1024..=1024 * 1024).contains(&max_header_bytes) {
        return Err(ConfigError::new(
            "server.max_header_bytes",
            "must be between 1024 and 1048576",
        ));
    }
    let max_uri_bytes = s.max_uri_bytes.unwrap_or(8 * 1024);
    if !(256..=65534).contains(&max_uri_bytes) {
        return Err(ConfigError::new(
            "server.max_uri_bytes",
            "must be between 256 and 65534",
        ));
    }
    Ok(ServerConfig {
        listen,
        max_header_bytes,
        max_uri_bytes,
        max_body_bytes: s.max_body_bytes.unwrap_or(0),
        header_read_timeout: ms(
            "server.header_read_timeout_ms",
            s.header_read_timeout_ms,
            30_000,
        )?,
    })
}

fn validate_upstream(u: RawUpstream) -> Result<UpstreamConfig, ConfigError> {
    let key = "upstream.url";
    let text = u.url.ok_or_else(|| {
        ConfigError::new(key, "is required, e.g. url = \"http://127.0.0.1:8008\"")
    })?;
    let url: http::Uri = text
        .parse()
        .map_err(|e| ConfigError::new(key, format!("`{text}` is not a URL: {e}")))?;
    match url.scheme_str() {
        Some("http") => {}
        Some(other) => {
            return Err(ConfigError::new(
                key,
                format!("scheme `{other}` is not supported yet; use http://"),
            ))
        }
        None => {
            return Err(ConfigError::new(
                key,
                "needs a scheme, e.g. http://host:port",
            ))
        }
    }
    if url.host().is_none() {
        return Err(ConfigError::new(
            key,
            "needs a host, e.g. http://127.0.0.1:8008",
        ));
    }
    if url.query().is_some() {
        return Err(ConfigError::new(key, "must not have a query string"));
    }
    let max_connections = u.max_connections.unwrap_or(64);
    if max_connections == 0 || max_connections > 100_000 {
        return Err(ConfigError::new(
            "upstream.max_connections",
            "must be between 1 and 100000",
        ));
    }
    let mut strip = Vec::new();
    for name in u
        .strip_response_headers
        .unwrap_or_else(|| vec!["alt-svc".into()])
    {
        let header = http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            ConfigError::new(
                "upstream.strip_response_headers",
                format!("`{name}` is not a header name"),
            )
        })?;
        strip.push(header);
    }
    Ok(UpstreamConfig {
        url,
        max_connections,
        connect_timeout: ms("upstream.connect_timeout_ms", u.connect_timeout_ms, 5_000)?,
        response_header_timeout: ms(
            "upstream.response_header_timeout_ms",
            u.response_header_timeout_ms,
            60_000,
        )?,
        idle_timeout: ms("upstream.idle_timeout_ms", u.idle_timeout_ms, 30_000)?,
        preserve_host: u.preserve_host.unwrap_or(true),
        strip_response_headers: strip,
    })
}

fn validate_token(
    t: RawToken,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<TokenConfig, ConfigError> {
    let mut algorithms = Vec::new();
    for name in t.algorithms.unwrap_or_else(|| vec!["HS512".into()]) {
        let alg = Algorithm::parse(&name).ok_or_else(|| {
            ConfigError::new(
                "token.algorithms",
                format!("`{name}` is not supported; use HS256, HS384 or HS512"),
            )
        })?;
        algorithms.push(alg);
    }
    if algorithms.is_empty() {
        return Err(ConfigError::new(
            "token.algorithms",
            "must list at least one algorithm, e.g. [\"HS512\"]",
        ));
    }
    let secret_ref = t.secret.ok_or_else(|| {
        ConfigError::new(
            "token.secret",
            "is required: \"env:NAME\", \"file:PATH\" or a literal; `tessera keygen` makes one",
        )
    })?;
    let secret = resolve_secret("token.secret", &secret_ref, env)?;
    let needed = algorithms
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
        secret: Zeroizing::new(secret.as_bytes().to_vec()),
        sources,
        sid_claim: t.sid_claim.unwrap_or_else(|| "sid".into()),
        leeway_seconds: t.leeway_seconds.unwrap_or(5),
        issuer: t.issuer,
        audience: t.audience,
        max_token_bytes,
    })
}

fn validate_session(s: RawSession) -> Result<SessionConfig, ConfigError> {
    let store_text = s
        .store
        .unwrap_or_else(|| "embedded:./tessera-sessions".into());
    let store = if let Some(path) = store_text.strip_prefix("embedded:") {
        if path.is_empty() {
            return Err(ConfigError::new(
                "session.store",
                "embedded: needs a path, e.g. \"embedded:./tessera-sessions\"",
            ));
        }
        StoreSpec::Embedded(PathBuf::from(path))
    } else if store_text.starts_with("redis://") || store_text.starts_with("rediss://") {
        StoreSpec::Redis(store_text)
    } else {
        return Err(ConfigError::new(
            "session.store",
            format!("`{store_text}` is neither \"embedded:PATH\" nor \"redis://HOST:PORT/DB\""),
        ));
    };
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
    if ttl_seconds == 0 {
        return Err(ConfigError::new(
            "session.ttl_seconds",
            "must be greater than 0",
        ));
    }
    Ok(SessionConfig {
        store,
        format,
        key_prefix: s.key_prefix.unwrap_or_else(|| "tessera:session:".into()),
        ttl_seconds,
        timeout: ms("session.timeout_ms", s.timeout_ms, 1_000)?,
    })
}

fn validate_credentials(
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

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

    fn env(name: &str) -> Option<String> {
        match name {
            "SECRET" => Some("s".repeat(64)),
            "KEY" => Some(KEY.into()),
            _ => None,
        }
    }

    fn minimal() -> String {
        "[upstream]\nurl = \"http://127.0.0.1:9\"\n[token]\nsecret = \"env:SECRET\"\n[credentials]\nkeys = { k1 = \"env:KEY\" }\n".into()
    }

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = Config::from_toml_with(&minimal(), env).unwrap();
        assert_eq!(c.server.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(c.upstream.max_connections, 64);
        assert_eq!(c.token.sid_claim, "sid");
        assert_eq!(c.token.sources.len(), 3);
        assert_eq!(
            c.session.store,
            StoreSpec::Embedded("./tessera-sessions".into())
        );
        assert_eq!(c.session.format, SessionFormat::Tessera);
        assert_eq!(c.credentials.active, "k1");
        assert!(!c.credentials.allow_plaintext_legacy);
    }

    #[test]
    fn unknown_key_is_named() {
        let text = format!("{}\n[server]\nlisen = \"x\"\n", minimal());
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(err.contains("lisen"), "{err}");
    }

    #[test]
    fn missing_env_secret_names_key_and_variable() {
        let text = minimal().replace("env:SECRET", "env:NOPE");
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(
            err.contains("token.secret") && err.contains("NOPE"),
            "{err}"
        );
    }

    #[test]
    fn short_hmac_secret_rejected() {
        let text = minimal().replace("env:SECRET", "tooshort");
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(err.contains("token.secret") && err.contains("64"), "{err}");
    }

    #[test]
    fn bad_sealing_key_length_rejected() {
        let text = minimal().replace("env:KEY", "AAAA");
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(
            err.contains("credentials.keys.k1") && err.contains("32"),
            "{err}"
        );
    }

    #[test]
    fn active_must_name_a_key() {
        let text = format!("{}active = \"k2\"\n", minimal());
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(err.contains("credentials.active"), "{err}");
    }

    #[test]
    fn bad_store_and_scheme_rejected() {
        let text = format!("{}[session]\nstore = \"memcached://x\"\n", minimal());
        assert!(Config::from_toml_with(&text, env)
            .unwrap_err()
            .to_string()
            .contains("session.store"));
        let text = minimal().replace("http://127.0.0.1:9", "ftp://x");
        assert!(Config::from_toml_with(&text, env)
            .unwrap_err()
            .to_string()
            .contains("upstream.url"));
    }

    #[test]
    fn file_secret_trailing_newline_removed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        std::fs::write(&p, format!("{}\n", "x".repeat(64))).unwrap();
        let v = resolve_secret("k", &format!("file:{}", p.display()), &env).unwrap();
        assert_eq!(v.len(), 64);
    }
}
