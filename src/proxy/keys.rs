//! A configuration reload's keys (SIGHUP): checked first, then put in place all at once.

use std::sync::Arc;

use crate::Config;

use super::Proxy;

/// Keys of a reloaded configuration, loaded and checked ([`Proxy::check_keys`]), not yet in
/// place.
pub struct ReadyKeys {
    keys: crate::token::ConfiguredKeys,
    summary: String,
}

/// Why a reloaded configuration's keys are refused ([`Proxy::check_keys`]); nothing changed.
/// The message names the configuration key and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// Its token keys could not be put in place.
    #[error(transparent)]
    Keys(#[from] crate::token::KeyReloadError),
    /// No key of it can sign while `[login]` is served.
    #[error(
        "config key `token.active_kid`: no key can sign, and tessera serves [login]; name a key \
         with a secret or private_key (a restart applies a config without [login])"
    )]
    NoSigner,
}

impl Proxy {
    /// Loads and checks the keys of a reloaded configuration (SIGHUP) without putting them in
    /// place: the JWT keys (`token.secret`, `[[token.keys]]`, `token.active_kid`); the sealing
    /// keys (`credentials.keys`, `credentials.active`) were checked when `cfg` loaded.
    ///
    /// Errors ([`ReloadError`], naming the key), with nothing changed: see
    /// [`Verifier::load_keys`](crate::token::Verifier::load_keys); or the login endpoints are served and no key of `cfg` can sign.
    pub fn check_keys(&self, cfg: &Config) -> Result<ReadyKeys, ReloadError> {
        let keys = self.verifier.load_keys(&cfg.token)?;
        if self.login.is_some() && !keys.can_sign() {
            return Err(ReloadError::NoSigner);
        }
        let summary = format!(
            "token kids [{}], signing {}; sealing keys [{}], active {}",
            keys.kids().join(", "),
            keys.signing_kid().unwrap_or("none"),
            cfg.credentials
                .keys
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", "),
            cfg.credentials.active
        );
        Ok(ReadyKeys { keys, summary })
    }

    /// Puts keys from [`Proxy::check_keys`] of `cfg` in place, with the `https://` upstream's
    /// trusted roots and client certificate. No connection is dropped and requests in flight
    /// go on. Cached verifications and cached sessions are forgotten, and sessions with open
    /// responses read again, so a key removed stops working at once. Every other setting in
    /// `cfg` is ignored: a restart applies it. Needs a tokio runtime (the rereads are tasks).
    /// The JWKS's CA (`token.jwks_ca`) is put in place for its next fetch too, when the JWKS
    /// URL is unchanged: then the JWKS should be fetched again at once ([`Proxy::refetch_jwks`]).
    /// Returns a summary for the log (key ids only), and whether the JWKS CA was replaced.
    pub fn install_keys(&self, ready: ReadyKeys, cfg: &Config) -> (String, bool) {
        self.verifier.install_keys(ready.keys);
        self.sessions.replace_sealing_keys(&cfg.credentials);
        let jwks = (self.verifier.keys()).replace_jwks_tls(cfg.token.jwks.as_ref());
        let summary = match self.upstream.reload_tls(cfg.upstream.tls.as_deref()) {
            true => {
                ready.summary + "; upstream CA and client certificate kept (another server name)"
            }
            false => ready.summary,
        };
        (summary, jwks)
    }

    /// Fetches the JWKS again in a task of its own (its CA was replaced, perhaps because the
    /// old one no longer fetched it); a changed key set forgets every cached verification.
    pub fn refetch_jwks(self: &Arc<Self>) {
        let proxy = self.clone();
        tokio::spawn(async move {
            if proxy.verifier.keys().refresh_jwks().await {
                proxy.verifier.clear_cache();
            }
        });
    }
}
