//! Requests counted by status and duration on the request path: three relaxed increments per
//! request into a row owned by its serving thread; and configuration reloads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Status codes counted: 100..=999, every code `http::StatusCode` holds (an upstream's 600-999
/// are relayed as they are).
pub(super) const FIRST_STATUS: u16 = 100;

pub(super) const STATUSES: usize = 900;

/// Upper bounds of the request-duration histogram's buckets, µs (Prometheus `le`, inclusive); a
/// last bucket, `+Inf`, holds the rest. From 50 µs (a warm request through tessera to a loopback
/// upstream) to 10 s (a slow upstream).
pub const DURATION_BOUNDS_US: [u64; 17] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

pub(super) const BUCKETS: usize = DURATION_BOUNDS_US.len() + 1;

/// One thread's request counters, on cache lines of their own.
#[repr(align(128))]
pub(super) struct Row {
    /// Requests by status code (index: status - 100).
    statuses: [AtomicU64; STATUSES],
    /// Requests by duration bucket (not cumulative; index as [`DURATION_BOUNDS_US`], then +Inf).
    durations: [AtomicU64; BUCKETS],
    /// Sum of the durations, µs.
    duration_sum_us: AtomicU64,
}

/// What [`RequestCounts::snapshot`] read: every thread's rows summed.
#[derive(Debug, PartialEq)]
pub struct RequestSnapshot {
    /// `(status, requests)` for every status seen, in ascending order of status.
    pub statuses: Vec<(u16, u64)>,
    /// Requests per duration bucket, not cumulative: one per [`DURATION_BOUNDS_US`] entry, then
    /// the `+Inf` bucket.
    pub durations: [u64; BUCKETS],
    /// Sum of the durations, µs.
    pub duration_sum_us: u64,
}

/// Outcomes of configuration reloads (SIGHUP), for `/metrics`.
#[derive(Debug)]
pub struct ReloadCounts {
    applied: AtomicU64,
    refused: AtomicU64,
    /// The last reload put its keys in place (true at start, as the start's own load did).
    last_ok: std::sync::atomic::AtomicBool,
}

impl Default for ReloadCounts {
    fn default() -> Self {
        Self {
            applied: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            last_ok: std::sync::atomic::AtomicBool::new(true),
        }
    }
}

impl ReloadCounts {
    /// Counts one reload: its keys put in place (`ok`) or refused.
    pub fn record(&self, ok: bool) {
        let n = if ok { &self.applied } else { &self.refused };
        n.fetch_add(1, Ordering::Relaxed);
        self.last_ok.store(ok, Ordering::Relaxed);
    }

    /// `(applied, refused, last one applied)`.
    pub fn snapshot(&self) -> (u64, u64, bool) {
        (
            self.applied.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
            self.last_ok.load(Ordering::Relaxed),
        )
    }
}

/// QUIC handshakes (HTTP/3), for `/metrics` and for the Retry policy that reads `unvalidated`.
#[derive(Debug, Default)]
pub struct QuicCounts {
    /// Handshakes in progress whose client has not proved it receives at its address.
    pub unvalidated: AtomicU64,
    /// Handshakes answered with a Retry (RFC 9000 section 8.1.2).
    pub retries: AtomicU64,
    /// Connections refused at `server.max_connections`.
    pub refused: AtomicU64,
}

impl QuicCounts {
    /// `(unvalidated handshakes now, retries, refused)`.
    pub fn snapshot(&self) -> (u64, u64, u64) {
        (
            self.unvalidated.load(Ordering::Relaxed),
            self.retries.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        )
    }
}

/// Requests answered, by status code and by duration, counted per serving thread.
pub struct RequestCounts {
    /// One row per serving thread, and a last one for every other thread.
    rows: Box<[Row]>,
}

impl RequestCounts {
    /// Counters for `threads` serving threads (see [`crate::upstream::set_serving_thread`]).
    pub fn new(threads: usize) -> Self {
        Self {
            rows: (0..threads.max(1) + 1)
                .map(|_| Row {
                    statuses: std::array::from_fn(|_| AtomicU64::new(0)),
                    durations: std::array::from_fn(|_| AtomicU64::new(0)),
                    duration_sum_us: AtomicU64::new(0),
                })
                .collect(),
        }
    }

