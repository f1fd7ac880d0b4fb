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

use crate::token::keys::{JwksConfig, JwksSource, KeyMaterial, KeySpec, Keys};
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
    /// TOML syntax error (the message names the line and column), or a wrong type or unknown key
    /// (the message names the dotted key and the fix, then the line).
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
    login: Option<RawLogin>,
    log: Option<RawLog>,
    metrics: Option<RawMetrics>,
    websocket: Option<RawWebSocket>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWebSocket {
    max_connections: Option<usize>,
    idle_timeout_ms: Option<u64>,
    allowed_origins: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    max_header_bytes: Option<usize>,
    max_uri_bytes: Option<usize>,
    max_body_bytes: Option<u64>,
    header_read_timeout_ms: Option<u64>,
    send_timeout_ms: Option<u64>,
    http2_max_concurrent_streams: Option<u32>,
    threads: Option<usize>,
    busy_poll_us: Option<u64>,
    trusted_proxies: Option<Vec<String>>,
    allow_encoded_slashes: Option<bool>,
    client_body_timeout_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    url: Option<String>,
    max_connections: Option<usize>,
    max_connections_per_user: Option<usize>,
    connect_timeout_ms: Option<u64>,
    response_header_timeout_ms: Option<u64>,
    idle_timeout_ms: Option<u64>,
    preserve_host: Option<bool>,
    strip_response_headers: Option<Vec<String>>,
    affinity: Option<String>,
    affinity_wait_ms: Option<u64>,
    drain_wait_ms: Option<u64>,
    drain_max_bytes: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawToken {
    algorithms: Option<Vec<String>>,
    secret: Option<String>,
    keys: Option<Vec<RawKey>>,
    active_kid: Option<String>,
    jwks: Option<String>,
    jwks_ca: Option<String>,
    jwks_refresh_seconds: Option<u64>,
    jwks_min_refresh_seconds: Option<u64>,
    cache_max_entries: Option<u64>,
    cache_hmac: Option<bool>,
    sources: Option<Vec<String>>,
    sid_claim: Option<String>,
    leeway_seconds: Option<u64>,
    issuer: Option<String>,
    audience: Option<String>,
    max_token_bytes: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    kid: Option<String>,
    alg: Option<String>,
    secret: Option<String>,
    public_key: Option<String>,
    private_key: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLogin {
    enabled: Option<bool>,
    path_prefix: Option<String>,
    verify_path: Option<String>,
    cookie_name: Option<String>,
    cookie_secure: Option<bool>,
    cookie_same_site: Option<String>,
    token_ttl_seconds: Option<u64>,
    max_failures_per_ip: Option<u32>,
    max_failures_per_user: Option<u32>,
    failure_window_seconds: Option<u64>,
    page_title: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSession {
    store: Option<String>,
    format: Option<String>,
    key_prefix: Option<String>,
    ttl_seconds: Option<u64>,
    timeout_ms: Option<u64>,
    cache_max_entries: Option<u64>,
    cache_max_bytes: Option<u64>,
    cache_ttl_seconds: Option<u64>,
    negative_cache_ms: Option<u64>,
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
struct RawMetrics {
    listen: Option<String>,
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
    /// Login/logout/session endpoints; `None` when `[login]` is absent or `enabled = false`.
    pub login: Option<LoginConfig>,
    /// Logging.
    pub log: LogConfig,
    /// The Prometheus endpoint; `None` when `[metrics]` is absent.
    pub metrics: Option<MetricsConfig>,
    /// WebSocket upgrades passed to the upstream.
    pub websocket: WebSocketConfig,
}

/// `[websocket]`: WebSocket upgrades (RFC 6455) passed through to the upstream after the
/// request is authenticated like any other.
#[derive(Debug, Clone)]
pub struct WebSocketConfig {
    /// Most WebSocket connections open at once; an upgrade beyond it is answered 503 with
    /// `Retry-After`. Each holds one of `upstream.max_connections` for its life, so it must stay
    /// below that cap (plain requests keep the rest). `0`: upgrades are not passed (the
    /// `Upgrade` field is dropped like any hop-by-hop field, as before). Default
    /// `upstream.max_connections / 2`.
    pub max_connections: usize,
    /// A WebSocket connection with no byte in either direction for this long is closed;
    /// `None` (`idle_timeout_ms = 0`): never. Default 600 s (10 minutes).
    pub idle_timeout: Option<Duration>,
    /// Origins (`scheme://host[:port]`, lowercase) allowed to open a WebSocket besides the
    /// request's own host: a browser sends cookies with a cross-site WebSocket handshake, so an
    /// upgrade whose `Origin` names another host is refused (403) unless listed here
    /// (cross-site WebSocket hijacking). A request without `Origin` (not a browser) is not
    /// checked. Default empty.
    pub allowed_origins: Vec<String>,
}

/// `[metrics]`.
#[derive(Debug, Clone)]
pub struct MetricsConfig {
    /// Address of the listener serving `GET /metrics` (OpenMetrics text), apart from
    /// `server.listen` so it can stay private. Required in `[metrics]`.
    pub listen: SocketAddr,
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
    /// HTTP/1.1: time a client has to send a request head, from its first byte (then 408 and
    /// close; on the fast path also for a buffered body); an idle keep-alive connection is closed
    /// after the same time. h2c: a connection with no request open for this time is sent
    /// GOAWAY, and dropped when idle for the same time again. Default 30 s.
    pub header_read_timeout: Duration,
    /// Longest a response waits for the client to take its next bytes (nginx's `send_timeout`,
    /// counted between two successive writes, not for the whole response). A write that the
    /// client's full socket buffer does not take for this long ends the connection with a reset
    /// (also a WebSocket tunnel's), and the response's upstream connection is closed (it was
    /// mid-body). HTTP/2: a stream whose client grants no flow-control window is cut once hyper
    /// has held its next bytes this long (checked every quarter of it): its body is dropped, the
    /// other streams go on. So a client that stops reading holds an upstream connection for
    /// about this long at most. Default 60 s.
    pub send_timeout: Duration,
    /// Most streams one h2c connection may have open at once, announced in the server's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` (RFC 9113 section 6.5.2; nginx's
    /// `http2_max_concurrent_streams`); a client that opens more has them refused with
    /// `REFUSED_STREAM`. 1..=1000. Default 200 (hyper's). Each open stream may hold an upstream
    /// connection, so one h2c connection asks for at most this many at once.
    pub http2_max_concurrent_streams: u32,
    /// Serving threads, each a single-threaded runtime that accepts from the shared listener and
    /// runs its connections start to finish (thread per core). Default: the number of CPUs.
    pub threads: usize,
    /// How long a serving thread checks its sockets for readiness before it sleeps (busy
    /// polling, `server.busy_poll_us`, 0..=1000 µs): lower latency at low load for a busy core
    /// between requests. Default 0 (off).
    pub busy_poll: Duration,
    /// Peers (addresses or CIDR blocks) whose `X-Forwarded-For` and `X-Forwarded-Proto` are
    /// believed: a load balancer or TLS terminator in front of tessera. For a request from one
    /// of them, the client is the rightmost `X-Forwarded-For` entry that is not itself trusted
    /// (nginx's `set_real_ip_from` + `real_ip_recursive on`). Default empty: every peer is the
    /// client, and client-sent forwarding headers are dropped.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Forward a path holding an encoded slash (`%2F`, `%5C`, their overlong and full-width
    /// forms) or a backslash outside a dot segment, instead of refusing it with 400 (false,
    /// the default, as Tomcat and Apache's `AllowEncodedSlashes Off`). Dot segments in any
    /// encoding are refused either way (`screen::path`).
    pub allow_encoded_slashes: bool,
    /// Longest wait between two reads of a request body (nginx's `client_body_timeout`): a
    /// body that stalls this long ends its request with 408 and closes its upstream connection.
    /// Default 60 s.
    pub client_body_timeout: Duration,
}

/// `[upstream]`.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Base URL, `http://host:port` (an optional path prefix is prepended to every request path).
    pub url: http::Uri,
    /// Hard cap on open upstream connections (idle + busy); requests beyond it queue FIFO.
    /// Keep it at or below the upstream's own limit (Cyrus `maxchild`). Default 64.
    pub max_connections: usize,
    /// Most upstream connections one user (one upstream credential) or one HTTP/2 connection
    /// holds at once; its further requests wait for one of its own (see `upstream::share`).
    /// 1..=max_connections (equal: no bound). Default three quarters of `max_connections`,
    /// rounded up.
    pub max_connections_per_user: usize,
    /// TCP connect + HTTP handshake timeout. Default 5 s.
    pub connect_timeout: Duration,
    /// Longest wait for the upstream's response head with no request-body progress (pool queue
    /// included); past it -> 504. Default 60 s.
    pub response_header_timeout: Duration,
    /// Idle pooled connections older than this are closed; keep it below the upstream's
    /// keep-alive timeout (nginx: 75 s). A response's `Keep-Alive: timeout=N` shortens it for
    /// that connection (see `upstream::conn::H1::idle_limit`). Default 30 s.
    pub idle_timeout: Duration,
    /// Forward the client's `Host` (true, default) or the upstream URL's authority (false).
    pub preserve_host: bool,
    /// Response headers removed besides hop-by-hop ones. Default `["alt-svc"]`.
    pub strip_response_headers: Vec<http::HeaderName>,
    /// `"none"` (default: any idle connection serves any request) or `"session"`: a connection
    /// only carries requests with the same upstream credential, so it never carries two users'
    /// requests. At the cap, a request whose user holds its share waits up to
    /// `affinity_wait_ms` (0..=1000, default 5) for one of its own connections (see
    /// `upstream::pool` and BENCHMARKS.md, "Affinity without churn").
    pub affinity: crate::upstream::Affinity,
    /// Exchanges whose client went away, finished in the background so that their connection is
    /// kept: `drain_wait_ms` (0..=10000, default 250; 0 turns it off) bounds how young an
    /// exchange must be and how long its rest is read, `drain_max_bytes` (0..=16777216, default
    /// 65536; an error with `drain_wait_ms = 0`) how much of a body rest is read (see
    /// `upstream::pool`).
    pub drain: crate::upstream::Drain,
}

/// `[token]`.
#[derive(Clone)]
pub struct TokenConfig {
    /// Accepted JWS algorithms (pinned; the token's `alg` must be one of them). Default: the
    /// algorithms of the configured keys (`HS512` for `token.secret`), plus RS256, RS384, RS512,
    /// PS256, PS384, PS512, ES256, ES384 and EdDSA when `token.jwks` is set.
    pub algorithms: Vec<Algorithm>,
    /// Verification keys: the legacy `token.secret` (no `kid`, HMAC; bytes of the configured
    /// string, at least the hash size, RFC 7518 3.2) and every `[[token.keys]]` entry.
    pub keys: Vec<KeySpec>,
    /// `kid` of the key that signs tokens tessera issues. `None`: `token.secret` signs (no `kid`
    /// header), or nothing can sign when it is absent.
    pub active_kid: Option<String>,
    /// External identity provider's key set, when `token.jwks` is set.
    pub jwks: Option<JwksConfig>,
    /// Verified-token cache entries (0 = off). Default 100000. An entry lives until the token's
    /// `exp` + leeway, so a warm token costs a keyed hash and a lookup (about 0.3 µs), not a
    /// signature check (HS512 about 3 µs with its JSON, RS256/EdDSA 30-100 µs). About 0.16 KiB
    /// of RSS per cached token (BENCHMARKS.md).
    pub cache_max_entries: u64,
    /// Cache HS* tokens too (default true). With false, HS* tokens are verified on every request
    /// (about 2.8 µs more per warm request in benches/hot_path.rs, 1.2-1.3x fewer req/s in
    /// bench/ab.sh) and only RS*/PS*/ES*/EdDSA tokens are cached.
    pub cache_hmac: bool,
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
            .field("keys", &self.keys)
            .field("active_kid", &self.active_kid)
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
    /// Local session cache: entries (0 = no cache; default 100000), bytes (`cache_max_bytes`,
    /// default 64 MiB, at least 64 KiB; a session counts as the larger of its size, about
    /// 0.35 KiB, and `cache_max_bytes / cache_max_entries`), longest life of an entry
    /// (`cache_ttl_seconds`, default 300 s — a bound even if an invalidation were missed) and life
    /// of a remembered unknown sid (`negative_cache_ms`, default 1000 ms).
    pub cache: crate::session::CacheConfig,
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

/// `SameSite` attribute of the login cookie (RFC 6265bis 4.1.2.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SameSite {
    /// Never sent on cross-site requests (the default).
    Strict,
    /// Sent on top-level cross-site navigations (links into the app from mail).
    Lax,
    /// Always sent (requires `Secure`).
    None,
}

impl SameSite {
    /// The attribute value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Strict => "Strict",
            Self::Lax => "Lax",
            Self::None => "None",
        }
    }
}

/// Longest `login.failure_window_seconds`: one week. A counter's expiry must stay a valid
/// Redis `EXPIRE` and SQLite integer.
const MAX_FAILURE_WINDOW_SECONDS: u64 = 7 * 24 * 3600;

/// `[login]`: the session side served by tessera itself.
#[derive(Debug, Clone)]
pub struct LoginConfig {
    /// Path prefix of the endpoints (`{prefix}/login`, `/logout`, `/session`). Default `/auth`.
    pub path_prefix: String,
    /// Upstream path that must answer 2xx to a `GET` with the user's `Basic` credentials for a
    /// login to succeed, and 401/403 otherwise (Cyrus JMAP: `/jmap/`). Required.
    pub verify_path: http::uri::PathAndQuery,
    /// Name of the cookie holding the token. Default `__Host-tessera` (RFC 6265bis 4.1.3.2:
    /// Secure, Path=/, no Domain), or `tessera` when `cookie_secure = false`.
    pub cookie_name: String,
    /// `Secure` attribute. Default true; false only for local http development, and then the
    /// cookie name must not start with `__Host-`/`__Secure-`.
    pub cookie_secure: bool,
    /// `SameSite` attribute. Default `Strict`.
    pub cookie_same_site: SameSite,
    /// Lifetime of issued tokens, seconds; never longer than the session. Default
    /// `session.ttl_seconds`.
    pub token_ttl_seconds: u64,
    /// Failed logins allowed per client address per window before 429. Default 20.
    pub max_failures_per_ip: u32,
    /// Failed logins allowed per user name per window before 429. Default 20.
    pub max_failures_per_user: u32,
    /// The window the failure counts refill over, seconds: per instance one failure is forgiven
    /// every window / max; the count every instance shares in the store lasts one window from
    /// its first failure. Default 300.
    pub failure_window: Duration,
    /// Heading and `<title>` of the login page. Default `Sign in`.
    pub page_title: String,
}

/// `[log]`.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// `tracing` filter directive. Default `info`.
    pub level: String,
    /// Emit one access line per request on target `tessera::access` (written only when `level`
    /// lets that target through at INFO; see `src/access_log.rs`). Default true.
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
        let raw = parse_raw(text).map_err(FromTomlError::Parse)?;
        validate(raw, &env).map_err(FromTomlError::Invalid)
    }
}

