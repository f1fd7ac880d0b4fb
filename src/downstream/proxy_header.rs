//! The PROXY protocol (HAProxy's `proxy-protocol.txt`, v1 text and v2 binary): a load balancer
//! that passes TCP on (AWS NLB, HAProxy in TCP mode) names the client's address in a header
//! before the connection's first byte, which the `ppp` crate parses. With
//! `server.proxy_protocol`, every connection on the TCP listeners must start with one. Must
//! never: believe a header from a peer outside `server.trusted_proxies`, or read a byte past
//! the header (what follows is the client's TLS or HTTP).

use std::net::SocketAddr;
use std::time::Duration;

use ppp::v1;
use ppp::v2;
use ppp::{HeaderResult, PartialResult};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Longest header taken, bytes: a v1 header has at most 107, a v2 header 16 plus its addresses
/// (36 for IPv6) and the load balancer's TLVs (AWS's VPC endpoint id; HAProxy's TLS details,
/// certificate name and unique id, some hundreds of bytes).
pub(super) const MAX_HEADER: usize = 4096;

/// How long to wait before looking again at a header that has not all arrived (the protocol
/// asks senders to send it at once; a network may still split it).
const RETRY_AFTER: Duration = Duration::from_millis(5);

/// Reads the PROXY protocol header at the start of `stream`, within `timeout`, and no byte
/// after it. Returns the client's address it names; `None` when it names none: a connection
/// the load balancer opened for itself (v2 `LOCAL`: health checks), v1 `UNKNOWN`, or a v2
/// source that is no IP address (a UNIX socket).
///
/// Errors (a short reason for the debug log): the connection closed or failed first, the
/// header is malformed or longer than [`MAX_HEADER`], or it did not arrive within `timeout`.
pub(super) async fn read(
    stream: &mut TcpStream,
    timeout: Duration,
) -> Result<Option<SocketAddr>, &'static str> {
    match tokio::time::timeout(timeout, read_now(stream)).await {
        Ok(read) => read,
        Err(_) => Err("no PROXY protocol header within server.header_read_timeout_ms"),
    }
}

async fn read_now(stream: &mut TcpStream) -> Result<Option<SocketAddr>, &'static str> {
    let mut buf = vec![0u8; MAX_HEADER];
    loop {
        // Peeked, not read: the header's length is known only once it is parsed.
        let n = match stream.peek(&mut buf).await {
            Ok(0) | Err(_) => return Err("connection closed before its PROXY protocol header"),
            Ok(n) => n,
        };
        let parsed = HeaderResult::parse(&buf[..n]);
        if parsed.is_incomplete() {
            if n == buf.len() {
                return Err("PROXY protocol header longer than 4 KiB");
            }
            tokio::time::sleep(RETRY_AFTER).await;
            continue;
        }
        let (len, client) = parsed_header(parsed)?;
        stream
            .read_exact(&mut buf[..len])
            .await
            .map_err(|_| "connection failed in its PROXY protocol header")?;
        return Ok(client);
    }
}

/// A complete header's length in bytes and the client it names.
fn parsed_header(parsed: HeaderResult<'_>) -> Result<(usize, Option<SocketAddr>), &'static str> {
    match parsed {
        HeaderResult::V1(Ok(h)) => {
            let client = match h.addresses {
                v1::Addresses::Tcp4(a) => Some((a.source_address, a.source_port).into()),
                v1::Addresses::Tcp6(a) => Some((a.source_address, a.source_port).into()),
                v1::Addresses::Unknown => None,
            };
            Ok((h.header.len(), client))
        }
        HeaderResult::V2(Ok(h)) => {
            let client = match (h.command, h.addresses) {
                (v2::Command::Local, _) => None,
                (_, v2::Addresses::IPv4(a)) => Some((a.source_address, a.source_port).into()),
                (_, v2::Addresses::IPv6(a)) => Some((a.source_address, a.source_port).into()),
                (_, v2::Addresses::Unix(_) | v2::Addresses::Unspecified) => None,
            };
            Ok((h.len(), client))
        }
        HeaderResult::V1(Err(_)) | HeaderResult::V2(Err(_)) => {
            Err("no valid PROXY protocol header at the connection's start")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> Result<(usize, Option<SocketAddr>), &'static str> {
        parsed_header(HeaderResult::parse(bytes))
    }

    #[test]
    fn v1_names_the_client_and_its_length_ends_at_the_crlf() {
        let header = b"PROXY TCP4 203.0.113.7 10.0.0.1 51234 443\r\n";
        let with_data = [&header[..], b"\x16\x03\x01"].concat();
        let client = "203.0.113.7:51234".parse().ok();
        assert_eq!(parse(&with_data), Ok((header.len(), client)));
        let v6 = b"PROXY TCP6 2001:db8::7 2001:db8::1 4000 443\r\nGET";
        assert_eq!(parse(v6).unwrap().1, "[2001:db8::7]:4000".parse().ok());
        assert_eq!(parse(b"PROXY UNKNOWN\r\n"), Ok((15, None)));
    }

    #[test]
    fn v2_names_the_client_and_local_names_none() {
        let proxied = v2::Builder::with_addresses(
            v2::Version::Two | v2::Command::Proxy,
            v2::Protocol::Stream,
            (
                "198.51.100.9:7000".parse::<SocketAddr>().unwrap(),
                "10.0.0.1:443".parse::<SocketAddr>().unwrap(),
            ),
        )
        .build()
        .unwrap();
        let with_data = [&proxied[..], b"GET / HTTP/1.1\r\n"].concat();
        let client = "198.51.100.9:7000".parse().ok();
        assert_eq!(parse(&with_data), Ok((proxied.len(), client)));
        let local = v2::Builder::with_addresses(
            v2::Version::Two | v2::Command::Local,
            v2::Protocol::Unspecified,
            v2::Addresses::Unspecified,
        )
        .build()
        .unwrap();
        assert_eq!(parse(&local), Ok((16, None)));
    }

    #[test]
    fn anything_else_is_refused() {
        assert!(parse(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").is_err());
        assert!(parse(b"PROXY TCP4 not-an-address 10.0.0.1 1 2\r\n").is_err());
        assert!(HeaderResult::parse(b"PROXY TCP4 203.0.113.7").is_incomplete());
    }
}
