//! The phases after the screen: authenticate (extract, verify, resolve + unseal), inject, the
//! upstream target and body limits, and the answer to an upstream that refused the stored
//! credentials. Must never: leave a client credential in a request that goes upstream.

use bytes::Bytes;
use http::header::{self};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Method, Response, StatusCode, Uri, Version};
use http_body::Body;
use http_body_util::BodyExt;

use crate::error::ProxyError;
use crate::screen::{self, Screened};
use crate::session::Session;
use crate::token::{self};
use crate::unix_now;
use crate::upstream::{BoxError, ProxyBody, UpBody};

use super::{Proxy, RequestCtx};

impl Proxy {
    /// extract -> verify -> resolve (+ unseal): the session a request's token names.
    pub(super) async fn authenticate(
        &self,
        parts: &Parts,
        ctx: &mut RequestCtx<'_>,
    ) -> Result<std::sync::Arc<Session>, ProxyError> {
        let token = token::extract_carried(&parts.headers, &self.sources)?;
        let verified = self.verifier.verify_refreshing(&token, unix_now()).await?;
        let session = self.sessions.resolve(&verified.sid).await;
        ctx.sid = Some(verified.sid);
        Ok(session?)
    }

    /// The upstream answered 401 to a request made with the session's stored credentials. With
    /// `[login]`, they are checked again at `login.verify_path` first ([`crate::login::Login::still_accepted`]):
    /// still good (the 401 was that path's own), or the check failed, and the session is kept
    /// and the upstream's answer passed on without its challenges. Refused there (the password
    /// was changed, the account closed), or without `[login]`, the session is useless: it is
    /// deleted (evicted only, on a read-only store), and the client gets a Bearer challenge
    /// saying why. Never the upstream's `Basic` challenge, which would make a browser prompt
    /// for the upstream password.
    pub(super) async fn upstream_rejected(
        &self,
        ctx: &mut RequestCtx<'_>,
        session: &Session,
        resp: Response<ProxyBody>,
    ) -> Response<ProxyBody> {
        if let (Some(login), Some(sid)) = (&self.login, &ctx.sid) {
            // Read first: the answer's connection goes back to the pool before the check takes one.
            let resp = buffered(resp).await;
            match login
                .still_accepted(
                    sid,
                    &session.authorization,
                    ctx.request_id(),
                    ctx.peer().addr.ip(),
                    &self.upstream,
                )
                .await
            {
                Ok(false) => {}
                kept => {
                    ctx.reason = Some(match kept {
                        Err(e) => format!("upstream answered 401; re-check failed ({e}); session kept"),
                        Ok(_) => "upstream answered 401; credentials still accepted at login.verify_path; session kept".into(),
                    });
                    return resp;
                }
            }
        }
        if let Some(sid) = &ctx.sid {
            ctx.reason = Some(match self.sessions.drop_rejected(sid).await {
                Ok(done) => format!("upstream rejected credentials; {done}"),
                Err(e) => format!("upstream rejected credentials; delete failed: {e}"),
            });
        }
        self.rejected_answer()
    }

    /// The 401 for credentials the upstream refused ([`ProxyError::UpstreamRejected`]), with
    /// the token cookie cleared.
    fn rejected_answer(&self) -> Response<ProxyBody> {
        let mut resp = ProxyError::UpstreamRejected.into_response();
        if let Some(login) = &self.login {
            resp.headers_mut()
                .append(header::SET_COOKIE, login.clear_token_cookie());
        }
        resp
    }

    /// inject: drop every client credential, set the upstream's, set forwarding headers and
    /// rewrite the target for the upstream (origin-form, base path, `Host`).
    ///
    /// Errors: see [`Proxy::upstream_uri`].
    pub(super) fn inject(
        &self,
        parts: &mut Parts,
        screened: &Screened,
        session: &Session,
        ctx: &RequestCtx<'_>,
    ) -> Result<(), ProxyError> {
        parts.uri = self.upstream_uri(&parts.uri)?;
        parts.version = Version::HTTP_11;
        let headers = &mut parts.headers;
        // The client's `Authorization` values go with the insert of the upstream's below.
        if screened.cookie_is_hop_by_hop {
            headers.remove(header::COOKIE);
        } else {
            token::strip_token_cookies(headers, &self.token_cookies);
        }
        headers.insert(header::AUTHORIZATION, session.authorization.clone());
        let peer = ctx.peer();
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
        if let (Some(name), Some(id)) = (&self.request_id, ctx.request_id()) {
            headers.insert(name.clone(), id.clone());
        }
        Ok(())
    }

    /// The origin-form target sent upstream: the base path + the client's path and query.
    ///
    /// Errors: 400 for `*` under a base path, 414 if the result is no valid URI (too long).
    pub(super) fn upstream_uri(&self, uri: &Uri) -> Result<Uri, ProxyError> {
        if self.base_path.is_empty() && uri.scheme().is_none() && uri.authority().is_none() {
            // Already origin-form: reused as is (its bytes are shared, not copied or re-parsed).
            return Ok(uri.clone());
        }
        // An absolute form's empty path is `/` (RFC 3986 section 6.2.3): `http://h?q` is `/?q`.
        let pq: std::borrow::Cow<'_, str> = match uri.path_and_query().map(PathAndQuery::as_str) {
            None | Some("") => "/".into(),
            Some(pq) if pq.starts_with('?') => format!("/{pq}").into(),
            Some(pq) => pq.into(),
        };
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

    /// An `OPTIONS` with `Max-Forwards` (RFC 9110 section 7.6.2): at 0, tessera is its final
    /// recipient and answers it (204), else the value goes on one less. Any other request, or
    /// a value that is no number, is left as it is.
    pub(super) fn forwards_no_further(parts: &mut Parts) -> Option<Response<ProxyBody>> {
        if parts.method != Method::OPTIONS {
            return None;
        }
        let left = parts.headers.get(header::MAX_FORWARDS)?.to_str().ok()?;
        match left.trim().parse::<u64>().ok()? {
            0 => {
                let mut resp = Response::new(ProxyBody::empty());
                *resp.status_mut() = StatusCode::NO_CONTENT;
                Some(resp)
            }
            n => {
                parts.headers.insert(header::MAX_FORWARDS, (n - 1).into());
                None
            }
        }
    }

    pub(super) fn limit_body<B>(&self, body: B) -> UpBody
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        screen::body::limit(body, self.limits.max_body_bytes, self.body_timeout)
    }
}

/// Most bytes of an upstream 401's body kept while its session is checked again; a longer body
/// is dropped (the answer goes on with none).
const BUFFERED_MAX_BYTES: usize = 64 * 1024;

/// `resp` with its body read into memory (at most [`BUFFERED_MAX_BYTES`], within 5 s; else
/// none) and its `WWW-Authenticate` fields removed, so it holds no upstream connection.
async fn buffered(mut resp: Response<ProxyBody>) -> Response<ProxyBody> {
    crate::upstream::materialize(&mut resp);
    let (mut parts, body) = resp.into_parts();
    let read = http_body_util::Limited::new(body, BUFFERED_MAX_BYTES).collect();
    let bytes = match tokio::time::timeout(std::time::Duration::from_secs(5), read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        _ => Bytes::new(),
    };
    for name in [
        header::WWW_AUTHENTICATE,
        header::CONTENT_LENGTH,
        header::TRANSFER_ENCODING,
    ] {
        parts.headers.remove(name);
    }
    Response::from_parts(parts, ProxyBody::full(bytes))
}
