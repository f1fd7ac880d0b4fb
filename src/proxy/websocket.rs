//! WebSocket upgrades (RFC 6455) passed to the upstream after the request is authenticated: the
//! origin check, the limit on open tunnels, the 101 and the tunnel's task. Must never: switch a
//! connection the upstream did not switch, or let a foreign origin's page open a tunnel.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::header::{self};
use http::request::Parts;
use http::{HeaderValue, Response};

use crate::error::ProxyError;
use crate::screen::Screened;
use crate::session::Session;
use crate::upstream::{ProxyBody, Tunnel};

use super::{Proxy, RequestCtx};

/// WebSocket upgrades: the limit on open tunnels and the origin policy (`[websocket]`).
pub(super) struct WebSockets {
    /// One permit per tunnel open now, `websocket.max_connections` in all.
    pub(super) slots: Arc<tokio::sync::Semaphore>,
    /// Each user's share of them (`websocket.max_connections_per_user`).
    pub(super) users: crate::upstream::Shares,
    pub(super) max: usize,
    pub(super) idle_timeout: Option<Duration>,
    /// `server.send_timeout_ms`, for a tunnel's client side of unknown kind (an HTTP/2 stream).
    pub(super) send_timeout: Duration,
    pub(super) allowed_origins: Vec<String>,
    /// Tunnels opened since start.
    pub(super) opened: AtomicU64,
    /// The running tunnels, for the shutdown to wait on.
    pub(super) tunnels: tokio_util::task::TaskTracker,
    /// Cancelled at shutdown: every tunnel closes (Close 1001 to both sides).
    pub(super) stop: tokio_util::sync::CancellationToken,
}

/// Longest wait for hyper to write a 101 and hand the client's connection over (the client
/// reads it) before the tunnel is given up.
const UPGRADE_WAIT: Duration = Duration::from_secs(10);

/// What an upgrade the proxy passes on needs once the upstream has answered 101: the client's
/// side of the switch (resolved by hyper after the 101 is written) and the tunnel's slot.
pub(super) struct Upgrading {
    downstream: hyper::upgrade::OnUpgrade,
    slot: tokio::sync::OwnedSemaphorePermit,
    /// The user's share of the slots (`websocket.max_connections_per_user`); `None` when that
    /// is all of them.
    user_slot: Option<crate::share::SharePermit>,
    /// Asked by an HTTP/2 extended CONNECT (RFC 8441): answered 200, not 101.
    extended: bool,
    /// The client connection's busy mark, held while the tunnel runs (see [`ConnectionHold`]).
    hold: Option<ConnectionHold>,
}

/// Keeps a client connection counted as busy while a WebSocket tunnel on one of its HTTP/2
/// streams (RFC 8441) runs: the downstream puts it in a CONNECT request's extensions, and the
/// tunnel holds it until it ends. Without it the connection would look idle once the CONNECT's
/// 200 was sent, and be closed under the tunnel.
#[derive(Clone)]
pub struct ConnectionHold(pub Arc<dyn Send + Sync>);

impl Upgrading {
    /// The fields that make the upstream request an HTTP/1.1 WebSocket upgrade: `Connection`,
    /// `Upgrade`, and for an extended CONNECT a fresh `Sec-WebSocket-Key` (RFC 6455 section
    /// 4.1: 16 random bytes in base64), which HTTP/2 does not carry (RFC 8441 section 5).
    pub(super) fn set_request_fields(&self, h: &mut http::HeaderMap) {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        if self.extended {
            use base64::Engine;
            let mut nonce = [0u8; 16];
            getrandom::getrandom(&mut nonce).expect("the OS random source");
            let key = base64::engine::general_purpose::STANDARD.encode(nonce);
            let key = HeaderValue::from_str(&key).expect("base64 is a valid field value");
            h.insert(header::SEC_WEBSOCKET_KEY, key);
        }
    }

    /// Whether the client asked by an HTTP/2 extended CONNECT: an answer that is not a switch
    /// must not be a 2xx, which would tell it the tunnel is open.
    pub(super) fn extended(&self) -> bool {
        self.extended
    }
}

