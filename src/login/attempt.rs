//! One login attempt: the form or JSON read, the per-address and per-user limits (in flight, and
//! failures in this process and in the store), the upstream's check of the credentials, and the
//! session and token made when it says yes. Must never: create a session the upstream did not
//! accept, or keep a password longer than the attempt.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderValue;
use http::request::Parts;
use http::Response;
use http_body::Body;
use serde::Deserialize;
use zeroize::Zeroizing;

use crate::error::ProxyError;
use crate::per_ip::client_key;
use crate::seal::Credentials;
use crate::session::{Sessions, Store};
use crate::token::{self, TokenSource, Verifier};
use crate::upstream::{BoxError, ProxyBody};

use super::page::safe_redirect;
use super::request::{check_same_origin, constant_eq, content_type_is, cookie_value, read_body};
use super::{EndpointRequest, Login, Refusal};
use crate::session::LOGIN_FAILURES as SHARED_FAILURES;

/// Most concurrent login checks per client address (one per user name).
pub(super) const MAX_IN_FLIGHT_PER_IP: u32 = 4;

/// Longest accepted user name, bytes.
pub(super) const MAX_USER_BYTES: usize = 256;

#[derive(Hash, PartialEq, Eq, Clone)]
pub(super) enum InFlightKey {
    Ip(IpAddr),
    User(String),
    /// Every check of this process.
    All,
}

/// The most login checks in flight at once for a pool of `max_connections`: a quarter of it
/// (at least 1). Each check holds an upstream connection while the upstream hashes a password;
/// without a bound, attempts from many addresses (an IPv6 /48 holds 65,536 /64s) would fill
/// the pool's queue ahead of every user's request.
pub(super) fn max_checks(max_connections: usize) -> u32 {
    u32::try_from(max_connections / 4)
        .unwrap_or(u32::MAX)
        .max(1)
}

/// Releases an in-flight slot when the login check ends, however it ends.
pub(super) struct InFlight<'a> {
    map: &'a Mutex<HashMap<InFlightKey, u32>>,
    keys: [InFlightKey; 3],
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        for k in &self.keys {
            if let Some(n) = map.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    map.remove(k);
                }
            }
        }
    }
}

/// Records a login failure for its client address and user name in this process when dropped
/// still holding them: the attempt's future was dropped while the upstream checked the password.
/// (The shared count in the store was taken before the check, and is kept.)
pub(super) struct ChargeIfAbandoned<'a> {
    login: &'a Login,
    keys: Option<(IpAddr, String)>,
}

impl Drop for ChargeIfAbandoned<'_> {
    fn drop(&mut self) {
        if let Some((ip, user)) = self.keys.take() {
            self.login.by_ip.record_failure(ip);
            self.login.by_user.record_failure(user);
        }
    }
}

/// The store keys of the shared failed-login counts of a client address (its rate-limit key)
/// and of a user name: its SHA-256 in hex, which bounds the key's length and keeps the name out
/// of plain sight (a hash of a guessable name is not a secret).
pub(super) fn shared_failure_keys(ip: IpAddr, user: &str) -> [String; 2] {
    use sha2::{Digest, Sha256};
    use std::fmt::Write;
    let mut hex = String::with_capacity(64);
    for b in Sha256::digest(user.as_bytes()) {
        let _ = write!(hex, "{b:02x}");
    }
    [
        format!("{SHARED_FAILURES}ip:{ip}"),
        format!("{SHARED_FAILURES}user:{hex}"),
    ]
}

/// Gives back an attempt taken from the shared counts at `keys` (see `Login::login`), in a task
/// of its own, so that a client leaving meanwhile cannot keep it counted. A store that cannot
/// take it back is logged: the attempt stays counted as a failure. (A window that ends while the
/// upstream checks the password has the attempt given back to the next one: one too few there.)
pub(super) fn give_back(store: &Store, keys: Vec<String>) {
    let store = store.clone();
    tokio::spawn(async move {
        for key in &keys {
            if let Err(e) = store.decrement(key).await {
                tracing::warn!(cause = %e, "login: cannot take back an attempt counted in the store");
            }
        }
    });
}

/// What a login request carried.
#[derive(Deserialize)]
pub(super) struct LoginForm {
    username: String,
    #[serde(deserialize_with = "zeroizing_string")]
    password: Zeroizing<String>,
    #[serde(default)]
    rd: Option<String>,
    #[serde(default)]
    csrf: Option<String>,
}

pub(super) fn zeroizing_string<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Zeroizing<String>, D::Error> {
    String::deserialize(d).map(Zeroizing::new)
}

