//! Operator commands behind the CLI: session create/revoke, key generation, config check.
//! Each works against the same store a running `tessera serve` uses (the embedded store is SQLite
//! in WAL mode, safe across processes). Must never: print a password or a sealing key it read.

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use serde::Serialize;

use crate::seal::Credentials;
use crate::session::store::EmbeddedStore;
use crate::session::{StoreError, StoreSpec};
use crate::token::{Keys, Signer};
use crate::unix_now;
use crate::Config;

/// Output of `tessera session create`, printed as one JSON line.
#[derive(Debug, Serialize)]
pub struct CreatedSession {
    /// The new session id.
    pub sid: String,
    /// A JWT the running proxy accepts for this session.
    pub token: String,
    /// Expiry of session and token, seconds since the Unix epoch.
    pub expires_at: u64,
}

/// Why an admin command failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// Store failure.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// User/password unusable for Basic (empty user, `:` in user, control characters).
    #[error("credentials rejected: user must be non-empty without ':' and neither may contain control characters")]
    Credentials,
    /// No token can be issued with this configuration (the reason names the key).
    #[error("cannot sign token: {0}")]
    Sign(String),
    /// The signing key refused the token (the crypto backend's error is the source).
    #[error(transparent)]
    Signing(#[from] crate::token::SignError),
    /// `check-config` found a problem.
    #[error("{0}")]
    Check(String),
}

/// Creates a session for `user`/`password` living `ttl_seconds` and a token for it.
///
/// Errors: [`AdminError`].
pub async fn create_session(
    cfg: &Config,
    user: String,
    password: String,
    ttl_seconds: u64,
) -> Result<CreatedSession, AdminError> {
    let creds = Credentials::new(user, password).map_err(|_| AdminError::Credentials)?;
    // Before the store: a session no token can name would keep its sealed password until its
    // expiry, unlisted anywhere but `session list`.
    let signer = token_signer(cfg)?;
    let sessions = crate::sessions_from_config(cfg)?;
    let created = sessions.create(&creds, ttl_seconds).await?;
    let token = signer
        .issue(
            &cfg.token,
            creds.user(),
            &created.sid,
            unix_now(),
            created.expires_at,
        )
        .map_err(AdminError::Signing)?;
    Ok(CreatedSession {
        sid: created.sid,
        token,
        expires_at: created.expires_at,
    })
}

/// Signs a token for `sid` with the active key (`token.active_kid` or `token.secret`) and the
/// configured issuer/audience.
///
/// Errors: [`AdminError::Sign`] when no key can sign or `token.sid_claim` is not `sid`.
pub fn issue_token(cfg: &Config, sub: &str, sid: &str, exp: u64) -> Result<String, AdminError> {
    token_signer(cfg)?
        .issue(&cfg.token, sub, sid, unix_now(), exp)
        .map_err(AdminError::Signing)
}

/// The key that signs tokens (`token.active_kid` or `token.secret`).
///
/// Errors: [`AdminError::Sign`] when no key can sign or `token.sid_claim` is not `sid`.
fn token_signer(cfg: &Config) -> Result<std::sync::Arc<Signer>, AdminError> {
    if cfg.token.sid_claim != "sid" {
        return Err(AdminError::Sign(format!(
            "token.sid_claim is `{}`; tessera issues tokens with `sid` only",
            cfg.token.sid_claim
        )));
    }
    let keys = Keys::new(
        &cfg.token.keys,
        cfg.token.active_kid.as_deref(),
        None,
        &cfg.token.algorithms,
    )
    .map_err(|e| AdminError::Sign(e.0))?;
    keys.signer().ok_or_else(|| {
        AdminError::Sign(
            "no signing key: set token.secret, or token.active_kid naming a key with secret/private_key"
                .into(),
        )
    })
}

/// Deletes session `sid`; `true` if it existed.
///
/// Errors: [`AdminError::Store`].
pub async fn revoke_session(cfg: &Config, sid: &str) -> Result<bool, AdminError> {
    Ok(crate::sessions_from_config(cfg)?.revoke(sid).await?)
}

