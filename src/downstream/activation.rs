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
    /// Takes the sockets passed in the environment (none without `LISTEN_FDS`, or when
    /// `LISTEN_PID` names another process) and removes its variables, so that no child process
    /// takes them too. Call it before any thread starts: it edits the environment.
    ///
    /// Errors: a passed descriptor is neither a TCP listener nor a UDP socket (its index).
    pub fn from_env() -> Result<Self, String> {
        let mut fds = listenfd::ListenFd::from_env();
        let mut inherited = Self::default();
        for i in 0..fds.len() {
            if let Ok(Some(tcp)) = fds.take_tcp_listener(i) {
                inherited.tcp.push(tcp);
            } else if let Ok(Some(udp)) = fds.take_udp_socket(i) {
                inherited.udp.push(udp);
            } else {
                return Err(format!(
                    "socket activation: descriptor {} is neither a TCP listener nor a UDP socket",
                    3 + i
                ));
            }
        }
        Ok(inherited)
    }

    /// The passed TCP listener bound to `addr` (see [`same_address`]), set non-blocking.
    ///
    /// Errors: it cannot be made non-blocking.
    pub fn take_tcp(&mut self, addr: SocketAddr) -> io::Result<Option<TcpListener>> {
        let Some(i) = position(&self.tcp, addr, TcpListener::local_addr) else {
            return Ok(None);
        };
        let listener = self.tcp.swap_remove(i);
        listener.set_nonblocking(true)?;
        Ok(Some(listener))
    }

    /// The passed UDP socket bound to `addr` (see [`same_address`]), set non-blocking.
    ///
    /// Errors: it cannot be made non-blocking.
    pub fn take_udp(&mut self, addr: SocketAddr) -> io::Result<Option<UdpSocket>> {
        let Some(i) = position(&self.udp, addr, UdpSocket::local_addr) else {
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

fn position<S>(
    sockets: &[S],
    addr: SocketAddr,
    local: fn(&S) -> io::Result<SocketAddr>,
) -> Option<usize> {
    sockets
        .iter()
        .position(|s| local(s).is_ok_and(|bound| same_address(bound, addr)))
}

/// Whether a socket bound to `bound` serves the configured `wanted`: the same address, or the
/// same port on the unspecified address of either family (systemd's `ListenStream=443` binds
/// `[::]:443`, which takes IPv4 too, where a config says `0.0.0.0:443`).
fn same_address(bound: SocketAddr, wanted: SocketAddr) -> bool {
    bound == wanted
        || (bound.port() == wanted.port()
            && bound.ip().is_unspecified()
            && wanted.ip().is_unspecified())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_matches_itself_or_any_address_of_the_other_family() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(same_address(a("127.0.0.1:8080"), a("127.0.0.1:8080")));
        assert!(same_address(a("[::]:443"), a("0.0.0.0:443")));
        assert!(same_address(a("0.0.0.0:443"), a("[::]:443")));
        assert!(!same_address(a("[::]:443"), a("127.0.0.1:443")));
        assert!(!same_address(a("127.0.0.1:8080"), a("127.0.0.1:8081")));
    }

    #[test]
    fn without_the_environment_nothing_is_inherited() {
        // The test runner sets no LISTEN_FDS.
        let inherited = Inherited::from_env().unwrap();
        assert!(inherited.untaken().is_empty());
    }
}
