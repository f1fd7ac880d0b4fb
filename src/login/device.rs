//! Device cookies (OWASP, "Slow Down Online Guessing Attacks with Device Cookies"): a browser
//! that signs a user in gets a cookie naming that user and an expiry, sealed under the
//! sealing key (AES-256-GCM, associated data `device cookie`, which no sid can be), so every
//! instance can open it and a reload's keys apply. Its later logins as that user are spared the
//! per-user failure limit, not the per-address one: someone who fails as a user from elsewhere,
//! to lock them out, does not lock out the devices they signed in on. A stolen device cookie
//! gives its thief the per-address limit only, as if there were no per-user one.

use http::{HeaderMap, HeaderValue};

use super::request::cookie_value;
use super::Login;
use crate::seal::Sealer;
use crate::unix_now;

/// The sealed value's associated data: a space, so never a sid's.
const PURPOSE: &str = "device cookie";

impl Login {
    /// The `Set-Cookie` of a device that signed `user_key` (the lower-cased user name) in;
    /// `None` when device cookies are off (`login.device_cookie_max_age_seconds = 0`).
    pub(super) fn device_cookie(&self, sealer: &Sealer, user_key: &str) -> Option<HeaderValue> {
        let age = self.cfg.device_cookie_max_age;
        if age == 0 {
            return None;
        }
        let sealed = sealer.seal(
            PURPOSE,
            format!("{} {user_key}", unix_now() + age).as_bytes(),
        );
        Some(self.cookie(&self.device_cookie, &sealed, Some(age)))
    }

    /// Whether `headers` carry a device cookie for `user_key` that opens under the sealing keys
    /// in place and has not expired.
    pub(super) fn known_device(
        &self,
        headers: &HeaderMap,
        sealer: &Sealer,
        user_key: &str,
    ) -> bool {
        if self.cfg.device_cookie_max_age == 0 {
            return false;
        }
        let Some(sealed) = cookie_value(headers, &self.device_cookie) else {
            return false;
        };
        let Ok(plain) = sealer.unseal(PURPOSE, sealed) else {
            return false;
        };
        let Some((until, user)) = std::str::from_utf8(&plain)
            .ok()
            .and_then(|t| t.split_once(' '))
        else {
            return false;
        };
        user == user_key && until.parse::<u64>().is_ok_and(|u| u > unix_now())
    }
}
