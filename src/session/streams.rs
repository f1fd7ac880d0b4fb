//! Open responses by session, so that a revoked or expired session's responses end (DESIGN.md,
//! the session side: "open streams of that session are closed").
//!
//! A response whose `Content-Length` body arrived with its head costs nothing here. Any other
//! upstream body gets an armed watch (one allocation), and is registered under its sid when it
//! first waits for the upstream, or goes on past its second frame with nothing left buffered, or
//! past its eighth frame (server-sent events, a JMAP push stream, a download the upstream sends
//! faster than the client reads). From then on it ends with an error (HTTP/1.1: the connection
//! closes before the body's end; h2: the stream is reset) when:
//! - the session is revoked through this instance (logout, the upstream refusing the stored
//!   credentials): at once;
//! - the store reports the session's key changed (another instance's logout, a `DEL` by any
//!   writer) and a fresh read finds it gone or unusable: within the invalidation stream's delay
//!   plus one store read;
//! - the invalidation stream comes back after a loss, or the sealing keys are reloaded
//!   (SIGHUP): every registered sid is read again;
//! - the session's own expiry (`expires_at`, as it was when the request was authenticated)
//!   passes by the wall clock.
//!
//! A write that leaves the session usable (a reseal, a rewrite of the same record) ends nothing.
//! Must never: end another session's response, or miss a revocation that raced the request
//! between the store read that produced its session and its registration (the per-bucket
//! epochs, see [`OpenStreams::epoch`]).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// Buckets of sids sharing one change epoch: a change of one sid makes the registration of a
/// response of another sid in its bucket re-read the store once. A cached session's epoch
/// is as old as its entry (up to `session.cache_ttl_seconds`), so with 64 buckets and a change
/// a second nearly every registration re-read; with 4,096, about 7 in 100.
const BUCKETS: usize = 4096;

/// The registry of open responses of one serving process, by sid.
pub(crate) struct OpenStreams {
    by_sid: Mutex<HashMap<Arc<str>, Open>>,
    /// Changes seen per sid bucket ([`bucket`]): bumped after the session cache evicted the sid.
    epochs: [AtomicU64; BUCKETS],
    /// Sids to read again from the store (to the task following the invalidation stream).
    recheck: UnboundedSender<Arc<str>>,
    /// Responses ended because their session was revoked or expired, since start.
    cut: AtomicU64,
}

/// The open responses of one sid.
struct Open {
    /// Cancelled when the session is found revoked.
    revoked: CancellationToken,
    /// Responses registered and not yet ended.
    count: usize,
}

/// The bucket of `sid` ([`super::cache::spread`]). Sids sharing one only cost spare store
/// reads, never a missed revocation.
fn bucket(sid: &str) -> usize {
    (super::cache::spread(sid) % BUCKETS as u64) as usize
}

impl OpenStreams {
    /// An empty registry; sids whose registration raced a change are sent on `recheck`.
    pub(crate) fn new(recheck: UnboundedSender<Arc<str>>) -> Self {
        Self {
            by_sid: Mutex::new(HashMap::new()),
            epochs: std::array::from_fn(|_| AtomicU64::new(0)),
            recheck,
            cut: AtomicU64::new(0),
        }
    }

    /// The change epoch of `sid`'s bucket. Taken before the store read that produces a session
    /// (kept with it in the cache): if it moved by the time a response of that session registers,
    /// the session may have been revoked since that read, so the registration asks for a fresh
    /// one.
    pub(crate) fn epoch(&self, sid: &str) -> u64 {
        self.epochs[bucket(sid)].load(Ordering::SeqCst)
    }

    /// Records that `sid`'s session was written or deleted. Called after the session cache
    /// evicted it: a request that took the epoch after this bump resolves without that entry.
    pub(crate) fn changed(&self, sid: &str) {
        self.epochs[bucket(sid)].fetch_add(1, Ordering::SeqCst);
    }

