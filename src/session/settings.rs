//! `[session]`: which session store and record format, as validated by `config`.

use std::path::PathBuf;
use std::time::Duration;

/// Where sessions live. Its `Debug` shows URLs through [`redacted_url`].
#[derive(Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// `embedded:PATH` — SQLite file in WAL mode (shared safely by `serve` and the CLI).
    Embedded(PathBuf),
    /// `redis://...`, `redis+sentinel://...` or `redis+cluster://...` URL, each also as
    /// `rediss` (TLS).
    Redis(String),
    /// `postgres://...` or `postgresql://...` URL (libpq's form); with a [`SessionQuery`], the
    /// sessions are read from the application's own table instead of tessera's.
    Postgres(String, Option<SessionQuery>),
    /// `mysql://...` or `mariadb://...` URL.
    Mysql(String),
}

impl std::fmt::Debug for StoreSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Embedded(path) => f.debug_tuple("Embedded").field(path).finish(),
            Self::Redis(url) => f.debug_tuple("Redis").field(&redacted_url(url)).finish(),
            Self::Postgres(url, query) => f
                .debug_tuple("Postgres")
                .field(&redacted_url(url))
                .field(query)
                .finish(),
            Self::Mysql(url) => f.debug_tuple("Mysql").field(&redacted_url(url)).finish(),
        }
    }
}

/// `url` fit to show in an error or a `Debug`: everything before its last `@` (a password,
/// which may itself hold `/`, `?` or `@`) and its query (libpq's `?password=`) as `***`. Text
/// with no `://` is redacted the same way, so a mistyped `postgres:/user:pw@host` hides its
/// password too. Over-redacts rather than under: with a `?` before the last `@`, that `@` may
/// be in a query's password (`?password=ab@cd`), so all of it is hidden.
pub(crate) fn redacted_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), url),
    };
    let rest = match (rest.rfind('@'), rest.find('?')) {
        (Some(at), Some(query)) if query < at => "***".to_string(),
        (Some(at), _) => format!("***{}", &rest[at..]),
        (None, _) => rest.to_string(),
    };
    match rest.split_once('?') {
        Some((base, _)) => format!("{scheme}{base}?***"),
        None => format!("{scheme}{rest}"),
    }
}

/// Sessions kept in the application's own schema (`session.query`, PostgreSQL): tessera only
/// reads them, and writes nothing, not even its own tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionQuery {
    /// A `SELECT` given the session's key as `$1` (`{key_prefix}{sid}`), answering at most one
    /// row whose first column is the record (`bytea`, `text`, `json` or `jsonb`).
    pub query: String,
    /// The channel the application notifies with the changed key (`NOTIFY channel, 'key'`,
    /// `session.notify_channel`), which each instance listens on to keep its cache; `None`:
    /// no cache, every request reads the table.
    pub channel: Option<String>,
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
    /// How often the embedded and MySQL stores read their change log (`poll_interval_ms`,
    /// 1-1000 ms, default 25): a write by another process reaches this one's cache within about
    /// this long. Redis and PostgreSQL push their invalidations instead.
    pub poll_interval: Duration,
    /// Local session cache: entries (0 = no cache; default 100000), bytes (`cache_max_bytes`,
    /// default 64 MiB, at least 64 KiB; a session counts as the larger of its size, about
    /// 0.35 KiB, and `cache_max_bytes / cache_max_entries`), longest life of an entry
    /// (`cache_ttl_seconds`, default 300 s — a bound even if an invalidation were missed) and life
    /// of a remembered unknown sid (`negative_cache_ms`, default 1000 ms).
    pub cache: crate::session::CacheConfig,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_urls_are_shown_without_their_secrets() {
        let spec = StoreSpec::Postgres(
            "postgres://u:pw@db:5432/x?sslmode=require&password=pw2".into(),
            None,
        );
        let shown = format!("{spec:?}");
        assert!(!shown.contains("pw"), "{shown}");
        assert!(shown.contains("postgres://***@db:5432/x?***"), "{shown}");
        assert_eq!(redacted_url("postgres:/u:pw@db/x"), "***@db/x");
        assert_eq!(
            redacted_url("redis://127.0.0.1:6379/0"),
            "redis://127.0.0.1:6379/0"
        );
        assert_eq!(redacted_url("redis://:p@w@h/0"), "redis://***@h/0");
        assert_eq!(
            redacted_url("postgres://u:pa/ss@db/x"),
            "postgres://***@db/x"
        );
        // A `?` before the last `@`: a password in the userinfo or in the query, all hidden.
        assert_eq!(redacted_url("postgres://u:p?w@db/x"), "postgres://***");
        assert_eq!(
            redacted_url("postgres://db/x?password=ab@cdef"),
            "postgres://***"
        );
        assert_eq!(redacted_url("pg://u:pw@db/x?password=a@b&x=1"), "pg://***");
    }
}
