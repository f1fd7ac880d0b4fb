//! The resolve and unseal phases: session id -> session record -> ready upstream credential.
//!
//! Owns the record formats (`tessera`, `hyper-auth-proxy`) and session creation/revocation.
//! Must never: return or log plaintext credentials except as the sensitive header value, or turn a
//! store failure into "unknown session" (that would be a 401 where 503 is true).

mod cache;
mod settings;
pub mod store;
mod streams;

use std::sync::Arc;
use std::time::Duration;

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use http::HeaderValue;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::seal::{Credentials, SealError, Sealer, SEALED_PREFIX};
use crate::unix_now;
pub use cache::CacheConfig;
use cache::{Cached, SessionCache};
pub use settings::{SessionConfig, SessionFormat, StoreSpec};
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

/// The stored record. `credentials` is sealed (`tsl1.`...) or, in hyper-auth-proxy records written
/// by the published proxy, base64 of `user:password`.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    credentials: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sub: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expires_at: Option<u64>,
    /// Members tessera does not know (written by another tool): kept as they are on reseal.
    #[serde(flatten)]
    extra: serde_json::Map<String, serde_json::Value>,
}

/// A newly created session.
#[derive(Debug, Clone, Serialize)]
pub struct Created {
    /// The fresh session id (base64url of 18 random bytes: 144 bits).
    pub sid: String,
    /// Expiry, seconds since the Unix epoch.
    pub expires_at: u64,
}

/// One line of `tessera session list`.
#[derive(Debug, Clone, Serialize)]
pub struct Listed {
    /// [`sid_hash`] of the session id (the id itself is a bearer secret and is not shown).
    pub sid_hash: String,
    /// The upstream user.
    pub sub: Option<String>,
    /// Expiry, seconds since the Unix epoch (absent in hyper-auth-proxy records).
    pub expires_at: Option<u64>,
    /// Sealing key id of the stored credentials; `None` for legacy plaintext.
    pub key_id: Option<String>,
}

/// What `tessera session reseal` did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ResealReport {
    /// Session records seen.
    pub total: usize,
    /// Re-sealed under the active key.
    pub resealed: usize,
    /// Already sealed under the active key.
    pub already_active: usize,
    /// Could not be opened (retired key, corrupt, plaintext not allowed); left as they were.
    pub unreadable: usize,
    /// Revoked, expired or rewritten between read and write; left as it is.
    pub gone: usize,
}

