//! What one request carries through the phases: its downstream peer ([`Peer`]) and its
//! context ([`RequestCtx`]: the facts the phases learn and its access-log line, written once, or
//! as 499 when the client leaves first). Must never: log a token, a credential or a sid (only its hash).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http::HeaderValue;

use crate::screen::{self};
use crate::upstream::ConnectionShare;

use super::Proxy;

/// The downstream peer of a connection, with its `X-Forwarded-For` value formatted once per
/// connection rather than per request (formatting the address was 2-3% of a warm request's
/// user CPU in the profile).
pub struct Peer {
    /// The client's socket address (for a request relayed by a trusted proxy: the client it
    /// names, port 0).
    pub addr: SocketAddr,
    pub(super) forwarded_for: Option<HeaderValue>,
    /// The peer is a trusted proxy (`server.trusted_proxies`): each request names its client.
    pub(super) trusted: bool,
    /// `X-Forwarded-Proto` sent upstream: `http`, or what a trusted proxy reported.
    pub(super) proto: &'static str,
    /// `server.redirect_to_https`: every request is answered with a redirect to https at this
    /// port.
    pub(super) to_https: Option<u16>,
    /// Plain HTTP on the TLS listener: every request is answered 400, the connection closed.
    pub(super) plain_on_tls: bool,
    /// `Alt-Svc` added to every response (HTTP/3 advertised over TLS).
    pub(super) alt_svc: Option<HeaderValue>,
    /// The connection's share of the upstream pool, made at its first HTTP/2 request (an
    /// HTTP/1.1 connection carries one request at a time and needs none).
    pub(super) share: std::sync::OnceLock<ConnectionShare>,
}

impl Peer {
    /// The peer at `addr`, itself the client (see [`Proxy::peer`] for trusted proxies); an
    /// IPv4-mapped IPv6 address (a dual-stack listener's IPv4 peer) is taken as IPv4.
    pub fn new(addr: SocketAddr) -> Self {
        let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
        Self {
            addr,
            forwarded_for: HeaderValue::from_str(&addr.ip().to_string()).ok(),
            trusted: false,
            proto: "http",
            to_https: None,
            plain_on_tls: false,
            alt_svc: None,
            share: std::sync::OnceLock::new(),
        }
    }

    /// The same peer, connected over TLS: `X-Forwarded-Proto: https` upstream, and `https`
    /// URLs in redirects and JMAP session resources.
    pub fn over_tls(self) -> Self {
        Self {
            proto: "https",
            ..self
        }
    }

    /// Whether the peer is a trusted proxy (`server.trusted_proxies`), whose requests name
    /// their client.
    pub fn is_trusted(&self) -> bool {
        self.trusted
    }

    /// The same peer, told of another protocol on every response (`Alt-Svc`, RFC 7838).
    pub fn advertising(self, alt_svc: Option<HeaderValue>) -> Self {
        Self { alt_svc, ..self }
    }

    /// The same peer on a plain listener that only redirects to https at `port`
    /// (`server.redirect_to_https`).
    pub fn redirected_to_https(self, port: Option<u16>) -> Self {
        Self {
            to_https: port,
            ..self
        }
    }

    /// The same peer, speaking plain HTTP to the TLS listener: each of its requests is
    /// answered 400 ([`crate::error::ProxyError::PlainHttpOnTlsPort`]).
    pub fn plain_on_tls_port(self) -> Self {
        Self {
            plain_on_tls: true,
            ..self
        }
    }

    /// Whether the peer speaks plain HTTP to the TLS listener: its connection closes after the
    /// first answer.
    pub fn is_plain_on_tls_port(&self) -> bool {
        self.plain_on_tls
    }

    /// The client a trusted proxy relayed this request for (see [`screen::forwarded_client`]);
    /// its scheme is the one the proxy reports, else the one the proxy itself used.
    pub(super) fn relayed(&self, headers: &http::HeaderMap, trusted: &[ipnet::IpNet]) -> Self {
        let ip = screen::forwarded_client(headers, trusted, self.addr.ip());
        Self {
            proto: screen::forwarded_proto(headers).unwrap_or(self.proto),
            to_https: self.to_https,
            plain_on_tls: self.plain_on_tls,
            alt_svc: self.alt_svc.clone(),
            ..Self::new(SocketAddr::new(ip, 0))
        }
    }
}

/// One request's context, carried through the phases ([`super::flow`]): its peer, what the
/// phases learn (the session id, a log reason), its connection's share of the upstream pool, and
/// its access-log record (its start time), written once by [`RequestCtx::finish`] or as 499
/// when the request is dropped first.
pub(super) struct RequestCtx<'a> {
    /// The connection's peer.
    conn_peer: &'a Peer,
    /// The client a trusted proxy relayed this request for; `None`: the peer itself.
    relayed: Option<Peer>,
    /// The verified session id (hashed only when a log line is written).
    pub(super) sid: Option<Arc<str>>,
    /// Log reason of a response that is not a [`crate::error::ProxyError`] (login endpoints, a
    /// kept or deleted session).
    pub(super) reason: Option<String>,
    /// The downstream connection's share of the upstream pool (HTTP/2 and HTTP/3 only).
    pub(super) share: ConnectionShare,
    record: Record<'a>,
}

