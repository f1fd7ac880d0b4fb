//! One request's way through the phases: [`Proxy::handle`] runs them top to bottom and turns
//! any failure into a response in one place; a body left unread by an early answer is
//! discarded (bounded) on multiplexed connections.

use std::sync::Arc;

use bytes::Bytes;
use http::header;
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Request, Response, Version};
use http_body::Body;

use crate::error::ProxyError;
use crate::login::{Endpoint, Login};
use crate::screen::{self, Limits, Screened};
use crate::session::Session;
use crate::upstream::{BoxError, ForwardError, ProxyBody, RequestShares};

use super::websocket::Upgrading;
use super::{Peer, Proxy, RequestCtx};

impl Proxy {
    /// Handles one downstream request end to end. Never fails: errors become responses.
    pub async fn handle<B>(&self, req: Request<B>, peer: &Peer) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        let mut resp = self.respond(req, peer).await;
        crate::upstream::materialize(&mut resp);
        resp
    }

    /// [`Proxy::handle`] for a writer that reads an upstream response's fields from the body
    /// ([`ProxyBody::take_fields`], already screened) and the rest from the `HeaderMap`: the
    /// fields never become map entries.
    pub async fn respond<B>(&self, req: Request<B>, peer: &Peer) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        // Written by `finish` when the answer is ready, or as 499 if this future is dropped first.
        let mut ctx = RequestCtx::new(self, &req, peer);
        let cors = self.cors_for(&req);
        let (parts, body) = req.into_parts();
        let multiplexed = parts.version >= Version::HTTP_2;
        // A body its client holds back until a `100 Continue` that an early answer never sent
        // is not waited for: the answer goes at once, and the client sends none.
        let held_back =
            multiplexed && !body.is_end_stream() && screen::body::expects_continue(&parts.headers);
        let mut body = Some(body);
        let (mut resp, error) = match self.process(parts, &mut body, &mut ctx).await {
            Ok(resp) => (resp, None),
            Err(e) => {
                let reason = e.to_string();
                (e.into_response(), Some(reason))
            }
        };
        if let Some(body) = body.filter(|b| multiplexed && !held_back && !b.is_end_stream()) {
            // Answered without its body: see `discard` (HTTP/1.1's own reader drains or
            // closes after the answer).
            screen::body::discard(body).await;
        }
        ctx.finish(resp.status().as_u16(), error.as_deref());
        if let Some(alt_svc) = &peer.alt_svc {
            resp.headers_mut().insert(header::ALT_SVC, alt_svc.clone());
        }
        // A proxied answer's upstream fields of these names were screened out; one of tessera's
        // own answers keeps what it set (the login page's stricter CSP and X-Frame-Options,
        // `no-store` on a 401).
        for (name, value) in &self.response_headers {
            if !resp.headers().contains_key(name) {
                resp.headers_mut().insert(name.clone(), value.clone());
            }
        }
        if let (Some(name), Some(id)) = (&self.request_id, ctx.request_id()) {
            resp.headers_mut().insert(name.clone(), id.clone());
        }
        if let (Some(cors), Some(allowed)) = (&self.cors, cors) {
            cors.mark(allowed, resp.headers_mut());
        }
        resp
    }

    /// The screen's limits for a request to `path`: with `allow_encoded_slashes` under a
    /// prefix of `server.allow_encoded_slashes_under`.
    fn limits_for(&self, path: &str) -> Limits {
        match self
            .slashes_under
            .iter()
            .any(|p| path.starts_with(p.as_str()))
        {
            true => Limits {
                allow_encoded_slashes: true,
                ..self.limits
            },
            false => self.limits,
        }
    }

    /// With `[cors]`, for a request that is not to a session endpoint (same-origin only):
    /// `Some` of its [`crate::cors::Cors::allowed`] origin.
    fn cors_for<B>(&self, req: &Request<B>) -> Option<Option<http::HeaderValue>> {
        let cors = self.cors.as_ref()?;
        let login = self.login.as_ref();
        if login.is_some_and(|l| l.route(req.uri().path()).is_some()) {
            return None;
        }
        Some(cors.allowed(req.headers()))
    }

    /// The phases after the head is read, top to bottom; `body` is taken when the request is
    /// forwarded or given to a login endpoint, and left for the caller to discard otherwise.
    async fn process<B>(
        &self,
        mut parts: Parts,
        body: &mut Option<B>,
        ctx: &mut RequestCtx<'_>,
    ) -> Result<Response<ProxyBody>, ProxyError>
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        if ctx.peer().plain_on_tls {
            return Err(ProxyError::PlainHttpOnTlsPort);
        }
        let extended =
            self.websockets.is_some() && super::websocket::from_extended_connect(&mut parts);
        let limits = self.limits_for(parts.uri.path());
        let screened = screen::screen_request_with(&mut parts, &limits, &self.stripped)?;
        if let Some(port) = ctx.peer().to_https {
            if screened.host.is_empty() {
                // An HTTP/1.0 request without Host: `https:///x` would send a browser to host x.
                return Err(ProxyError::BadRequest("no Host to redirect to"));
            }
            let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
            return Ok(super::redirect::to_https(&screened.host, target, port));
        }
        if let Some(endpoint) = self.login.as_ref().and_then(|l| l.route(parts.uri.path())) {
            if extended {
                // Its 200 would tell the client a tunnel is open.
                return Err(screen::ScreenError::MethodNotAllowed.into());
            }
            return Ok(self
                .session_endpoint(endpoint, &parts, &screened, body, ctx)
                .await);
        }
        if let Some(cors) = &self.cors {
            // Before authentication: a browser sends a preflight without credentials.
            if crate::cors::is_preflight(&parts.method, &parts.headers) {
                return cors.preflight(&parts.headers);
            }
        }
        let session = match self.authenticate(&parts, ctx).await {
            Ok(session) => session,
            Err(e) => return self.unauthenticated(e, &parts, ctx),
        };
        if let Some(answer) = Self::forwards_no_further(&mut parts) {
            return Ok(answer);
        }
        let upgrading = if screened.websocket || extended {
            let empty = body.as_ref().is_none_or(Body::is_end_stream);
            let proto = ctx.peer().proto;
            let credential = &session.authorization;
            self.upgrading(&mut parts, &screened, credential, proto, empty, extended)?
        } else {
            None
        };
        let jmap_origin = self
            .jmap_origin(&parts, &screened, ctx)
            .map(|origin| (origin, parts.method == http::Method::HEAD));
        if jmap_origin.is_some() {
            crate::jmap::ask_whole(&mut parts.headers);
        }
        self.inject(&mut parts, &screened, &session, ctx)?;
        if let Some(upgrading) = &upgrading {
            upgrading.set_request_fields(&mut parts.headers);
        }
        let body = body.take().expect("the body is taken once");
        let req = Request::from_parts(parts, self.limit_body(body));
        let shares = RequestShares {
            user: session
                .upstream_share
                .get_or_init(|| self.upstream.user_share(&session.authorization))
                .as_ref(),
            connection: ctx.share.as_ref(),
        };
        let mut resp = self.upstream.forward_on(req, shares).await?;
        self.answer(&mut resp, upgrading, &session, ctx).await;
        self.point_redirects(&mut resp, &screened, ctx);
        Ok(match jmap_origin {
            // Boxed: rare, and its body read would grow every request's future.
            Some((origin, head)) => {
                let origin = crate::jmap::Origin {
                    client: &origin,
                    base_path: &self.base_path,
                };
                let max_body = self.limits.max_body_bytes;
                Box::pin(crate::jmap::rewrite_session(resp, origin, head, max_body)).await
            }
            None => resp,
        })
    }

    /// A `{prefix}/login`, `/logout` or `/session` request, served by [`Login::handle`].
    async fn session_endpoint<B>(
        &self,
        endpoint: Endpoint,
        parts: &Parts,
        screened: &Screened,
        body: &mut Option<B>,
        ctx: &mut RequestCtx<'_>,
    ) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        let login = self.login.as_ref().expect("routed by the login endpoints");
        let request_id = ctx.request_id().cloned();
        let req = crate::login::EndpointRequest {
            parts,
            host: &screened.host,
            peer: ctx.peer().addr,
            verifier: &self.verifier,
            sessions: &self.sessions,
            upstream: &self.upstream,
            request_id: request_id.as_ref(),
        };
        let body = body.take().expect("the body is taken once");
        // Boxed: the login future (an upstream check, a store write) is many times the size of
        // the proxy path's, and every request's future would carry its size.
        let (resp, reason) = Box::pin(login.handle(endpoint, req, body, &mut ctx.sid)).await;
        ctx.reason = reason;
        resp
    }

    /// With `[jmap] session_urls = "absolute"`, for a request of the JMAP session resource: the
    /// origin (`scheme://host`) the client used, on which its URLs are made absolute.
    fn jmap_origin(
        &self,
        parts: &Parts,
        screened: &Screened,
        ctx: &RequestCtx<'_>,
    ) -> Option<String> {
        let jmap = self.jmap.as_ref()?;
        if !jmap.is_session_request(&parts.method, parts.uri.path()) {
            return None;
        }
        let host = screened.host.to_str().ok().filter(|h| !h.is_empty())?;
        Some(format!("{}://{host}", ctx.peer().proto))
    }

    /// A request that did not authenticate: a browser navigation is sent to the login page (when
    /// `[login]` is served), anything else gets `e`'s answer.
    fn unauthenticated(
        &self,
        e: ProxyError,
        parts: &Parts,
        ctx: &mut RequestCtx<'_>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        match &self.login {
            Some(login)
                if e.status() == http::StatusCode::UNAUTHORIZED
                    && Login::wants_login_page(parts) =>
            {
                ctx.reason = Some(format!("{e}; sent to the login page"));
                let target = parts.uri.path_and_query().map_or("/", PathAndQuery::as_str);
                Ok(login.login_redirect(target))
            }
            _ => Err(e),
        }
    }

    /// The upstream's answer on its way back, changed in place (a response moved in and out
    /// costs two copies of it per request): a switch to a WebSocket tunnel, a body that may
    /// wait tied to its session (logout, expiry), its fields screened, a 401 checked.
    async fn answer(
        &self,
        resp: &mut Response<ProxyBody>,
        upgrading: Option<Upgrading>,
        session: &Arc<Session>,
        ctx: &mut RequestCtx<'_>,
    ) {
        if let Some(upgrading) = upgrading {
            if let Some(tunnel) = resp.body_mut().take_tunnel() {
                let switching = std::mem::replace(resp, Response::new(ProxyBody::empty()));
                *resp = self.switch(switching, tunnel, upgrading, ctx, session);
                return;
            }
            if upgrading.extended() && resp.status().is_success() {
                let why = "upstream answered a WebSocket upgrade without switching";
                *resp = ProxyError::Upstream(ForwardError::Broken(why.into())).into_response();
                ctx.reason = Some(why.into());
                return;
            }
        }
        if resp.body_mut().may_wait() {
            // (Not asked of a body already in memory: a watch is an allocation, 1.5% of a warm
            // request's instructions.)
            if let Some(sid) = &ctx.sid {
                if let Some(w) = self.sessions.revocable(sid.clone(), session) {
                    resp.body_mut().end_with_session(w);
                }
            }
        }
        // An upstream response's fields are all in its body until `materialize` (its map is
        // empty), so they are screened there; its trailers by the head's `Connection`.
        let strip = &self.strip_response;
        resp.body_mut()
            .screen_trailers(|head| screen::unlisted_in_trailers(head, strip));
        if let Some(fields) = resp.body_mut().fields_mut() {
            self.screen_upstream_fields(fields);
        }
        self.mark_private(resp);
        if resp.status() == http::StatusCode::UNAUTHORIZED {
            let rejected = std::mem::replace(resp, Response::new(ProxyBody::empty()));
            // Boxed, as the session store's futures are (see `Sessions::resolve`).
            *resp = Box::pin(self.upstream_rejected(ctx, session, rejected)).await;
        }
    }

    /// Screens the upstream's fields on their way to the client, a proxied answer's and a
    /// WebSocket switch's alike: hop-by-hop and `upstream.strip_response_headers` fields out, and any
    /// `Set-Cookie` of tessera's own cookies (browsers store those of a switch's answer too).
    pub(super) fn screen_upstream_fields(&self, fields: &mut crate::upstream::RawHead) {
        screen::screen_response(fields, &self.strip_response);
        screen::drop_set_cookies(fields, &self.own_cookies);
    }

    /// `Cache-Control: private` added to an answer whose fields say nothing of shared caches
    /// (`server.private_responses`, [`screen::PrivateResponses`]).
    fn mark_private(&self, resp: &mut Response<ProxyBody>) {
        let cache_control = http::header::CACHE_CONTROL;
        let wants = match resp.body_mut().fields_mut() {
            Some(fields) => self
                .private_responses
                .wants_private(fields.get_all(b"cache-control")),
            None => self.private_responses.wants_private(
                resp.headers()
                    .get_all(&cache_control)
                    .iter()
                    .map(http::HeaderValue::as_bytes),
            ),
        };
        // A 304 updates the stored answer's fields with its own (RFC 9111 section 4.3.4): one
        // without `Cache-Control` leaves the stored `private` in place, where a `private` alone
        // would drop the stored `max-age`.
        let updates_none =
            resp.status() == http::StatusCode::NOT_MODIFIED && !has_cache_control(resp);
        if wants && !updates_none {
            match resp.body_mut().fields_mut() {
                // Beside the upstream's bytes: no map allocated per answer for it.
                Some(fields) => fields.add(&crate::upstream::raw::CACHE_CONTROL_PRIVATE),
                None => {
                    let private = http::HeaderValue::from_static("private");
                    resp.headers_mut().append(cache_control, private);
                }
            }
        }
    }
}

/// Whether `resp` (its raw upstream fields, or its map) has a `Cache-Control` field.
fn has_cache_control(resp: &mut Response<ProxyBody>) -> bool {
    match resp.body_mut().fields_mut() {
        Some(fields) => fields.contains(b"cache-control"),
        None => resp.headers().contains_key(http::header::CACHE_CONTROL),
    }
}
