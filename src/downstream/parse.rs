//! Requests from a connection's received bytes, with no socket involved (the fuzz targets drive
//! exactly this code): framing per RFC 9112 section 6.3. A request is taken only when one
//! `Content-Length` of plain digits, or none, frames it; its whole body is read before the proxy
//! sees it, so no body byte is ever left in the buffer to be mistaken for the next request. Must
//! never: take a head `httparse` refuses or whose framing is in doubt (those go to hyper).

use std::cell::RefCell;
use std::mem::MaybeUninit;

use bytes::{Buf, Bytes, BytesMut};
use http::header::HeaderName;
use http::{HeaderValue, Method, Request, Uri, Version};
use http_body_util::Full;

use crate::fields::{content_length, has_token};

/// Most request header fields the fast path parses (hyper's default limit); more go to hyper.
const MAX_HEADERS: usize = 100;

/// A connection's received bytes and what the fast path has made of them so far: the requests
/// are taken from here ([`Incoming::take`]) with no socket involved, so the fuzz targets
/// (`fuzz/`) drive exactly the code that serves.
#[derive(Default)]
pub(crate) struct Incoming {
    /// Bytes read and not yet served (the next request's head, pipelined requests).
    pub(super) buf: BytesMut,
    /// Offsets of the parsed head's header names and values (reused).
    spans: Vec<[u32; 4]>,
    /// The head parsed while its body is still arriving.
    pending: Option<Parsed>,
}

/// What [`Incoming::take`] made of the bytes received so far.
// Made once per request and moved straight on: see `Next`.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Taken {
    /// A whole request (its body read), and whether the client asked to close after it.
    Request(Request<Full<Bytes>>, bool),
    /// Not for the fast path: hyper takes the connection with every byte not yet taken.
    HandOff,
    /// More bytes are needed.
    More,
}

/// A request head the fast path takes: where its parts are in the buffer.
struct Parsed {
    len: usize,
    method: Method,
    path: (usize, usize),
    body: u64,
    close: bool,
}

enum Parse {
    Partial,
    HandOff,
    Head(Parsed),
}

impl Incoming {
    /// Takes the next request from the bytes received so far, given the largest head (bytes)
    /// the fast path waits for and the largest body (bytes) it buffers. Called again after
    /// more bytes arrived, it goes on where it stopped (a parsed head waiting for its body is
    /// not parsed again).
    ///
    /// Empty lines (CRLF, or a bare LF as hyper and httparse allow) before a request line are
    /// dropped (RFC 9112 section 2.2: some clients send CRLF after a body); they neither start a
    /// request nor keep one open. A bare CR is not an empty line (RFC 9112 section 2.2 makes it
    /// invalid): it stays, and the request it starts goes to hyper, which refuses it.
    pub(crate) fn take(&mut self, max_head: usize, max_body: u64) -> Taken {
        let parsed = match self.pending.take() {
            Some(p) => p,
            None => {
                let blank = empty_lines(&self.buf);
                self.buf.advance(blank);
                if self.buf.is_empty() {
                    return Taken::More;
                }
                match self.parse(max_body) {
                    Parse::Head(p) => p,
                    Parse::HandOff => return Taken::HandOff,
                    Parse::Partial if self.buf.len() >= max_head => return Taken::HandOff,
                    Parse::Partial => return Taken::More,
                }
            }
        };
        if self.buf.len() < parsed.len + parsed.body as usize {
            self.pending = Some(parsed);
            return Taken::More;
        }
        match self.build(&parsed) {
            Some(req) => Taken::Request(req, parsed.close),
            None => Taken::HandOff,
        }
    }