/// The sealing key id of a stored credentials value (`tsl1.<kid>.…`), if sealed.
fn sealed_key_id(credentials: &str) -> Option<&str> {
    credentials
        .strip_prefix(SEALED_PREFIX)?
        .split_once('.')
        .map(|(kid, _)| kid)
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
    /// stream comes back after a loss.
    pub fn serving(mut self, cfg: CacheConfig) -> Self {
        let cache = (cfg.max_entries > 0).then(|| Arc::new(SessionCache::new(cfg)));
        let (recheck_tx, mut recheck_rx) = tokio::sync::mpsc::unbounded_channel();
        let streams = Arc::new(OpenStreams::new(recheck_tx));
        let mut rx = self.store.watch(self.scan_prefix());
        let weak_cache = cache.as_ref().map(Arc::downgrade);
        let weak_streams = Arc::downgrade(&streams);
        let prefix = self.scan_prefix().to_owned();
        // Reads for the rechecks: the same store, no cache, no registry (so this task holds
        // nothing that keeps the serving layer alive).
        let reader = self.clone();
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    msg = rx.recv() => msg,
                    sid = recheck_rx.recv() => match sid {
                        Some(sid) => {
                            tokio::spawn(recheck(reader.clone(), weak_streams.clone(), vec![sid]));
                            continue;
                        }
                        None => return, // the registry is gone: the layer was dropped
                    },
                };
                let Some(msg) = msg else { return };
                let Some(streams) = weak_streams.upgrade() else {
                    return;
                };
                let cache = match &weak_cache {
                    Some(weak) => match weak.upgrade() {
                        Some(cache) => Some(cache),
                        None => return,
                    },
                    None => None,
                };
                match msg {
                    Invalidation::Keys(keys) => {
                        let mut open = Vec::new();
                        for key in keys {
                            if let Some(sid) = key.strip_prefix(prefix.as_str()) {
                                if let Some(cache) = &cache {
                                    cache.invalidate(sid);
                                }
                                // After the eviction (see `OpenStreams::changed`).
                                streams.changed(sid);
                                if streams.is_open(sid) {
                                    open.push(Arc::from(sid));
                                }
                            }
                        }
                        if !open.is_empty() {
                            tokio::spawn(recheck(reader.clone(), weak_streams.clone(), open));
                        }
                    }
                    Invalidation::Live => {
                        if let Some(cache) = &cache {
                            cache.flush();
                            cache.set_live(true);
                        }
                        recheck_all(&reader, &streams);
                    }
                    Invalidation::Lost => {
                        if let Some(cache) = &cache {
                            cache.set_live(false);
                            cache.flush();
                        }
                    }
                }
            }
        });
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

    /// Puts the sealing keys of `cfg` in place (a configuration reload) and flushes the session
    /// cache, so that every cached session is unsealed again under the keys now in place: one
    /// sealed under a key removed (or whose bytes changed) is refused from then on, as after a
    /// restart. Costs one store read per session in use afterwards (needs a tokio runtime).
    /// Sessions with open responses are read again the same way: those sealed under a key
    /// removed end their responses, as a revocation would.
    pub fn replace_sealing_keys(&self, cfg: &crate::seal::CredentialsConfig) {
        self.sealer.replace(cfg);
        if let Some(cache) = &self.cache {
            cache.flush();
        }
        if let Some(streams) = &self.streams {
            let reader = Self {
                cache: None,
                streams: None,
                ..self.clone()
            };
            recheck_all(&reader, streams);
        }
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

    async fn deadline<T>(
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
    }

    /// Looks up `sid` and unseals its credentials into a ready `Authorization` value.
    ///
    /// Errors: [`ResolveError`]; `Store` only when the store itself failed or timed out.
    pub async fn resolve(&self, sid: &str) -> Result<Arc<Session>, ResolveError> {
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
        let raw = self
            .deadline(self.store.get(&self.key(sid)))
            .await?
            .ok_or(ResolveError::Unknown)?;
        let record: Record =
            serde_json::from_slice(&raw).map_err(|_| ResolveError::Corrupt("not a JSON record"))?;
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

    /// The `user:password` pair of a record: unsealed, or decoded legacy plaintext when allowed.
    fn open_record(
        &self,
        sid: &str,
        record: &Record,
    ) -> Result<zeroize::Zeroizing<Vec<u8>>, ResolveError> {
        if record.credentials.starts_with(SEALED_PREFIX) {
            self.sealer.unseal(sid, &record.credentials).map_err(|e| {
                ResolveError::Corrupt(match e {
                    SealError::Format => "sealed value malformed",
                    SealError::UnknownKey => "sealed under a retired key",
                    SealError::Decrypt => "sealed value does not authenticate",
                })
            })
        } else if self.format == SessionFormat::HyperAuthProxy && self.allow_plaintext_legacy {
            Ok(zeroize::Zeroizing::new(
                STANDARD
                    .decode(record.credentials.trim())
                    .map_err(|_| ResolveError::Corrupt("legacy credentials not base64"))?,
            ))
        } else {
            Err(ResolveError::Corrupt("plaintext credentials not allowed"))
        }
    }

    /// The key prefix sessions live under, and the sid of a store key.
    fn scan_prefix(&self) -> &str {
        match self.format {
            SessionFormat::Tessera => &self.key_prefix,
            SessionFormat::HyperAuthProxy => "",
        }
    }

    /// Every live session: sid hash, subject and expiry; never credentials. Records that are not
    /// session records (other keys in a shared Redis database) are skipped.
    ///
    /// Errors: the store failed (no deadline: an operator command walking the whole store).
    pub async fn list(&self) -> Result<Vec<Listed>, StoreError> {
        let prefix = self.scan_prefix();
        let mut out = Vec::new();
        for (key, raw) in self.store.scan(prefix).await? {
            let Ok(record) = serde_json::from_slice::<Record>(&raw) else {
                continue;
            };
            let sid = &key[prefix.len()..];
            out.push(Listed {
                sid_hash: sid_hash(sid),
                key_id: sealed_key_id(&record.credentials).map(str::to_owned),
                sub: record.sub.clone().or_else(|| {
                    self.open_record(sid, &record)
                        .ok()
                        .and_then(|p| Credentials::from_pair(&p).ok())
                        .map(|c| c.user().to_owned())
                }),
                expires_at: record.expires_at,
            });
        }
        Ok(out)
    }

    /// Re-seals every stored session under the active sealing key (`credentials.active`),
    /// keeping each session's expiry and any members tessera does not know. Legacy plaintext
    /// records are sealed too when `credentials.allow_plaintext_legacy` lets tessera read them.
    /// Each record is replaced only if it is still exactly what was read (compare-and-set): a
    /// session revoked or rewritten meanwhile is left alone and counted as `gone`.
    ///
    /// Errors: the store failed; records that cannot be opened are counted, not fatal.
    pub async fn reseal(&self) -> Result<ResealReport, StoreError> {
        let prefix = self.scan_prefix();
        let active = self.sealer.active_key_id();
        let mut report = ResealReport::default();
        for (key, raw) in self.store.scan(prefix).await? {
            let Ok(mut record) = serde_json::from_slice::<Record>(&raw) else {
                continue;
            };
            report.total += 1;
            if sealed_key_id(&record.credentials) == Some(active.as_str()) {
                report.already_active += 1;
                continue;
            }
            let sid = &key[prefix.len()..];
            let Ok(pair) = self.open_record(sid, &record) else {
                report.unreadable += 1;
                continue;
            };
            record.credentials = self.sealer.seal(sid, &pair);
            let value = serde_json::to_vec(&record).expect("record serializes");
            if self.store.replace(&key, &raw, &value).await? {
                self.evict(sid).await;
                report.resealed += 1;
            } else {
                report.gone += 1;
            }
        }
        Ok(report)
    }

    /// Creates a session for `creds` living `ttl_seconds`: fresh random sid, sealed credentials.
    ///
    /// Errors: the store failed or timed out.
    pub async fn create(
        &self,
        creds: &Credentials,
        ttl_seconds: u64,
    ) -> Result<Created, StoreError> {
        let mut raw = [0u8; 18];
        getrandom::getrandom(&mut raw).map_err(|e| StoreError(format!("random source: {e}")))?;
        let sid = URL_SAFE_NO_PAD.encode(raw);
        let expires_at = unix_now() + ttl_seconds;
        let record = Record {
            credentials: self.sealer.seal(&sid, &creds.to_pair()),
            sub: (self.format == SessionFormat::Tessera).then(|| creds.user().to_owned()),
            expires_at: (self.format == SessionFormat::Tessera).then_some(expires_at),
            extra: serde_json::Map::new(),
        };
        let value = serde_json::to_vec(&record).expect("record serializes");
        self.deadline(self.store.put(&self.key(&sid), &value, ttl_seconds))
            .await?;
        self.evict(&sid).await;
        Ok(Created { sid, expires_at })
    }

    /// Deletes the session `sid`; `true` if it existed.
    ///
    /// Errors: the store failed or timed out.
    pub async fn revoke(&self, sid: &str) -> Result<bool, StoreError> {
        let existed = self.deadline(self.store.delete(&self.key(sid))).await;
        self.evict(sid).await;
        if let (Ok(_), Some(streams)) = (&existed, &self.streams) {
            streams.cut(sid);
        }
        existed
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

    /// Stores a raw record value at the key for `sid` (tests and migration tooling).
    pub async fn put_raw(
        &self,
        sid: &str,
        value: &[u8],
        ttl_seconds: u64,
    ) -> Result<(), StoreError> {
        self.deadline(self.store.put(&self.key(sid), value, ttl_seconds))
            .await?;
        self.evict(sid).await;
        Ok(())
    }
}

/// Store reads at once when every session with open responses is read again (the invalidation
/// stream came back, or the sealing keys were reloaded): enough to go through thousands
/// quickly, few enough to leave the store and the runtime to the requests.
const RECHECK_TASKS: usize = 16;

/// Has every session with open responses read again by `reader` (no cache, no registry), by at
/// most [`RECHECK_TASKS`] tasks at a time; each one gone or no longer readable ends its open
/// responses ([`recheck`]). For when any session may have changed unreported: the invalidation
/// stream is back after a loss, or the sealing keys were reloaded.
fn recheck_all(reader: &Sessions, streams: &Arc<OpenStreams>) {
    streams.changed_all();
    let open = streams.open_sids();
    let per_task = open.len().div_ceil(RECHECK_TASKS).max(1);
    for sids in open.chunks(per_task) {
        tokio::spawn(recheck(
            reader.clone(),
            Arc::downgrade(streams),
            sids.to_vec(),
        ));
    }
}

/// Reads each of `sids` again and ends its open responses if the session is gone or unusable.
/// A store failure is retried (every 0.1 s, doubling to 2 s) while the sid still has open
/// responses: a revocation is never dropped because the store hiccuped.
async fn recheck(reader: Sessions, streams: std::sync::Weak<OpenStreams>, sids: Vec<Arc<str>>) {
    for sid in sids {
        let mut backoff = Duration::from_millis(100);
        loop {
            let answer = reader.resolve_from_store(&sid).await;
            let Some(streams) = streams.upgrade() else {
                return;
            };
            match answer {
                Ok(_) => break,
                Err(ResolveError::Unknown | ResolveError::Corrupt(_)) => {
                    streams.cut(&sid);
                    break;
                }
                Err(ResolveError::Store(e)) => {
                    if !streams.is_open(&sid) {
                        break;
                    }
                    tracing::debug!(cause = %e, "re-reading a session with open responses failed; retrying");
                }
            }
            drop(streams);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
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
        let got = s.resolve(&c.sid).await.unwrap();
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
            s.resolve(&c.sid).await,
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
        assert!(rotated.resolve(&sids[0]).await.is_ok());
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
            assert!(only_new.resolve(sid).await.is_ok());
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
            cached.resolve(&c.sid).await.unwrap();
            uncached.resolve(&c.sid).await.unwrap();
        }
        assert_eq!(cached.store_reads(), 1, "one fill, then warm");
        assert_eq!(cached.cache_loads(), Some(1));
        assert_eq!(uncached.store_reads(), 3, "no cache: every resolve reads");
        assert_eq!(uncached.cache_entries(), None);
        assert_eq!(cached.cache_entries(), Some(1));
        assert!(cached.cache_live() && !uncached.cache_live());
        // A clone shares the counter.
        uncached.clone().resolve(&c.sid).await.unwrap();
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
                tokio::spawn(async move { s.resolve(&sid).await.map(|s| s.sub.clone()) })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap().as_deref(), Some("alice"));
        }
        assert_eq!(cached.cache_loads().unwrap() - before, 1);
        cached.resolve(&c.sid).await.unwrap();
        assert_eq!(
            cached.cache_loads().unwrap() - before,
            1,
            "warm: no store read"
        );

        // unknown sids are remembered
        for _ in 0..50 {
            assert!(matches!(
                cached.resolve("nope").await,
                Err(ResolveError::Unknown)
            ));
        }
        assert_eq!(cached.cache_loads().unwrap() - before, 2);

        // revoked by the other process: evicted within a few polls
        other.revoke(&c.sid).await.unwrap();
        let mut gone = false;
        for _ in 0..100 {
            if matches!(cached.resolve(&c.sid).await, Err(ResolveError::Unknown)) {
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
        cached.resolve(&d.sid).await.unwrap();
        cached.revoke(&d.sid).await.unwrap();
        assert!(matches!(
            cached.resolve(&d.sid).await,
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
            strict.resolve("legacy-sid").await,
            Err(ResolveError::Corrupt(_))
        ));
        let lax = sessions(dir.path(), SessionFormat::HyperAuthProxy, true);
        assert_eq!(
            lax.resolve("legacy-sid")
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
            strict.resolve(&c.sid).await.unwrap().sub.as_deref(),
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
            s.resolve("other").await,
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
            s.resolve("gone").await,
            Err(ResolveError::Unknown)
        ));
    }
}
