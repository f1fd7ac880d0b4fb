//! A master is used only while a Sentinel still names it. An instance cut off from every
//! Sentinel, but not from the old master, would otherwise read that master for as long as the
//! cut lasts, while the Sentinels promote a replica and other instances revoke sessions there;
//! and a Sentinel's connection cut without a FIN or RST ends no subscription. So each Sentinel
//! is asked every second which master it names, and the tracking loop ends, the cache is
//! bypassed and the command connections are dropped once none has named the tracked one for a
//! while (`session.timeout_ms` + [`TRUST`]): requests then get 503 until a Sentinel answers.

use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::aio::MultiplexedConnection;
use tokio::time::{Instant, MissedTickBehavior};

use super::sentinel::{Sentinel, TRUST};
use super::{err, StoreError};

/// How often every Sentinel is asked.
const EVERY: Duration = Duration::from_secs(1);

impl Sentinel {
    /// Asks every Sentinel, every second and all at once, which master it names (`SENTINEL
    /// get-master-addr-by-name` on a connection kept for each, each ask bounded by `timeout`);
    /// returns once none has named `tracked` (`HOST:PORT`) for `timeout` + [`TRUST`] (none
    /// answered, or each named another), with what each said. Never while one names it.
    pub(super) async fn vouching(&self, tracked: &str, timeout: Duration) -> StoreError {
        let mut conns: Vec<Option<MultiplexedConnection>> = vec![None; self.sentinels.len()];
        let mut vouched = Instant::now();
        let mut every = tokio::time::interval(EVERY);
        every.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let asked = Instant::now();
            let said: Vec<_> = (conns.iter_mut().zip(&self.sentinels))
                .map(|(conn, sentinel)| async move {
                    let named = tokio::time::timeout(timeout, self.ask(conn, sentinel, timeout))
                        .await
                        .unwrap_or_else(|_| Err(err("timed out")));
                    if named.is_err() {
                        // Made again at the next round: a reply late past its timeout must not
                        // answer the next question.
                        *conn = None;
                    }
                    (sentinel.addr().to_string(), named)
                })
                .collect::<FuturesUnordered<_>>()
                .collect()
                .await;
            let mut causes = Vec::new();
            for (sentinel, named) in said {
                match named {
                    Ok((host, port)) if format!("{host}:{port}") == tracked => {
                        self.named(host, port, asked);
                        vouched = asked;
                    }
                    Ok((host, port)) => causes.push(format!("{sentinel} names {host}:{port}")),
                    Err(e) => causes.push(format!("{sentinel}: {e}")),
                }
            }
            if vouched.elapsed() > timeout + TRUST {
                return err(format!(
                    "no Sentinel has named {tracked} as the master for {} ms ({}); \
                     requests wait for one",
                    vouched.elapsed().as_millis(),
                    causes.join("; ")
                ));
            }
        }
    }
}
