//! TCP Fast Open on the TCP listeners (RFC 7413, `server.fastopen`): a client that holds a
//! Fast Open cookie from an earlier connection sends its first bytes (a TLS ClientHello, a
//! request head) in the SYN, saving one round trip per new connection.

use std::io;
use std::net::SocketAddr;

use tokio::net::TcpListener;

/// The kernel's Fast Open switch (Linux `Documentation/networking/ip-sysctl.rst`).
const SYSCTL: &str = "/proc/sys/net/ipv4/tcp_fastopen";
/// Its bit that lets a listener with `TCP_FASTOPEN` take data in a SYN (`TFO_SERVER_ENABLE`).
const SERVER_BIT: u32 = 0x2;

/// Binds a TCP listener on `addr`; with `fastopen`, sets `TCP_FASTOPEN` on it (a queue of 1024
/// pending Fast Open handshakes, tokio-tfo's; the kernel caps it at `net.core.somaxconn`) and
/// warns, naming the fix, when the kernel's switch leaves server-side Fast Open off.
/// Errors: the address cannot be bound, or the kernel refuses the option (the error says
/// `server.fastopen`).
pub async fn bind_tcp(addr: SocketAddr, fastopen: bool) -> io::Result<TcpListener> {
    let listener = TcpListener::bind(addr).await?;
    if fastopen {
        fast_open(&listener, addr)?;
    }
    Ok(listener)
}

/// `TCP_FASTOPEN` on `listener` (bound to `addr`), with a warning when the kernel's sysctl
/// keeps it from working.
fn fast_open(listener: &TcpListener, addr: SocketAddr) -> io::Result<()> {
    set_fast_open(listener)
        .map_err(|e| io::Error::new(e.kind(), format!("server.fastopen: {e}")))?;
    if server_fast_open_allowed() == Some(false) {
        tracing::warn!(
            listen = %addr,
            "server.fastopen is on but the kernel takes no Fast Open data on listeners: set \
             `sysctl -w net.ipv4.tcp_fastopen=3` (bit 2 enables the server side)"
        );
    }
    Ok(())
}

/// A listening socket the service manager passed ([`super::Inherited`]), for tokio, with TCP
/// Fast Open when `fastopen` (as [`bind_tcp`] would have made it). Call it inside the runtime.
///
/// Errors: tokio cannot register the socket, or Fast Open cannot be set.
pub fn adopt_tcp(listener: std::net::TcpListener, fastopen: bool) -> io::Result<TcpListener> {
    let listener = TcpListener::from_std(listener)?;
    if fastopen {
        fast_open(&listener, listener.local_addr()?)?;
    }
    Ok(listener)
}

/// `TCP_FASTOPEN` on `listener`'s socket, through tokio-tfo (the crate forbids `unsafe`, and
/// neither rustix nor socket2 has the server-side option): tokio-tfo sets it on a duplicate
/// descriptor of the same socket, which it then closes; the option belongs to the socket, so it
/// stays.
fn set_fast_open(listener: &TcpListener) -> io::Result<()> {
    use std::os::fd::AsFd;
    let duplicate = std::net::TcpListener::from(listener.as_fd().try_clone_to_owned()?);
    tokio_tfo::TfoListener::from_std(duplicate).map(drop)
}

/// Whether `net.ipv4.tcp_fastopen` has its server bit; `None` when it cannot be read (no
/// procfs, not Linux).
fn server_fast_open_allowed() -> Option<bool> {
    let flags: u32 = std::fs::read_to_string(SYSCTL).ok()?.trim().parse().ok()?;
    Some(flags & SERVER_BIT != 0)
}
