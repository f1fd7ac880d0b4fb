//! Fair shares of the upstream pool: one user (one upstream credential, its `Authorization`
//! value; a `Basic` one's user name in any case) and one downstream connection (the streams of
//! one HTTP/2 connection) each hold at most `upstream.max_connections_per_user` upstream
//! connections at once. A request over its share waits (first come, first served) for one of
//! its own to end before it asks the pool for a slot, so it never holds a slot another user
//! could use meanwhile.
//!
//! Why: without it one authenticated client that trickles request bodies, or reads responses
//! with a closed flow-control window, holds every connection of the pool while other users'
//! requests wait. Must never: let a request take a pool slot before its shares, or let a user's
//! entry be replaced while one of its permits is out (its bound would then count twice).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use http::{HeaderMap, HeaderValue};

use super::ForwardError;

use crate::share::{Share, SharePermit};

/// The default of `upstream.max_connections_per_user` for a pool of `max_connections`: three
/// quarters of it, rounded up (at least 1), so one user leaves a quarter for the others.
pub fn default_per_user(max_connections: usize) -> usize {
    max_connections.saturating_mul(3).div_ceil(4).max(1)
}

/// The users' and downstream connections' shares of one pool.
pub struct Shares {
    /// Most upstream connections one user or one downstream connection holds at once; 0: off.
    per_user: usize,
    /// One share per credential in use, keyed by a keyed 128-bit hash of the credential (the
    /// table never holds a password); an entry whose share is gone (no session, request or
    /// permit refers to it) is made anew on next use, or pruned.
    users: Mutex<Users>,
    /// Hashes the credentials (its key random per process).
    hash: CredentialHash,
    /// Requests that waited because their user or downstream connection held its share.
    waited: AtomicU64,
    /// `upstream.max_event_streams`; `None` when it is the pool's cap (no bound).
    event_streams: Option<Arc<Share>>,
    /// Each user's part of the event streams, as of the pool ([`Shares::bounding_event_streams`]),
    /// keyed as `users`; empty and unused when shares are off.
    event_users: Mutex<Users>,
    /// Most event streams one user holds; 0: no bound of its own.
    events_per_user: usize,
}

/// A keyed 128-bit hash (SipHash-2-4) of an upstream credential, for tables keyed by user that
/// must never hold a password: collisions are beyond reach without the key, random per process.
pub(crate) struct CredentialHash(u64, u64);

impl CredentialHash {
    /// A new random key.
    pub(crate) fn new() -> Self {
        let mut k = [0u8; 16];
        getrandom::getrandom(&mut k).expect("the OS random source works");
        let (a, b) = k.split_at(8);
        Self(
            u64::from_le_bytes(a.try_into().expect("8 bytes")),
            u64::from_le_bytes(b.try_into().expect("8 bytes")),
        )
    }

    /// The hash of `credential` (an `Authorization` value).
    pub(crate) fn of(&self, credential: &HeaderValue) -> u128 {
        self.of_bytes(credential.as_bytes())
    }

    fn of_bytes(&self, bytes: &[u8]) -> u128 {
        use siphasher::sip128::Hasher128;
        use std::hash::Hasher;
        let mut h = siphasher::sip128::SipHasher24::new_with_keys(self.0, self.1);
        h.write(bytes);
        u128::from(h.finish128())
    }

    /// The hash of the account `credential` names, for bounds per user: a `Basic` one's user
    /// name in lower case (the failed-login limits' rule) with its password, so that `Alice`
    /// and `alice` (one account to an upstream that folds case, as Cyrus does by default) hold
    /// one share, not two; any other credential as [`CredentialHash::of`].
    pub(crate) fn of_user(&self, credential: &HeaderValue) -> u128 {
        use base64::Engine;
        let bytes = credential.as_bytes();
        let decoded = bytes
            .get(..6)
            .filter(|scheme| scheme.eq_ignore_ascii_case(b"basic "))
            .and_then(|_| {
                let b64 = base64::engine::general_purpose::STANDARD;
                b64.decode(bytes[6..].trim_ascii()).ok()
            })
            .map(zeroize::Zeroizing::new);
        let Some((user, password)) = decoded.as_ref().and_then(|d| {
            let colon = d.iter().position(|&b| b == b':')?;
            Some((std::str::from_utf8(&d[..colon]).ok()?, &d[colon..]))
        }) else {
            return self.of(credential);
        };
        let folded = zeroize::Zeroizing::new([user.to_lowercase().as_bytes(), password].concat());
        self.of_bytes(&folded)
    }
}

