//! HTTP/3 (RFC 9114) over QUIC (quinn): the UDP endpoint, each connection's HTTP/3 session, and
//! the handshake state its requests need for the 0-RTT policy ([`super::http3`]). Graceful
//! shutdown sends GOAWAY and lets open requests finish. Must never: let a request that is not
//! safe to replay reach the upstream before the handshake completes.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::proxy::Proxy;

use super::h3_guard::GuardedConnection;
use super::quic_handshake::{handshake, Handshake};
use super::retry::{retried, unvalidated_limit, Unvalidated};
use super::settings::{Http3Config, Retry};
use super::ServerConfig;

/// UDP socket buffer asked for, bytes: the kernel's default (about 208 KiB here) drops
/// datagrams of a busy connection; the kernel caps it at `net.core.rmem_max` / `wmem_max`.
const UDP_BUFFER: usize = 4 * 1024 * 1024;

/// Binds the HTTP/3 UDP socket at `addr` with 4 MiB receive and send buffers (quinn does not
/// raise them; a warning names the sysctl when the kernel gives less).
///
/// Errors: the address cannot be bound.
pub fn bind_udp(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        let _ = socket.set_only_v6(false);
    }
    size_buffers(socket2::SockRef::from(&socket));
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

/// A UDP socket the service manager passed ([`super::Inherited`]) for HTTP/3, its buffers
/// asked for as [`bind_udp`] does.
pub fn adopt_udp(socket: std::net::UdpSocket) -> std::net::UdpSocket {
    size_buffers(socket2::SockRef::from(&socket));
    socket
}

/// Raises (never lowers: a socket unit's `ReceiveBuffer=` may give more) both buffers to
/// [`UDP_BUFFER`].
fn size_buffers(socket: socket2::SockRef<'_>) {
    // Linux reports twice what it grants.
    if socket.recv_buffer_size().unwrap_or(0) < 2 * UDP_BUFFER {
        let _ = socket.set_recv_buffer_size(UDP_BUFFER);
    }
    if socket.send_buffer_size().unwrap_or(0) < 2 * UDP_BUFFER {
        let _ = socket.set_send_buffer_size(UDP_BUFFER);
    }
    // Linux reports twice what it grants (its own bookkeeping).
    if socket.recv_buffer_size().unwrap_or(0) < UDP_BUFFER {
        tracing::warn!(
            wanted = UDP_BUFFER,
            "HTTP/3: the UDP receive buffer is smaller than asked; raise sysctl net.core.rmem_max"
        );
    }
}

/// What every HTTP/3 connection shares.
pub(super) struct Quic {
    pub(super) proxy: Arc<Proxy>,
    /// `http3.early_data`: connections are taken before their handshake completes.
    pub(super) early_data: bool,
    /// `server.header_read_timeout_ms`: how long a request's head may take to arrive, and a
    /// request held for the handshake may wait.
    pub(super) header_read_timeout: Duration,
    /// `server.send_timeout_ms`, per response write.
    pub(super) send_timeout: Duration,
    pub(super) max_field_section: u64,
    pub(super) shutdown: CancellationToken,
    /// Handshakes counted for `/metrics` and the Retry policy.
    pub(super) counts: Arc<crate::telemetry::QuicCounts>,
    /// `http3.retry`.
    pub(super) retry: Retry,
    /// Unvalidated handshakes in progress past which `Retry::Auto` asks for a Retry.
    pub(super) unvalidated_limit: u64,
}

/// Serves HTTP/3 on `endpoint` until `shutdown` resolves, then drains: each connection is sent
/// GOAWAY, its open requests finish (at most 10 s), and the endpoint closes.
///
/// Errors: none (a failed handshake or connection is logged at debug level).
pub async fn serve_http3(
    endpoint: quinn::Endpoint,
    proxy: Arc<Proxy>,
    h3: Http3Config,
    server: &ServerConfig,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let proxy_limit = proxy.client_connections().map(|l| l.limit());
    let counts = proxy.quic_counts().cloned().unwrap_or_default();
    let quic = Arc::new(Quic {
        counts,
        proxy,
        early_data: h3.early_data,
        header_read_timeout: server.header_read_timeout,
        send_timeout: server.send_timeout,
        max_field_section: (server.max_header_bytes + server.max_uri_bytes) as u64,
        shutdown: CancellationToken::new(),
        retry: h3.retry,
        unvalidated_limit: unvalidated_limit(proxy_limit),
    });
    let connections = TaskTracker::new();
    tokio::pin!(shutdown);
    loop {
        let incoming = tokio::select! {
            incoming = endpoint.accept() => incoming,
            () = &mut shutdown => break,
        };
        let Some(incoming) = incoming else { break };
        // QUIC connections count against server.max_connections with TCP's. Past it one is
        // refused (CONNECTION_REFUSED: a browser goes on over TCP, where it waits in the
        // backlog) rather than left to retransmit its Initial into a loop that reads none.
        let slot = match quic.proxy.client_connections() {
            None => None,
            Some(limit) => match limit.try_acquire() {
                Some(slot) => Some(slot),
                None => {
                    refused_at_limit(limit.limit());
                    quic.counts.refused.fetch_add(1, Ordering::Relaxed);
                    incoming.refuse();
                    continue;
                }
            },
        };
        // After the limit: a client sent a Retry must not come back only to be refused.
        let Some(incoming) = retried(&quic, incoming) else {
            continue;
        };
        let unvalidated = quic.unvalidated(&incoming);
        let quic = quic.clone();
        // Boxed, as a TCP connection's task (`serve`): tokio moves a task's future as it
        // spawns and ends it, and this one is some 8 KiB; a box moves as a pointer.
        connections.spawn(Box::pin(async move {
            connection(quic, incoming, unvalidated).await;
            drop(slot);
        }));
    }
    // No new connection from here on; open ones are sent GOAWAY.
    endpoint.set_server_config(None);
    quic.shutdown.cancel();
    connections.close();
    let drain = server.shutdown_timeout;
    if tokio::time::timeout(drain, connections.wait())
        .await
        .is_err()
    {
        tracing::warn!("HTTP/3 connections still open after {drain:?}; closing");
    }
    endpoint.close(quinn::VarInt::from_u32(0), b"shutdown");
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
}