impl<'a> RequestCtx<'a> {
    /// The context of `req` from `peer`'s connection: the client a trusted peer names, the
    /// connection's pool share (multiplexed connections), the start time when a log line or
    /// metrics want it.
    pub(super) fn new<B>(proxy: &'a Proxy, req: &http::Request<B>, peer: &'a Peer) -> Self {
        let share = if req.version() >= http::Version::HTTP_2 {
            peer.share
                .get_or_init(|| proxy.upstream.connection_share())
                .clone()
        } else {
            ConnectionShare::default()
        };
        let relayed = peer
            .trusted
            .then(|| peer.relayed(req.headers(), &proxy.trusted_proxies));
        let logged = (proxy.access_log && crate::access_log::enabled()).then(|| {
            (
                req.method().clone(),
                crate::access_log::logged_path(req.uri().path()),
                req.version(),
            )
        });
        let started = (logged.is_some() || proxy.request_counts.is_some()).then(Instant::now);
        let client = relayed.as_ref().unwrap_or(peer).addr.ip();
        let request_id = proxy.request_id.as_ref().map(|name| {
            let relayed = peer.trusted.then(|| req.headers().get(name)).flatten();
            relayed
                .filter(|id| valid_id(id))
                .cloned()
                .unwrap_or_else(new_id)
        });
        Self {
            conn_peer: peer,
            relayed,
            sid: None,
            reason: None,
            share,
            record: Record {
                proxy,
                peer: client,
                logged,
                started,
                written: false,
                request_id,
            },
        }
    }

    /// The request id (`upstream.request_id_header`), when one is kept.
    pub(super) fn request_id(&self) -> Option<&HeaderValue> {
        self.record.request_id.as_ref()
    }

    /// The connection's peer (the PROXY protocol's client, or the socket's), whatever a trusted
    /// proxy relayed: what `server.max_connections_per_ip` counts.
    pub(super) fn conn_peer(&self) -> &Peer {
        self.conn_peer
    }

    /// The request's client: the relayed one, or the connection's peer.
    pub(super) fn peer(&self) -> &Peer {
        self.relayed.as_ref().unwrap_or(self.conn_peer)
    }

    /// Writes the access line and metrics for an answer of `status`; `error`, the failure that
    /// made it, is logged before any reason a phase left.
    pub(super) fn finish(&mut self, status: u16, error: Option<&str>) {
        let reason = error.or(self.reason.as_deref());
        self.record.write(status, self.sid.as_deref(), reason);
    }
}

/// One request's access line and metrics, written once: by [`Proxy::respond`] when the answer is
/// ready, or, when its future is dropped before (the client went away: see
/// `downstream::h1::ClientWatch`; hyper drops it on an h2 stream reset), by its
/// [`RequestCtx`]'s drop as 499 (nginx's "client closed request").
struct Record<'a> {
    proxy: &'a Proxy,
    peer: std::net::IpAddr,
    /// Method, path and HTTP version, when the access log is on.
    logged: Option<(http::Method, String, http::Version)>,
    /// When the request head was read (`None`: neither log nor metrics want it).
    started: Option<Instant>,
    written: bool,
    /// `upstream.request_id_header`'s value for this request.
    request_id: Option<HeaderValue>,
}

impl Proxy {
    /// Logs and counts an answer made before a request head was read whole (a 408 for a head
    /// that stalled, hyper's 400, 414 or 431 for one it refused): an access line with
    /// `method=-`, `path=-` and `reason` (no secret in it), and `status` in the metrics.
    pub fn record_unread(&self, peer: std::net::IpAddr, status: u16, reason: &str) {
        if self.access_log && crate::access_log::enabled() {
            crate::access_log::write(&crate::access_log::Line {
                peer,
                method: "-",
                path: "-",
                status,
                duration_us: 0,
                proto: "HTTP/1.1",
                request_id: None,
                sid: None,
                reason: Some(reason),
            });
        }
        if let Some(counts) = &self.request_counts {
            counts.count_status(status);
        }
    }
}

/// A relayed request id worth keeping: 1 to 128 visible ASCII characters.
fn valid_id(id: &HeaderValue) -> bool {
    (1..=128).contains(&id.len()) && id.as_bytes().iter().all(u8::is_ascii_graphic)
}

/// A fresh request id: 128 random bits as 32 hex digits.
fn new_id() -> HeaderValue {
    HeaderValue::try_from(format!("{:032x}", rand::random::<u128>())).expect("hex digits")
}

/// The access log's name of `version` (nginx's `$server_protocol`, without HTTP/2's `.0`).
fn protocol(version: http::Version) -> &'static str {
    match version {
        http::Version::HTTP_09 => "HTTP/0.9",
        http::Version::HTTP_10 => "HTTP/1.0",
        http::Version::HTTP_2 => "HTTP/2",
        http::Version::HTTP_3 => "HTTP/3",
        _ => "HTTP/1.1",
    }
}

/// The status logged for a request the client gave up on (nginx's non-standard 499).
const CLIENT_CLOSED: u16 = 499;

impl Record<'_> {
    /// Writes the access line (with the session's `sid` hashed, and `reason`) and counts the
    /// request under `status` with its duration so far.
    fn write(&mut self, status: u16, sid: Option<&str>, reason: Option<&str>) {
        self.written = true;
        let took = self.started.map(|s| s.elapsed()).unwrap_or_default();
        if let Some((method, path, version)) = &self.logged {
            crate::access_log::write(&crate::access_log::Line {
                peer: self.peer,
                method: method.as_str(),
                path,
                status,
                duration_us: u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
                proto: protocol(*version),
                request_id: self.request_id.as_ref().and_then(|id| id.to_str().ok()),
                sid,
                reason,
            });
        }
        if let Some(counts) = &self.proxy.request_counts {
            counts.record(status, took);
        }
    }
}

impl Drop for RequestCtx<'_> {
    /// A request whose answer was never ready: logged as 499, with its session when one was
    /// verified.
    fn drop(&mut self) {
        if !self.record.written {
            self.record.write(
                CLIENT_CLOSED,
                self.sid.as_deref(),
                Some("answer dropped unfinished: the client went away (or shutdown's drain time ended)"),
            );
        }
    }
}