/// The users' table of [`Shares`].
#[derive(Default)]
struct Users {
    map: HashMap<u128, Weak<Share>>,
    /// Entries left by the last prune.
    live_after_prune: usize,
}

impl Users {
    /// The live share under `key`, or a new one of `limit` put there.
    fn share(&mut self, key: u128, limit: usize) -> Arc<Share> {
        if let Some(live) = self.map.get(&key).and_then(Weak::upgrade) {
            return live;
        }
        // Entries no one refers to leave once the table has doubled since the last pass.
        if self.map.len() >= 2 * self.live_after_prune.max(32) {
            self.map.retain(|_, share| share.strong_count() > 0);
            self.live_after_prune = self.map.len();
        }
        let share = Arc::new(Share::new(limit));
        self.map.insert(key, Arc::downgrade(&share));
        share
    }
}

/// The share permits one request holds while its upstream connection is checked out.
#[derive(Default)]
pub struct Held {
    _user: Option<SharePermit>,
    _downstream: Option<SharePermit>,
    /// Its place under `upstream.max_event_streams`, if it asked for an event stream.
    _event_stream: Option<EventPlace>,
}

/// An event stream's places: one of all the event streams', and one of its user's.
pub struct EventPlace {
    _all: SharePermit,
    _user: Option<SharePermit>,
}

impl Held {
    /// Whether it holds no permit.
    pub fn is_empty(&self) -> bool {
        self._user.is_none() && self._downstream.is_none() && self._event_stream.is_none()
    }

    /// The same permits, and `event_stream`'s.
    pub fn with(self, event_stream: Option<EventPlace>) -> Self {
        Self {
            _event_stream: event_stream,
            ..self
        }
    }
}

impl Shares {
    /// Shares of `per_user` connections each; `per_user >= max_connections` turns them off (no
    /// cost per request).
    pub fn new(per_user: usize, max_connections: usize) -> Self {
        Self {
            per_user: if per_user >= max_connections {
                0
            } else {
                per_user
            },
            users: Mutex::new(Users::default()),
            hash: CredentialHash::new(),
            waited: AtomicU64::new(0),
            event_streams: None,
            event_users: Mutex::new(Users::default()),
            events_per_user: 0,
        }
    }

    /// The same shares, with at most `max` event streams out of a pool of `max_connections`
    /// (`upstream.max_event_streams`; equal: no bound); with shares on, one user holds at most
    /// the part of them its share is of the pool (rounded up): one user's pages cannot take
    /// every place.
    pub fn bounding_event_streams(self, max: usize, max_connections: usize) -> Self {
        let bounded = max < max_connections;
        let per_user = (self.per_user * max)
            .div_ceil(max_connections.max(1))
            .max(1);
        Self {
            event_streams: bounded.then(|| Arc::new(Share::new(max))),
            events_per_user: if bounded && self.per_user > 0 && per_user < max {
                per_user
            } else {
                0
            },
            ..self
        }
    }

    /// A place under `upstream.max_event_streams` for a request (`method`, `fields`) that asks
    /// for an event stream, held with its connection ([`Held::with`]); `None` for any other request, or with
    /// no bound. Never waits: a page's `EventSource` would hold its place in the queue.
    ///
    /// Errors: [`ForwardError::TooManyEventStreams`] when every place is taken, or every one
    /// of its user's (by its upstream credential, `fields`' `Authorization`).
    pub fn event_stream(
        &self,
        method: &http::Method,
        fields: &HeaderMap,
    ) -> Result<Option<EventPlace>, ForwardError> {
        let places = match &self.event_streams {
            Some(places) if super::request::asks_for_event_stream(method, fields) => places,
            _ => return Ok(None),
        };
        let all = places
            .try_acquire()
            .ok_or(ForwardError::TooManyEventStreams)?;
        let user = match self.events_per_user {
            0 => None,
            limit => {
                let none = HeaderValue::from_static("");
                let credential = fields.get(http::header::AUTHORIZATION).unwrap_or(&none);
                let key = self.hash.of_user(credential);
                let mut users = self.event_users.lock().unwrap_or_else(|p| p.into_inner());
                let share = users.share(key, limit);
                drop(users);
                let permit = share.try_acquire();
                Some(permit.ok_or(ForwardError::TooManyEventStreams)?)
            }
        };
        Ok(Some(EventPlace {
            _all: all,
            _user: user,
        }))
    }