/// Says once in the log that QUIC connections are refused at `server.max_connections`.
fn refused_at_limit(limit: usize) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            max = limit,
            "server.max_connections client connections are open; new QUIC connections are \
             refused until one closes"
        );
    }
}

/// One QUIC connection: its handshake ([`handshake`]), then its HTTP/3 session until it ends,
/// shutdown drains it, or it has had no request open for `server.header_read_timeout_ms` (then
/// GOAWAY, and the connection is closed with `H3_NO_ERROR`).
async fn connection(quic: Arc<Quic>, incoming: quinn::Incoming, unvalidated: Option<Unvalidated>) {
    let address_validated = unvalidated.is_none();
    // A proven address (a Retry or NEW_TOKEN token) takes its place per address at once, so a
    // client stalling its handshakes holds no more than its share of server.max_connections.
    let place = match address_validated {
        true => match quic.proxy.enter_per_ip(incoming.remote_address().ip()) {
            Ok(place) => place,
            Err(_) => return incoming.refuse(),
        },
        false => None,
    };
    let Some((conn, handshake)) = handshake(&quic, incoming, unvalidated).await else {
        return;
    };
    let peer = Arc::new(quic.proxy.peer(conn.remote_address()).over_tls());
    let quic_conn = conn.clone();
    let handshake = Handshake::new(conn.clone(), handshake, address_validated);
    if !address_validated {
        count_per_ip(&quic, &conn, handshake.clone());
    }
    let mut builder = h3::server::builder();
    builder.max_field_section_size(quic.max_field_section);
    let built =
        builder.build::<_, bytes::Bytes>(GuardedConnection::new(conn, quic.max_field_section));
    // h3 opens its control stream and writes SETTINGS first: a client that grants no
    // unidirectional stream would hold it, and this connection's place, for ever.
    let mut session = match tokio::time::timeout(quic.header_read_timeout, built).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return tracing::debug!(cause = %e, "HTTP/3 session not set up"),
        Err(_) => {
            quic_conn.close(H3_EXCESSIVE_LOAD, b"");
            return tracing::debug!("HTTP/3 session not set up in server.header_read_timeout_ms");
        }
    };
    let linger = serve_requests(&quic, &mut session, &peer, &handshake, &quic_conn).await;
    // Closing now would drop answers not yet acknowledged (quinn closes at once, and drops
    // what it has not sent): the client gets `linger` to take them, or closes first.
    tokio::select! {
        _ = tokio::time::timeout(linger, quic_conn.closed()) => {}
        // A drain does not wait out a long linger (it has its own bound, 10 s in all).
        () = quic.shutdown.cancelled(), if linger > ANSWER_LINGER => {
            let _ = tokio::time::timeout(ANSWER_LINGER, quic_conn.closed()).await;
        }
    }
    quic_conn.close(H3_NO_ERROR, b"");
    drop(place);
}