impl Login {
    pub(super) async fn login<B>(
        &self,
        req: &EndpointRequest<'_>,
        body: B,
        sid_out: &mut Option<Arc<str>>,
    ) -> (Response<ProxyBody>, Option<String>)
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let EndpointRequest {
            parts,
            host,
            peer,
            verifier,
            sessions,
            upstream,
            request_id,
        } = *req;
        let shape = super::page::Shape::of(parts, &self.csrf_cookie);
        let form = match self.read_login(parts, body, host, shape.form).await {
            Ok(f) => f,
            Err(r) => return self.refuse(r, shape, None),
        };
        let rd = form.rd.as_deref().and_then(safe_redirect);
        if form.rd.is_some() && rd.is_none() {
            return self.refuse(Refusal::Bad("rd must be a same-origin path"), shape, None);
        }
        let ip_key = client_key(peer.ip());
        // What the second limit counts: the user name, or for a device this user signed in on,
        // that device's own failures, under the same cap (see `device`).
        let device = self.known_device(&parts.headers, sessions.sealer(), form.username.trim());
        let user_key = device.unwrap_or_else(|| form.username.trim().to_lowercase());
        let wait = self
            .by_ip
            .blocked_for(&ip_key)
            .max(self.by_user.blocked_for(&user_key));
        if let Some(wait) = wait {
            return self.refuse(Refusal::Limited(wait.as_secs().max(1)), shape, rd);
        }
        let _slot = match self.enter(ip_key, &user_key) {
            Ok(slot) => slot,
            Err(refusal) => return self.refuse(refusal, shape, rd),
        };
        let creds =
            match Credentials::new(form.username.trim().to_owned(), form.password.to_string()) {
                Ok(c) => c,
                Err(_) => {
                    return self.refuse(Refusal::Bad("user name or password unusable"), shape, rd)
                }
            };
        drop(form.password);
        // The count every instance on the store shares (without it, n instances behind a load
        // balancer would allow n times the attempts): the attempt is counted as a failure before
        // the upstream is asked, and given back if it was not one. Counting first, atomically,
        // means parallel attempts on several instances cannot all pass the last free one.
        let store = sessions.store();
        let shared = shared_failure_keys(ip_key, &user_key);
        if let Err(refusal) = self
            .count_shared(sessions, &shared, (ip_key, &user_key))
            .await
        {
            return self.refuse(refusal, shape, rd);
        }
        // A client that leaves while the upstream checks its password drops this future (the
        // server watches for that): it is charged a failure all the same, or closing each
        // connection early would try passwords against the upstream without limit.
        let mut abandoned = ChargeIfAbandoned {
            login: self,
            keys: Some((ip_key, user_key)),
        };
        let checked = self
            .check_upstream(&creds, request_id, peer.ip(), upstream)
            .await;
        let (ip_key, user_key) = abandoned.keys.take().expect("taken only here");
        match checked {
            Ok(true) => give_back(store, shared.to_vec()),
            Ok(false) => {
                self.by_ip.record_failure(ip_key);
                self.by_user.record_failure(user_key);
                return self.refuse(Refusal::Credentials, shape, rd);
            }
            // The upstream did not answer: not the client's failure.
            Err(e) => {
                give_back(store, shared.to_vec());
                return self.refuse(Refusal::Proxy(e), shape, rd);
            }
        }
        let replaced = self.replaced_session(parts, verifier, creds.user());
        self.issue(&creds, sessions, replaced, rd, shape, sid_out)
            .await
    }

    /// The session this browser's login cookie names (its token verified but for its expiry)
    /// when it is `user`'s (the name in any case, as the failed-login limits take it), which a
    /// new login of `user` replaces: left alone, it would keep its sealed password in the store
    /// until its TTL, out of reach of a logout (the cookie now names the new one). Another
    /// user's session is left to that user (a shared browser, a page holding two accounts).
    fn replaced_session(&self, parts: &Parts, verifier: &Verifier, user: &str) -> Option<Arc<str>> {
        let source = TokenSource::Cookie(self.cfg.cookie_name.clone());
        let tok = token::extract(&parts.headers, std::slice::from_ref(&source)).ok()?;
        let verified = verifier
            .verify_ignoring_expiry(&tok, crate::unix_now())
            .ok()?;
        let owner = verified.sub.as_deref().map(str::to_lowercase);
        (owner.as_deref() == Some(user.trim().to_lowercase().as_str())).then_some(verified.sid)
    }

    /// Counts the attempt as a failure in the store, under both `shared` keys (address, user),
    /// before the upstream is asked; refuses it when either is over its cap (and gives both
    /// counts back: a refused attempt counts for neither side), and blocks that side here
    /// (`local`: address, user name) for the rest of the shared window, so the next attempts
    /// are refused without a store call: the local block alone ends sooner (one failure
    /// forgiven every window / cap) than the shared count's window.
    ///
    /// Errors: [`Refusal::Limited`] over a cap, [`Refusal::Proxy`] when the store fails.
    async fn count_shared(
        &self,
        sessions: &Sessions,
        shared: &[String; 2],
        (ip_key, user_key): (IpAddr, &str),
    ) -> Result<(), Refusal> {
        let (store, window) = (sessions.store(), self.cfg.failure_window.as_secs());
        // Within the store's deadline, as every other call a request waits on.
        let counted = tokio::join!(
            sessions.deadline(store.increment(&shared[0], window)),
            sessions.deadline(store.increment(&shared[1], window))
        );
        let ((ip_n, ip_left), (user_n, user_left)) = match counted {
            (Ok(ip), Ok(user)) => (ip, user),
            (ip, user) => {
                // Whichever side was counted is taken back: the attempt was not made.
                let counted: Vec<String> = [(ip.is_ok(), &shared[0]), (user.is_ok(), &shared[1])]
                    .into_iter()
                    .filter(|(ok, _)| *ok)
                    .map(|(_, key)| key.clone())
                    .collect();
                give_back(store, counted);
                return Err(Refusal::Proxy(ProxyError::StoreUnavailable));
            }
        };
        let over = [
            (ip_n > u64::from(self.cfg.max_failures_per_ip)).then_some(ip_left),
            (user_n > u64::from(self.cfg.max_failures_per_user)).then_some(user_left),
        ];
        // At most a window: the seconds left come from a row anyone with the store could write.
        let wait = |secs: u64| Duration::from_secs(secs).min(self.cfg.failure_window);
        if let Some(secs) = over[0] {
            self.by_ip.block(ip_key, wait(secs));
        }
        if let Some(secs) = over[1] {
            self.by_user.block(user_key.to_owned(), wait(secs));
        }
        if let Some(secs) = over.into_iter().flatten().max() {
            // Refused without asking: counts for neither side, so an address over its cap
            // cannot lock out the users it names, nor a user over hers the address she shares.
            give_back(store, shared.to_vec());
            return Err(Refusal::Limited(
                secs.min(self.cfg.failure_window.as_secs()),
            ));
        }
        Ok(())
    }

    /// Takes an in-flight slot for this address and user, and one of all.
    ///
    /// Errors: [`Refusal::Limited`] when the address or the user is at its cap,
    /// [`Refusal::Busy`] when the process is ([`max_checks`]).
    pub(super) fn enter(&self, ip: IpAddr, user: &str) -> Result<InFlight<'_>, Refusal> {
        let keys = [
            InFlightKey::Ip(ip),
            InFlightKey::User(user.to_owned()),
            InFlightKey::All,
        ];
        let mut map = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        let busy = |k: &InFlightKey, cap: u32| map.get(k).is_some_and(|n| *n >= cap);
        if busy(&keys[0], MAX_IN_FLIGHT_PER_IP) || busy(&keys[1], 1) {
            return Err(Refusal::Limited(1));
        }
        if busy(&keys[2], self.max_checks) {
            return Err(Refusal::Busy);
        }
        for k in &keys {
            *map.entry(k.clone()).or_insert(0) += 1;
        }
        drop(map);
        Ok(InFlight {
            map: &self.in_flight,
            keys,
        })
    }

    /// Reads and checks a login body: same-origin POST, size/time caps, form or JSON, and the
    /// double-submit CSRF token for forms.
    pub(super) async fn read_login<B>(
        &self,
        parts: &Parts,
        body: B,
        host: &HeaderValue,
        is_form: bool,
    ) -> Result<LoginForm, Refusal>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        check_same_origin(parts, host)?;
        let is_json = content_type_is(parts, "application/json");
        if !is_form && !is_json {
            return Err(Refusal::MediaType);
        }
        let bytes = read_body(body).await?;
        let form: LoginForm = if is_json {
            serde_json::from_slice(&bytes).map_err(|_| {
                Refusal::Bad("body must be {\"username\": string, \"password\": string}")
            })?
        } else {
            let mut fields: HashMap<String, Zeroizing<String>> = HashMap::new();
            for (k, v) in form_urlencoded::parse(&bytes) {
                if fields
                    .insert(k.into_owned(), Zeroizing::new(v.into_owned()))
                    .is_some()
                {
                    return Err(Refusal::Bad("repeated form field"));
                }
            }
            let mut take = |k: &str| fields.remove(k);
            LoginForm {
                username: take("username")
                    .map(|v| v.to_string())
                    .ok_or(Refusal::Bad("username missing"))?,
                password: take("password").ok_or(Refusal::Bad("password missing"))?,
                rd: take("rd").map(|v| v.to_string()),
                csrf: take("csrf").map(|v| v.to_string()),
            }
        };
        if is_form {
            let cookie = cookie_value(&parts.headers, &self.csrf_cookie);
            let ok = matches!((&form.csrf, cookie), (Some(f), Some(c)) if !f.is_empty() && constant_eq(f.as_bytes(), c.as_bytes()));
            if !ok {
                return Err(Refusal::Forbidden(
                    "CSRF token missing or wrong; reload the login page",
                ));
            }
        }
        if form.username.trim().is_empty() || form.password.is_empty() {
            return Err(Refusal::Bad("username and password are required"));
        }
        if form.username.len() > MAX_USER_BYTES {
            return Err(Refusal::Bad("username too long"));
        }
        Ok(form)
    }
}
