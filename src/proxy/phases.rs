//! The phases after the screen: authenticate (extract, verify, resolve + unseal), inject, the
//! upstream target and body limits, and the answer to an upstream that refused the stored
//! credentials. Must never: leave a client credential in a request that goes upstream.

use bytes::Bytes;
use http::header::{self};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{HeaderValue, Response, Uri, Version};
use http_body::Body;

use crate::error::ProxyError;
use crate::screen::{self, Screened};
use crate::session::Session;
use crate::token::{self};
use crate::unix_now;
use crate::upstream::{BoxError, ProxyBody, UpBody};

use super::{Ctx, Peer, Proxy, UPSTREAM_REJECTED};

impl Proxy {
    /// extract -> verify -> resolve (+ unseal): the session a request's token names.
    pub(super) async fn authenticate(
        &self,
        parts: &Parts,
        ctx: &mut Ctx,
    ) -> Result<std::sync::Arc<Session>, ProxyError> {
        let token = token::extract(&parts.headers, &self.sources)?;
        let verified = self.verifier.verify_refreshing(&token, unix_now()).await?;
        drop(token);
        let session = self.sessions.resolve(&verified.sid).await;
        ctx.sid = Some(verified.sid);
        Ok(session?)
    }

    /// The upstream refused the stored credentials (the password was changed or the account
    /// closed): the session is useless, so it is deleted, and the client gets a Bearer challenge
    /// saying why instead of the upstream's `Basic` one (which would make a browser prompt for
    /// the upstream password).
    pub(super) async fn upstream_rejected(&self, ctx: &mut Ctx) -> Response<ProxyBody> {
        if let Some(sid) = &ctx.sid {
            match self.sessions.revoke(sid).await {
                Ok(_) => ctx.reason = Some("upstream rejected credentials; session deleted".into()),
                Err(e) => {
                    ctx.reason = Some(format!("upstream rejected credentials; delete failed: {e}"))
                }
            }
        }
        let mut resp = Response::new(ProxyBody::full("Unauthorized\n"));
        *resp.status_mut() = http::StatusCode::UNAUTHORIZED;
        let h = resp.headers_mut();
        h.insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static(UPSTREAM_REJECTED),
        );
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(login) = &self.login {
            h.append(header::SET_COOKIE, login.clear_token_cookie());
        }
        resp
    }

    /// inject: drop every client credential, set the upstream's, set forwarding headers and
    /// rewrite the target for the upstream (origin-form, base path, `Host`).
    pub(super) fn inject(
        &self,
        parts: &mut Parts,
        screened: &Screened,
        session: &Session,
        peer: &Peer,
        target: Uri,
    ) {
        let headers = &mut parts.headers;
        // The client's `Authorization` values go with the insert of the upstream's below.
        if screened.cookie_is_hop_by_hop {
            headers.remove(header::COOKIE);
        } else {
            token::strip_token_cookies(headers, &self.sources);
        }
        headers.insert(header::AUTHORIZATION, session.authorization.clone());
        screen::set_forwarded(
            headers,
            peer.forwarded_for.as_ref(),
            peer.proto,
            &screened.host,
        );
        let host = if self.preserve_host && !screened.host.is_empty() {
            screened.host.clone()
        } else {
            self.upstream_host.clone()
        };
        headers.insert(header::HOST, host);
        parts.uri = target;
        parts.version = Version::HTTP_11;
    }

    /// The origin-form target sent upstream: the base path + the client's path and query.
    ///
    /// Errors: 400 for `*` under a base path, 414 if the result is no valid URI (too long).
    pub(super) fn upstream_uri(&self, uri: &Uri) -> Result<Uri, ProxyError> {
        if self.base_path.is_empty() && uri.scheme().is_none() && uri.authority().is_none() {
            // Already origin-form: reused as is (its bytes are shared, not copied or re-parsed).
            return Ok(uri.clone());
        }
        let pq = uri.path_and_query().map_or("/", PathAndQuery::as_str);
        if self.base_path.is_empty() {
            return pq.parse().map_err(|_| ProxyError::UriTooLong);
        }
        if pq == "*" {
            return Err(ProxyError::BadRequest("asterisk-form under a base path"));
        }
        format!("{}{pq}", self.base_path)
            .parse()
            .map_err(|_| ProxyError::UriTooLong)
    }

    pub(super) fn limit_body<B>(&self, body: B) -> UpBody
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        screen::body::limit(body, self.limits.max_body_bytes, self.body_timeout)
    }
}
