//! Whether the upstream serves a connection it accepted. A process-per-connection upstream (Cyrus
//! `httpd`, up to `maxchild` children) lets the kernel accept connections past its limit into
//! the listen backlog and never reads them: a request sent on one waited for the whole
//! response-head timeout. With `upstream.probe_timeout_ms`, a new connection is first asked
//! `OPTIONS * HTTP/1.1` (RFC 9110 9.3.7: the server itself, no resource, no credential); any
//! complete answer within the timeout proves a worker serves it. An upstream that answers it by
//! closing the connection, or with a body of unknown length, cannot be probed so: probing stops.
//! Must never: send a client's request on a connection the probe found unserved.

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::upstream::codec::final_head;
use crate::upstream::conn::Framing;
use crate::upstream::{Transport, UpIo};

/// Largest probe answer read, bytes (Cyrus's is about 500).
const MAX_ANSWER: usize = 16 * 1024;

/// What the probe of a new connection found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Probed {
    /// A complete answer came: the connection is served and still usable.
    Served,
    /// No answer within the timeout: accepted, not served.
    Unserved,
    /// The upstream answered in a way that leaves the connection unusable (closed it, an
    /// answer of unknown length, bytes after it) or broke it: it cannot be probed so.
    Unsupported,
}

/// Sends `OPTIONS *` for `addr` (`host:port`, an IPv6 host without brackets) on `stream` and
/// waits at most `timeout` for the whole answer.
pub(super) async fn probe(stream: &mut UpIo, addr: &str, timeout: Duration) -> Probed {
    let ask = format!("OPTIONS * HTTP/1.1\r\nHost: {}\r\n\r\n", host_field(addr));
    if stream.write_all(ask.as_bytes()).await.is_err() || stream.flush().await.is_err() {
        return Probed::Unsupported;
    }
    match tokio::time::timeout(timeout, read_answer(stream)).await {
        Ok(served) => served,
        Err(_) => Probed::Unserved,
    }
}

/// Reads one answer to the probe: its head and a body of declared length, nothing after it.
async fn read_answer(stream: &mut UpIo) -> Probed {
    let mut buf = BytesMut::with_capacity(1024);
    loop {
        match stream.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return Probed::Unsupported,
            Ok(_) => {}
        }
        match complete(&buf) {
            // Nothing after it, here nor held by a TLS session.
            Some(end) if end == buf.len() && !stream.holds_unread() => return Probed::Served,
            Some(_) => return Probed::Unsupported,
            None if buf.len() > MAX_ANSWER => return Probed::Unsupported,
            None => {}
        }
    }
}

/// Where the answer at the front of `buf` ends (its head and its `Content-Length` body; an
/// interim 1xx head is skipped); `None` while incomplete, `Some(usize::MAX)` when it cannot be
/// used (unparsable, chunked, `Connection: close`, HTTP/1.0 without keep-alive, a body of no
/// declared length, a 101). Read by the parser requests' answers go through, so that a probe
/// answer frames as any answer would (a 204 or 304 has no body whatever its `Content-Length`;
/// differing lengths are an error: RFC 9112 section 6.3).
fn complete(buf: &[u8]) -> Option<usize> {
    let mut rest = BytesMut::from(buf);
    let head = match final_head(&mut rest, false) {
        Ok(Some(head)) => head,
        Ok(None) => return None,
        Err(_) => return Some(usize::MAX),
    };
    if !head.keep_alive || head.response.status() == http::StatusCode::SWITCHING_PROTOCOLS {
        return Some(usize::MAX);
    }
    let body = match head.framing {
        Framing::Done => 0,
        Framing::Length(n) if n <= MAX_ANSWER as u64 => n as usize,
        _ => return Some(usize::MAX),
    };
    let end = buf.len() - rest.len() + body;
    (buf.len() >= end).then_some(end)
}

/// `addr` as a `Host` field value: an IPv6 address in brackets (RFC 9110 section 7.2, RFC 3986
/// section 3.2.2), which strict servers (nginx, Apache) require, answering 400 otherwise.
fn host_field(addr: &str) -> std::borrow::Cow<'_, str> {
    match addr.rsplit_once(':') {
        Some((host, port)) if host.contains(':') => format!("[{host}]:{port}").into(),
        _ => addr.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_host_is_bracketed_in_the_host_field() {
        assert_eq!(host_field("::1:8008"), "[::1]:8008");
        assert_eq!(host_field("127.0.0.1:8008"), "127.0.0.1:8008");
        assert_eq!(host_field("cyrus.internal:80"), "cyrus.internal:80");
    }

    #[test]
    fn an_answer_ends_after_its_head_and_declared_body() {
        let cyrus = b"HTTP/1.1 200 OK\r\nAllow: OPTIONS, GET\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(complete(cyrus), Some(cyrus.len()));
        let body = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
        assert_eq!(complete(body), Some(body.len()));
        assert_eq!(complete(&body[..body.len() - 1]), None);
        let interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(complete(interim), Some(interim.len()));
        assert_eq!(complete(b"HTTP/1.1 200 OK\r\nDate: x"), None);
        let kept = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(complete(kept), Some(kept.len()));
        // No body, whatever the length says (RFC 9112 section 6.3).
        let empty = b"HTTP/1.1 204 No Content\r\nContent-Length: 3\r\n\r\n";
        assert_eq!(complete(empty), Some(empty.len()));
    }

    #[test]
    fn answers_that_leave_the_connection_unusable_are_told() {
        for answer in [
            &b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 99999999\r\n\r\n",
            b"SSH-2.0-OpenSSH\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nAllow: GET\r\n\r\n",
            b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nContent-Length: 5\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
        ] {
            assert_eq!(complete(answer), Some(usize::MAX), "{answer:?}");
        }
    }
}
