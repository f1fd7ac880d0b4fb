//! The serving layer's task that follows the store's invalidation stream: it evicts what changed
//! from the session cache, reads again the sessions with open responses, and turns the cache off
//! and on as the stream is lost and back. While the stream is not live (lost, or never live: a
//! PostgreSQL `session.query` without `notify_channel`, a Redis without client tracking), the
//! sessions with open responses are also read again every [`UNWATCHED_RECHECK`], one round at a
//! time: nothing else would end those of a session revoked on another instance or by the
//! application.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::mpsc;

use super::cache::SessionCache;
use super::invalidate::{recheck, recheck_all, recheck_round, sid_of};
use super::streams::OpenStreams;
use super::{Invalidation, Sessions};

/// How often the sessions with open responses are read again while the stream is not live.
pub(super) const UNWATCHED_RECHECK: Duration = Duration::from_secs(2);

/// What the task holds: nothing that keeps the serving layer alive (it ends when the layer is
/// dropped).
pub(super) struct Follower {
    /// The store's invalidation stream.
    pub(super) stream: mpsc::Receiver<Invalidation>,
    /// Sids whose open responses registered while their session may have changed.
    pub(super) rechecks: mpsc::UnboundedReceiver<Arc<str>>,
    pub(super) cache: Option<Weak<SessionCache>>,
    pub(super) streams: Weak<OpenStreams>,
    /// The store key prefix of sessions.
    pub(super) prefix: String,
    /// Reads for the rechecks: the same store, no cache, no registry.
    pub(super) reader: Sessions,
}

impl Follower {
    pub(super) async fn run(mut self) {
        let mut live = false;
        let mut unwatched = tokio::time::interval(UNWATCHED_RECHECK);
        unwatched.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut round: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            let msg = tokio::select! {
                msg = self.stream.recv() => msg,
                sid = self.rechecks.recv() => match sid {
                    Some(sid) => {
                        let streams = self.streams.clone();
                        tokio::spawn(recheck(self.reader.clone(), streams, vec![sid]));
                        continue;
                    }
                    None => return, // the registry is gone: the layer was dropped
                },
                _ = unwatched.tick(), if !live => {
                    // A round still waiting for the store (it retries while down) is not
                    // joined by another.
                    if round.as_ref().is_none_or(|r| r.is_finished()) {
                        let streams = self.streams.clone();
                        round = Some(tokio::spawn(recheck_round(self.reader.clone(), streams)));
                    }
                    continue;
                }
            };
            let Some(msg) = msg else {
                // The store's watcher is gone (it never ends on its own: a panic): nothing
                // will evict a cached session again, so the cache must stop serving.
                if let Some(cache) = self.cache.as_ref().and_then(Weak::upgrade) {
                    cache.set_live(false);
                    cache.flush();
                }
                tracing::error!(
                    "the session store's invalidation stream ended; the session cache is off"
                );
                return;
            };
            let Some(streams) = self.streams.upgrade() else {
                return;
            };
            let cache = match &self.cache {
                Some(weak) => match weak.upgrade() {
                    Some(cache) => Some(cache),
                    None => return,
                },
                None => None,
            };
            match msg {
                Invalidation::Keys(keys) => self.changed(keys, cache.as_deref(), &streams),
                Invalidation::Live => {
                    live = true;
                    if let Some(cache) = &cache {
                        cache.flush();
                        cache.set_live(true);
                    }
                    recheck_all(&self.reader, &streams);
                }
                Invalidation::Lost => {
                    live = false;
                    if let Some(cache) = &cache {
                        cache.set_live(false);
                        cache.flush();
                    }
                }
            }
        }
    }

    /// `keys` changed: each session among them leaves the cache, and those with open
    /// responses are read again.
    fn changed(&self, keys: Vec<String>, cache: Option<&SessionCache>, streams: &OpenStreams) {
        let mut open = Vec::new();
        for key in keys {
            if let Some(sid) = sid_of(&key, &self.prefix) {
                if let Some(cache) = cache {
                    cache.invalidate(sid);
                }
                // After the eviction (see `OpenStreams::changed`).
                streams.changed(sid);
                if streams.is_open(sid) {
                    open.push(Arc::from(sid));
                }
            }
        }
        if !open.is_empty() {
            let streams = self.streams.clone();
            tokio::spawn(recheck(self.reader.clone(), streams, open));
        }
    }
}