    /// A new downstream connection's share, for the streams of one HTTP/2 connection; `None`
    /// when shares are off.
    pub fn for_connection(&self) -> Option<Arc<Share>> {
        (self.per_user > 0).then(|| Arc::new(Share::new(self.per_user)))
    }

    /// Requests that waited for their share so far.
    pub fn waited(&self) -> u64 {
        self.waited.load(Ordering::Relaxed)
    }

    /// The share of the user whose upstream credential is `credential` (requests without one
    /// share one entry), made on first use; `None` when shares are off. The caller may keep it
    /// (a session does) to skip this lookup on its next requests.
    pub fn user(&self, credential: Option<&HeaderValue>) -> Option<Arc<Share>> {
        if self.per_user == 0 {
            return None;
        }
        let none = HeaderValue::from_static("");
        let credential = credential.unwrap_or(&none);
        let key = self.hash.of_user(credential);
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        Some(users.share(key, self.per_user))
    }

    /// Takes one permit of `user` and one of `downstream`, in that order (every request takes
    /// them in the same order, so two requests can never each hold what the other waits for),
    /// waiting for them if need be.
    pub async fn take(&self, user: Option<&Arc<Share>>, downstream: Option<&Arc<Share>>) -> Held {
        // Nearly always both are free: taken without a wait, and the waiting path (boxed)
        // does not enlarge every request's future.
        let free = (
            user.map(|s| s.try_acquire()),
            downstream.map(|s| s.try_acquire()),
        );
        match free {
            (None | Some(Some(_)), None | Some(Some(_))) => Held {
                _user: free.0.flatten(),
                _downstream: free.1.flatten(),
                _event_stream: None,
            },
            _ => {
                drop(free);
                Box::pin(self.take_waiting(user, downstream)).await
            }
        }
    }

    /// [`Shares::take`] when a share is full: waits for each in order.
    async fn take_waiting(
        &self,
        user: Option<&Arc<Share>>,
        downstream: Option<&Arc<Share>>,
    ) -> Held {
        Held {
            _user: match user {
                Some(share) => Some(self.acquire(share).await),
                None => None,
            },
            _downstream: match downstream {
                Some(share) => Some(self.acquire(share).await),
                None => None,
            },
            _event_stream: None,
        }
    }

    async fn acquire(&self, share: &Arc<Share>) -> SharePermit {
        if let Some(permit) = share.try_acquire() {
            return permit;
        }
        self.waited.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            "request waits: its user or connection holds its share of the upstream pool"
        );
        share.acquire().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn bob() -> HeaderValue {
        HeaderValue::from_static("Basic Ym9iOnB3")
    }