    /// Appends received bytes (the fuzz targets' way in; serving reads into `buf` directly).
    pub(crate) fn extend(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The bytes not taken: what hyper gets after [`Taken::HandOff`].
    pub(crate) fn rest(&self) -> &[u8] {
        &self.buf
    }

    /// Parses the head at the front of the buffer, recording its header offsets in `spans`.
    fn parse(&mut self, max_body: u64) -> Parse {
        let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut []);
        let len = match httparse::ParserConfig::default().parse_request_with_uninit_headers(
            &mut req,
            &self.buf,
            &mut headers,
        ) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Parse::Partial,
            Err(_) => return Parse::HandOff,
        };
        if req.version != Some(1) {
            return Parse::HandOff;
        }
        let Ok(method) = Method::from_bytes(req.method.unwrap_or("").as_bytes()) else {
            return Parse::HandOff;
        };
        if method == Method::CONNECT {
            return Parse::HandOff;
        }
        let base = self.buf.as_ptr() as usize;
        let offset = |s: &[u8]| s.as_ptr() as usize - base;
        let path = req.path.unwrap_or("");
        let path = (
            offset(path.as_bytes()),
            offset(path.as_bytes()) + path.len(),
        );
        let (mut body, mut close) = (None, false);
        self.spans.clear();
        for h in req.headers.iter() {
            let name = h.name.as_bytes();
            if name.eq_ignore_ascii_case(b"content-length") {
                match (body, content_length(h.value)) {
                    (None, Some(n)) if n <= max_body => body = Some(n),
                    _ => return Parse::HandOff,
                }
            } else if name.eq_ignore_ascii_case(b"connection") {
                close |= has_token(h.value, b"close");
            } else if name.eq_ignore_ascii_case(b"transfer-encoding")
                || name.eq_ignore_ascii_case(b"expect")
                || name.eq_ignore_ascii_case(b"upgrade")
            {
                return Parse::HandOff;
            }
            // Offsets within the buffer, which is far below 4 GiB (a head arriving in pieces is
            // handed off past `max_head`; one read adds at most a few KiB to it).
            let (n, v) = (offset(name) as u32, offset(h.value) as u32);
            self.spans
                .push([n, n + name.len() as u32, v, v + h.value.len() as u32]);
        }
        Parse::Head(Parsed {
            len,
            method,
            path,
            body: body.unwrap_or(0),
            close,
        })
    }

    /// Splits the parsed head and its body off the buffer and builds the request; `None` (the
    /// bytes put back) when hyper should answer it: an invalid target or header.
    fn build(&mut self, p: &Parsed) -> Option<Request<Full<Bytes>>> {
        let head = self.buf.split_to(p.len).freeze();
        let body = self.buf.split_to(p.body as usize).freeze();
        match request(&head, p, &self.spans) {
            Some(req) => Some(req.map(|()| Full::new(body))),
            None => {
                let mut all = BytesMut::with_capacity(head.len() + body.len() + self.buf.len());
                all.extend_from_slice(&head);
                all.extend_from_slice(&body);
                all.extend_from_slice(&self.buf);
                self.buf = all;
                None
            }
        }
    }
}

/// Whether `buf` starts with a line of three or more words whose last is no HTTP version
/// (`HTTP/...`): neither an HTTP/1.x request line nor the HTTP/2 preface (`PRI * HTTP/2.0`).
/// Such a peer speaks no HTTP tessera could answer in, so its connection is closed unanswered:
/// RFC 9113 3.4 for a client that meant HTTP/2 with a broken preface (an HTTP/1.1 400 would be
/// noise to it). A shorter line (`GET`, `GET /`) is an HTTP/1 request cut short: hyper answers
/// it 400. `false` while the first line is incomplete.
pub(super) fn speaks_no_http(buf: &[u8]) -> bool {
    let Some(end) = buf.iter().position(|&b| b == b'\n') else {
        return false;
    };
    let line = buf[..end].strip_suffix(b"\r").unwrap_or(&buf[..end]);
    let words = line.split(|&b| b == b' ').filter(|w| !w.is_empty());
    let (count, last) = words.fold((0, &b""[..]), |(n, _), w| (n + 1, w));
    count >= 3 && !last.starts_with(b"HTTP/")
}

/// Whether `buf` starts like a TLS record carrying a handshake (type 22, version 3.x): a client
/// speaking https to the plain listener. Answering it in HTTP would be noise; it is closed and
/// logged as such, so the operator can tell a misdirected client from garbage.
pub(super) fn speaks_tls(buf: &[u8]) -> bool {
    matches!(buf, [0x16, 0x03, ..])
}

/// Length, bytes, of the empty lines (CRLF or LF) at the front of `buf`.
fn empty_lines(buf: &[u8]) -> usize {
    let mut at = 0;
    loop {
        match &buf[at..] {
            [b'\n', ..] => at += 1,
            [b'\r', b'\n', ..] => at += 2,
            _ => return at,
        }
    }
}