    /// Records that any session may have changed (the invalidation stream is back after a
    /// loss: changes made meanwhile were not reported; or the sealing keys were reloaded).
    pub(crate) fn changed_all(&self) {
        for e in &self.epochs {
            e.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Whether `sid` has open responses now.
    pub(crate) fn is_open(&self, sid: &str) -> bool {
        self.lock().contains_key(sid)
    }

    /// Every sid with open responses now.
    pub(crate) fn open_sids(&self) -> Vec<Arc<str>> {
        self.lock().keys().cloned().collect()
    }

    /// Responses registered and not ended now.
    pub(crate) fn open(&self) -> u64 {
        self.lock().values().map(|o| o.count as u64).sum()
    }

    /// Responses ended because their session was revoked or expired, since start.
    pub(crate) fn cut_total(&self) -> u64 {
        self.cut.load(Ordering::Relaxed)
    }

    /// Ends every open response of `sid` (its session is gone); returns how many.
    pub(crate) fn cut(&self, sid: &str) -> usize {
        let open = {
            let mut map = self.lock();
            let Some(open) = map.remove(sid) else {
                return 0;
            };
            // Under the lock: a `release` that takes it next sees its token cancelled and leaves
            // any newer entry for this sid alone.
            open.revoked.cancel();
            open
        };
        self.cut.fetch_add(open.count as u64, Ordering::Relaxed);
        tracing::info!(
            sid_hash = %super::sid_hash(sid),
            responses = open.count,
            "open responses of a revoked session ended"
        );
        open.count
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Open>> {
        // A panic while holding this lock leaves the map consistent (each step is one insert,
        // update or remove), so a poisoned lock is used as it is.
        self.by_sid.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers one response of `sid`, resolved at `epoch`; its token is cancelled when the
    /// session is found revoked.
    fn register(&self, sid: &Arc<str>, epoch: u64) -> CancellationToken {
        let token = {
            let mut map = self.lock();
            let open = map.entry(sid.clone()).or_insert_with(|| Open {
                revoked: CancellationToken::new(),
                count: 0,
            });
            open.count += 1;
            open.revoked.clone()
        };
        // After the insert: a change whose follower looked for `sid` before it was there bumped
        // the epoch first, so it is seen here (see `changed`).
        if self.epoch(sid) != epoch {
            let _ = self.recheck.send(sid.clone());
        }
        token
    }

    /// Ends one registration of `sid` (its response ended or was dropped).
    fn release(&self, sid: &str, token: &CancellationToken) {
        let mut map = self.lock();
        if token.is_cancelled() {
            return; // cut: its entry is already gone (a new one may be another registration's)
        }
        if let Some(open) = map.get_mut(sid) {
            open.count -= 1;
            if open.count == 0 {
                map.remove(sid);
            }
        }
    }
}

/// Why an open response ended early.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Ended {
    /// The session was revoked (or its record became unusable).
    #[error("session revoked; open response ended")]
    Revoked,
    /// The session's `expires_at` passed.
    #[error("session expired; open response ended")]
    Expired,
}

/// What a response body needs to be ended with its session: taken when the request was
/// authenticated, registered only if the body waits or goes on (see [`Watch::poll_ended`]).
pub(crate) struct Revocable {
    streams: Arc<OpenStreams>,
    sid: Arc<str>,
    epoch: u64,
    /// Seconds since the Unix epoch.
    expires_at: Option<u64>,
    /// Frames the body returned and went on after (saturating).
    frames: u8,
}

impl Revocable {
    pub(crate) fn new(
        streams: Arc<OpenStreams>,
        sid: Arc<str>,
        epoch: u64,
        expires_at: Option<u64>,
    ) -> Self {
        Self {
            streams,
            sid,
            epoch,
            expires_at,
            frames: 0,
        }
    }
}

/// A response body's tie to its session: armed until the body waits or goes on, then
/// registered.
/// One pointer wide (the state is boxed), so the body it rides in stays small: only bodies still
/// open when their head arrived get one.
pub struct Watch(Box<State>);

enum State {
    /// Not registered: the body has not waited yet.
    Armed(Revocable),
    /// Registered under its sid.
    Registered(Registered),
    /// Ended (reported once).
    Done,
}

/// A registered response.
struct Registered {
    streams: Arc<OpenStreams>,
    sid: Arc<str>,
    token: CancellationToken,
    revoked: Pin<Box<WaitForCancellationFutureOwned>>,
    /// Fires at `expires_at` (re-armed if the wall clock says it came early).
    expiry: Option<(u64, Pin<Box<tokio::time::Sleep>>)>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.streams.release(&self.sid, &self.token);
    }
}

/// Time left until `expires_at` (seconds since the Unix epoch), zero if it passed;
/// `Duration::MAX` for a time beyond what the system clock can name (a stored record may say
/// anything).
fn until(expires_at: u64) -> Duration {
    match UNIX_EPOCH.checked_add(Duration::from_secs(expires_at)) {
        Some(at) => at
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
        None => Duration::MAX,
    }
}

impl Watch {
    /// A watch for the response `r` describes, not yet registered.
    pub(crate) fn new(r: Revocable) -> Self {
        Self(Box::new(State::Armed(r)))
    }

    /// Polls for the session's end. `waiting`: the body is waiting for the upstream;
    /// `went_on`: it returned a frame and is not at its end; `drained`: nothing of it is left
    /// buffered (its next frame has to be read from the socket). An armed watch registers (and
    /// from then on wakes `cx` when the session ends) at the first wait, when it goes on drained
    /// after its first frame, or after [`MAX_ARMED_FRAMES`] frames whatever the buffer held: a
    /// body the upstream sends faster than the client reads may never wait, while a small
    /// chunked body that arrived whole ends without registering. Ready once, with why.
    pub fn poll_ended(
        &mut self,
        cx: &mut Context<'_>,
        waiting: bool,
        went_on: bool,
        drained: bool,
    ) -> Poll<Ended> {
        let state = &mut *self.0;
        if let State::Armed(r) = state {
            let register =
                waiting || went_on && (drained && r.frames > 0 || r.frames >= MAX_ARMED_FRAMES);
            if !register {
                r.frames = r.frames.saturating_add(u8::from(went_on));
                return Poll::Pending;
            }
            let token = r.streams.register(&r.sid, r.epoch);
            *state = State::Registered(Registered {
                revoked: Box::pin(token.clone().cancelled_owned()),
                expiry: r
                    .expires_at
                    .map(|e| (e, Box::pin(tokio::time::sleep(until(e).min(RECHECK_CLOCK))))),
                token,
                streams: r.streams.clone(),
                sid: r.sid.clone(),
            });
        }
        let State::Registered(reg) = state else {
            return Poll::Pending;
        };
        let ended = if reg.revoked.as_mut().poll(cx).is_ready() {
            Ended::Revoked
        } else if reg.expiry.as_mut().is_some_and(|(at, sleep)| {
            // The timer is monotonic, `expires_at` wall-clock time: it fires at least every
            // minute and is re-armed until the wall clock agrees (a clock step, a VM resume).
            while sleep.as_mut().poll(cx).is_ready() {
                let left = until(*at);
                if left.is_zero() {
                    return true;
                }
                sleep
                    .as_mut()
                    .reset(tokio::time::Instant::now() + left.min(RECHECK_CLOCK));
            }
            false
        }) {
            reg.streams.cut.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                sid_hash = %super::sid_hash(&reg.sid),
                "open response of an expired session ended"
            );
            Ended::Expired
        } else {
            return Poll::Pending;
        };
        *state = State::Done;
        Poll::Ready(ended)
    }
}

/// Frames an armed body may return before it registers even though its next frame was already
/// buffered each time (socket reads that happen to end on chunk boundaries).
const MAX_ARMED_FRAMES: u8 = 8;

/// Longest expiry timer: the wall clock is checked again at least this often, so a clock step
/// makes a cut at most this late (and `Instant` arithmetic stays far from overflow).
const RECHECK_CLOCK: Duration = Duration::from_secs(60);

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Waker;

