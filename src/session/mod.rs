//! The resolve and unseal phases: session id -> session record -> ready upstream credential.
//!
//! Owns the record formats (`tessera`, `hyper-auth-proxy`, [`record`]) and session creation and
//! revocation ([`lifecycle`]); the local cache ([`cache`]) is kept true by the store's
//! invalidations ([`invalidate`]). Must never: return or log plaintext credentials except as the
//! sensitive header value, or turn a store failure into "unknown session" (that would be a 401
//! where 503 is true).

use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use sha2::{Digest, Sha256};

use crate::seal::{Credentials, Sealer};
use crate::unix_now;

mod cache;
mod follow;
mod invalidate;
mod lifecycle;
mod record;
mod settings;
pub mod store;
mod streams;

pub use cache::CacheConfig;
use cache::{Cached, SessionCache};
pub(crate) use invalidate::LOGIN_FAILURES;
pub use lifecycle::{Created, Listed, ResealReport, Revoked};
use record::Record;
pub(crate) use settings::redacted_url;
pub use settings::{SessionConfig, SessionFormat, SessionQuery, StoreSpec};
pub use store::{Invalidation, Store, StoreError};
use streams::OpenStreams;
use streams::Revocable;
pub use streams::{Ended, Watch};

/// A resolved session, ready to inject.
#[derive(Debug, Clone)]
pub struct Session {
    /// The upstream user, when the record names it.
    pub sub: Option<String>,
    /// `Basic base64(user:password)`, marked sensitive.
    pub authorization: HeaderValue,
    /// Expiry, seconds since the Unix epoch, when the record has it.
    pub expires_at: Option<u64>,
    /// The change epoch of the sid's bucket taken before the store read that produced this
    /// session (see `streams.rs`: a response registering later re-reads the session if it moved).
    pub(crate) read_epoch: u64,
    /// This user's share of the upstream pool, looked up at the session's first request and
    /// kept, so later requests skip the lookup (`upstream::share`).
    pub upstream_share: std::sync::OnceLock<Option<std::sync::Arc<crate::share::Share>>>,
}

/// Why a session could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// No record for this sid (never created, revoked or expired). 401.
    #[error("unknown session")]
    Unknown,
    /// A record exists but cannot be used (bad JSON, plaintext not allowed, unseal failed). 401.
    #[error("unusable session record: {0}")]
    Corrupt(&'static str),
    /// The store did not answer in time or failed. 503.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Session operations over one store and one sealing key set.
#[derive(Clone)]
pub struct Sessions {
    store: Store,
    sealer: Arc<Sealer>,
    format: SessionFormat,
    key_prefix: String,
    timeout: Duration,
    allow_plaintext_legacy: bool,
    cache: Option<Arc<SessionCache>>,
    /// Records read by [`Sessions::resolve`] without the cache (absent, or bypassed while the
    /// invalidation stream is down), for metrics; shared by clones. Cache fills are counted
    /// by the cache.
    uncached_reads: Arc<std::sync::atomic::AtomicU64>,
    /// Open responses by sid, ended when their session is revoked (set by
    /// [`Sessions::serving`]).
    streams: Option<Arc<OpenStreams>>,
}

/// Short, non-reversible tag for a sid, for logs: first 12 hex digits of SHA-256.
pub fn sid_hash(sid: &str) -> String {
    String::from_utf8_lossy(&sid_hash_hex(sid)).into_owned()
}

/// [`sid_hash`] as ASCII bytes, without allocating (the access log's hot path).
pub fn sid_hash_hex(sid: &str) -> [u8; 12] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let d = Sha256::digest(sid.as_bytes());
    let mut out = [0; 12];
    for (i, b) in d[..6].iter().enumerate() {
        out[2 * i] = HEX[usize::from(b >> 4)];
        out[2 * i + 1] = HEX[usize::from(b & 0xf)];
    }
    out
}

impl Sessions {
    /// Builds the session layer over an opened store.
    pub fn new(
        store: Store,
        sealer: Arc<Sealer>,
        cfg: &SessionConfig,
        allow_plaintext_legacy: bool,
    ) -> Self {
        Self {
            store,
            sealer,
            format: cfg.format,
            key_prefix: cfg.key_prefix.clone(),
            timeout: cfg.timeout,
            allow_plaintext_legacy,
            cache: None,
            uncached_reads: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            streams: None,
        }
    }

