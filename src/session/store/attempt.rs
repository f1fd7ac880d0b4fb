//! One store call against a pooled server connection, tried at most twice: the SQL stores'
//! shared policy (Redis's clients reconnect by themselves).

use std::future::Future;
use std::time::Duration;

use super::StoreError;

/// How one attempt failed: its connection broke under it (the server restarted or ended it;
/// worth one more try on another connection), or anything else.
pub(super) enum Attempt {
    Broken(StoreError),
    Failed(StoreError),
}

impl From<StoreError> for Attempt {
    fn from(e: StoreError) -> Self {
        Self::Failed(e)
    }
}

impl From<Attempt> for StoreError {
    fn from(a: Attempt) -> Self {
        match a {
            Attempt::Broken(e) | Attempt::Failed(e) => e,
        }
    }
}

/// Runs `attempt` within `timeout`, and once more when its connection broke: every store call
/// is idempotent or, for the failed-login counters, harmless when repeated. `store` names the
/// backend in the timeout's error.
pub(super) async fn twice<T, Fut>(
    store: &str,
    timeout: Duration,
    attempt: impl Fn() -> Fut,
) -> Result<T, StoreError>
where
    Fut: Future<Output = Result<T, Attempt>>,
{
    let once = || async {
        tokio::time::timeout(timeout, attempt())
            .await
            .unwrap_or_else(|_| {
                Err(Attempt::Failed(StoreError(format!(
                    "{store}: no answer within {} ms",
                    timeout.as_millis()
                ))))
            })
    };
    match once().await {
        Err(Attempt::Broken(_)) => once().await,
        other => other,
    }
    .map_err(StoreError::from)
}

/// Rows a SQL store's scan reads per query ([`paged`]).
pub(super) const SCAN_PAGE: usize = 1000;

/// Every `(key, value)` row `page` gives, read in pages of [`SCAN_PAGE`] in key order: `page`
/// is asked for the rows after the key it is given (the default, empty, first), each page a
/// store call with its own deadline (`session.timeout_ms`), so that listing, resealing or
/// revoking on a store of many sessions does not fail as one query past the deadline. The key
/// is passed back exactly as the store gave it (MySQL's are bytes).
///
/// Errors: a page's.
pub(super) async fn paged<K: Clone + Default, Fut>(
    page: impl Fn(K) -> Fut,
) -> Result<Vec<(K, Vec<u8>)>, StoreError>
where
    Fut: Future<Output = Result<Vec<(K, Vec<u8>)>, StoreError>>,
{
    let mut out: Vec<(K, Vec<u8>)> = Vec::new();
    loop {
        let after = out.last().map(|(k, _)| k.clone()).unwrap_or_default();
        let rows = page(after).await?;
        let done = rows.len() < SCAN_PAGE;
        out.extend(rows);
        if done {
            return Ok(out);
        }
    }
}