/// Deserializes the file's tables. A syntax error is toml's message as it is (line, column and
/// the line itself). A wrong-typed value or an unknown key is led by a line naming the dotted
/// key and the fix, e.g. ``config key `upstream.idle_timeout_ms`: must be a whole number of
/// milliseconds, without quotes``, followed by toml's message.
fn parse_raw(text: &str) -> Result<RawConfig, String> {
    let document = toml::Deserializer::parse(text).map_err(|e| e.to_string())?;
    serde_path_to_error::deserialize(document).map_err(|e| {
        let key = e.path().to_string();
        let error = e.into_inner();
        format!(
            "config key `{key}`: {}\n{error}",
            type_fix(&key, error.message())
        )
    })
}

/// The fix for serde's message about `key` (serde's wording: "invalid type: string \"5s\",
/// expected u64", "unknown field `x`, expected one of ..."), in one sentence.
fn type_fix(key: &str, message: &str) -> String {
    // The keys that are arrays of tables (`Vec` of a struct in the `Raw*` types).
    const ARRAYS_OF_TABLES: [&str; 1] = ["token.keys"];
    let expected = message.rsplit("expected ").next().unwrap_or("");
    let unit = [
        ("_ms", " of milliseconds"),
        ("_us", " of microseconds"),
        ("_seconds", " of seconds"),
        ("_bytes", " of bytes"),
    ]
    .into_iter()
    .find(|(suffix, _)| key.ends_with(suffix))
    .map_or("", |(_, unit)| unit);
    // An entry of an array of tables (`token.keys[0]`) is written `[[token.keys]]`.
    let entry_of = key
        .strip_suffix(']')
        .and_then(|k| k.rsplit_once('['))
        .map(|(array, _)| array);
    if message.starts_with("unknown field") {
        "is unknown here; check its spelling and its table against the keys listed below \
         and the configuration reference in README.md"
            .to_string()
    } else if ["u8", "u16", "u32", "u64", "usize"].contains(&expected) {
        // No range: the type's is not the key's, whose own bounds are checked after this.
        format!("must be a whole number{unit}, without quotes")
    } else if ARRAYS_OF_TABLES.contains(&key) {
        format!(
            "must be an array of tables: one `[[{key}]]` block per entry, with its keys below it"
        )
    } else if let (true, Some(array)) = (expected.starts_with("struct "), entry_of) {
        format!("must be a table: a `[[{array}]]` block with its keys below it")
    } else if expected.starts_with("struct ") {
        format!("must be a table: a `[{key}]` line with its keys below it")
    } else if expected == "a map" {
        format!(
            "must be a table: a `[{key}]` line with `name = \"value\"` lines below it, or \
             `{{ name = \"value\" }}`"
        )
    } else if expected == "a boolean" {
        "must be true or false, without quotes".to_string()
    } else if expected == "a string" {
        "must be a quoted string".to_string()
    } else if expected == "a sequence" && message.starts_with("invalid type: map") {
        "must be an array, not a table, e.g. [\"a\", \"b\"]".to_string()
    } else if expected == "a sequence" {
        "must be an array, e.g. [\"a\", \"b\"]".to_string()
    } else {
        "has the wrong type; see the configuration reference in README.md".to_string()
    }
}

