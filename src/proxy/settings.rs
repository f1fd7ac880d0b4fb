//! `[websocket]`: WebSocket upgrades passed to the upstream, as validated by `config`.

use std::time::Duration;

/// `[websocket]`: WebSocket upgrades (RFC 6455) passed through to the upstream after the
/// request is authenticated like any other.
#[derive(Debug, Clone)]
pub struct WebSocketConfig {
    /// Most WebSocket connections open at once; an upgrade beyond it is answered 503 with
    /// `Retry-After`. Each holds one of `upstream.max_connections` for its life, so it must stay
    /// below that cap (plain requests keep the rest). `0`: upgrades are not passed (the
    /// `Upgrade` field is dropped like any hop-by-hop field). Default
    /// `upstream.max_connections / 2`.
    pub max_connections: usize,
    /// Most of them one user (one upstream credential) holds at once, so that one user's tabs
    /// or scripts cannot take every one; an upgrade beyond it is answered 429 with
    /// `Retry-After`. Default `max_connections / 4` (at least 1).
    pub max_connections_per_user: usize,
    /// A WebSocket connection with no byte in either direction for this long is closed;
    /// `None` (`idle_timeout_ms = 0`): never. Default 600 s (10 minutes).
    pub idle_timeout: Option<Duration>,
    /// Origins (`scheme://host[:port]`, lowercase) allowed to open a WebSocket besides the
    /// request's own host: a browser sends cookies with a cross-site WebSocket handshake, so an
    /// upgrade whose `Origin` names another host is refused (403) unless listed here
    /// (cross-site WebSocket hijacking). A request without `Origin` (not a browser) is not
    /// checked. Default empty.
    pub allowed_origins: Vec<String>,
}