    /// Makes this the serving process's session layer: the local session cache (unless
    /// `cfg.max_entries` is 0) and the registry of open responses, both following the store's
    /// invalidation stream (needs a tokio runtime). Until the stream reports `Live`, and whenever
    /// it is lost, every request reads the store: the cache never serves what it cannot trust.
    /// A change of a session with open responses is read again from the store, and if the
    /// session is gone its responses end (see `streams.rs`); so is every such session when the
    /// stream comes back after a loss, and every 2 s while it is not live (`follow.rs`).
    pub fn serving(mut self, cfg: CacheConfig) -> Self {
        let cache = (cfg.max_entries > 0).then(|| Arc::new(SessionCache::new(cfg)));
        let (recheck_tx, recheck_rx) = tokio::sync::mpsc::unbounded_channel();
        let streams = Arc::new(OpenStreams::new(recheck_tx));
        let rx = self.store.watch(self.scan_prefix());
        let weak_cache = cache.as_ref().map(Arc::downgrade);
        let weak_streams = Arc::downgrade(&streams);
        let prefix = self.scan_prefix().to_owned();
        // Reads for the rechecks: the same store, no cache, no registry (so this task holds
        // nothing that keeps the serving layer alive).
        tokio::spawn(
            follow::Follower {
                stream: rx,
                rechecks: recheck_rx,
                cache: weak_cache,
                streams: weak_streams,
                prefix,
                reader: self.clone(),
            }
            .run(),
        );
        self.cache = cache;
        self.streams = Some(streams);
        self
    }

    /// Store reads done to fill the session cache since start (`None` without a cache).
    pub fn cache_loads(&self) -> Option<u64> {
        self.cache.as_ref().map(|c| c.loads())
    }

    /// Session records read from the store by [`Sessions::resolve`] since start: cache fills,
    /// and every resolve while the cache is bypassed or absent.
    pub fn store_reads(&self) -> u64 {
        self.cache_loads().unwrap_or(0)
            + self
                .uncached_reads
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Entries in the session cache now (`None` without a cache).
    pub fn cache_entries(&self) -> Option<u64> {
        self.cache.as_ref().map(|c| c.len() as u64)
    }

    /// Whether the cache is in use: the store's invalidation stream is live (false without a
    /// cache, or while the stream is lost and every request reads the store).
    pub fn cache_live(&self) -> bool {
        self.cache.as_ref().is_some_and(|c| c.is_live())
    }

    /// The sealer of stored credentials, for what else tessera seals under the same keys (the
    /// login's device cookies): it follows reloads of `credentials.keys`.
    pub fn sealer(&self) -> &crate::seal::Sealer {
        &self.sealer
    }

    /// The store (for health checks).
    pub fn store(&self) -> &Store {
        &self.store
    }

    fn key(&self, sid: &str) -> String {
        match self.format {
            SessionFormat::Tessera => format!("{}{sid}", self.key_prefix),
            SessionFormat::HyperAuthProxy => sid.to_owned(),
        }
    }

    /// `f`, a call on [`Sessions::store`], within `session.timeout_ms`, its failure logged.
    ///
    /// Errors: `f`'s, or no answer in time.
    pub(crate) async fn deadline<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(self.timeout, f)
            .await
            .unwrap_or_else(|_| {
                Err(StoreError(format!(
                    "no answer within {} ms",
                    self.timeout.as_millis()
                )))
            })
            .inspect_err(warn_store_failure)
    }

    /// Looks up `sid` and unseals its credentials into a ready `Authorization` value.
    ///
    /// `sid` is shared (an `Arc`) so a cached session keys on the verified token's own copy.
    ///
    /// Errors: [`ResolveError`]; `Store` only when the store itself failed or timed out.
    pub async fn resolve(&self, sid: &Arc<str>) -> Result<Arc<Session>, ResolveError> {
        match &self.cache {
            Some(cache) if cache.is_live() => {
                // The store's futures are boxed: they are about 16 KiB, and a warm request's
                // future (which is moved as it is awaited) would otherwise carry that size.
                let cached = match cache.get_fresh(sid) {
                    Some(hit) => hit,
                    None => Box::pin(cache.get_or_load(sid, self.resolve_from_store(sid))).await?,
                };
                match cached {
                    Cached::Found(s) => Ok(s),
                    Cached::Unknown => Err(ResolveError::Unknown),
                    Cached::Corrupt(why) => Err(ResolveError::Corrupt(why)),
                }
            }
            _ => {
                self.uncached_reads
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Box::pin(self.resolve_from_store(sid)).await.map(Arc::new)
            }
        }
    }