/// Turns an HTTP/2 extended CONNECT for a WebSocket (RFC 8441 section 4: `:method CONNECT`,
/// `:protocol websocket`) into the `GET` an HTTP/1.1 upgrade is, as HAProxy does; returns
/// whether it was one. Any other CONNECT stays one (and is refused by the screen).
pub(super) fn from_extended_connect(parts: &mut Parts) -> bool {
    let extended = parts.method == http::Method::CONNECT
        && parts
            .extensions
            .get::<hyper::ext::Protocol>()
            .is_some_and(|p| p.as_str().eq_ignore_ascii_case("websocket"));
    if extended {
        parts.method = http::Method::GET;
    }
    extended
}

/// A WebSocket handshake as RFC 6455 section 4.2.1 has a server check it, before it takes a
/// tunnel's slot and an upstream connection: version 13, and over HTTP/1.1 one
/// `Sec-WebSocket-Key` of 16 bytes in base64 (over HTTP/2 there is none: tessera makes one,
/// RFC 8441 section 5).
///
/// Errors: 426 for another version ([`ProxyError::WebSocketVersion`]); 400 for a missing,
/// repeated or malformed key.
fn check_handshake(h: &http::HeaderMap, extended: bool) -> Result<(), ProxyError> {
    let one = |name| {
        let mut all = h.get_all(name).iter();
        match (all.next(), all.next()) {
            (Some(v), None) => Some(v),
            _ => None,
        }
    };
    if one(header::SEC_WEBSOCKET_VERSION).is_none_or(|v| v != "13") {
        return Err(ProxyError::WebSocketVersion);
    }
    if extended {
        return Ok(());
    }
    use base64::Engine;
    let key = one(header::SEC_WEBSOCKET_KEY)
        .and_then(|k| base64::engine::general_purpose::STANDARD.decode(k).ok());
    match key {
        Some(k) if k.len() == 16 => Ok(()),
        _ => Err(ProxyError::BadRequest(
            "WebSocket handshake without one Sec-WebSocket-Key of 16 bytes",
        )),
    }
}

/// Whether a WebSocket upgrade with this `Origin` may go on (RFC 6455 section 10.2): the origin
/// is the request's own, `scheme://host` (`scheme` as the client used it: `http`, or what a
/// trusted proxy reported in `X-Forwarded-Proto`; a plain-HTTP page cannot speak for an HTTPS
/// site), or one of `allowed` (lowercase `scheme://host[:port]`, default ports removed). ASCII
/// case is ignored; `null` and anything else are refused.
fn origin_allowed(
    origin: &HeaderValue,
    scheme: &str,
    host: &HeaderValue,
    allowed: &[String],
) -> bool {
    let origin = origin.as_bytes();
    let own = origin.len() == scheme.len() + 3 + host.len()
        && origin[..scheme.len()].eq_ignore_ascii_case(scheme.as_bytes())
        && &origin[scheme.len()..scheme.len() + 3] == b"://"
        && origin[scheme.len() + 3..].eq_ignore_ascii_case(host.as_bytes());
    own || crate::cors::listed(origin, allowed)
}

impl Proxy {
    /// Shutdown of WebSocket tunnels: every open one (and any opened from now on) sends both
    /// sides a Close frame 1001 (going away) and ends within about a second
    /// ([`crate::upstream::CLOSING_WAIT`]). Call it when shutdown starts; [`Self::tunnels_closed`]
    /// waits for them.
    pub fn close_websockets(&self) {
        if let Some(ws) = &self.websockets {
            ws.stop.cancel();
            ws.tunnels.close();
        }
    }

    /// Resolves once no WebSocket tunnel runs (at once when upgrades are off), after
    /// [`Self::close_websockets`]; a tunnel spawned by a handshake still being answered is
    /// waited for too if that handshake's connection was waited for first. The tunnels of every
    /// serving thread count, so each thread's drain waits for the slowest (bounded by the
    /// caller's drain time; a thread that gives up drops its own tunnels).
    pub async fn tunnels_closed(&self) {
        if let Some(ws) = &self.websockets {
            ws.tunnels.wait().await;
        }
    }

