//! Asking the upstream whether credentials are good (`GET login.verify_path` with them): at
//! login, and again before a session is deleted because the upstream answered 401 to a request
//! made with its stored credentials. Why the second: a 401 on an arbitrary path may be that
//! path's own answer (or a cross-site `GET` to it, with `SameSite=Lax`), and deleting the
//! session then would log the user out; only credentials refused at `login.verify_path` are.
//! Must never: ask more than once at a time for one session.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::Request;
use http_body_util::BodyExt;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::error::ProxyError;
use crate::seal::Credentials;
use crate::upstream::{empty_body, Upstream};

use super::Login;

/// How long one session's re-check answer is reused by later upstream 401s of that session.
const RECHECK_REUSE: Duration = Duration::from_secs(10);

/// Sessions remembered before answers older than [`RECHECK_REUSE`] are pruned.
const PRUNE_AT: usize = 1024;

/// One session's check: when it started, and its answer (set once).
type Check = (Instant, Arc<OnceCell<bool>>);

/// The re-checks of stored credentials, one per session at a time (single flight).
#[derive(Default)]
pub(super) struct Rechecks {
    by_sid: Mutex<Table>,
}

/// Session id -> its latest check, and the size past which old answers are pruned.
#[derive(Default)]
struct Table {
    map: HashMap<Arc<str>, Check>,
    /// At least [`PRUNE_AT`], twice what a prune left: a table of many fresh answers is not
    /// walked again at each new session.
    prune_at: usize,
}

impl Rechecks {
    /// The answer cell for `sid`: the one of a check under way (however long it takes: never
    /// two at once) or started less than [`RECHECK_REUSE`] ago, else a new one.
    fn cell(&self, sid: &Arc<str>) -> Arc<OnceCell<bool>> {
        let now = Instant::now();
        // Under way: unanswered, and someone waits on it (a failed check leaves its cell
        // unanswered, and nobody waiting).
        let live = |at: &Instant, cell: &Arc<OnceCell<bool>>| {
            now.duration_since(*at) < RECHECK_REUSE
                || (!cell.initialized() && Arc::strong_count(cell) > 1)
        };
        let mut table = self.by_sid.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, cell)) = table.map.get(sid) {
            if live(at, cell) {
                return cell.clone();
            }
        }
        if table.map.len() >= table.prune_at.max(PRUNE_AT) {
            table.map.retain(|_, (at, cell)| live(at, cell));
            table.prune_at = table.map.len() * 2;
        }
        let cell = Arc::new(OnceCell::new());
        table.map.insert(sid.clone(), (now, cell.clone()));
        cell
    }
}

impl Login {
    /// Whether the upstream still accepts a session's stored credentials (`authorization`, its
    /// injected `Authorization` value) at `login.verify_path`, naming the `client` whose
    /// request asks (as a login's check does). Concurrent callers for one `sid` share one check
    /// (with the first one's `request_id` and `client`), and its answer is reused for 10 s.
    ///
    /// Errors: as [`Login::check_upstream`] (the upstream failed or answered neither 2xx nor
    /// 401/403); a failed check is not reused.
    pub async fn still_accepted(
        &self,
        sid: &Arc<str>,
        authorization: &HeaderValue,
        request_id: Option<&HeaderValue>,
        client: std::net::IpAddr,
        upstream: &Upstream,
    ) -> Result<bool, ProxyError> {
        let cell = self.rechecks.cell(sid);
        let check =
            || self.check_authorization(authorization.clone(), request_id, Some(client), upstream);
        cell.get_or_try_init(check).await.copied()
    }