    fn registry() -> (
        Arc<OpenStreams>,
        tokio::sync::mpsc::UnboundedReceiver<Arc<str>>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (Arc::new(OpenStreams::new(tx)), rx)
    }

    fn armed(streams: &Arc<OpenStreams>, sid: &str, expires_at: Option<u64>) -> Watch {
        let epoch = streams.epoch(sid);
        Watch::new(Revocable::new(
            streams.clone(),
            Arc::from(sid),
            epoch,
            expires_at,
        ))
    }

    fn poll(w: &mut Watch, waiting: bool) -> Poll<Ended> {
        w.poll_ended(
            &mut Context::from_waker(Waker::noop()),
            waiting,
            false,
            true,
        )
    }

    #[tokio::test]
    async fn a_body_that_never_waits_registers_when_it_goes_on_past_its_first_frame() {
        let (streams, _rx) = registry();
        let mut w = armed(&streams, "sid-fast", None);
        let cx = &mut Context::from_waker(Waker::noop());
        // first frame, more to come: not yet (a small chunked body ends on the next poll)
        assert_eq!(w.poll_ended(cx, false, true, true), Poll::Pending);
        assert_eq!(streams.open(), 0);
        // second frame and still going, nothing buffered: a download faster than its reader
        assert_eq!(w.poll_ended(cx, false, true, true), Poll::Pending);
        assert_eq!(streams.open(), 1);
        streams.cut("sid-fast");
        assert_eq!(
            w.poll_ended(cx, false, true, true),
            Poll::Ready(Ended::Revoked)
        );
        // With the next frame always already buffered: after MAX_ARMED_FRAMES frames.
        let mut w = armed(&streams, "sid-buffered", None);
        for _ in 0..MAX_ARMED_FRAMES {
            assert_eq!(w.poll_ended(cx, false, true, false), Poll::Pending);
            assert_eq!(
                streams.open(),
                0,
                "registered while its frames were buffered"
            );
        }
        assert_eq!(w.poll_ended(cx, false, true, false), Poll::Pending);
        assert_eq!(streams.open(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_expiry_beyond_the_clock_never_fires_and_never_panics() {
        assert_eq!(until(u64::MAX), Duration::MAX);
        assert_eq!(until(0), Duration::ZERO);
        let (streams, _rx) = registry();
        let mut w = armed(&streams, "sid-far", Some(u64::MAX));
        assert_eq!(poll(&mut w, true), Poll::Pending);
        tokio::time::advance(RECHECK_CLOCK * 2).await;
        assert_eq!(poll(&mut w, true), Poll::Pending);
    }

    #[tokio::test]
    async fn a_release_racing_a_cut_leaves_a_newer_registration_alone() {
        let (streams, _rx) = registry();
        let mut old = armed(&streams, "sid-r", None);
        assert_eq!(poll(&mut old, true), Poll::Pending);
        streams.cut("sid-r");
        let mut new = armed(&streams, "sid-r", None);
        assert_eq!(poll(&mut new, true), Poll::Pending);
        drop(old); // its token is cancelled: the new entry keeps its count
        assert_eq!(streams.open(), 1);
        assert_eq!(streams.cut("sid-r"), 1);
    }

    #[tokio::test]
    async fn only_a_waiting_body_registers_and_a_cut_ends_only_its_sessions_responses() {
        let (streams, _rx) = registry();
        let mut a1 = armed(&streams, "sid-a", None);
        let mut a2 = armed(&streams, "sid-a", None);
        let mut b = armed(&streams, "sid-b", None);
        assert_eq!(poll(&mut a1, false), Poll::Pending);
        assert_eq!(streams.open(), 0, "a body that never waited registered");
        for w in [&mut a1, &mut a2, &mut b] {
            assert_eq!(poll(w, true), Poll::Pending);
        }
        assert_eq!(streams.open(), 3);
        assert_eq!(streams.cut("sid-a"), 2);
        assert_eq!(poll(&mut a1, false), Poll::Ready(Ended::Revoked));
        assert_eq!(poll(&mut a2, true), Poll::Ready(Ended::Revoked));
        assert_eq!(poll(&mut a1, true), Poll::Pending, "reported twice");
        assert_eq!(
            poll(&mut b, true),
            Poll::Pending,
            "another session's response ended"
        );
        assert_eq!((streams.open(), streams.cut_total()), (1, 2));
        drop(b);
        assert_eq!(streams.open(), 0, "a dropped response stayed registered");
        assert!(!streams.is_open("sid-b"));
        // A registration after a cut starts a fresh entry that the old responses' drops
        // must not decrement.
        let mut a3 = armed(&streams, "sid-a", None);
        assert_eq!(poll(&mut a3, true), Poll::Pending);
        drop(a1);
        drop(a2);
        assert_eq!(streams.open(), 1);
        assert!(streams.is_open("sid-a"));
    }

    #[tokio::test]
    async fn a_change_between_authentication_and_registration_asks_for_a_fresh_read() {
        let (streams, mut rx) = registry();
        let mut quiet = armed(&streams, "sid-quiet", None);
        let mut raced = armed(&streams, "sid-raced", None);
        streams.changed("sid-raced");
        assert_eq!(poll(&mut quiet, true), Poll::Pending);
        assert!(rx.try_recv().is_err() || bucket("sid-quiet") == bucket("sid-raced"));
        assert_eq!(poll(&mut raced, true), Poll::Pending);
        let mut asked = Vec::new();
        while let Ok(sid) = rx.try_recv() {
            asked.push(sid.to_string());
        }
        assert!(asked.contains(&"sid-raced".to_string()), "{asked:?}");
        // And a loss of the invalidation stream marks every sid.
        let mut later = armed(&streams, "sid-later", None);
        streams.changed_all();
        assert_eq!(poll(&mut later, true), Poll::Pending);
        assert_eq!(rx.try_recv().unwrap().as_ref(), "sid-later");
    }

    #[tokio::test]
    async fn a_registered_response_ends_when_its_session_expires_by_the_wall_clock() {
        let (streams, _rx) = registry();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        // expires at the next whole second + 1: within 2 s
        let mut w = armed(&streams, "sid-exp", Some(now.as_secs() + 1));
        let mut forever = armed(&streams, "sid-none", None);
        assert_eq!(poll(&mut w, true), Poll::Pending);
        assert_eq!(poll(&mut forever, true), Poll::Pending);
        let ended = tokio::time::timeout(
            Duration::from_secs(3),
            std::future::poll_fn(|cx| w.poll_ended(cx, false, false, true)),
        )
        .await
        .expect("not ended within 3 s");
        assert_eq!(ended, Ended::Expired);
        let at = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        assert!(at.as_secs() > now.as_secs(), "ended before its expiry");
        assert_eq!(poll(&mut forever, false), Poll::Pending);
        assert_eq!(streams.cut_total(), 1);
        drop(w);
        assert_eq!(streams.open(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_expiry_timer_is_rearmed_until_the_wall_clock_agrees() {
        let (streams, _rx) = registry();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        // The paused runtime clock runs ahead of the wall clock: the timer fires, the wall
        // clock says not yet, so the response stays open.
        let mut w = armed(&streams, "sid-exp", Some(now + 60));
        assert_eq!(poll(&mut w, true), Poll::Pending);
        tokio::time::advance(Duration::from_secs(120)).await;
        assert_eq!(poll(&mut w, false), Poll::Pending);
        assert_eq!(streams.cut_total(), 0);
        // An already expired session ends at its first wait.
        let mut past = armed(&streams, "sid-past", Some(now.saturating_sub(10)));
        let mut ended = poll(&mut past, true);
        if ended.is_pending() {
            tokio::time::advance(Duration::from_millis(1)).await;
            ended = poll(&mut past, false);
        }
        assert_eq!(ended, Poll::Ready(Ended::Expired));
    }
}