    /// Counts one answered request with `status` (100..=999; other values are not counted by
    /// status) whose response head was ready `took` after its request head was read.
    pub fn record(&self, status: u16, took: Duration) {
        let row = self.row();
        Self::count_in(row, status);
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let bucket = DURATION_BOUNDS_US.partition_point(|&bound| bound < us);
        row.durations[bucket].fetch_add(1, Ordering::Relaxed);
        row.duration_sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Counts a request answered before it reached the proxy (the 408 for a head that did not
    /// arrive in time, hyper's own 400/414/431 for a head it could not take) by `status` only:
    /// it is not in the duration histogram.
    pub fn count_status(&self, status: u16) {
        Self::count_in(self.row(), status);
    }

    /// The calling thread's row: serving threads are numbered below `threads`, and any other
    /// thread counts in the last row.
    pub(super) fn row(&self) -> &Row {
        let others = self.rows.len() - 1;
        &self.rows[crate::upstream::serving_thread()
            .filter(|&i| i < others)
            .unwrap_or(others)]
    }

    pub(super) fn count_in(row: &Row, status: u16) {
        if let Some(c) = status
            .checked_sub(FIRST_STATUS)
            .and_then(|i| row.statuses.get(usize::from(i)))
        {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Every thread's counters summed (each read with a relaxed load: a request recorded
    /// during the read may be in one sum and not yet in another).
    pub fn snapshot(&self) -> RequestSnapshot {
        let sum = |read: &dyn Fn(&Row) -> &AtomicU64| -> u64 {
            self.rows
                .iter()
                .map(|r| read(r).load(Ordering::Relaxed))
                .sum()
        };
        RequestSnapshot {
            statuses: (0..STATUSES)
                .filter_map(|i| {
                    let n = sum(&|r| &r.statuses[i]);
                    (n > 0).then(|| (FIRST_STATUS + i as u16, n))
                })
                .collect(),
            durations: std::array::from_fn(|i| sum(&|r| &r.durations[i])),
            duration_sum_us: sum(&|r| &r.duration_sum_us),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn request_counts_sum_every_threads_row_and_ignore_codes_out_of_range() {
        let counts = Arc::new(RequestCounts::new(2));
        let threads: Vec<_> = [Some(0), Some(1), Some(2), None]
            .into_iter()
            .map(|serving| {
                let counts = counts.clone();
                std::thread::spawn(move || {
                    if let Some(i) = serving {
                        crate::upstream::set_serving_thread(i);
                    }
                    let ms = Duration::from_millis(1);
                    for _ in 0..1000 {
                        counts.record(200, ms);
                    }
                    counts.record(599, ms);
                    counts.record(999, ms);
                    counts.record(100, ms);
                    counts.record(99, ms);
                    counts.record(1000, ms);
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        counts.record(401, Duration::from_micros(40));
        let snapshot = counts.snapshot();
        assert_eq!(
            snapshot.statuses,
            vec![(100, 4), (200, 4000), (401, 1), (599, 4), (999, 4)]
        );
        // Every request, status counted or not, is in the histogram: 4 x 1005 of 1 ms (bound
        // 1,000 µs, index 4, inclusive) and one of 40 µs (the first bucket).
        let mut durations = [0; BUCKETS];
        durations[4] = 4020;
        durations[0] = 1;
        assert_eq!(snapshot.durations, durations);
        assert_eq!(snapshot.duration_sum_us, 4020 * 1000 + 40);
        // Each serving thread wrote its own row; a thread numbered beyond them (2) and an
        // unmarked one the last.
        let row =
            |r: usize, status: usize| counts.rows[r].statuses[status - 100].load(Ordering::Relaxed);
        assert_eq!((row(0, 200), row(1, 200), row(2, 200)), (1000, 1000, 2000));
    }

    #[test]
    fn durations_fall_in_the_first_bucket_whose_bound_they_do_not_exceed() {
        let counts = RequestCounts::new(1);
        for us in [0, 50, 51, 10_000_000, 10_000_001] {
            counts.record(200, Duration::from_micros(us));
        }
        counts.record(200, Duration::MAX);
        let d = counts.snapshot().durations;
        assert_eq!((d[0], d[1], d[BUCKETS - 2], d[BUCKETS - 1]), (2, 1, 1, 2));
        assert_eq!(d.iter().sum::<u64>(), 6);
    }
}