    /// Asks the upstream whether `creds` are good: `GET login.verify_path` with them (and the
    /// id of the request that asks, under `upstream.request_id_header`), naming the `client`
    /// who tries them in `X-Forwarded-For`, so that an upstream's own defence against password
    /// guessing (fail2ban on its auth log) blames the client, not tessera.
    /// Ok(true) on 2xx, Ok(false) on 401/403; anything else is an upstream failure.
    pub(super) async fn check_upstream(
        &self,
        creds: &Credentials,
        request_id: Option<&HeaderValue>,
        client: std::net::IpAddr,
        upstream: &Upstream,
    ) -> Result<bool, ProxyError> {
        self.check_authorization(creds.basic_header(), request_id, Some(client), upstream)
            .await
    }

    /// [`Login::check_upstream`] with the `Authorization` value to send (a stored session's).
    pub(super) async fn check_authorization(
        &self,
        authorization: HeaderValue,
        request_id: Option<&HeaderValue>,
        client: Option<std::net::IpAddr>,
        upstream: &Upstream,
    ) -> Result<bool, ProxyError> {
        let mut req = Request::get(self.verify_target.clone())
            .header(header::HOST, self.upstream_host.clone())
            .header(header::AUTHORIZATION, authorization)
            .body(empty_body())
            .expect("valid request");
        if let (Some(name), Some(id)) = (&self.request_id_header, request_id) {
            req.headers_mut().insert(name.clone(), id.clone());
        }
        if let Some(client) = client {
            let value = HeaderValue::from_str(&client.to_string()).expect("an address is ASCII");
            req.headers_mut().insert("x-forwarded-for", value);
        }
        let resp = upstream.forward(req).await?;
        let status = resp.status();
        // Drain (bounded) so the connection goes back to the pool.
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            http_body_util::Limited::new(resp.into_body(), 1 << 20).collect(),
        )
        .await;
        match status.as_u16() {
            200..=299 => Ok(true),
            401 | 403 => Ok(false),
            _ => {
                tracing::warn!(
                    status = status.as_u16(),
                    "login check: unexpected upstream status"
                );
                Err(ProxyError::Upstream(crate::upstream::ForwardError::Broken(
                    "unexpected status to the login check".into(),
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_session_shares_one_check_until_its_answer_is_old() {
        let rechecks = Rechecks::default();
        let (a, b): (Arc<str>, Arc<str>) = ("sid-a".into(), "sid-b".into());
        let first = rechecks.cell(&a);
        assert!(Arc::ptr_eq(&first, &rechecks.cell(&a)));
        assert!(!Arc::ptr_eq(&first, &rechecks.cell(&b)));
        first.set(true).unwrap();
        tokio::time::advance(RECHECK_REUSE - Duration::from_millis(1)).await;
        assert!(Arc::ptr_eq(&first, &rechecks.cell(&a)));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!Arc::ptr_eq(&first, &rechecks.cell(&a)));
    }

    #[tokio::test(start_paused = true)]
    async fn old_answers_are_pruned_once_many_sessions_are_remembered() {
        let rechecks = Rechecks::default();
        for i in 0..PRUNE_AT {
            rechecks.cell(&Arc::from(format!("sid-{i}")));
        }
        tokio::time::advance(RECHECK_REUSE).await;
        rechecks.cell(&Arc::from("new"));
        assert_eq!(rechecks.by_sid.lock().unwrap().map.len(), 1);
    }

    /// A check still under way is shared however long it takes (its upstream is slow), never
    /// replaced by a second one for the same session.
    #[tokio::test(start_paused = true)]
    async fn a_check_under_way_is_shared_past_the_reuse_time() {
        let rechecks = Rechecks::default();
        let sid: Arc<str> = "sid".into();
        let waiting = rechecks.cell(&sid);
        tokio::time::advance(RECHECK_REUSE * 3).await;
        assert!(Arc::ptr_eq(&waiting, &rechecks.cell(&sid)));
        // Given up (its caller gone, the cell unanswered): the next one starts anew.
        let gone = Arc::downgrade(&waiting);
        drop(waiting);
        let _next = rechecks.cell(&sid);
        assert!(
            gone.upgrade().is_none(),
            "the given-up check is still shared"
        );
    }
}