    /// resolve without the cache: one store read and one unseal.
    async fn resolve_from_store(&self, sid: &str) -> Result<Session, ResolveError> {
        let read_epoch = self.stream_epoch(sid);
        let (raw, key_expires) = self
            .deadline(self.store.get_expiring(&self.key(sid)))
            .await?
            .ok_or(ResolveError::Unknown)?;
        let mut record: Record =
            serde_json::from_slice(&raw).map_err(|_| ResolveError::Corrupt("not a JSON record"))?;
        // The earlier of the record's expiry and its key's: the cache serves it no longer.
        record.expires_at = match (record.expires_at, key_expires) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if record.expires_at.is_some_and(|e| e <= unix_now()) {
            return Err(ResolveError::Unknown);
        }
        let pair = self.open_record(sid, &record)?;
        let creds = Credentials::from_pair(&pair)
            .map_err(|_| ResolveError::Corrupt("credentials not valid for Basic"))?;
        Ok(Session {
            sub: record.sub.or_else(|| Some(creds.user().to_owned())),
            authorization: creds.basic_header(),
            expires_at: record.expires_at,
            read_epoch,
            upstream_share: Default::default(),
        })
    }

    /// Evicts `sid` from this process's cache (other processes hear it from the store).
    async fn evict(&self, sid: &str) {
        if let Some(cache) = &self.cache {
            cache.invalidate(sid);
        }
        if let Some(streams) = &self.streams {
            streams.changed(sid);
        }
    }

    /// The change epoch of `sid`, taken before its record is read (see [`Sessions::revocable`]).
    fn stream_epoch(&self, sid: &str) -> u64 {
        self.streams.as_ref().map_or(0, |s| s.epoch(sid))
    }

    /// What a response of `session` (resolved for `sid`) needs to end with it: on revocation,
    /// or when its `expires_at` passes. `None` unless this is a serving layer
    /// ([`Sessions::serving`]).
    pub fn revocable(&self, sid: Arc<str>, session: &Session) -> Option<Watch> {
        let streams = self.streams.as_ref()?;
        Some(Watch::new(Revocable::new(
            streams.clone(),
            sid,
            session.read_epoch,
            session.expires_at,
        )))
    }

    /// Responses open now that would end with their session (`(open, ended since start)`);
    /// `None` unless this is a serving layer.
    pub fn streams(&self) -> Option<(u64, u64)> {
        self.streams.as_ref().map(|s| (s.open(), s.cut_total()))
    }
}