/// Revokes every live session whose sid hash is `sid_hash` (as `session list` and the logs show
/// it) or whose upstream user is `user` (both given: either); the revoked sessions' hashes.
/// User names compare trimmed and in any case, as login's failure limit counts them: a session
/// signed in as `Alice` is `alice`'s to most upstreams, and one left out outlives an incident.
///
/// Errors: [`AdminError::Store`]: the store could not be read (a session whose revocation
/// fails is named in [`crate::session::Revoked::failed`], and the others go on).
pub async fn revoke_sessions(
    cfg: &Config,
    sid_hash: Option<&str>,
    user: Option<&str>,
) -> Result<crate::session::Revoked, AdminError> {
    let sessions = crate::sessions_from_config(cfg)?;
    let user = user.map(|u| u.trim().to_lowercase());
    let sid_hash = sid_hash.map(|h| h.trim().to_ascii_lowercase());
    let pick = |l: &crate::session::Listed| {
        sid_hash.as_ref().is_some_and(|h| *h == l.sid_hash)
            || user.as_ref().is_some_and(|u| {
                l.sub
                    .as_deref()
                    .is_some_and(|s| s.trim().to_lowercase() == *u)
            })
    };
    Ok(sessions.revoke_where(pick).await?)
}

/// Every live session in the configured store (sid hash, subject, expiry, sealing key id).
///
/// Errors: [`AdminError::Store`].
pub async fn list_sessions(cfg: &Config) -> Result<Vec<crate::session::Listed>, AdminError> {
    Ok(crate::sessions_from_config(cfg)?.list().await?)
}

/// Re-seals every stored session under `credentials.active`.
///
/// Errors: [`AdminError::Store`].
pub async fn reseal_sessions(cfg: &Config) -> Result<crate::session::ResealReport, AdminError> {
    Ok(crate::sessions_from_config(cfg)?.reseal().await?)
}

/// Fresh key material: a 64-byte JWT secret (base64url, 86 chars), a 32-byte sealing key and
/// a 48-byte session ticket key (standard base64), as `NAME=value` lines for an environment
/// file.
pub fn keygen() -> String {
    let mut jwt = [0u8; 64];
    let mut cred = [0u8; 32];
    let mut ticket = [0u8; 48];
    for buf in [&mut jwt[..], &mut cred, &mut ticket] {
        getrandom::getrandom(buf).expect("OS random source");
    }
    format!(
        "# tessera keygen: fresh secrets; keep them out of version control.\n\
         # Config: token.secret = \"env:TESSERA_JWT_SECRET\", credentials.keys = {{ k1 = \"env:TESSERA_CRED_KEY\" }}\n\
         # and, with [tls] on several instances, tls.session_ticket_keys = [\"env:TESSERA_TICKET_KEY\"]\n\
         TESSERA_JWT_SECRET={}\nTESSERA_CRED_KEY={}\nTESSERA_TICKET_KEY={}\n",
        URL_SAFE_NO_PAD.encode(jwt),
        STANDARD.encode(cred),
        STANDARD.encode(ticket)
    )
}

/// Whether the configured store is there to work on: an embedded store must have been made
/// (by `serve`; unless the command `makes` one), so that a command run from another working
/// directory than `serve`'s (a relative `embedded:` path) is not answered from a new empty
/// store, as if nothing were stored: a revocation that revoked nothing, with exit 0.
///
/// Errors: [`AdminError::Check`] naming the key, the path looked at, and the fix: no store
/// there, or one this user may not look at (run as another user than `serve`'s).
pub fn store_present(cfg: &Config, makes: bool) -> Result<(), AdminError> {
    match absent_store(cfg) {
        Some(Absent::NotMade(path)) if !makes => Err(AdminError::Check(format!(
            "config key `session.store`: no embedded store at {path} (a relative path is taken \
             from the working directory); run this where `tessera serve` runs, or give \
             session.store an absolute path"
        ))),
        Some(Absent::Unreadable(path, e)) => Err(unreadable(&path, &e)),
        _ => Ok(()),
    }
}

/// Why the configured embedded store is not there to work on ([`absent_store`]).
#[derive(Debug)]
pub enum Absent {
    /// None has been made at this absolute path yet.
    NotMade(String),
    /// This user may not look at this absolute path (and why).
    Unreadable(String, std::io::Error),
}

/// Whether the configured embedded store is there to work on; `None` when it is, or the store
/// is no embedded one.
pub fn absent_store(cfg: &Config) -> Option<Absent> {
    let StoreSpec::Embedded(dir) = &cfg.session.store else {
        return None;
    };
    match EmbeddedStore::exists(dir) {
        Ok(true) => None,
        Ok(false) => Some(Absent::NotMade(shown_path(dir))),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            Some(Absent::Unreadable(shown_path(dir), e))
        }
        // Another failure (a file where the directory should be): the store's open says what.
        Err(_) => None,
    }
}

/// The refusal of an embedded store at `path` that this user may not look at (`e`).
fn unreadable(path: &str, e: &std::io::Error) -> AdminError {
    AdminError::Check(format!(
        "config key `session.store`: cannot look at the embedded store at {path} ({e}); run \
         this as the user `tessera serve` runs as (e.g. `sudo -u tessera tessera ...`), whom \
         alone serve lets into it"
    ))
}