/// The requests of one HTTP/3 session, each in a task of its own, until the client ends it,
/// shutdown drains it, or no request has been open for `server.header_read_timeout_ms` (then
/// GOAWAY, as over HTTP/2: a client's PINGs keep QUIC's own idle timeout from ever firing);
/// then waits for the requests taken. Returns how long the connection may linger for the
/// client to take the last answers: after an idle GOAWAY or the client's own,
/// `server.send_timeout_ms` (quinn may still hold megabytes of a download the client is
/// reading), else (shutdown, an error) [`ANSWER_LINGER`].
async fn serve_requests(
    quic: &Arc<Quic>,
    session: &mut h3::server::Connection<GuardedConnection, bytes::Bytes>,
    peer: &Arc<crate::proxy::Peer>,
    handshake: &Handshake,
    conn: &quinn::Connection,
) -> Duration {
    let after = quic.header_read_timeout;
    let requests = TaskTracker::new();
    let start = Instant::now();
    // When the last request ended, in ms after `start`.
    let ended = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut last_accept = start;
    let mut linger = ANSWER_LINGER;
    loop {
        let last_end = start + Duration::from_millis(ended.load(Ordering::Relaxed));
        let idle = tokio::time::sleep_until(last_accept.max(last_end) + after);
        let accepted = tokio::select! {
            accepted = session.accept() => accepted,
            () = idle => {
                let last_end = start + Duration::from_millis(ended.load(Ordering::Relaxed));
                if requests.is_empty() && Instant::now() >= last_end + after {
                    let _ = tokio::time::timeout(after, session.shutdown(1)).await;
                    linger = quic.send_timeout;
                    break;
                }
                if !requests.is_empty() {
                    last_accept = Instant::now();
                }
                continue;
            }
            () = quic.shutdown.cancelled() => {
                // GOAWAY naming the stream after the last one taken (h3 adds the `1` to it):
                // the client learns the requests taken were not refused (RFC 9114 section
                // 5.2), and they finish below; an idle connection (or one whose client is
                // gone) closes at once.
                let _ = tokio::time::timeout(after, session.shutdown(1)).await;
                break;
            }
        };
        match accepted {
            Ok(Some(resolver)) => {
                last_accept = Instant::now();
                let (quic, peer, ended) = (quic.clone(), peer.clone(), ended.clone());
                let (handshake, conn) = (handshake.clone(), conn.clone());
                // Boxed, as the connection's task (some 3.7 KiB).
                requests.spawn(Box::pin(async move {
                    request(quic, peer, handshake, conn, resolver).await;
                    let at = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
                    ended.fetch_max(at, Ordering::Relaxed);
                }));
            }
            Ok(None) => {
                // The client's GOAWAY: its last answers may still be in quinn's buffers.
                linger = quic.send_timeout;
                break;
            }
            Err(e) => {
                tracing::debug!(cause = ?e, "HTTP/3 connection ended");
                break;
            }
        }
    }
    requests.close();
    requests.wait().await;
    linger
}

/// Takes the place under `server.max_connections_per_ip` of `conn`, from an address not proven
/// by a token, once its handshake completes (only then is its address proven: with 0-RTT the
/// connection is taken at its first Initial, and forged Initials must not use up the places of
/// the address they name) and holds it until the connection ends; past the limit, the
/// connection is closed with `H3_EXCESSIVE_LOAD`.
fn count_per_ip(quic: &Quic, conn: &quinn::Connection, mut handshake: Handshake) {
    if !quic.proxy.limits_per_ip() {
        return;
    }
    let (proxy, conn) = (quic.proxy.clone(), conn.clone());
    tokio::spawn(async move {
        if !handshake.wait().await {
            return;
        }
        match proxy.enter_per_ip(conn.remote_address().ip()) {
            Ok(place) => {
                conn.closed().await;
                drop(place);
            }
            Err(_) => conn.close(H3_EXCESSIVE_LOAD, b"too many connections from this address"),
        }
    });
}

/// One request stream: its head (within `server.header_read_timeout_ms`, as over TCP: a stream
/// holding half a HEADERS frame is dropped, the client told to stop sending), then
/// [`super::http3::serve`] until it is done or the connection ends (closed, lost or idle): the
/// exchange is then dropped, which frees its upstream connection, as a TCP client's FIN does.
async fn request(
    quic: Arc<Quic>,
    peer: Arc<crate::proxy::Peer>,
    handshake: Handshake,
    conn: quinn::Connection,
    resolver: h3::server::RequestResolver<GuardedConnection, bytes::Bytes>,
) {
    let head = tokio::time::timeout(quic.header_read_timeout, resolver.resolve_request());
    let (req, stream) = match head.await {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => return tracing::debug!(cause = %e, "HTTP/3 request head refused"),
        Err(_) => {
            return tracing::debug!(
                "HTTP/3 request head not complete in server.header_read_timeout_ms"
            )
        }
    };
    // Boxed: a request's future (the phases, the forward, the answer) takes tens of KiB, and a
    // spawned task's future is moved, and copied whole, several times on its way into the
    // runtime (30 % of an upload's instructions were those copies).
    let serve = Box::pin(super::http3::serve(&quic, req, stream, &peer, handshake));
    tokio::select! {
        () = serve => {}
        _ = conn.closed() => tracing::debug!("HTTP/3 connection ended with a request open"),
    }
}

/// HTTP/3's code for a peer that causes excessive load (RFC 9114 section 8.1).
const H3_EXCESSIVE_LOAD: quinn::VarInt = quinn::VarInt::from_u32(0x107);

/// HTTP/3's "no error" code (RFC 9114 section 8.1), for a close that blames nobody.
pub(super) const H3_NO_ERROR: quinn::VarInt = quinn::VarInt::from_u32(0x100);

/// How long a connection ending (shutdown, or the client's GOAWAY) is kept for the client to
/// acknowledge the last answers.
const ANSWER_LINGER: Duration = Duration::from_secs(1);