/// Error from [`Config::from_toml`].
#[derive(Debug, thiserror::Error)]
pub enum FromTomlError {
    /// Syntax error (line and column), or a wrong type or unknown key (dotted key and fix, then
    /// the line); see `parse_raw`.
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

/// Longest `upstream.drain_wait_ms`: a drain holds a connection slot, so seconds at most.
const MAX_DRAIN_WAIT_MS: u64 = 10_000;
/// Largest `upstream.drain_max_bytes`: 16 MiB.
const MAX_DRAIN_BYTES: u64 = 16 * 1024 * 1024;

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
    let mut token = token;
    let login = match raw.login {
        Some(l) if l.enabled != Some(false) => Some(validate_login(l, &mut token, &session)?),
        _ => None,
    };
    let log = raw.log.unwrap_or_default();
    let websocket = validate_websocket(raw.websocket.unwrap_or_default(), &upstream)?;
    let metrics = raw
        .metrics
        .map(|m| validate_metrics(m, server.listen))
        .transpose()?;
    Ok(Config {
        server,
        upstream,
        token,
        session,
        credentials,
        login,
        log: LogConfig {
            level: log.level.unwrap_or_else(|| "info".into()),
            access_log: log.access_log.unwrap_or(true),
        },
        metrics,
        websocket,
    })
}

