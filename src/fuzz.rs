//! Entry points for the fuzz targets (`fuzz/`) and their corpus replay (`tests/fuzz.rs`): the
//! hand-written wire parsers, driven without a socket by the same code that serves. Not part of
//! tessera's API: shapes change with the parsers.
//!
//! Each function takes the received bytes as `pieces`, in the order they arrive, so a target
//! can check that where the bytes are cut changes nothing.

use std::task::Poll;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request};
use http_body_util::BodyExt;

use crate::downstream::{Incoming, Taken};
use crate::upstream::chunked::{body_eof, decode_body};
use crate::upstream::codec::final_head;

/// Whether the upstream decoder drops this trailer field (the connection's and the framing's),
/// which hyper's client keeps: the fuzz oracle leaves these out of hyper's trailers.
pub fn trailer_dropped(name: &str) -> bool {
    crate::upstream::chunked::connection_or_framing(name)
}

/// What the downstream HTTP/1.1 fast path (`src/downstream/h1.rs`) made of a connection's bytes.
#[derive(Debug, Default)]
pub struct FastPath {
    /// The requests it took, in order, each with its whole body and whether the client asked to
    /// close after it (the fast path stops serving after such a request; these go on, to show
    /// what the bytes after it would have become).
    pub requests: Vec<(Request<Bytes>, bool)>,
    /// The bytes hyper reads, when the fast path gave the connection up: those not taken, then
    /// the pieces that had not arrived yet; `None` when it did not.
    pub handed_off: Option<Bytes>,
    /// The bytes still waiting for more when the pieces ran out (none after a hand-off).
    pub waiting: Bytes,
}

/// Runs the fast path over `pieces` received in turn on a new connection, with the largest head
/// it waits for (`max_head`, bytes; `serve` uses `max_header_bytes + max_uri_bytes + 1024`, at
/// least 8192) and body it buffers (`max_body`, bytes, at most [`crate::downstream::MAX_FAST_BODY`]).
pub fn fast_path(pieces: &[&[u8]], max_head: usize, max_body: u64) -> FastPath {
    let mut incoming = Incoming::default();
    let mut out = FastPath::default();
    for (i, piece) in pieces.iter().enumerate() {
        incoming.extend(piece);
        loop {
            match incoming.take(max_head, max_body) {
                Taken::Request(req, close) => {
                    let (parts, body) = req.into_parts();
                    let body = now_or_never(body.collect())
                        .map(|c| c.map_or_else(|e| match e {}, |c| c.to_bytes()))
                        .expect("a fast-path body is in memory");
                    out.requests.push((Request::from_parts(parts, body), close));
                }
                Taken::HandOff => {
                    let mut rest = incoming.rest().to_vec();
                    pieces[i + 1..]
                        .iter()
                        .for_each(|p| rest.extend_from_slice(p));
                    out.handed_off = Some(rest.into());
                    return out;
                }
                Taken::More => break,
            }
        }
    }
    out.waiting = Bytes::copy_from_slice(incoming.rest());
    out
}

/// An upstream response as the upstream HTTP/1.1 client (`src/upstream/h1.rs`) read it.
#[derive(Debug, PartialEq, Eq)]
pub struct UpstreamResponse {
    /// The final status (1xx interim heads skipped; a 101 is final).
    pub status: u16,
    /// The fields as received, in order, minus a `Content-Length` that `Transfer-Encoding`
    /// overrides.
    pub fields: Vec<(Bytes, Bytes)>,
    /// The body's data, concatenated.
    pub body: Bytes,
    /// The chunked body's trailer fields, when it had any.
    pub trailers: Option<HeaderMap>,
    /// Whether the connection could carry another request afterwards (before the pool's own
    /// check that no byte is left over).
    pub keep_alive: bool,
}

/// Reads one response from `pieces` received in turn, then the connection's end (EOF), as the
/// upstream client reads the answer to a request (`head_request`: a HEAD, whose response has no
/// body). Returns the response or the client's error text (what becomes a 502), and how many
/// bytes were left unread after it.
pub fn upstream_response(
    pieces: &[&[u8]],
    head_request: bool,
) -> (Result<UpstreamResponse, String>, usize) {
    let mut buf = BytesMut::new();
    let mut pieces = pieces.iter();
    let head = loop {
        match final_head(&mut buf, head_request) {
            Ok(Some(head)) => break head,
            Ok(None) => match pieces.next() {
                Some(piece) => buf.extend_from_slice(piece),
                None => return (Err("connection closed before a response".into()), buf.len()),
            },
            Err(e) => return (Err(e.to_string()), unread(&buf, pieces)),
        }
    };
    let mut framing = head.framing;
    let (mut body, mut trailers) = (BytesMut::new(), None);
    loop {
        let frame = match decode_body(&mut buf, &mut framing) {
            Poll::Ready(frame) => frame,
            Poll::Pending => match pieces.next() {
                Some(piece) => {
                    buf.extend_from_slice(piece);
                    continue;
                }
                None => body_eof(&mut framing),
            },
        };
        match frame {
            None => break,
            Some(Err(e)) => return (Err(e.to_string()), unread(&buf, pieces)),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => body.extend_from_slice(&data),
                Err(frame) => trailers = frame.into_trailers().ok(),
            },
        }
    }
    let left = unread(&buf, pieces);
    let response = UpstreamResponse {
        status: head.response.status().as_u16(),
        fields: head
            .fields
            .iter()
            .map(|(n, v)| (Bytes::copy_from_slice(n), Bytes::copy_from_slice(v)))
            .collect(),
        body: body.freeze(),
        trailers,
        keep_alive: head.keep_alive,
    };
    (Ok(response), left)
}

/// Bytes received or still to come that the client has not consumed.
fn unread<'a>(buf: &[u8], pieces: impl Iterator<Item = &'a &'a [u8]>) -> usize {
    buf.len() + pieces.map(|p| p.len()).sum::<usize>()
}

/// Where a WebSocket frame stream stands after each of `pieces` is written in turn (the
/// tunnel's `FrameEdge`): whether the bytes so far end on a frame's last byte, and whether a
/// Close frame was begun.
pub fn frame_edges(pieces: &[&[u8]]) -> Vec<(bool, bool)> {
    crate::upstream::frame_edges(pieces)
}

/// Polls `f` once, for bodies that are already in memory.
fn now_or_never<F: std::future::Future>(f: F) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(f).poll(&mut cx) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}
