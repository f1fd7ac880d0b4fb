//! A login the upstream accepted: the session stored (credentials sealed), the token signed by
//! the active key, and the answer (JSON, or a redirect to `rd`) with the token cookie. Must
//! never: leave a session behind whose token could not be signed.

use std::sync::Arc;

use http::header;
use http::{Response, StatusCode};
use serde::Serialize;

use crate::seal::Credentials;
use crate::session::Sessions;
use crate::unix_now;
use crate::upstream::ProxyBody;

use super::page::{json, json_error, redirect};
use super::{Login, Refusal};
use crate::error::ProxyError;

/// The JSON body of a login answered without `rd`.
#[derive(Serialize)]
struct LoginOk<'a> {
    token: &'a str,
    expires_at: u64,
    sub: &'a str,
}

impl Login {
    /// Stores a new session for `creds`, signs its token and answers: `rd`'s redirect or the
    /// JSON body, with the token cookie (and the CSRF cookie cleared for the form). Then revokes
    /// the session the cookie named before (`replaced`), if any. Sets `sid_out` for the access
    /// log.
    pub(super) async fn issue(
        &self,
        creds: &Credentials,
        sessions: &Sessions,
        replaced: Option<Arc<str>>,
        rd: Option<&str>,
        shape: super::page::Shape<'_>,
        sid_out: &mut Option<Arc<str>>,
    ) -> (Response<ProxyBody>, Option<String>) {
        let created = match sessions.create(creds, self.session_ttl).await {
            Ok(c) => c,
            Err(_) => return self.refuse(Refusal::Proxy(ProxyError::StoreUnavailable), shape, rd),
        };
        let now = unix_now();
        let exp = (now + self.cfg.token_ttl_seconds).min(created.expires_at);
        let signer = self
            .keys
            .signer()
            .expect("validated: login has a signing key");
        let jwt = match signer.issue(&self.token, creds.user(), &created.sid, now, exp) {
            Ok(t) => t,
            Err(_) => {
                let _ = sessions.revoke(&created.sid).await;
                return (
                    json_error(StatusCode::INTERNAL_SERVER_ERROR, "cannot sign token"),
                    Some("token signing failed".into()),
                );
            }
        };
        if let Some(old) = replaced.filter(|old| **old != *created.sid) {
            // Best effort: the new session stands whatever becomes of the old one.
            if sessions.revoke(&old).await.is_err() {
                tracing::warn!("login: the session it replaces could not be revoked (store)");
            }
        }
        *sid_out = Some(created.sid.into());
        // A store write slower than a very short session.ttl_seconds leaves exp behind now:
        // a cookie that expires at once, never one that wraps to a huge Max-Age.
        let cookie = self.token_cookie(&jwt, exp.saturating_sub(now));
        let mut resp = match rd {
            Some(rd) => redirect(rd, Some(cookie)),
            None => {
                let body = serde_json::to_vec(&LoginOk {
                    token: &jwt,
                    expires_at: exp,
                    sub: creds.user(),
                })
                .expect("serializes");
                let mut r = json(StatusCode::OK, body);
                r.headers_mut().append(header::SET_COOKIE, cookie);
                r
            }
        };
        if shape.form {
            resp.headers_mut()
                .append(header::SET_COOKIE, self.clear_cookie(&self.csrf_cookie));
        }
        if let Some(device) = self.device_cookie(sessions.sealer(), creds.user()) {
            resp.headers_mut().append(header::SET_COOKIE, device);
        }
        (resp, Some("login".into()))
    }
}