fn validate_websocket(
    w: RawWebSocket,
    upstream: &UpstreamConfig,
) -> Result<WebSocketConfig, ConfigError> {
    let cap = upstream.max_connections;
    let max_connections = w.max_connections.unwrap_or(cap / 2);
    if max_connections >= cap && max_connections > 0 {
        return Err(ConfigError::new(
            "websocket.max_connections",
            format!(
                "{max_connections} would let WebSockets hold every upstream connection \
                 (upstream.max_connections = {cap}); set it below {cap}, or 0 to pass no upgrades"
            ),
        ));
    }
    let mut allowed_origins = Vec::new();
    for (i, text) in w.allowed_origins.unwrap_or_default().iter().enumerate() {
        let key = format!("websocket.allowed_origins[{i}]");
        let origin = text.trim_end_matches('/').to_ascii_lowercase();
        // Browsers leave the scheme's default port out of `Origin`.
        let origin = match origin.strip_suffix(":443") {
            Some(o) if origin.starts_with("https://") => o.to_string(),
            _ => match origin.strip_suffix(":80") {
                Some(o) if origin.starts_with("http://") => o.to_string(),
                _ => origin,
            },
        };
        let ok = origin.parse::<http::Uri>().is_ok_and(|u| {
            matches!(u.scheme_str(), Some("http" | "https"))
                && u.authority().is_some_and(|a| !a.as_str().contains('@'))
                && u.path_and_query().is_none_or(|pq| pq.as_str() == "/")
        });
        if !ok {
            return Err(ConfigError::new(
                &key,
                format!("`{text}` is not an origin; write scheme://host[:port], e.g. \"https://mail.example.com\""),
            ));
        }
        allowed_origins.push(origin);
    }
    let idle_timeout = match w.idle_timeout_ms.unwrap_or(600_000) {
        0 => None,
        n => Some(Duration::from_millis(n)),
    };
    Ok(WebSocketConfig {
        max_connections,
        idle_timeout,
        allowed_origins,
    })
}

fn validate_metrics(
    m: RawMetrics,
    server_listen: SocketAddr,
) -> Result<MetricsConfig, ConfigError> {
    let Some(text) = m.listen else {
        return Err(ConfigError::new(
            "metrics.listen",
            "missing: set the address to serve /metrics on, e.g. \"127.0.0.1:9464\", or remove [metrics]",
        ));
    };
    let listen = socket_addr("metrics.listen", &text, "127.0.0.1:9464")?;
    if listen == server_listen && listen.port() != 0 {
        return Err(ConfigError::new(
            "metrics.listen",
            "is the same address as server.listen; give the metrics their own port",
        ));
    }
    Ok(MetricsConfig { listen })
}

/// `text` as IP:PORT, or an error naming `key` with `example`.
fn socket_addr(key: &str, text: &str, example: &str) -> Result<SocketAddr, ConfigError> {
    text.parse()
        .map_err(|_| ConfigError::new(key, format!("`{text}` is not IP:PORT, e.g. \"{example}\"")))
}