    #[test]
    fn the_default_leaves_a_quarter_to_the_others() {
        assert_eq!(default_per_user(64), 48);
        assert_eq!(default_per_user(8), 6);
        assert_eq!(default_per_user(2), 2);
        assert_eq!(default_per_user(1), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_user_over_its_share_waits_for_its_own_and_others_go_on() {
        let shares = Shares::new(2, 4);
        let alice = HeaderValue::from_static("Basic YWxpY2U6cHc=");
        let alice = shares.user(Some(&alice));
        let a1 = shares.take(alice.as_ref(), None).await;
        let _a2 = shares.take(alice.as_ref(), None).await;
        let third = shares.take(alice.as_ref(), None);
        tokio::pin!(third);
        assert!(
            tokio::time::timeout(Duration::from_secs(1), &mut third)
                .await
                .is_err(),
            "alice's third request did not wait"
        );
        // Bob is not held up by alice.
        let bob = shares.user(Some(&bob()));
        let _b = tokio::time::timeout(Duration::from_secs(1), shares.take(bob.as_ref(), None))
            .await
            .expect("bob waited for alice's share");
        drop(a1);
        tokio::time::timeout(Duration::from_secs(1), third)
            .await
            .expect("alice's third request goes on once one of hers ended");
        assert_eq!(shares.waited(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_streams_of_one_connection_share_one_bound_across_users() {
        let shares = Shares::new(1, 4);
        let conn = shares.for_connection().expect("shares on");
        let alice = HeaderValue::from_static("Basic YWxpY2U6cHc=");
        let (alice, bob) = (shares.user(Some(&alice)), shares.user(Some(&bob())));
        let first = shares.take(alice.as_ref(), Some(&conn)).await;
        let other = shares.take(bob.as_ref(), Some(&conn));
        tokio::pin!(other);
        assert!(tokio::time::timeout(Duration::from_secs(1), &mut other)
            .await
            .is_err());
        drop(first);
        tokio::time::timeout(Duration::from_secs(1), other)
            .await
            .expect("goes on once the connection's other stream ended");
    }

    #[test]
    fn one_user_holds_its_part_of_the_event_streams_and_others_go_on() {
        let get = http::Method::GET;
        let fields = |auth: &'static str| {
            let mut f = HeaderMap::new();
            f.insert(
                http::header::ACCEPT,
                HeaderValue::from_static("text/event-stream"),
            );
            f.insert(http::header::AUTHORIZATION, HeaderValue::from_static(auth));
            f
        };
        // 8 places of a pool of 16; a user's share is 12 of 16, so 6 of the 8.
        let shares = Shares::new(12, 16).bounding_event_streams(8, 16);
        let alice = fields("Basic YWxpY2U6cHc=");
        let held: Vec<_> = (0..6)
            .map(|_| shares.event_stream(&get, &alice).unwrap())
            .collect();
        assert!(matches!(
            shares.event_stream(&get, &alice),
            Err(ForwardError::TooManyEventStreams)
        ));
        let bob = fields("Basic Ym9iOnB3");
        let b1 = shares.event_stream(&get, &bob).unwrap();
        let _b2 = shares.event_stream(&get, &bob).unwrap();
        // All 8 taken: a place refused to alice was not kept from the others.
        assert!(shares.event_stream(&get, &bob).is_err());
        drop(b1);
        assert!(shares.event_stream(&get, &bob).unwrap().is_some());
        drop(held);
        // Shares off (one service credential): only the bound of all.
        let shared = Shares::new(16, 16).bounding_event_streams(8, 16);
        let all: Vec<_> = (0..8)
            .map(|_| shared.event_stream(&get, &alice).unwrap())
            .collect();
        assert!(shared.event_stream(&get, &alice).is_err());
        drop(all);
    }

    #[test]
    fn one_account_in_any_case_is_one_user() {
        use base64::Engine;
        let basic = |pair: &str| {
            let b64 = base64::engine::general_purpose::STANDARD.encode(pair);
            HeaderValue::from_str(&format!("Basic {b64}")).unwrap()
        };
        let h = CredentialHash::new();
        let alice = h.of_user(&basic("alice:pw"));
        assert_eq!(h.of_user(&basic("Alice:pw")), alice);
        assert_eq!(h.of_user(&basic("ALICE:pw")), alice);
        assert_ne!(h.of_user(&basic("alice:PW")), alice);
        assert_ne!(h.of_user(&basic("bob:pw")), alice);
        let bearer = HeaderValue::from_static("Bearer Abc");
        assert_eq!(h.of_user(&bearer), h.of(&bearer));
        let broken = HeaderValue::from_static("Basic !!!");
        assert_eq!(h.of_user(&broken), h.of(&broken));
    }

    #[test]
    fn shares_at_or_over_the_pool_are_off() {
        let shares = Shares::new(4, 4);
        assert!(shares.for_connection().is_none());
        assert!(shares.user(Some(&bob())).is_none());
        assert!(shares.users.lock().unwrap().map.is_empty());
    }
}
