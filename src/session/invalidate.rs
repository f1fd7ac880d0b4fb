//! Sessions with open responses read again when the invalidation stream cannot say which changed
//! (it was lost, or the sealing keys were replaced): a bounded number of rereads at a time. Must
//! never: leave an open response of a revoked session running once its reread says so.

use std::sync::Arc;
use std::time::Duration;

use super::streams::OpenStreams;
use super::{ResolveError, Sessions};

/// Store key prefix of the failed-login counts every instance on one store shares (written by
/// `login`). Outside the default session key prefix; [`sid_of`] keeps them out of invalidations
/// where the prefix covers them (the hyper-auth-proxy format tracks every key).
pub(crate) const LOGIN_FAILURES: &str = "tessera:login-failures:";

/// The sid an invalidated store key names: `key` under `prefix`, and no failed-login count
/// (each failed login writes two, and an invalidation empties nothing but costs cache fills
/// in flight their place).
pub(super) fn sid_of<'a>(key: &'a str, prefix: &str) -> Option<&'a str> {
    if key.starts_with(LOGIN_FAILURES) {
        return None;
    }
    key.strip_prefix(prefix)
}

/// Store reads at once when every session with open responses is read again (the invalidation
/// stream came back, or the sealing keys were reloaded): enough to go through thousands
/// quickly, few enough to leave the store and the runtime to the requests.
pub(super) const RECHECK_TASKS: usize = 16;

/// Has every session with open responses read again by `reader` (no cache, no registry), in a
/// task of its own ([`recheck_round`]); each one gone or no longer readable ends its open
/// responses ([`recheck`]). For when any session may have changed unreported: the invalidation
/// stream is back after a loss, or the sealing keys were reloaded.
pub(super) fn recheck_all(reader: &Sessions, streams: &Arc<OpenStreams>) {
    streams.changed_all();
    tokio::spawn(recheck_round(reader.clone(), Arc::downgrade(streams)));
}

/// Has every session with open responses read again by `reader`, by at most [`RECHECK_TASKS`]
/// reads at a time, and ends when all are (a session the store cannot read is retried until
/// it can, or until its responses end).
pub(super) async fn recheck_round(reader: Sessions, streams: std::sync::Weak<OpenStreams>) {
    let Some(open) = streams.upgrade().map(|s| s.open_sids()) else {
        return;
    };
    let per_task = open.len().div_ceil(RECHECK_TASKS).max(1);
    let rounds = open
        .chunks(per_task)
        .map(|sids| recheck(reader.clone(), streams.clone(), sids.to_vec()));
    futures_util::future::join_all(rounds).await;
}

/// Reads each of `sids` again and ends its open responses if the session is gone or unusable.
/// A store failure is retried (every 0.1 s, doubling to 2 s) while the sid still has open
/// responses: a revocation is never dropped because the store hiccuped.
pub(super) async fn recheck(
    reader: Sessions,
    streams: std::sync::Weak<OpenStreams>,
    sids: Vec<Arc<str>>,
) {
    for sid in sids {
        let mut backoff = Duration::from_millis(100);
        loop {
            let answer = reader.resolve_from_store(&sid).await;
            let Some(streams) = streams.upgrade() else {
                return;
            };
            match answer {
                Ok(_) => break,
                Err(ResolveError::Unknown | ResolveError::Corrupt(_)) => {
                    streams.cut(&sid);
                    break;
                }
                Err(ResolveError::Store(e)) => {
                    if !streams.is_open(&sid) {
                        break;
                    }
                    tracing::debug!(cause = %e, "re-reading a session with open responses failed; retrying");
                }
            }
            drop(streams);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_login_count_names_no_session_under_any_prefix() {
        let count = "tessera:login-failures:ip:127.0.0.1";
        for prefix in ["", "tessera:", "tessera:session:"] {
            assert_eq!(sid_of(count, prefix), None, "{prefix:?}");
        }
        assert_eq!(
            sid_of("tessera:session:abc", "tessera:session:"),
            Some("abc")
        );
        assert_eq!(sid_of("abc", ""), Some("abc"));
        assert_eq!(sid_of("other:abc", "tessera:session:"), None);
    }
}