/// Logs a store failure's cause (a refused certificate, a lost server), at most once a second:
/// each failure is a 503 whose access-log line says only "session store unavailable", and an
/// outage would otherwise log one warning per request.
fn warn_store_failure(e: &StoreError) {
    static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    if crate::once_a_second(&LAST) {
        tracing::warn!(error = %e, "session store call failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seal::CredentialsConfig;
    use crate::session::StoreSpec;
    use std::collections::BTreeMap;

    fn sessions(dir: &std::path::Path, format: SessionFormat, plaintext: bool) -> Sessions {
        sessions_with(dir, format, plaintext, &[("k1", 3)], "k1")
    }

    fn sessions_with(
        dir: &std::path::Path,
        format: SessionFormat,
        plaintext: bool,
        keys: &[(&str, u8)],
        active: &str,
    ) -> Sessions {
        let keys: BTreeMap<_, _> = keys
            .iter()
            .map(|(id, b)| (id.to_string(), zeroize::Zeroizing::new([*b; 32])))
            .collect();
        let sealer = Arc::new(Sealer::new(&CredentialsConfig {
            keys,
            active: active.into(),
            allow_plaintext_legacy: plaintext,
        }));
        let spec = StoreSpec::Embedded(dir.to_path_buf());
        let cfg = SessionConfig {
            store: spec.clone(),
            format,
            key_prefix: "tessera:session:".into(),
            ttl_seconds: 60,
            timeout: Duration::from_secs(2),
            poll_interval: Duration::from_millis(25),
            cache: CacheConfig {
                max_entries: 1000,
                max_bytes: 1 << 20,
                ttl: Duration::from_secs(60),
                negative_ttl: Duration::from_secs(5),
            },
        };
        Sessions::new(
            Store::open(&spec, cfg.timeout).unwrap(),
            sealer,
            &cfg,
            plaintext,
        )
    }

    #[tokio::test]
    async fn create_resolve_revoke_embedded() {
        let dir = tempfile::tempdir().unwrap();
        let s = sessions(dir.path(), SessionFormat::Tessera, false);
        let c = s
            .create(&Credentials::new("alice".into(), "pw".into()).unwrap(), 60)
            .await
            .unwrap();
        assert!(c.sid.len() >= 24);
        let got = s.resolve(&c.sid.as_str().into()).await.unwrap();
        assert_eq!(got.authorization.to_str().unwrap(), "Basic YWxpY2U6cHc=");
        assert_eq!(got.sub.as_deref(), Some("alice"));
        let raw = s
            .store()
            .get(&format!("tessera:session:{}", c.sid))
            .await
            .unwrap()
            .unwrap();
        assert!(
            !String::from_utf8_lossy(&raw).contains("pw\""),
            "password must not be stored in clear"
        );
        assert!(s.revoke(&c.sid).await.unwrap());
        assert!(matches!(
            s.resolve(&c.sid.as_str().into()).await,
            Err(ResolveError::Unknown)
        ));
    }

    #[tokio::test]
    async fn reseal_moves_every_session_to_the_active_key_and_list_hides_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let old = sessions(dir.path(), SessionFormat::Tessera, false);
        let mut sids = Vec::new();
        for user in ["alice", "bob", "carol"] {
            let c = old
                .create(
                    &Credentials::new(user.into(), "pw-secret".into()).unwrap(),
                    60,
                )
                .await
                .unwrap();
            sids.push(c.sid);
        }
        let rotated = sessions_with(
            dir.path(),
            SessionFormat::Tessera,
            false,
            &[("k1", 3), ("k2", 4)],
            "k2",
        );
        // before reseal: old seals still open under the rotated config
        assert!(rotated.resolve(&sids[0].as_str().into()).await.is_ok());
        let report = rotated.reseal().await.unwrap();
        assert_eq!(
            report,
            ResealReport {
                total: 3,
                resealed: 3,
                ..Default::default()
            }
        );
        let again = rotated.reseal().await.unwrap();
        assert_eq!(again.already_active, 3);
        let listed = rotated.list().await.unwrap();
        assert_eq!(listed.len(), 3);
        assert!(listed.iter().all(|l| l.key_id.as_deref() == Some("k2")));
        let text = serde_json::to_string(&listed).unwrap();
        assert!(
            !text.contains("pw-secret") && !text.contains(&sids[0]),
            "{text}"
        );
        // k1 retired: every session still opens
        let only_new = sessions_with(
            dir.path(),
            SessionFormat::Tessera,
            false,
            &[("k2", 4)],
            "k2",
        );
        for sid in &sids {
            assert!(only_new.resolve(&sid.as_str().into()).await.is_ok());
        }
    }

    async fn wait_live(s: &Sessions) {
        for _ in 0..200 {
            if s.cache.as_ref().unwrap().is_live() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("cache never went live");
    }

    /// Two session layers on one embedded store in `dir`: one with a live cache, one without;
    /// and alice's session, created through the second before the cache follows the change log
    /// (which starts after its last entry), so that write never arrives as an invalidation
    /// racing the tests' first cache fill.
    async fn cached_and_uncached(dir: &std::path::Path) -> (Sessions, Sessions, Created) {
        let cfg = CacheConfig {
            max_entries: 1000,
            max_bytes: 1 << 20,
            ttl: Duration::from_secs(60),
            negative_ttl: Duration::from_secs(5),
        };
        let uncached = sessions(dir, SessionFormat::Tessera, false);
        let c = uncached
            .create(&Credentials::new("alice".into(), "pw".into()).unwrap(), 60)
            .await
            .unwrap();
        let cached = sessions(dir, SessionFormat::Tessera, false).serving(cfg);
        wait_live(&cached).await;
        (cached, uncached, c)
    }

    #[tokio::test]
    async fn store_reads_count_cache_fills_and_uncached_reads_once_each() {
        let dir = tempfile::tempdir().unwrap();
        let (cached, uncached, c) = cached_and_uncached(dir.path()).await;
        for _ in 0..3 {
            cached.resolve(&c.sid.as_str().into()).await.unwrap();
            uncached.resolve(&c.sid.as_str().into()).await.unwrap();
        }
        assert_eq!(cached.store_reads(), 1, "one fill, then warm");
        assert_eq!(cached.cache_loads(), Some(1));
        assert_eq!(uncached.store_reads(), 3, "no cache: every resolve reads");
        assert_eq!(uncached.cache_entries(), None);
        assert_eq!(cached.cache_entries(), Some(1));
        assert!(cached.cache_live() && !uncached.cache_live());
        // A clone shares the counter.
        uncached
            .clone()
            .resolve(&c.sid.as_str().into())
            .await
            .unwrap();
        assert_eq!(uncached.store_reads(), 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cache_single_flight_negative_and_cross_process_invalidation() {
        let dir = tempfile::tempdir().unwrap();
        // `other`: another process (the CLI) writing the same store
        let (cached, other, c) = cached_and_uncached(dir.path()).await;

        // 200 concurrent cold requests: one store read
        let before = cached.cache_loads().unwrap();
        let tasks: Vec<_> = (0..200)
            .map(|_| {
                let s = cached.clone();
                let sid = c.sid.clone();
                tokio::spawn(
                    async move { s.resolve(&sid.as_str().into()).await.map(|s| s.sub.clone()) },
                )
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap().as_deref(), Some("alice"));
        }
        assert_eq!(cached.cache_loads().unwrap() - before, 1);
        cached.resolve(&c.sid.as_str().into()).await.unwrap();
        assert_eq!(
            cached.cache_loads().unwrap() - before,
            1,
            "warm: no store read"
        );

        // unknown sids are remembered
        for _ in 0..50 {
            assert!(matches!(
                cached.resolve(&"nope".into()).await,
                Err(ResolveError::Unknown)
            ));
        }
        assert_eq!(cached.cache_loads().unwrap() - before, 2);

        // revoked by the other process: evicted within a few polls
        other.revoke(&c.sid).await.unwrap();
        let mut gone = false;
        for _ in 0..100 {
            if matches!(
                cached.resolve(&c.sid.as_str().into()).await,
                Err(ResolveError::Unknown)
            ) {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(gone, "revocation by another process reached the cache");

        // a local revoke evicts at once
        let d = cached
            .create(&Credentials::new("bob".into(), "pw".into()).unwrap(), 60)
            .await
            .unwrap();
        cached.resolve(&d.sid.as_str().into()).await.unwrap();
        cached.revoke(&d.sid).await.unwrap();
        assert!(matches!(
            cached.resolve(&d.sid.as_str().into()).await,
            Err(ResolveError::Unknown)
        ));
    }

    #[tokio::test]
    async fn legacy_plaintext_only_when_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let rec = br#"{"credentials":"YWxpY2U6cHc="}"#;
        let strict = sessions(dir.path(), SessionFormat::HyperAuthProxy, false);
        strict.put_raw("legacy-sid", rec, 60).await.unwrap();
        assert!(matches!(
            strict.resolve(&"legacy-sid".into()).await,
            Err(ResolveError::Corrupt(_))
        ));
        let lax = sessions(dir.path(), SessionFormat::HyperAuthProxy, true);
        assert_eq!(
            lax.resolve(&"legacy-sid".into())
                .await
                .unwrap()
                .authorization
                .to_str()
                .unwrap(),
            "Basic YWxpY2U6cHc="
        );
        // a sealed value in the legacy layout works in strict mode
        let c = strict
            .create(&Credentials::new("bob".into(), "x".into()).unwrap(), 60)
            .await
            .unwrap();
        assert_eq!(
            strict
                .resolve(&c.sid.as_str().into())
                .await
                .unwrap()
                .sub
                .as_deref(),
            Some("bob")
        );
    }

    #[tokio::test]
    async fn sealed_value_moved_to_other_sid_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let s = sessions(dir.path(), SessionFormat::Tessera, false);
        let c = s
            .create(&Credentials::new("alice".into(), "pw".into()).unwrap(), 60)
            .await
            .unwrap();
        let raw = s
            .store()
            .get(&format!("tessera:session:{}", c.sid))
            .await
            .unwrap()
            .unwrap();
        s.put_raw("other", &raw, 60).await.unwrap();
        assert!(matches!(
            s.resolve(&"other".into()).await,
            Err(ResolveError::Corrupt(_))
        ));
    }

    #[tokio::test]
    async fn expired_embedded_entries_are_invisible() {
        let dir = tempfile::tempdir().unwrap();
        let s = sessions(dir.path(), SessionFormat::Tessera, false);
        s.put_raw("gone", br#"{"credentials":"x","expires_at":1}"#, 60)
            .await
            .unwrap();
        assert!(matches!(
            s.resolve(&"gone".into()).await,
            Err(ResolveError::Unknown)
        ));
    }
}
