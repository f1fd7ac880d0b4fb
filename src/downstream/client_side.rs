//! A WebSocket tunnel's client side, as the downstream makes it for the proxy
//! ([`crate::upstream::ClientSideFn`]): the connection's own socket unwrapped from hyper's
//! upgraded stream, or that stream (an HTTP/2 stream, RFC 8441) with a send timeout. Must
//! never: lose bytes hyper read past the handshake, or let a client that takes nothing hold a
//! tunnel past `server.send_timeout_ms`.

use std::time::Duration;

use bytes::BytesMut;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

use super::io::{Prefixed, Socket};
use crate::stall::SendTimed;

/// A WebSocket tunnel's client side ([`crate::upstream::ClientSideFn`]): the connection's own
/// socket, TCP or TLS, with the bytes hyper had read past the handshake first and no lingering
/// close (the client's bytes are the tunnel's to read, also after the upstream has closed); or
/// hyper's upgraded stream (an HTTP/2 stream, RFC 8441), its writes within `send_timeout`.
pub fn client_side(
    upgraded: hyper::upgrade::Upgraded,
    send_timeout: Duration,
) -> crate::upstream::ClientSide {
    let upgraded = match unwrapped::<TcpStream>(upgraded) {
        Ok(socket) => return Box::new(socket),
        Err(upgraded) => upgraded,
    };
    match unwrapped::<TlsStream<TcpStream>>(upgraded) {
        Ok(socket) => Box::new(socket),
        Err(upgraded) => Box::new(SendTimed::new(TokioIo::new(upgraded), send_timeout)),
    }
}

/// Hyper's upgraded stream unwrapped to tessera's socket of kind `S` (served by either hyper
/// builder); given back when it is not one.
fn unwrapped<S: Socket>(
    upgraded: hyper::upgrade::Upgraded,
) -> Result<Prefixed<S>, hyper::upgrade::Upgraded> {
    let (io, read_buf) =
        match hyper_util::server::conn::auto::upgrade::downcast::<TokioIo<Prefixed<S>>>(upgraded) {
            Ok(parts) => (parts.io, parts.read_buf),
            Err(upgraded) => {
                let parts = upgraded.downcast::<TokioIo<Prefixed<S>>>()?;
                (parts.io, parts.read_buf)
            }
        };
    let mut io = io.into_inner();
    // hyper read `read_buf` from the stream, so it came before what is left of `pre`.
    if !read_buf.is_empty() {
        let mut all = BytesMut::with_capacity(read_buf.len() + io.pre.len());
        all.extend_from_slice(&read_buf);
        all.extend_from_slice(&io.pre);
        io.pre = all.freeze();
    }
    io.lingers = false;
    Ok(io)
}