    /// WebSocket tunnels `(open now, opened since start)`; `None` when upgrades are not passed
    /// (`websocket.max_connections = 0`).
    pub fn websockets(&self) -> Option<(u64, u64)> {
        self.websockets.as_ref().map(|w| {
            let open = w.max.saturating_sub(w.slots.available_permits()) as u64;
            (open, w.opened.load(Ordering::Relaxed))
        })
    }

    /// Whether a WebSocket upgrade request (authenticated) is passed on as one: `None` when
    /// upgrades are off or the connection cannot switch (no `OnUpgrade`: not hyper's HTTP/1.1),
    /// and the request then goes upstream as a plain `GET` (its `Upgrade` already removed).
    ///
    /// Errors: 403 when a browser page of a foreign origin asks ([`ProxyError::ForeignOrigin`]);
    /// 400 when the request has a body; 426 or 400 for a handshake RFC 6455 refuses
    /// ([`check_handshake`]); 429 when the user whose upstream `credential` it
    /// carries holds `websocket.max_connections_per_user` tunnels, 503 when
    /// `websocket.max_connections` are open.
    pub(super) fn upgrading(
        &self,
        parts: &mut Parts,
        screened: &Screened,
        credential: &HeaderValue,
        scheme: &str,
        no_body: bool,
        extended: bool,
    ) -> Result<Option<Upgrading>, ProxyError> {
        let Some(ws) = &self.websockets else {
            return Ok(None);
        };
        // Taken out at once: a refused handshake is answered as any request (no switch).
        let Some(downstream) = parts.extensions.remove::<hyper::upgrade::OnUpgrade>() else {
            return Ok(None);
        };
        if let Some(origin) = parts.headers.get(header::ORIGIN) {
            if !origin_allowed(origin, scheme, &screened.host, &ws.allowed_origins) {
                return Err(ProxyError::ForeignOrigin);
            }
        }
        if !no_body {
            return Err(ProxyError::BadRequest(
                "WebSocket upgrade request with a body",
            ));
        }
        check_handshake(&parts.headers, extended)?;
        let user_slot = match ws.users.user(Some(credential)) {
            Some(share) => Some(
                share
                    .try_acquire()
                    .ok_or(ProxyError::TooManyWebSocketsForUser)?,
            ),
            None => None,
        };
        let slot = ws
            .slots
            .clone()
            .try_acquire_owned()
            .map_err(|_| ProxyError::TooManyWebSockets)?;
        Ok(Some(Upgrading {
            downstream,
            slot,
            user_slot,
            extended,
            hold: parts.extensions.remove::<ConnectionHold>(),
        }))
    }

