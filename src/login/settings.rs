//! `[login]`: the session endpoints' settings, as validated by `config`.

use std::time::Duration;

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

impl LoginConfig {
    /// The cookies tessera sets: the login cookie (`cookie_name`), the login form's CSRF cookie
    /// (`{cookie_name}-csrf`) and the device cookie (`{cookie_name}-device`), in that order.
    pub fn own_cookies(&self) -> [String; 3] {
        let name = &self.cookie_name;
        [
            name.clone(),
            format!("{name}-csrf"),
            format!("{name}-device"),
        ]
    }
}

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
    /// Lifetime of the device cookie a browser gets at each login it makes, seconds
    /// (`login.device_cookie_max_age_seconds`; 0: none given or honoured). Its logins as that
    /// user count its own failures against `max_failures_per_user`, not the user's (the
    /// per-address limit holds). Default 30 days.
    pub device_cookie_max_age: u64,
    /// Heading and `<title>` of the login page. Default `Sign in`.
    pub page_title: String,
}
