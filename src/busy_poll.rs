//! Busy polling before a serving thread sleeps (`server.busy_poll_us`, off by default).
//!
//! A serving thread with nothing to run parks in `epoll_wait`. On a VM, sleeping there and being
//! woken by the next packet costs each side several microseconds (an idle vCPU halts; waking it
//! takes an inter-processor interrupt), and a proxied request waits twice: for the upstream's
//! response and for the client's next request. With busy polling on, the thread first spends up
//! to `busy_poll_us` checking whether one of its sockets became readable, yielding the CPU
//! between checks, and parks only after that; tokio's own `epoll_wait` then returns at once.
//!
//! The check is a second, edge-triggered epoll set per serving thread holding the sockets that
//! thread serves (its listener, client connections from accept, upstream connections while they
//! are registered with it), polled with a zero timeout; a task woken from another thread (a
//! session-store lookup on the blocking pool, say) ends the poll too. Edge-triggered, so a socket
//! that stays readable (an upload the upstream does not take yet, a closed idle upstream
//! connection) ends one poll, not all of them. The kernel drops a socket from every epoll set when
//! the last reference to it is closed. Linux's `SO_BUSY_POLL` does the same for NIC queues but not
//! for loopback; Go's scheduler spins with a non-blocking netpoll likewise. A timer that comes due
//! during a poll fires when it ends, at most `busy_poll_us` late.
//!
//! Trade-off (BENCHMARKS.md, "Busy polling"): at c=1 the added latency and req/s improve, and
//! the thread keeps its core busy between requests; on a saturated host the spinning takes CPU
//! from other processes.

use std::cell::Cell;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{epoll, Timespec};

thread_local! {
    /// How long this thread polls before it parks; zero (the default) = off.
    static SPIN: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    /// This thread's watch set, made on first use by a thread with polling on. `None` when
    /// `epoll_create1` failed (polling is then skipped).
    static SET: Option<Arc<OwnedFd>> = epoll::create(epoll::CreateFlags::CLOEXEC).ok().map(Arc::new);
}

/// Most a thread may poll before parking, µs (`server.busy_poll_us` is checked against it).
pub const MAX_BUSY_POLL_US: u64 = 1000;

/// Turns busy polling on for the calling thread, polling for up to `spin` before each park
/// ([`Duration::ZERO`] = off). Call it on a serving thread before its runtime starts, and pass
/// [`before_park`] to the runtime's `on_thread_park`.
pub fn enable(spin: Duration) {
    SPIN.with(|s| s.set(spin));
}

/// Adds `socket` (new data, peer closed; edge-triggered) to the calling thread's watch set when
/// that thread polls; returns the set for [`unwatch`] (`None`: polling is off here, or the set or
/// the registration failed, which only means this socket does not end a poll early).
pub fn watch(socket: impl AsFd) -> Option<Arc<OwnedFd>> {
    if SPIN.with(Cell::get).is_zero() {
        return None;
    }
    SET.with(|set| {
        let set = set.as_ref()?;
        epoll::add(
            set,
            socket,
            epoll::EventData::new_u64(0),
            epoll::EventFlags::IN | epoll::EventFlags::RDHUP | epoll::EventFlags::ET,
        )
        .ok()?;
        Some(set.clone())
    })
}

/// Removes `socket` from `set` (a socket that moves to another thread; a closed socket leaves
/// every set by itself). Errors are ignored: a socket not in `set` is simply not there.
pub fn unwatch(set: &OwnedFd, socket: impl AsFd) {
    let _ = epoll::delete(set, socket);
}

/// The runtime's park hook: with polling on, returns as soon as a watched socket has news, a task
/// was woken from another thread, or the thread's poll time has passed (overrun by at most one
/// `sched_yield`), yielding the CPU between checks; an epoll error ends it too. Returns at once
/// when polling is off.
pub fn before_park() {
    let spin = SPIN.with(Cell::get);
    if spin.is_zero() {
        return;
    }
    SET.with(|set| {
        let Some(set) = set else { return };
        // Tasks woken from other threads wait in the runtime's queue for this thread.
        let metrics = tokio::runtime::Handle::try_current()
            .ok()
            .map(|h| h.metrics());
        let start = Instant::now();
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut event = [MaybeUninit::<epoll::Event>::uninit(); 1];
        loop {
            match epoll::wait(set.as_fd(), &mut event[..], Some(&now)) {
                Ok(([], _)) => {}
                // Readable, or the set is unusable: park.
                _ => return,
            }
            if start.elapsed() >= spin
                || metrics.as_ref().is_some_and(|m| m.global_queue_depth() > 0)
            {
                return;
            }
            std::thread::yield_now();
        }
    });
}

/// Turns polling on for `spin` on the calling thread and times one [`before_park`] (tests).
#[cfg(test)]
pub fn timed_poll(spin: Duration) -> Duration {
    enable(spin);
    let t = Instant::now();
    before_park();
    t.elapsed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn new_data_on_a_watched_socket_ends_the_poll_and_nothing_else_does() {
        std::thread::spawn(|| {
            let short = Duration::from_millis(30);
            enable(short);
            let (a, mut b) = UnixStream::pair().unwrap();
            let set = watch(&a).expect("polling is on for this thread");

            // Nothing new: the whole poll time passes.
            assert!(timed_poll(short) >= short);

            // New data ends it at once (well under the poll time, even on a busy box).
            b.write_all(b"x").unwrap();
            let waited = timed_poll(Duration::from_secs(10));
            assert!(waited < Duration::from_secs(5), "{waited:?}");

            // Edge-triggered: the same unread byte does not end the next poll.
            assert!(timed_poll(short) >= short);

            // Unwatched, new data no longer ends it.
            unwatch(&set, &a);
            b.write_all(b"y").unwrap();
            assert!(timed_poll(short) >= short);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn off_by_default_and_then_nothing_is_watched() {
        std::thread::spawn(|| {
            let (a, _b) = UnixStream::pair().unwrap();
            assert!(watch(&a).is_none());
            let t = Instant::now();
            before_park();
            assert!(t.elapsed() < Duration::from_secs(1));
        })
        .join()
        .unwrap();
    }
}