fn validate_server(s: RawServer) -> Result<ServerConfig, ConfigError> {
    let listen = s.listen.as_deref().unwrap_or("127.0.0.1:8080");
    let listen = socket_addr("server.listen", listen, "127.0.0.1:8080")?;
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
    let threads = match s.threads {
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        Some(n @ 1..=1024) => n,
        Some(_) => {
            return Err(ConfigError::new(
                "server.threads",
                "must be between 1 and 1024 (leave it out for one per CPU)",
            ))
        }
    };
    let busy_poll_us = s.busy_poll_us.unwrap_or(0);
    if busy_poll_us > crate::busy_poll::MAX_BUSY_POLL_US {
        return Err(ConfigError::new(
            "server.busy_poll_us",
            format!(
                "must be between 0 (off, the default) and {} microseconds",
                crate::busy_poll::MAX_BUSY_POLL_US
            ),
        ));
    }
    let mut trusted_proxies = Vec::new();
    for (i, text) in s.trusted_proxies.unwrap_or_default().iter().enumerate() {
        let net = text
            .parse::<ipnet::IpNet>()
            .or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| {
                ConfigError::new(
                    &format!("server.trusted_proxies[{i}]"),
                    format!(
                        "`{text}` is not an IP address or CIDR block, e.g. \"10.0.0.0/8\" or \"::1\""
                    ),
                )
            })?;
        if let ipnet::IpNet::V6(v6) = net {
            if v6.network().to_ipv4_mapped().is_some() {
                return Err(ConfigError::new(
                    &format!("server.trusted_proxies[{i}]"),
                    format!(
                        "`{text}` is IPv4-mapped; write it as IPv4 (peers are matched as IPv4)"
                    ),
                ));
            }
        }
        trusted_proxies.push(net);
    }
    Ok(ServerConfig {
        listen,
        threads,
        trusted_proxies,
        busy_poll: Duration::from_micros(busy_poll_us),
        max_header_bytes,
        max_uri_bytes,
        max_body_bytes: s.max_body_bytes.unwrap_or(0),
        header_read_timeout: ms(
            "server.header_read_timeout_ms",
            s.header_read_timeout_ms,
            30_000,
        )?,
        send_timeout: ms("server.send_timeout_ms", s.send_timeout_ms, 60_000)?,
        client_body_timeout: ms(
            "server.client_body_timeout_ms",
            s.client_body_timeout_ms,
            60_000,
        )?,
        allow_encoded_slashes: s.allow_encoded_slashes.unwrap_or(false),
        http2_max_concurrent_streams: match s.http2_max_concurrent_streams {
            None => 200,
            Some(n @ 1..=1000) => n,
            Some(_) => {
                return Err(ConfigError::new(
                    "server.http2_max_concurrent_streams",
                    "must be between 1 and 1000 (leave it out for 200)",
                ))
            }
        },
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
    let max_connections_per_user = match u.max_connections_per_user {
        None => crate::upstream::default_per_user(max_connections),
        Some(n) if (1..=max_connections).contains(&n) => n,
        Some(n) => {
            return Err(ConfigError::new(
                "upstream.max_connections_per_user",
                format!(
                    "must be between 1 and upstream.max_connections ({max_connections}), not {n} \
                     (leave it out for {})",
                    crate::upstream::default_per_user(max_connections)
                ),
            ))
        }
    };
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
    let affinity = match (u.affinity.as_deref().unwrap_or("none"), u.affinity_wait_ms) {
        ("none", None) => crate::upstream::Affinity::None,
        ("none", Some(_)) => {
            return Err(ConfigError::new(
                "upstream.affinity_wait_ms",
                "applies only with affinity = \"session\"; remove it or set affinity = \"session\"",
            ))
        }
        ("session", wait) => match wait {
            Some(ms) if ms > 1000 => {
                return Err(ConfigError::new(
                    "upstream.affinity_wait_ms",
                    format!("must be between 0 (never wait) and 1000 milliseconds, not {ms} (leave it out for 5)"),
                ))
            }
            wait => crate::upstream::Affinity::Session {
                wait: wait.map_or(crate::upstream::AFFINITY_WAIT, Duration::from_millis),
                stale: crate::upstream::AFFINITY_STALE,
            },
        },
        (other, _) => {
            return Err(ConfigError::new(
                "upstream.affinity",
                format!("`{other}` is not an affinity; use \"none\" or \"session\""),
            ))
        }
    };
    let drain = crate::upstream::Drain {
        wait: match u.drain_wait_ms {
            None => crate::upstream::DRAIN_WAIT,
            Some(ms) if ms <= MAX_DRAIN_WAIT_MS => Duration::from_millis(ms),
            Some(ms) => {
                return Err(ConfigError::new(
                    "upstream.drain_wait_ms",
                    format!(
                        "must be between 0 (close at once) and {MAX_DRAIN_WAIT_MS} milliseconds, not {ms} (leave it out for {})",
                        crate::upstream::DRAIN_WAIT.as_millis()
                    ),
                ))
            }
        },
        max_bytes: match u.drain_max_bytes {
            None => crate::upstream::DRAIN_BYTES,
            Some(n) if n <= MAX_DRAIN_BYTES => n,
            Some(n) => {
                return Err(ConfigError::new(
                    "upstream.drain_max_bytes",
                    format!(
                        "must be between 0 and {MAX_DRAIN_BYTES} bytes (16 MiB), not {n} (leave it out for {})",
                        crate::upstream::DRAIN_BYTES
                    ),
                ))
            }
        },
    };
    if drain.wait.is_zero() && u.drain_max_bytes.is_some() {
        return Err(ConfigError::new(
            "upstream.drain_max_bytes",
            "has no effect with drain_wait_ms = 0 (drains off); remove it or set drain_wait_ms \
             above 0",
        ));
    }
    Ok(UpstreamConfig {
        url,
        max_connections,
        max_connections_per_user,
        affinity,
        drain,
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

fn parse_alg(key: &str, name: &str) -> Result<Algorithm, ConfigError> {
    Algorithm::parse(name).ok_or_else(|| {
        ConfigError::new(
            key,
            format!("`{name}` is not supported; use one of HS256 HS384 HS512 RS256 RS384 RS512 PS256 PS384 PS512 ES256 ES384 EdDSA"),
        )
    })
}

fn validate_token(
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

fn validate_login(
    l: RawLogin,
    token: &mut TokenConfig,
    session: &SessionConfig,
) -> Result<LoginConfig, ConfigError> {
    let prefix = l.path_prefix.unwrap_or_else(|| "/auth".into());
    if !prefix.starts_with('/')
        || prefix.len() < 2
        || prefix.ends_with('/')
        || prefix.contains(['?', '#', ' '])
    {
        return Err(ConfigError::new(
            "login.path_prefix",
            format!("`{prefix}` must be an absolute path without trailing `/`, e.g. \"/auth\""),
        ));
    }
    // No default: many upstreams answer 2xx to `GET /` without credentials, and then any
    // password would log in.
    let verify = l.verify_path.ok_or_else(|| {
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
    let cookie_secure = l.cookie_secure.unwrap_or(true);
    let cookie_name = l.cookie_name.unwrap_or_else(|| {
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
    let source = TokenSource::Cookie(cookie_name.clone());
    if !token.sources.contains(&source) {
        token.sources.push(source);
    }
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
        page_title: l.page_title.unwrap_or_else(|| "Sign in".into()),
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
    fn server_threads_default_to_the_cpus_and_are_bounded() {
        let c = Config::from_toml_with(&minimal(), env).unwrap();
        assert!(c.server.threads >= 1);
        let text = format!("{}[server]\nthreads = 3\n", minimal());
        assert_eq!(
            Config::from_toml_with(&text, env).unwrap().server.threads,
            3
        );
        let text = format!("{}[server]\nthreads = 0\n", minimal());
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(err.contains("server.threads"), "{err}");
    }

    #[test]
    fn http2_streams_default_to_200_and_are_bounded() {
        let streams = |extra: &str| {
            Config::from_toml_with(&format!("{}[server]\n{extra}", minimal()), env)
                .map(|c| c.server.http2_max_concurrent_streams)
                .map_err(|e| e.to_string())
        };
        assert_eq!(streams(""), Ok(200));
        assert_eq!(streams("http2_max_concurrent_streams = 16\n"), Ok(16));
        for bad in ["0", "1001"] {
            let err = streams(&format!("http2_max_concurrent_streams = {bad}\n")).unwrap_err();
            assert!(
                err.contains("server.http2_max_concurrent_streams") && err.contains("1000"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn metrics_are_off_by_default_and_need_their_own_address() {
        assert!(Config::from_toml_with(&minimal(), env)
            .unwrap()
            .metrics
            .is_none());
        let with =
            |body: &str| Config::from_toml_with(&format!("{}[metrics]\n{body}", minimal()), env);
        assert_eq!(
            with("listen = \"127.0.0.1:9464\"\n")
                .unwrap()
                .metrics
                .unwrap()
                .listen
                .to_string(),
            "127.0.0.1:9464"
        );
        for (body, says) in [
            ("", "missing"),
            ("listen = \"9464\"\n", "not IP:PORT"),
            (
                "listen = \"127.0.0.1:8080\"\n",
                "same address as server.listen",
            ),
        ] {
            let err = with(body).unwrap_err().to_string();
            assert!(
                err.contains("metrics.listen") && err.contains(says),
                "{body:?}: {err}"
            );
        }
        let err = with("listen = \"127.0.0.1:9464\"\nport = 1\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("port"), "unknown key: {err}");
    }

    #[test]
    fn jwks_urls_and_their_ca_file_are_checked_at_load() {
        let with = |token: &str| {
            Config::from_toml_with(
                &format!("[upstream]\nurl = \"http://127.0.0.1:9\"\n[token]\n{token}\n[credentials]\nkeys = {{ k1 = \"env:KEY\" }}\n"),
                env,
            )
        };
        let not_pem = std::env::temp_dir().join(format!("tessera-not-pem-{}", std::process::id()));
        std::fs::write(&not_pem, "not a certificate\n").unwrap();
        let not_pem = not_pem.display().to_string();
        for (token, key, says) in [
            ("jwks = \"ftp://idp/jwks.json\"", "token.jwks", "is none of"),
            ("jwks = \"https:///jwks.json\"", "token.jwks", "jwks.json"),
            (
                "jwks = \"https://u:p@idp/jwks.json\"",
                "token.jwks",
                "user:password",
            ),
            (
                "secret = \"env:SECRET\"\njwks_ca = \"file:/etc/hosts\"",
                "token.jwks_ca",
                "only used with an \"https://\"",
            ),
            (
                "jwks = \"http://127.0.0.1:9/j\"\njwks_ca = \"file:/etc/hosts\"",
                "token.jwks_ca",
                "only used with an \"https://\"",
            ),
            (
                "jwks = \"https://idp/j\"\njwks_ca = \"/etc/ca.pem\"",
                "token.jwks_ca",
                "is not \"file:PATH\"",
            ),
            (
                "jwks = \"https://idp/j\"\njwks_ca = \"file:/nonexistent/ca.pem\"",
                "token.jwks_ca",
                "cannot read CA certificates",
            ),
            (
                &format!("jwks = \"https://idp/j\"\njwks_ca = \"file:{not_pem}\""),
                "token.jwks_ca",
                "holds no usable CA certificate",
            ),
        ] {
            let err = with(token).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(says), "{token}: {err}");
        }
        let c = with("jwks = \"http://127.0.0.1:9/jwks.json\"").unwrap();
        assert!(matches!(
            c.token.jwks.unwrap().source,
            JwksSource::Url(_, None)
        ));
        std::fs::remove_file(&not_pem).unwrap();
    }

    #[test]
    fn websocket_defaults_limits_and_origins() {
        let c = Config::from_toml_with(&minimal(), env).unwrap();
        assert_eq!(
            c.websocket.max_connections, 32,
            "half of upstream.max_connections"
        );
        assert_eq!(c.websocket.idle_timeout, Some(Duration::from_secs(600)));
        assert!(c.websocket.allowed_origins.is_empty());
        let with = |lines: &str| {
            Config::from_toml_with(&format!("{}[websocket]\n{lines}\n", minimal()), env)
        };
        let c = with("max_connections = 0\nidle_timeout_ms = 0\nallowed_origins = [\"https://Mail.Example.com:443/\", \"http://127.0.0.1:8080\"]").unwrap();
        assert_eq!(c.websocket.max_connections, 0);
        assert_eq!(c.websocket.idle_timeout, None);
        assert_eq!(
            c.websocket.allowed_origins,
            ["https://mail.example.com", "http://127.0.0.1:8080"]
        );
        let err = with("max_connections = 64").unwrap_err().to_string();
        assert!(
            err.contains("websocket.max_connections") && err.contains("below 64"),
            "{err}"
        );
        for bad in [
            "mail.example.com",
            "https://mail.example.com/inbox",
            "ftp://a",
            "https://u@a",
        ] {
            let err = with(&format!("allowed_origins = [\"https://ok\", \"{bad}\"]"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("websocket.allowed_origins[1]")
                    && err.contains("scheme://host[:port]"),
                "{bad}: {err}"
            );
        }
        let err = with("max_conections = 1").unwrap_err().to_string();
        assert!(err.contains("max_conections"), "unknown key: {err}");
    }

    #[test]
    fn trusted_proxies_are_addresses_or_cidr_blocks_and_none_by_default() {
        let c = Config::from_toml_with(&minimal(), env).unwrap();
        assert!(c.server.trusted_proxies.is_empty());
        let text = format!(
            "{}[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"::1\", \"192.0.2.7\"]\n",
            minimal()
        );
        let nets = Config::from_toml_with(&text, env)
            .unwrap()
            .server
            .trusted_proxies;
        let shown: Vec<String> = nets.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["10.0.0.0/8", "::1/128", "192.0.2.7/32"]);
        for (bad, says) in [
            ("10.0.0.0/33", "e.g. \"10.0.0.0/8\""),
            ("lb.internal", "e.g. \"10.0.0.0/8\""),
            ("", "e.g. \"10.0.0.0/8\""),
            ("::ffff:10.0.0.0/104", "write it as IPv4"),
        ] {
            let text = format!(
                "{}[server]\ntrusted_proxies = [\"127.0.0.1\", \"{bad}\"]\n",
                minimal()
            );
            let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
            assert!(err.contains("server.trusted_proxies[1]"), "{bad}: {err}");
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn busy_polling_is_off_by_default_and_bounded() {
        let c = Config::from_toml_with(&minimal(), env).unwrap();
        assert_eq!(c.server.busy_poll, Duration::ZERO);
        let text = format!("{}[server]\nbusy_poll_us = 50\n", minimal());
        assert_eq!(
            Config::from_toml_with(&text, env).unwrap().server.busy_poll,
            Duration::from_micros(50)
        );
        let text = format!("{}[server]\nbusy_poll_us = 1000\n", minimal());
        assert!(Config::from_toml_with(&text, env).is_ok());
        let text = format!("{}[server]\nbusy_poll_us = 1001\n", minimal());
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(err.contains("server.busy_poll_us"), "{err}");
    }

    #[test]
    fn send_timeout_defaults_to_a_minute_and_is_never_zero() {
        let c = Config::from_toml_with(&minimal(), env).unwrap();
        assert_eq!(c.server.send_timeout, Duration::from_secs(60));
        let text = format!("{}[server]\nsend_timeout_ms = 1500\n", minimal());
        assert_eq!(
            Config::from_toml_with(&text, env)
                .unwrap()
                .server
                .send_timeout,
            Duration::from_millis(1500)
        );
        let text = format!("{}[server]\nsend_timeout_ms = 0\n", minimal());
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(
            err.contains("server.send_timeout_ms") && err.contains("greater than 0"),
            "{err}"
        );
    }

    /// The `[upstream]` table of [`minimal`] with `lines` added, or the error's text.
    fn upstream_with(lines: &str) -> Result<UpstreamConfig, String> {
        let text = minimal().replace("[token]", &format!("{lines}\n[token]"));
        Config::from_toml_with(&text, env)
            .map(|c| c.upstream)
            .map_err(|e| e.to_string())
    }

    /// Each `(lines, key, says)`: `[upstream]` with `lines` is refused, naming `key` and saying
    /// `says`.
    fn rejected(cases: &[(&str, &str, &str)]) {
        for (lines, key, says) in cases {
            let err = upstream_with(lines)
                .err()
                .unwrap_or_else(|| panic!("{lines}: accepted"));
            assert!(err.contains(key) && err.contains(says), "{lines}: {err}");
        }
    }

    #[test]
    fn upstream_affinity_is_none_or_session() {
        let c = Config::from_toml_with(&minimal(), env).unwrap();
        assert_eq!(c.upstream.affinity, crate::upstream::Affinity::None);
        let with = |lines: &str| upstream_with(lines).map(|u| u.affinity);
        let session = |ms| crate::upstream::Affinity::Session {
            wait: Duration::from_millis(ms),
            stale: crate::upstream::AFFINITY_STALE,
        };
        assert_eq!(with("affinity = \"session\""), Ok(session(5)));
        assert_eq!(
            with("affinity = \"session\"\naffinity_wait_ms = 0"),
            Ok(session(0))
        );
        assert_eq!(
            with("affinity = \"session\"\naffinity_wait_ms = 1000"),
            Ok(session(1000))
        );
        rejected(&[
            ("affinity = \"user\"", "upstream.affinity", "\"session\""),
            (
                "affinity = \"session\"\naffinity_wait_ms = 1001",
                "upstream.affinity_wait_ms",
                "1000",
            ),
            (
                "affinity_wait_ms = 5",
                "upstream.affinity_wait_ms",
                "affinity = \"session\"",
            ),
        ]);
    }

    #[test]
    fn upstream_drain_settings_default_bound_and_turn_off() {
        use crate::upstream::Drain;
        let with = |lines: &str| upstream_with(lines).map(|u| u.drain);
        let drain = |ms, max_bytes| Drain {
            wait: Duration::from_millis(ms),
            max_bytes,
        };
        assert_eq!(with(""), Ok(drain(250, 65_536)));
        assert_eq!(with("drain_wait_ms = 0"), Ok(drain(0, 65_536)));
        assert_eq!(
            with("drain_wait_ms = 10000\ndrain_max_bytes = 16777216"),
            Ok(drain(10_000, 16_777_216))
        );
        assert_eq!(with("drain_max_bytes = 0"), Ok(drain(250, 0)));
        rejected(&[
            ("drain_wait_ms = 10001", "upstream.drain_wait_ms", "10000"),
            (
                "drain_max_bytes = 16777217",
                "upstream.drain_max_bytes",
                "16 MiB",
            ),
            (
                "drain_wait_ms = 0\ndrain_max_bytes = 100",
                "upstream.drain_max_bytes",
                "remove it or set drain_wait_ms above 0",
            ),
        ]);
    }

    #[test]
    fn session_cache_is_bounded_by_entries_and_bytes() {
        let c = Config::from_toml_with(&minimal(), env).unwrap();
        assert_eq!(c.session.cache.max_entries, 100_000);
        assert_eq!(c.session.cache.max_bytes, 64 << 20);
        assert!(c.token.cache_hmac, "HS* tokens are cached by default");
        let text = format!("{}[session]\ncache_max_bytes = 1048576\n", minimal());
        let c = Config::from_toml_with(&text, env).unwrap();
        assert_eq!(c.session.cache.max_bytes, 1 << 20);
        let text = format!("{}[session]\ncache_max_bytes = 65535\n", minimal());
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(err.contains("session.cache_max_bytes"), "{err}");
    }

    #[test]
    fn unknown_key_is_named() {
        let text = format!("{}\n[server]\nlisen = \"x\"\n", minimal());
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(
            err.starts_with("config key `server.lisen`: is unknown here; check its spelling"),
            "{err}"
        );
        // toml's own message follows, with the line and the keys this table has.
        assert!(err.contains("line 9") && err.contains("`listen`"), "{err}");
    }

    /// A value of the wrong type is led by its dotted key and the fix, then toml's line.
    #[test]
    fn wrong_typed_values_name_the_key_and_the_fix() {
        let cases = [
            (
                "[upstream]\nidle_timeout_ms = -1\n",
                "config key `upstream.idle_timeout_ms`: must be a whole number of milliseconds, \
                 without quotes\n",
            ),
            (
                "[upstream]\ndrain_wait_ms = \"250ms\"\n",
                "config key `upstream.drain_wait_ms`: must be a whole number of milliseconds",
            ),
            (
                "[login]\nmax_failures_per_ip = 5000000000\n",
                "config key `login.max_failures_per_ip`: must be a whole number, without \
                 quotes\n",
            ),
            (
                "[upstream]\npreserve_host = \"yes\"\n",
                "config key `upstream.preserve_host`: must be true or false, without quotes",
            ),
            (
                "[server]\nlisten = 8080\n",
                "config key `server.listen`: must be a quoted string",
            ),
            (
                "[token]\nalgorithms = \"HS256\"\n",
                "config key `token.algorithms`: must be an array",
            ),
            (
                "[[token.keys]]\nkid = \"a\"\nalg = 5\n",
                "config key `token.keys[0].alg`: must be a quoted string",
            ),
            (
                "log = 5\n",
                "config key `log`: must be a table: a `[log]` line with its keys below it",
            ),
            (
                "[token]\nkeys = [5]\n",
                "config key `token.keys[0]`: must be a table: a `[[token.keys]]` block with its \
                 keys below it",
            ),
            (
                "[token.keys]\nkid = \"a\"\n",
                "config key `token.keys`: must be an array of tables: one `[[token.keys]]` \
                 block per entry, with its keys below it",
            ),
            (
                "[token]\nkeys = \"a\"\n",
                "config key `token.keys`: must be an array of tables: one `[[token.keys]]`",
            ),
            (
                "[server.trusted_proxies]\na = 1\n",
                "config key `server.trusted_proxies`: must be an array, not a table, e.g. \
                 [\"a\", \"b\"]",
            ),
            (
                "[credentials]\nkeys = 5\n",
                "config key `credentials.keys`: must be a table: a `[credentials.keys]` line \
                 with `name = \"value\"` lines below it, or `{ name = \"value\" }`",
            ),
            (
                "[server]\nbusy_poll_us = true\n",
                "config key `server.busy_poll_us`: must be a whole number of microseconds",
            ),
        ];
        for (text, want) in cases {
            // Types are checked before any value is validated, so the rest may be missing.
            let err = Config::from_toml_with(text, env).unwrap_err().to_string();
            assert!(err.starts_with(want), "{text}\n{err}");
            assert!(err.contains("TOML parse error at line "), "{err}");
        }
        // A syntax error has no key to name: toml's message alone.
        let err = Config::from_toml_with("[upstream\n", env)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("TOML parse error at line 1"), "{err}");
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
