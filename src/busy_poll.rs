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
//! Trade-off (docs/benchmarks.md, "Busy polling"): at c=1 the added latency and req/s improve, and
//! the thread keeps its core busy between requests; on a saturated host the spinning takes CPU
//! from other processes. So a thread backs off when its CPU is contended: a poll of at least
//! [`JUDGED_AFTER`] in which the thread ran less than half the wall time (its `sched_yield`s let
//! other runnable tasks in, or it was preempted; `CLOCK_THREAD_CPUTIME_ID` vs the monotonic clock)
//! is contended, and after [`BACKOFF_STREAK`] contended polls in a row the thread parks without
//! polling for [`BACKOFF`].

use std::cell::{Cell, OnceCell};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{epoll, Timespec};

thread_local! {
    /// How long this thread polls before it parks; zero (the default) = off.
    static SPIN: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    /// This thread's watch set, made on first use by a thread with polling on. `None` when
    /// `epoll_create1` failed (polling is then skipped).
    static SET: Option<Arc<OwnedFd>> = epoll::create(epoll::CreateFlags::CLOEXEC).ok().map(Arc::new);
    /// This thread's contention record (see [`Backoff::judge`]).
    static BACKOFF_STATE: Cell<Backoff> = const { Cell::new(Backoff::CLEAR) };
    /// This thread's counters, registered in [`THREADS`] by the first [`enable`] that turns
    /// polling on.
    static COUNTS: OnceCell<Arc<PollCounts>> = const { OnceCell::new() };
}

/// One polling thread's counters (monotonic), on cache lines of their own: written by that
/// thread only, summed by [`stats`].
#[derive(Debug, Default)]
#[repr(align(128))]
struct PollCounts {
    polls: AtomicU64,
    answered: AtomicU64,
    backoffs: AtomicU64,
}

/// Every thread that has turned polling on, for [`stats`] (kept after the thread ends, so the
/// sums never go down). One set per process: two proxies run in one process share it.
static THREADS: Mutex<Vec<Arc<PollCounts>>> = Mutex::new(Vec::new());

/// Busy-polling activity of the whole process since start (every counter monotonic).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PollStats {
    /// Polls run before a park (not those skipped during a back-off).
    pub polls: u64,
    /// Polls ended by news (a watched socket became readable, or a task was woken from another
    /// thread): each saved the thread a sleep and a wake-up.
    pub answered: u64,
    /// Back-offs: times a thread stopped polling for [`BACKOFF`] after contended polls.
    pub backoffs: u64,
}

/// Sums every polling thread's counters (relaxed loads; all zero while polling is off).
pub fn stats() -> PollStats {
    let threads = THREADS.lock().unwrap_or_else(|p| p.into_inner());
    threads
        .iter()
        .fold(PollStats::default(), |sum, c| PollStats {
            polls: sum.polls + c.polls.load(Ordering::Relaxed),
            answered: sum.answered + c.answered.load(Ordering::Relaxed),
            backoffs: sum.backoffs + c.backoffs.load(Ordering::Relaxed),
        })
}

fn add(counter: impl Fn(&PollCounts) -> &AtomicU64) {
    COUNTS.with(|c| {
        if let Some(c) = c.get() {
            counter(c).fetch_add(1, Ordering::Relaxed);
        }
    });
}

/// A poll that lasted at least this long is judged for contention (shorter ones say too little).
pub const JUDGED_AFTER: Duration = Duration::from_micros(10);
/// Contended polls in a row that pause polling (one alone is usually a stray preemption: at c=1
/// on an otherwise idle 2-core VM, about 1 poll in 1,000 looks contended).
pub const BACKOFF_STREAK: u32 = 2;
/// How long a thread parks without polling once it backs off (then it tries again).
pub const BACKOFF: Duration = Duration::from_millis(20);

/// One thread's contention record: contended polls in a row, and the end of a pause.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Backoff {
    streak: u32,
    paused_until: Option<Instant>,
}

impl Backoff {
    const CLEAR: Backoff = Backoff {
        streak: 0,
        paused_until: None,
    };

