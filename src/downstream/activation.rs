//! Listening sockets handed over by the service manager (systemd socket activation,
//! sd_listen_fds(3): `LISTEN_FDS`, `LISTEN_PID`), taken with the listenfd crate and matched to
//! the listen keys by the address each is bound to. systemd keeps such a socket open across a
//! restart, so clients that connect meanwhile wait in its backlog instead of being refused, and
//! it can bind a privileged port for an unprivileged tessera. Must never: serve on a socket no
//! listen key names (a unit and a config that disagree are an error at start).

use std::io;
use std::net::{SocketAddr, TcpListener, UdpSocket};

/// The sockets the service manager passed, not yet taken by a listen key.
#[derive(Debug, Default)]
pub struct Inherited {
    tcp: Vec<TcpListener>,
    udp: Vec<UdpSocket>,
}

impl Inherited {
    /// Takes the sockets passed in the environment (none without `LISTEN_FDS`, or unless
    /// `LISTEN_PID` names this process, as sd_listen_fds(3) says) and removes its variables, so
    /// that no child process takes them too. Call it before any thread starts: it edits the
    /// environment.
    ///
    /// Errors: a passed socket is neither a listening TCP socket nor a UDP socket (an
    /// `Accept=yes` unit passes connections, which tessera does not take).
    pub fn from_env() -> Result<Self, String> {
        if std::env::var_os("LISTEN_PID").is_none() {
            return Ok(Self::default());
        }
        let mut fds = listenfd::ListenFd::from_env();
        std::env::remove_var("LISTEN_FDNAMES");
        let mut inherited = Self::default();
        let count = fds.len();
        for i in 0..count {
            let refused = |why: &dyn std::fmt::Display| {
                format!(
                    "socket activation: passed socket {} of {count}: {why}",
                    i + 1
                )
            };
            if let Ok(Some(tcp)) = fds.take_tcp_listener(i) {
                match socket2::SockRef::from(&tcp).is_listener() {
                    Ok(true) => inherited.tcp.push(tcp),
                    Ok(false) => {
                        return Err(refused(
                            &"a connection, not a listening socket (use Accept=no, the default)",
                        ))
                    }
                    Err(e) => return Err(refused(&e)),
                }
            } else {
                match fds.take_udp_socket(i) {
                    Ok(Some(udp)) => inherited.udp.push(udp),
                    Ok(None) => {}
                    Err(e) => return Err(refused(&e)),
                }
            }
        }
        Ok(inherited)
    }

    /// The passed TCP listener for `addr` (see [`serves`]), set non-blocking.
    ///
    /// Errors: it cannot be made non-blocking.
    pub fn take_tcp(&mut self, addr: SocketAddr) -> io::Result<Option<TcpListener>> {
        let Some(i) = find(&self.tcp, addr) else {
            return Ok(None);
        };
        let listener = self.tcp.swap_remove(i);
        listener.set_nonblocking(true)?;
        Ok(Some(listener))
    }

    /// The passed UDP socket for `addr` (see [`serves`]), set non-blocking.
    ///
    /// Errors: it cannot be made non-blocking.
    pub fn take_udp(&mut self, addr: SocketAddr) -> io::Result<Option<UdpSocket>> {
        let Some(i) = find(&self.udp, addr) else {
            return Ok(None);
        };
        let socket = self.udp.swap_remove(i);
        socket.set_nonblocking(true)?;
        Ok(Some(socket))
    }

    /// The addresses of the passed sockets no listen key took, as `tcp ADDR` / `udp ADDR`.
    pub fn untaken(&self) -> Vec<String> {
        let tcp = self.tcp.iter().map(|s| ("tcp", s.local_addr()));
        let udp = self.udp.iter().map(|s| ("udp", s.local_addr()));
        tcp.chain(udp)
            .map(|(kind, addr)| match addr {
                Ok(addr) => format!("{kind} {addr}"),
                Err(_) => format!("{kind} (address unknown)"),
            })
            .collect()
    }
}

/// The socket among `sockets` bound to `addr` itself, else one that [`serves`] it.
fn find<S: std::os::fd::AsFd>(sockets: &[S], addr: SocketAddr) -> Option<usize> {
    let bound = |s: &S| socket2::SockRef::from(s).local_addr().ok()?.as_socket();
    sockets
        .iter()
        .position(|s| bound(s) == Some(addr))
        .or_else(|| sockets.iter().position(|s| serves(s, addr)))
}

/// Whether `socket` takes what a key asking for `wanted` would: bound to it, or `wanted` is
/// `0.0.0.0:P` and the socket is a dual-stack `[::]:P` (systemd's `ListenStream=443`, unless
/// `BindIPv6Only=ipv6-only`), which takes IPv4 clients too.
fn serves<S: std::os::fd::AsFd>(socket: &S, wanted: SocketAddr) -> bool {
    let socket = socket2::SockRef::from(socket);
    let Some(bound) = socket.local_addr().ok().and_then(|a| a.as_socket()) else {
        return false;
    };
    bound == wanted
        || (bound.port() == wanted.port()
            && wanted == SocketAddr::from(([0, 0, 0, 0], wanted.port()))
            && bound.ip() == std::net::Ipv6Addr::UNSPECIFIED
            && socket.only_v6().is_ok_and(|v6_only| !v6_only))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_takes_its_own_address_or_a_dual_stack_socket_for_any_ipv4_address() {
        let v4 = TcpListener::bind("127.0.0.1:0").unwrap();
        let own = v4.local_addr().unwrap();
        assert!(serves(&v4, own));
        assert!(!serves(
            &v4,
            SocketAddr::from(([127, 0, 0, 1], own.port() + 1))
        ));
        let any = |v6_only: bool| {
            let s = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None);
            let s = s.unwrap();
            s.set_only_v6(v6_only).unwrap();
            s.bind(&SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0)).into())
                .unwrap();
            s
        };
        let dual = any(false);
        let port = dual.local_addr().unwrap().as_socket().unwrap().port();
        assert!(serves(&dual, SocketAddr::from(([0, 0, 0, 0], port))));
        assert!(!serves(&dual, SocketAddr::from(([127, 0, 0, 1], port))));
        let v6_only = any(true);
        let port = v6_only.local_addr().unwrap().as_socket().unwrap().port();
        assert!(!serves(&v6_only, SocketAddr::from(([0, 0, 0, 0], port))));
    }
}
