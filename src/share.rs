//! A share: a bound on how many upstream connections one holder (a user, an HTTP/2 connection)
//! has at once, taken and given back on every proxied request. A leaf module: the session keeps
//! its user's share, the upstream pool takes it, neither imports the other for it.
//!
//! Hand-written, not `tokio::sync::Semaphore`: a semaphore's release takes its waiters' lock
//! every time, and the share is taken on every warm request; here the uncontended path is one
//! compare-and-swap to take and one subtraction to give back. Waiters are woken in the order
//! they began to wait, but a request arriving just then may take the freed place first. Must
//! never: let more than `limit` permits be out at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// At most `limit` permits out at once.
#[derive(Debug)]
pub struct Share {
    limit: usize,
    in_use: AtomicUsize,
    /// Requests waiting for a permit (read by a release to decide whether to wake one).
    waiting: AtomicUsize,
    notify: Notify,
    /// Acquisitions that found every permit out and waited (since start).
    waits: std::sync::atomic::AtomicU64,
}

/// One permit of a [`Share`], given back when dropped.
#[derive(Debug)]
pub struct SharePermit(Arc<Share>);

impl Share {
    /// A share of `limit` permits (at least 1).
    pub fn new(limit: usize) -> Self {
        Self {
            limit: limit.max(1),
            in_use: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            notify: Notify::new(),
            waits: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// A permit at once, if one is free.
    pub fn try_acquire(self: &Arc<Self>) -> Option<SharePermit> {
        let mut n = self.in_use.load(Ordering::Relaxed);
        while n < self.limit {
            match self
                .in_use
                .compare_exchange_weak(n, n + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return Some(SharePermit(self.clone())),
                Err(now) => n = now,
            }
        }
        None
    }

    /// A permit now, counted even past the limit: for a connection that goes on in another task
    /// and takes its place over (a WebSocket tunnel after its HTTP connection's task ends), so
    /// the count stays right; the two overlap for a moment.
    pub fn acquire_over(self: &Arc<Self>) -> SharePermit {
        self.in_use.fetch_add(1, Ordering::Acquire);
        SharePermit(self.clone())
    }

    /// A permit, waiting until one is given back if all are out.
    pub async fn acquire(self: &Arc<Self>) -> SharePermit {
        if let Some(permit) = self.try_acquire() {
            return permit;
        }
        self.waits.fetch_add(1, Ordering::Relaxed);
        loop {
            if let Some(permit) = self.try_acquire() {
                return permit;
            }
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the count is read again, so a release in between wakes it.
            notified.as_mut().enable();
            self.waiting.fetch_add(1, Ordering::SeqCst);
            if self.in_use.load(Ordering::SeqCst) < self.limit {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            let _uncount = Uncount(&self.waiting);
            notified.await;
        }
    }

    /// Acquisitions that had to wait, since start.
    pub fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    /// The most permits out at once.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Permits out now.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Relaxed)
    }
}

/// Lowers the waiting count when a wait ends, or its future is dropped mid-wait.
struct Uncount<'a>(&'a AtomicUsize);

impl Drop for Uncount<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for SharePermit {
    fn drop(&mut self) {
        let share = &self.0;
        share.in_use.fetch_sub(1, Ordering::SeqCst);
        if share.waiting.load(Ordering::SeqCst) > 0 {
            share.notify.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn no_more_than_the_limit_is_out_and_a_waiter_gets_the_next_one_back() {
        let share = Arc::new(Share::new(2));
        let a = share.acquire().await;
        let _b = share.acquire().await;
        assert!(share.try_acquire().is_none());
        let waiting = tokio::spawn({
            let share = share.clone();
            async move { share.acquire().await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiting.is_finished(), "a third permit was handed out");
        drop(a);
        let c = tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("the waiter was not woken")
            .unwrap();
        assert_eq!(share.in_use(), 2);
        drop(c);
        assert_eq!(share.in_use(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_wait_is_uncounted_and_wakes_nobody_wrongly() {
        let share = Arc::new(Share::new(1));
        let a = share.acquire().await;
        let gone = tokio::time::timeout(Duration::from_secs(1), share.acquire()).await;
        assert!(gone.is_err());
        assert_eq!(share.waiting.load(Ordering::SeqCst), 0);
        drop(a);
        assert!(share.try_acquire().is_some());
    }

    #[test]
    fn many_threads_never_hold_more_than_the_limit() {
        let share = Arc::new(Share::new(3));
        let peak = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (share, peak) = (share.clone(), peak.clone());
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .build()
                        .unwrap();
                    rt.block_on(async {
                        for _ in 0..2000 {
                            let p = share.acquire().await;
                            peak.fetch_max(share.in_use(), Ordering::SeqCst);
                            tokio::task::yield_now().await;
                            drop(p);
                        }
                    });
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(peak.load(Ordering::SeqCst) <= 3);
        assert_eq!(share.in_use(), 0);
    }
}