    /// The upstream switched to WebSocket: answers the client 101 with the upstream's fields
    /// (screened; `Connection` and `Upgrade` set anew) and starts the tunnel, which runs in a
    /// task of its own once hyper has written the 101, until either side closes, it idles out
    /// (`websocket.idle_timeout_ms`), the session is revoked or expires, or shutdown
    /// ([`Self::close_websockets`]).
    pub(super) fn switch(
        &self,
        mut resp: Response<ProxyBody>,
        tunnel: Tunnel,
        upgrading: Upgrading,
        ctx: &RequestCtx<'_>,
        session: &Session,
    ) -> Response<ProxyBody> {
        let ws = self
            .websockets
            .as_ref()
            .expect("upgrading implies websockets");
        ws.opened.fetch_add(1, Ordering::Relaxed);
        let mut out = Response::new(ProxyBody::empty());
        if let Some(mut fields) = resp.body_mut().take_fields() {
            self.screen_upstream_fields(&mut fields);
            fields.append_to(out.headers_mut());
        }
        if !upgrading.extended {
            *out.status_mut() = http::StatusCode::SWITCHING_PROTOCOLS;
        }
        let h = out.headers_mut();
        if upgrading.extended {
            // RFC 8441 section 5: a 200 opens the stream's tunnel; the accept answers a key
            // the client never sent.
            h.remove(header::SEC_WEBSOCKET_ACCEPT);
        } else {
            h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        }
        let sid = ctx.sid.clone();
        let watch = sid
            .as_ref()
            .and_then(|sid| self.sessions.revocable(sid.clone(), session));
        let idle = ws.idle_timeout;
        let client_side = self.client_side;
        let stop = ws.stop.clone();
        // The client's socket lives on in the tunnel once its connection's task has ended: the
        // tunnel takes that connection's places under server.max_connections and
        // max_connections_per_ip once hyper has handed the socket over, by when the connection's
        // task (which ends in that same poll) has given them up, so that a WebSocket never
        // counts twice. (An HTTP/2 stream's connection keeps its own places while it runs.)
        let places = (!upgrading.extended).then(|| {
            let ip = ctx.conn_peer().addr.ip();
            let per_ip = self.per_ip.clone().filter(|_| !self.trusts(ip));
            (self.client_connections.clone(), per_ip, ip)
        });
        let send_timeout = ws.send_timeout;
        ws.tunnels.spawn(async move {
            let Upgrading {
                downstream,
                slot,
                user_slot,
                extended,
                hold,
            } = upgrading;
            let over = if extended { "HTTP/2" } else { "HTTP/1.1" };
            let sid_hash = sid.as_deref().map(crate::session::sid_hash);
            // hyper hands the connection over once the 101 is written; a client that does not
            // read it must not hold the slot and the upstream connection for ever, nor hold up
            // a shutdown.
            let upgraded = tokio::select! {
                taken = tokio::time::timeout(UPGRADE_WAIT, downstream) => Some(taken),
                () = stop.cancelled() => None,
            };
            let Some(upgraded) = upgraded else {
                tracing::debug!("WebSocket 101 not taken by the client before shutdown");
                return;
            };
            match upgraded {
                Ok(Ok(io)) => {
                    let _places = places.map(|(all, per_ip, ip)| {
                        let place = all.map(|c| c.acquire_over());
                        (place, per_ip.map(|p| p.enter_over(ip)))
                    });
                    let io = client_side(io, send_timeout);
                    let report = tunnel.run(io, idle, send_timeout, watch, stop).await;
                    tracing::info!(
                        sid_hash = sid_hash.as_deref().unwrap_or("-"),
                        over,
                        end = %report.end,
                        close_code = report.close_code.unwrap_or(0),
                        up_bytes = report.up_bytes,
                        down_bytes = report.down_bytes,
                        duration_ms = report.duration.as_millis() as u64,
                        "WebSocket closed"
                    );
                }
                Ok(Err(e)) => {
                    tracing::debug!(cause = %e, "client side of a WebSocket upgrade failed")
                }
                Err(_) => tracing::debug!("WebSocket 101 not taken by the client in time"),
            }
            drop((slot, user_slot, hold));
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_websocket_origin_must_name_the_requested_host_or_be_listed() {
        let host = HeaderValue::from_static("mail.example.com:8080");
        let allowed = ["https://app.example.net".to_string()];
        let ok = |origin: &str| {
            origin_allowed(
                &HeaderValue::from_str(origin).unwrap(),
                "https",
                &host,
                &allowed,
            )
        };
        assert!(ok("https://mail.example.com:8080"));
        assert!(ok("HTTPS://MAIL.example.com:8080"), "any case");
        assert!(
            !ok("http://mail.example.com:8080"),
            "a plain-HTTP page for an HTTPS site"
        );
        assert!(origin_allowed(
            &HeaderValue::from_static("http://mail.example.com:8080"),
            "http",
            &host,
            &allowed
        ));
        assert!(ok("https://app.example.net"));
        assert!(ok("HTTPS://APP.example.net"));
        assert!(
            !ok("https://mail.example.com"),
            "another port is another origin"
        );
        assert!(!ok("https://evil.example"));
        assert!(!ok("https://mail.example.com:8080.evil.example"));
        assert!(!ok("null"));
        assert!(!ok("mail.example.com:8080"), "no scheme");
    }
}