/// The request (its body attached by the caller) from a parsed head; `None` for a target or
/// header `http` refuses.
fn request(head: &Bytes, p: &Parsed, spans: &[[u32; 4]]) -> Option<Request<()>> {
    let uri = Uri::from_maybe_shared(head.slice(p.path.0..p.path.1)).ok()?;
    // Room for what inject adds (credential, X-Forwarded-*), so the map never grows; a map an
    // earlier request gave back when it was sent upstream, so no allocation either.
    let mut headers = crate::upstream::spare_header_map(spans.len() + 6);
    for &[ns, ne, vs, ve] in spans {
        let name = HeaderName::from_bytes(&head[ns as usize..ne as usize]).ok()?;
        let value = HeaderValue::from_maybe_shared(head.slice(vs as usize..ve as usize)).ok()?;
        headers.append(name, value);
    }
    let mut req = Request::new(());
    *req.method_mut() = p.method.clone();
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = headers;
    Some(req)
}

/// Bytes read per `recv`.
pub(super) const READ_CHUNK: usize = 8 * 1024;

thread_local! {
    /// Read buffers given back by this thread's idle fast-path connections.
    static SPARE_READ_BUFS: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

/// Most spare read buffers kept per thread.
const MAX_SPARE_READ_BUFS: usize = 64;

/// An empty read buffer: one of this thread's spares, else a new one of [`READ_CHUNK`] bytes.
pub(super) fn spare_read_buf() -> BytesMut {
    SPARE_READ_BUFS
        .with(|s| s.borrow_mut().pop())
        .unwrap_or_else(|| BytesMut::with_capacity(READ_CHUNK))
}

/// Gives an empty read buffer back for [`spare_read_buf`]; kept only while this thread holds
/// fewer than [`MAX_SPARE_READ_BUFS`] and when it has at least half a [`READ_CHUNK`] of room and
/// at most four (one grown by a large head is dropped).
pub(super) fn recycle_read_buf(buf: BytesMut) {
    debug_assert!(buf.is_empty());
    if !(READ_CHUNK / 2..=4 * READ_CHUNK).contains(&buf.capacity()) {
        return;
    }
    SPARE_READ_BUFS.with(|s| {
        let mut spare = s.borrow_mut();
        if spare.len() < MAX_SPARE_READ_BUFS {
            spare.push(buf);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_line_with_no_http_version_is_no_http() {
        assert!(speaks_no_http(b"INVALID CONNECTION PREFACE\r\n\r\n"));
        assert!(speaks_no_http(b"GET / FTP/1.0\r\n"));
        assert!(!speaks_no_http(b"GET /\r\n"));
        assert!(!speaks_no_http(b"GET\r\n"));
        assert!(!speaks_no_http(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"));
        assert!(!speaks_no_http(b"GET / HTTP/1.1\r\nHost: a\r\n"));
        assert!(!speaks_no_http(b"GET / HTTP/3.0\n"));
        assert!(!speaks_no_http(b"INVALID CONNECTION"));
    }

    #[test]
    fn a_tls_handshake_is_told_from_http() {
        assert!(speaks_tls(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]));
        assert!(!speaks_tls(b"GET / HTTP/1.1\r\n"));
        assert!(!speaks_tls(&[0x16]));
    }

    #[test]
    fn only_crlf_and_lf_are_empty_lines_before_a_request() {
        assert_eq!(empty_lines(b"\r\n\n\r\nGET"), 5);
        assert_eq!(empty_lines(b"GET"), 0);
        // A bare CR is no empty line (found by fuzz/ `fast_path`: the fast path dropped it and
        // took "\rT / HTTP/1.1" as method T; hyper refuses it).
        assert_eq!(empty_lines(b"\r\n\rT / HTTP/1.1"), 2);
        assert_eq!(empty_lines(b"\r"), 0);
        let mut incoming = Incoming::default();
        incoming.extend(b"\rT / HTTP/1.1\r\nHost: a\r\n\r\n");
        assert!(matches!(incoming.take(8192, 1024), Taken::HandOff));
    }

    #[test]
    fn a_recycled_read_buffer_comes_back_with_its_room_and_an_odd_one_is_dropped() {
        let mut buf = BytesMut::with_capacity(READ_CHUNK);
        buf.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
        buf.clear();
        let at = buf.as_ptr();
        recycle_read_buf(buf);
        let again = spare_read_buf();
        assert!(again.is_empty());
        assert_eq!(again.as_ptr(), at, "not the recycled allocation");
        recycle_read_buf(BytesMut::with_capacity(16 * READ_CHUNK));
        recycle_read_buf(BytesMut::new());
        let fresh = spare_read_buf();
        assert_eq!(
            fresh.capacity(),
            READ_CHUNK,
            "a too large or too small buffer was kept"
        );
    }
}
