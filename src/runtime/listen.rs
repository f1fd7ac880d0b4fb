//! The listening sockets a config names (`server.listen`, `tls.listen`, `http3.listen`,
//! `metrics.listen`): each one the service manager passed for it (socket activation,
//! [`downstream::Inherited`]), else one bound now. Must never: leave a passed socket unserved,
//! or report a bind failure where the real fault is a passed socket no key names.

use std::net::SocketAddr;

use tokio::net::TcpListener;

use crate::{downstream, Config};

use super::Listeners;

/// Opens every listener `cfg` names, taking the passed sockets in `inherited` first: all of
/// them are matched to keys before anything is bound, so that a passed socket no key names is
/// reported as such, not as the bind on its port failing.
///
/// Errors (a message naming the key and the fix): a passed socket no key names; a socket that
/// cannot be bound or adopted.
pub async fn open_listeners(
    cfg: &Config,
    mut inherited: downstream::Inherited,
) -> Result<Listeners, String> {
    let plain_addr = cfg.server.listen;
    let tls_addr = cfg.tls.as_ref().map(|t| t.listen);
    let metrics_addr = cfg.metrics.as_ref().map(|m| m.listen);
    let quic_addr = cfg.http3.as_ref().map(|h| h.listen);
    let passed_plain = take_tcp(&mut inherited, "server.listen", plain_addr)?;
    let passed_tls = take_tcp(&mut inherited, "tls.listen", tls_addr)?;
    let passed_metrics = take_tcp(&mut inherited, "metrics.listen", metrics_addr)?;
    let passed_quic = match quic_addr {
        Some(addr) => inherited
            .take_udp(addr)
            .map_err(|e| format!("config key `http3.listen`: passed socket on {addr}: {e}"))?,
        None => None,
    };
    let untaken = inherited.untaken();
    if !untaken.is_empty() {
        return Err(format!(
            "socket activation passed {}, which no listen key (server.listen, tls.listen, \
             http3.listen, metrics.listen) names: name it in the config or remove it from the \
             socket unit",
            untaken.join(", ")
        ));
    }
    let fastopen = cfg.server.fastopen;
    Ok(Listeners {
        plain: tcp("server.listen", plain_addr, passed_plain, fastopen).await?,
        tls: tcp("tls.listen", tls_addr, passed_tls, fastopen).await?,
        metrics: tcp("metrics.listen", metrics_addr, passed_metrics, false).await?,
        quic: match quic_addr {
            Some(addr) => Some(udp(addr, passed_quic)?),
            None => None,
        },
    })
}

fn take_tcp(
    inherited: &mut downstream::Inherited,
    key: &str,
    addr: Option<SocketAddr>,
) -> Result<Option<std::net::TcpListener>, String> {
    match addr {
        Some(addr) => inherited
            .take_tcp(addr)
            .map_err(|e| format!("config key `{key}`: passed socket on {addr}: {e}")),
        None => Ok(None),
    }
}

/// The TCP listener for `key` at `addr`: `passed`, else bound now (with TCP Fast Open when
/// `fastopen`).
async fn tcp(
    key: &str,
    addr: Option<SocketAddr>,
    passed: Option<std::net::TcpListener>,
    fastopen: bool,
) -> Result<Option<TcpListener>, String> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    let listener = match passed {
        Some(passed) => {
            tracing::info!(key, listen = %addr, "listening socket passed by the service manager");
            downstream::adopt_tcp(passed, fastopen)
        }
        None => downstream::bind_tcp(addr, fastopen).await,
    };
    listener.map(Some).map_err(|e| {
        format!(
            "config key `{key}`: cannot listen on {addr}: {e}{}",
            privileged(addr, &e)
        )
    })
}

/// The fix for a port below 1024 refused for want of privilege: what an unprivileged service
/// needs to bind it (operations.md); empty otherwise.
fn privileged(addr: SocketAddr, e: &std::io::Error) -> &'static str {
    if addr.port() < 1024 && e.kind() == std::io::ErrorKind::PermissionDenied {
        "; a port below 1024 needs CAP_NET_BIND_SERVICE (systemd: \
         AmbientCapabilities=CAP_NET_BIND_SERVICE), or a socket passed by systemd"
    } else {
        ""
    }
}

/// The UDP socket for `http3.listen` at `addr`: `passed`, else bound now.
fn udp(
    addr: SocketAddr,
    passed: Option<std::net::UdpSocket>,
) -> Result<std::net::UdpSocket, String> {
    let socket = match passed {
        Some(passed) => {
            tracing::info!(
                key = "http3.listen",
                listen = %addr,
                "UDP socket passed by the service manager"
            );
            Ok(downstream::adopt_udp(passed))
        }
        None => downstream::bind_udp(addr),
    };
    socket.map_err(|e| {
        let fix = privileged(addr, &e);
        format!("config key `http3.listen`: cannot bind {addr} (UDP): {e}{fix}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_privileged_port_refused_names_the_capability() {
        let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        let in_use = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let at = |port| SocketAddr::from(([127, 0, 0, 1], port));
        assert!(privileged(at(443), &denied).contains("CAP_NET_BIND_SERVICE"));
        assert_eq!(privileged(at(8443), &denied), "");
        assert_eq!(privileged(at(443), &in_use), "");
    }
}
