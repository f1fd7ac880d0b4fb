//! Sessions made, listed, resealed and revoked (login, logout, the operator CLI). Must never:
//! reuse a sid, or list a sid or a credential.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use serde::Serialize;

use crate::seal::Credentials;
use crate::unix_now;

use super::record::{sealed_key_id, Record};
use super::{sid_hash, SessionFormat, Sessions, StoreError};

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

/// What a revocation of several sessions did ([`Sessions::revoke_where`]).
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Revoked {
    /// Sessions revoked: their sid hashes.
    pub sid_hashes: Vec<String>,
    /// Sessions chosen whose revocation failed (the store's error each): their sid hashes.
    /// Some may be revoked all the same (a write the store made but could not confirm, as a
    /// replica's acknowledgement missing); run the command again.
    pub failed: Vec<String>,
}

impl Sessions {
    /// The key prefix sessions live under, and the sid of a store key.
    pub(super) fn scan_prefix(&self) -> &str {
        match self.format {
            SessionFormat::Tessera => &self.key_prefix,
            SessionFormat::HyperAuthProxy => "",
        }
    }

    /// Every live session: sid hash, subject and expiry; never credentials. Records that are not
    /// session records (other keys in a shared Redis database) are skipped.
    ///
    /// Errors: the store failed (each page of the walk has the store's deadline: on SQL, 1,000
    /// records a page; Redis's SCAN pages itself).
    pub async fn list(&self) -> Result<Vec<Listed>, StoreError> {
        Ok(self.entries().await?.into_iter().map(|(_, l)| l).collect())
    }

    /// Revokes every live session `pick` chooses from what [`Sessions::list`] shows of it (the
    /// operator's way to end a session seen in the list or the log by its hash, or every
    /// session of a user); the revoked sessions' hashes.
    ///
    /// A session whose revocation fails does not stop the others (one replica down must not
    /// leave the rest of a user's sessions live): it is named in [`Revoked::failed`] and
    /// logged.
    ///
    /// Errors: the store could not be read.
    pub async fn revoke_where(
        &self,
        pick: impl Fn(&Listed) -> bool,
    ) -> Result<Revoked, StoreError> {
        let mut out = Revoked::default();
        for (sid, listed) in self.entries().await? {
            if !pick(&listed) {
                continue;
            }
            match self.revoke(&sid).await {
                Ok(true) => out.sid_hashes.push(listed.sid_hash),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(sid_hash = %listed.sid_hash, error = %e, "revocation failed");
                    out.failed.push(listed.sid_hash);
                }
            }
        }
        Ok(out)
    }

    /// Every live session record: its id and what [`Sessions::list`] shows of it.
    async fn entries(&self) -> Result<Vec<(String, Listed)>, StoreError> {
        let prefix = self.scan_prefix();
        let mut out = Vec::new();
        for (key, raw) in self.store.scan(prefix).await? {
            let Ok(record) = serde_json::from_slice::<Record>(&raw) else {
                continue;
            };
            let sid = &key[prefix.len()..];
            let listed = Listed {
                sid_hash: sid_hash(sid),
                key_id: sealed_key_id(&record.credentials).map(str::to_owned),
                sub: record.sub.clone().or_else(|| {
                    self.open_record(sid, &record)
                        .ok()
                        .and_then(|p| Credentials::from_pair(&p).ok())
                        .map(|c| c.user().to_owned())
                }),
                expires_at: record.expires_at,
            };
            out.push((sid.to_string(), listed));
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

    /// Deletes the session `sid`; `true` if it existed. Done in a task of its own, finished
    /// even when the caller is dropped (a client leaving mid-logout, before the delete was
    /// sent, must not leave its session alive).
    ///
    /// Errors: the store failed or timed out.
    pub async fn revoke(&self, sid: &str) -> Result<bool, StoreError> {
        let (this, sid) = (self.clone(), sid.to_owned());
        match tokio::spawn(async move { this.revoke_here(&sid).await }).await {
            Ok(existed) => existed,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(StoreError("shutting down; the session may remain".into())),
        }
    }

    /// [`Sessions::revoke`] in the caller's task.
    async fn revoke_here(&self, sid: &str) -> Result<bool, StoreError> {
        let existed = self.deadline(self.store.delete(&self.key(sid))).await;
        self.evict(sid).await;
        if let (Ok(_), Some(streams)) = (&existed, &self.streams) {
            streams.cut(sid);
        }
        existed
    }

    /// The upstream refused `sid`'s credentials: the session is deleted; with a read-only store
    /// (`session.query`: the application owns its sessions and deletes them itself) it is only
    /// dropped from the cache, so the next request reads the row again. Returns what was done,
    /// for the access log.
    ///
    /// Errors: the delete failed or timed out.
    pub async fn drop_rejected(&self, sid: &str) -> Result<&'static str, StoreError> {
        if self.store.read_only() {
            self.evict(sid).await;
            return Ok("session kept: the store is read-only (session.query)");
        }
        self.revoke(sid).await.map(|_| "session deleted")
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
