//! Device cookies (OWASP, "Slow Down Online Guessing Attacks with Device Cookies"): a browser
//! that signs a user in gets a cookie naming that user (as typed, not lower-cased: two accounts
//! that differ in case are two users) and an expiry, sealed under the sealing key (AES-256-GCM,
//! associated data `device cookie`, which no sid can be), so every instance can open it and a
//! key removed from `credentials.keys` retires it. A later login as that user carrying it is
//! held to the per-address limit and, in place of the per-user one, to a limit of that device's
//! own under the same cap: someone who fails as a user from elsewhere, to lock them out, does
//! not lock out the devices they signed in on, and a stolen device cookie is good for as many
//! guesses as the user's own cap, then refused for the window like a user.

use http::{HeaderMap, HeaderValue};
use sha2::{Digest, Sha256};

use super::request::cookie_values;
use super::Login;
use crate::seal::Sealer;
use crate::unix_now;

/// The sealed value's associated data: a space, so never a sid's.
const PURPOSE: &str = "device cookie";

/// The plaintext's first word: its layout, `d1 <expiry> <user>`.
const LAYOUT: &str = "d1";

impl Login {
    /// The `Set-Cookie` of a device that signed `user` (as given, trimmed) in; `None` when
    /// device cookies are off (`login.device_cookie_max_age_seconds = 0`).
    pub(super) fn device_cookie(&self, sealer: &Sealer, user: &str) -> Option<HeaderValue> {
        let age = self.cfg.device_cookie_max_age;
        if age == 0 {
            return None;
        }
        let plain = format!("{LAYOUT} {} {user}", unix_now() + age);
        let sealed = sealer.seal(PURPOSE, plain.as_bytes());
        Some(self.cookie(&self.device_cookie, &sealed, Some(age)))
    }

    /// The failure-limit key of the device cookie in `headers` made for `user` (as given,
    /// trimmed), if one opens under the sealing keys in place and has not expired: a NUL, which
    /// no user name holds, then a hash of the cookie. Every cookie of that name is tried, so
    /// one planted beside it (by a sibling domain, without the `__Host-` prefix) hides nothing.
    pub(super) fn known_device(
        &self,
        headers: &HeaderMap,
        sealer: &Sealer,
        user: &str,
    ) -> Option<String> {
        if self.cfg.device_cookie_max_age == 0 {
            return None;
        }
        let sealed = cookie_values(headers, &self.device_cookie)
            .find(|sealed| opens_for(sealer, sealed, user))?;
        let hash = Sha256::digest(sealed.as_bytes());
        Some(format!("\0device {}", hex(&hash[..16])))
    }
}

/// Whether `sealed` is a device cookie for `user` that has not expired.
fn opens_for(sealer: &Sealer, sealed: &str, user: &str) -> bool {
    let Ok(plain) = sealer.unseal(PURPOSE, sealed) else {
        return false;
    };
    let Some(rest) = std::str::from_utf8(&plain)
        .ok()
        .and_then(|t| t.strip_prefix(LAYOUT)?.strip_prefix(' '))
    else {
        return false;
    };
    rest.split_once(' ').is_some_and(|(until, named)| {
        named == user && until.parse::<u64>().is_ok_and(|u| u > unix_now())
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
