//! `{prefix}/logout` and `{prefix}/session` (who am I). Must never: answer for a token that
//! does not verify, or leave the token cookie set after a logout.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::{Response, StatusCode};
use http_body::Body;
use serde::Serialize;

use crate::error::ProxyError;
use crate::session::{sid_hash, Sessions};
use crate::token::{self, Verifier};
use crate::unix_now;
use crate::upstream::{BoxError, ProxyBody};

use super::page::{json, redirect, safe_redirect};
use super::request::{check_same_origin, query_param, read_body};
use super::{Login, Refusal};

#[derive(Serialize)]
pub(super) struct WhoAmI<'a> {
    sub: Option<&'a str>,
    sid_hash: String,
    expires_at: u64,
}

impl Login {
    pub(super) async fn logout<B>(
        &self,
        parts: &Parts,
        body: B,
        host: &HeaderValue,
        verifier: &Verifier,
        sessions: &Sessions,
        sid_out: &mut Option<Arc<str>>,
    ) -> (Response<ProxyBody>, Option<String>)
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let shape = super::page::Shape::of(parts, &self.csrf_cookie);
        if let Err(r) = check_same_origin(parts, host) {
            return self.refuse(r, shape, None);
        }
        let bytes = match read_body(body).await {
            Ok(b) => b,
            Err(r) => return self.refuse(r, shape, None),
        };
        let rd_raw = if shape.form {
            form_urlencoded::parse(&bytes)
                .find(|(k, _)| k == "rd")
                .map(|(_, v)| v.into_owned())
        } else {
            query_param(parts, "rd")
        };
        let rd = rd_raw.as_deref().and_then(safe_redirect);
        if rd_raw.is_some() && rd.is_none() {
            return self.refuse(Refusal::Bad("rd must be a same-origin path"), shape, None);
        }
        let mut reason = "logout without a valid token";
        // Every session a token of the request names, from each source apart: the login cookie
        // this answer deletes is one, whatever `Authorization` came with it (a fetch with
        // credentials sends both), and the client is told it is logged out of both.
        let mut revoked: Vec<Arc<str>> = Vec::new();
        for source in &self.token.sources {
            let Ok(tok) = token::extract(&parts.headers, std::slice::from_ref(source)) else {
                continue;
            };
            // An expired token still names a session worth deleting: everything but `exp` must hold.
            let Ok(v) = verifier.verify_ignoring_expiry(&tok, unix_now()) else {
                continue;
            };
            if revoked.contains(&v.sid) {
                continue;
            }
            let gone = sessions.revoke(&v.sid).await;
            *sid_out = Some(v.sid.clone());
            if gone.is_err() {
                return (
                    ProxyError::StoreUnavailable.into_response(),
                    Some("logout: session store unavailable".into()),
                );
            }
            revoked.push(v.sid);
            reason = "logout";
        }
        let clear = self.clear_cookie(&self.cfg.cookie_name);
        let mut resp = match rd {
            Some(rd) => redirect(rd, Some(clear)),
            None => {
                let mut r = Response::new(ProxyBody::empty());
                *r.status_mut() = StatusCode::NO_CONTENT;
                r.headers_mut()
                    .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
                r.headers_mut().append(header::SET_COOKIE, clear);
                r
            }
        };
        // What the browser kept of this user's answers (Cyrus's attachments are `immutable` for
        // a week) must not be shown to the next user of a shared computer (W3C Clear Site
        // Data; "cookies" would take the device cookie too). Secure contexts only.
        resp.headers_mut().insert(
            header::HeaderName::from_static("clear-site-data"),
            HeaderValue::from_static("\"cache\""),
        );
        (resp, Some(reason.into()))
    }

    pub(super) async fn who(
        &self,
        parts: &Parts,
        verifier: &Verifier,
        sessions: &Sessions,
        sid_out: &mut Option<Arc<str>>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let tok = token::extract_carried(&parts.headers, &self.token.sources)?;
        let v = verifier.verify_refreshing(&tok, unix_now()).await?;
        let session = sessions.resolve(&v.sid).await;
        *sid_out = Some(v.sid.clone());
        let session = session?;
        let body = serde_json::to_vec(&WhoAmI {
            sub: session.sub.as_deref().or(v.sub.as_deref()),
            sid_hash: sid_hash(&v.sid),
            expires_at: session.expires_at.map_or(v.exp, |e| e.min(v.exp)),
        })
        .expect("serializes");
        Ok(json(StatusCode::OK, body))
    }
}
