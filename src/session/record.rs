//! Session records as stored: the `tessera` format (sealed credentials, `sub`, `expires_at`) and
//! the `hyper-auth-proxy` one (`{"credentials": "..."}`), opened into a [`super::Session`] with the sid as
//! the seal's associated data. Must never: accept plaintext credentials unless
//! `credentials.allow_plaintext_legacy` says so.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::{Deserialize, Serialize};

use crate::seal::{SealError, SEALED_PREFIX};

use super::invalidate::recheck_all;
use super::{ResolveError, SessionFormat, Sessions};

/// The stored record. `credentials` is sealed (`tsl1.`...) or, in hyper-auth-proxy records written
/// by the published proxy, base64 of `user:password`.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Record {
    pub(super) credentials: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) sub: Option<String>,
    /// Unix seconds. Read from any non-negative JSON number, its fraction dropped (PostgreSQL's
    /// `extract(epoch from ...)` gives `1767225600.000000`); anything else makes the record corrupt.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "unix_seconds"
    )]
    pub(super) expires_at: Option<u64>,
    /// Members tessera does not know (written by another tool): kept as they are on reseal.
    #[serde(flatten)]
    pub(super) extra: serde_json::Map<String, serde_json::Value>,
}

/// `null` or a non-negative finite JSON number, truncated to whole seconds (as a JWT's
/// NumericDate, RFC 7519 section 2); a negative, a string or anything else is an error.
fn unix_seconds<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let Some(n) = Option::<serde_json::Number>::deserialize(d)? else {
        return Ok(None);
    };
    n.as_u64()
        .or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0)
                .map(|f| f as u64)
        })
        .map(Some)
        .ok_or_else(|| serde::de::Error::custom("expires_at is not a non-negative number"))
}

/// The sealing key id of a stored credentials value (`tsl1.<kid>.…`), if sealed.
pub(super) fn sealed_key_id(credentials: &str) -> Option<&str> {
    credentials
        .strip_prefix(SEALED_PREFIX)?
        .split_once('.')
        .map(|(kid, _)| kid)
}

impl Sessions {
    /// The `user:password` pair of a record: unsealed, or decoded legacy plaintext when allowed.
    pub(super) fn open_record(
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
}