    /// The record after a poll that ended at `now`, lasted `wall` and in which the thread ran
    /// for `cpu`: contended when `wall >= JUDGED_AFTER` and `cpu < wall / 2`; a poll under
    /// [`JUDGED_AFTER`] leaves it as it is, an uncontended one resets the streak.
    fn judge(self, wall: Duration, cpu: Duration, now: Instant) -> Backoff {
        if wall < JUDGED_AFTER {
            self
        } else if cpu * 2 >= wall {
            Backoff { streak: 0, ..self }
        } else if self.streak + 1 >= BACKOFF_STREAK {
            Backoff {
                streak: 0,
                paused_until: Some(now + BACKOFF),
            }
        } else {
            Backoff {
                streak: self.streak + 1,
                ..self
            }
        }
    }

    fn paused_at(&self, now: Instant) -> bool {
        self.paused_until.is_some_and(|t| now < t)
    }
}

/// CPU time the calling thread has run (`CLOCK_THREAD_CPUTIME_ID`, ns resolution).
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Most a thread may poll before parking, µs (`server.busy_poll_us` is checked against it).
pub const MAX_BUSY_POLL_US: u64 = 1000;

/// Turns busy polling on for the calling thread, polling for up to `spin` before each park
/// ([`Duration::ZERO`] = off), and clears its contention record. Call it on a serving thread
/// before its runtime starts, and pass [`before_park`] to the runtime's `on_thread_park`.
pub fn enable(spin: Duration) {
    SPIN.with(|s| s.set(spin));
    BACKOFF_STATE.with(|b| b.set(Backoff::CLEAR));
    if !spin.is_zero() {
        COUNTS.with(|c| {
            c.get_or_init(|| {
                let counts = Arc::new(PollCounts::default());
                THREADS
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(counts.clone());
                counts
            });
        });
    }
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
/// when polling is off or paused by contention (module docs). A poll that ends at its first check
/// with news costs one `epoll_wait` and reads no CPU clock or runtime handle; a longer one reads
/// the handle once and the CPU clock twice. Counted in [`stats`].
pub fn before_park() {
    let spin = SPIN.with(Cell::get);
    if spin.is_zero() {
        return;
    }
    SET.with(|set| {
        let Some(set) = set else { return };
        let start = Instant::now();
        let record = BACKOFF_STATE.with(Cell::get);
        if record.paused_at(start) {
            return;
        }
        add(|c| &c.polls);
        // Tasks woken from other threads wait in the runtime's queue for this thread (read from
        // the first empty check on).
        let mut metrics: Option<Option<tokio::runtime::RuntimeMetrics>> = None;
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut event = [MaybeUninit::<epoll::Event>::uninit(); 1];
        // Clocks read after the first empty check: a poll that ends at once is not judged.
        let mut judged_from: Option<(Instant, Duration)> = None;
        loop {
            let done = match epoll::wait(set.as_fd(), &mut event[..], Some(&now)) {
                Ok(([], _)) => {
                    let queued = metrics
                        .get_or_insert_with(|| {
                            tokio::runtime::Handle::try_current()
                                .ok()
                                .map(|h| h.metrics())
                        })
                        .as_ref()
                        .is_some_and(|m| m.global_queue_depth() > 0);
                    if queued {
                        add(|c| &c.answered);
                    }
                    queued || start.elapsed() >= spin
                }
                Ok(_) => {
                    add(|c| &c.answered);
                    true
                }
                // The set is unusable: park.
                Err(_) => true,
            };
            if done {
                if let Some((wall_start, cpu_start)) = judged_from {
                    let end = Instant::now();
                    let judged = record.judge(end - wall_start, thread_cpu() - cpu_start, end);
                    if judged.paused_until != record.paused_until {
                        add(|c| &c.backoffs);
                    }
                    BACKOFF_STATE.with(|b| b.set(judged));
                }
                return;
            }
            if judged_from.is_none() {
                judged_from = Some((Instant::now(), thread_cpu()));
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

            // This thread's counters: four polls, the one ended by data answered. They are
            // in the process's sums.
            let own = COUNTS
                .with(|c| c.get().cloned())
                .expect("registered by enable");
            let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
            assert_eq!(
                (read(&own.polls), read(&own.answered), read(&own.backoffs)),
                (4, 1, 0)
            );
            assert!(stats().polls >= 4 && stats().answered >= 1);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn two_contended_polls_in_a_row_pause_polling() {
        let now = Instant::now();
        let long = JUDGED_AFTER * 10;
        let clear = Backoff::CLEAR;
        // Ran the whole time, or half of it: not contended.
        assert_eq!(clear.judge(long, long, now), clear);
        assert_eq!(clear.judge(long, long / 2, now), clear);
        // Too short to judge, however little the thread ran.
        assert_eq!(clear.judge(JUDGED_AFTER / 2, Duration::ZERO, now), clear);
        // One contended poll counts; an uncontended one after it resets the count.
        let once = clear.judge(long, long / 3, now);
        assert_eq!(once.streak, 1);
        assert!(!once.paused_at(now));
        assert_eq!(once.judge(long, long, now), clear);
        // A short poll between two contended ones changes nothing.
        let twice =
            once.judge(JUDGED_AFTER / 2, Duration::ZERO, now)
                .judge(long, Duration::ZERO, now);
        assert_eq!(twice.streak, 0);
        assert!(twice.paused_at(now));
        assert!(twice.paused_at(now + BACKOFF - Duration::from_micros(1)));
        assert!(!twice.paused_at(now + BACKOFF));
    }

    #[test]
    fn a_paused_thread_parks_without_polling() {
        std::thread::spawn(|| {
            let spin = Duration::from_secs(10);
            enable(spin);
            let (a, _b) = UnixStream::pair().unwrap();
            watch(&a).expect("polling is on for this thread");
            BACKOFF_STATE.with(|b| {
                b.set(Backoff {
                    streak: 0,
                    paused_until: Some(Instant::now() + spin),
                })
            });
            let t = Instant::now();
            before_park();
            assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
            // `enable` clears the pause: the whole poll time passes again.
            assert!(timed_poll(Duration::from_millis(30)) >= Duration::from_millis(30));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_sharing_its_cpu_with_a_busy_one_backs_off() {
        use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
        use std::sync::atomic::{AtomicBool, Ordering};
        std::thread::spawn(|| {
            // Both threads on the first CPU this process may use.
            let allowed = sched_getaffinity(None).unwrap();
            let first = (0..CpuSet::MAX_CPU).find(|&c| allowed.is_set(c)).unwrap();
            let mut one = CpuSet::new();
            one.set(first);
            let stop = Arc::new(AtomicBool::new(false));
            // Two, so that even a fair share would leave the poller a third of the CPU.
            let rivals: Vec<_> = (0..2)
                .map(|_| {
                    let stop = stop.clone();
                    std::thread::spawn(move || {
                        sched_setaffinity(None, &one).unwrap();
                        while !stop.load(Ordering::Relaxed) {
                            std::hint::spin_loop();
                        }
                    })
                })
                .collect();
            sched_setaffinity(None, &one).unwrap();
            enable(Duration::from_millis(20));
            let (a, _b) = UnixStream::pair().unwrap();
            watch(&a).expect("polling is on for this thread");
            // Each poll yields to the rivals and runs for a fraction of its wall time.
            let polls = (1..=50).find(|_| {
                before_park();
                BACKOFF_STATE.with(Cell::get).paused_at(Instant::now())
            });
            stop.store(true, Ordering::Relaxed);
            for rival in rivals {
                rival.join().unwrap();
            }
            let polls = polls.expect("50 contended polls did not pause polling");
            let own = COUNTS
                .with(|c| c.get().cloned())
                .expect("registered by enable");
            assert_eq!(own.polls.load(Ordering::Relaxed), polls as u64);
            assert_eq!(own.backoffs.load(Ordering::Relaxed), 1);
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