/// `path` made absolute against the working directory, to say where a relative one points.
pub(crate) fn shown_path(path: &std::path::Path) -> String {
    std::path::absolute(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .display()
        .to_string()
}

/// Checks what a valid config cannot show by itself: the store answers (an embedded one not
/// made yet is said so, and not made), the upstream host resolves, the JWKS loads with a key
/// for `token.algorithms`, and each certificate's expiry. Returns human-readable `ok` lines.
///
/// Errors: [`AdminError::Check`] naming the key: the store or JWKS failed, the upstream does
/// not resolve, a certificate expired.
pub async fn check(cfg: &Config) -> Result<Vec<String>, AdminError> {
    let mut out = vec!["config: ok".to_string()];
    match absent_store(cfg) {
        // Not made here: a check run as another user, or elsewhere, must not make it.
        Some(Absent::NotMade(path)) => out.push(format!(
            "session.store: no embedded store at {path} yet; `tessera serve` makes it there"
        )),
        Some(Absent::Unreadable(path, e)) => return Err(unreadable(&path, &e)),
        None => out.push(reach_store(cfg).await?),
    }
    let addr = cfg.upstream.addr();
    let resolved = tokio::net::lookup_host(&addr)
        .await
        .map_err(|e| {
            AdminError::Check(format!(
                "config key `upstream.url`: cannot resolve {addr}: {e}"
            ))
        })?
        .count();
    out.push(format!(
        "upstream.url: {addr} resolves ({resolved} address(es))"
    ));
    if let Some(jwks) = &cfg.token.jwks {
        // serve starts without it (and warns), then refuses every token it would have verified.
        let usable = crate::token::keys::check_jwks(jwks, &cfg.token.algorithms)
            .await
            .map_err(|e| AdminError::Check(format!("config key `token.jwks`: {e}")))?;
        if usable == 0 {
            return Err(AdminError::Check(
                "config key `token.jwks`: the document holds no key for token.algorithms".into(),
            ));
        }
        out.push(format!("token.jwks: {usable} key(s) for token.algorithms"));
    }
    if let Some(tls) = &cfg.tls {
        for identity in std::iter::once(&tls.default).chain(&tls.sni) {
            let summary = identity
                .summary()
                .map_err(|e| AdminError::Check(format!("config key `{}`: {}", e.key, e.problem)))?;
            let line = certificate_line(&summary, crate::unix_now() as i64);
            if line.contains(EXPIRED) {
                // serve starts with it (and warns), but every client refuses it.
                let (key, said) = line.split_once(": ").unwrap_or((&line, ""));
                return Err(AdminError::Check(format!("config key `{key}`: {said}")));
            }
            out.push(line);
        }
    }
    Ok(out)
}

/// Opens the configured store and asks it to answer: the `check-config` line.
///
/// Errors: [`AdminError::Check`] naming the key.
async fn reach_store(cfg: &Config) -> Result<String, AdminError> {
    let sessions = crate::sessions_from_config(cfg)
        .map_err(|e| AdminError::Check(format!("config key `session.store`: {e}")))?;
    tokio::time::timeout(cfg.session.timeout, sessions.store().ping())
        .await
        .map_err(|_| AdminError::Check("config key `session.store`: no answer in time".into()))?
        .map_err(|e| AdminError::Check(format!("config key `session.store`: {e}")))?;
    Ok(match &cfg.session.store {
        // Where, in full: a relative path is taken from the working directory, and the CLI
        // and `serve` must name the same store.
        StoreSpec::Embedded(dir) => format!("session.store: reachable at {}", shown_path(dir)),
        _ => "session.store: reachable".into(),
    })
}

/// How [`certificate_line`] flags an expired certificate.
const EXPIRED: &str = " EXPIRED: clients refuse it; renew it, then SIGHUP";

/// One `check-config` line for a certificate: its names and expiry, flagged `EXPIRED` or
/// `expires soon` (within 14 days); the key matched it already (config validation).
fn certificate_line(c: &crate::downstream::CertSummary, now: i64) -> String {
    let when = c.until();
    let flag = match c.not_after - now {
        left if left <= 0 => EXPIRED,
        left if left <= crate::downstream::CERT_WARN_BEFORE => {
            " expires soon: renew it, then SIGHUP"
        }
        _ => "",
    };
    format!(
        "{}: key matches; names {}; valid until {when}{flag}",
        c.key,
        c.names.join(", ")
    )
}
