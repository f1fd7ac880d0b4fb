//! A request as it goes out: how its body is framed (none, `Content-Length`, chunked), the write
//! queue that carries head and body pieces in one `writev`, and what a failed sending is
//! reported as. Must never: frame a body two ways.

use std::io::{self, IoSlice};

use bytes::{Buf, Bytes};
use http::{Method, Request};
use http_body::{Body, Frame};

use super::{BoxError, ForwardError, UpBody};

use super::conn::{broken, SendError};

pub(super) enum Fail {
    Io(io::Error),
    Body(BoxError),
    Head(ForwardError),
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyFraming {
    None,
    Length(u64),
    Chunked,
}

/// Pieces one `writev` takes at most: a head and several body frames (three pieces each when
/// chunked).
pub(super) const MAX_SLICES: usize = 16;
/// Body bytes gathered for one `writev` at most, from the frames a body has ready at once.
pub(super) const GATHER_BYTES: usize = 64 << 10;

/// Bytes queued for the socket (the head, then body pieces), written with one `writev` where
/// several are queued.
#[derive(Default)]
pub(super) struct Out {
    pub(super) queue: std::collections::VecDeque<Bytes>,
}

impl Out {
    pub(super) fn push(&mut self, b: Bytes) {
        if !b.is_empty() {
            self.queue.push_back(b);
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Whether another body frame may join the next `writev` ([`MAX_SLICES`], [`GATHER_BYTES`]).
    pub(super) fn has_room(&self) -> bool {
        self.queue.len() + 3 <= MAX_SLICES
            && self.queue.iter().map(Bytes::len).sum::<usize>() < GATHER_BYTES
    }

    pub(super) fn slices<'a>(&'a self, into: &mut [IoSlice<'a>; MAX_SLICES]) -> usize {
        let mut n = 0;
        for (slot, b) in into.iter_mut().zip(self.queue.iter()) {
            *slot = IoSlice::new(b);
            n += 1;
        }
        n
    }

    pub(super) fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let Some(front) = self.queue.front_mut() else {
                return;
            };
            if n >= front.len() {
                n -= front.len();
                self.queue.pop_front();
            } else {
                front.advance(n);
                n = 0;
            }
        }
    }
}

/// A request-body error as the forward phase reports it.
pub(super) fn body_error(e: BoxError) -> ForwardError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&*e);
    while let Some(s) = src {
        if s.is::<http_body_util::LengthLimitError>() {
            return ForwardError::BodyTooLarge;
        }
        if s.is::<super::BodyStalled>() {
            return ForwardError::BodyTimeout;
        }
        src = s.source();
    }
    ForwardError::ClientBody(e.to_string())
}

/// The error of a sending that failed; `unsent` is the request when none of it was written
/// and its body was not read (it may be replayed on another connection).
pub(super) fn failed(fail: Fail, unsent: Option<Request<UpBody>>) -> SendError {
    match (fail, unsent) {
        (Fail::Body(e), _) => SendError::Failed(body_error(e)),
        (Fail::Head(e), _) => SendError::Failed(e),
        (Fail::Io(e), Some(req)) => {
            SendError::Unsent(req, broken(format!("writing the request: {e}")))
        }
        (Fail::Io(e), None) => SendError::Failed(broken(format!("writing the request: {e}"))),
    }
}

/// How a request body is framed upstream: none for a bodyless GET/HEAD/DELETE/OPTIONS/TRACE,
/// `Content-Length` when the body's size is known, else chunked.
pub(super) fn body_framing(method: &Method, body: &UpBody) -> BodyFraming {
    if body.is_end_stream() {
        match *method {
            Method::GET
            | Method::HEAD
            | Method::DELETE
            | Method::OPTIONS
            | Method::TRACE
            | Method::CONNECT => BodyFraming::None,
            _ => BodyFraming::Length(0),
        }
    } else {
        match body.size_hint().exact() {
            Some(n) => BodyFraming::Length(n),
            None => BodyFraming::Chunked,
        }
    }
}

/// Queues the body's next frame for the socket, then every frame it has ready after it, so
/// that they go out in one `writev` ([`Out::has_room`]): an HTTP/3 body arrives a QUIC packet
/// (about 1 KiB) at a time, one write each otherwise. `Ok(true)` once the body ended; pending
/// while the body has no frame.
pub(super) fn poll_queue(
    mut body: std::pin::Pin<&mut UpBody>,
    cx: &mut std::task::Context<'_>,
    framing: &mut BodyFraming,
    out: &mut Out,
) -> std::task::Poll<Result<bool, BoxError>> {
    let frame = std::task::ready!(body.as_mut().poll_frame(cx));
    let mut done = queue_frame(frame, framing, out)?;
    while !done && out.has_room() {
        let std::task::Poll::Ready(frame) = body.as_mut().poll_frame(cx) else {
            break;
        };
        done = queue_frame(frame, framing, out)?;
    }
    std::task::Poll::Ready(Ok(done))
}

/// Queues a body frame for the socket in `framing` (request trailers are dropped: the hop-by-hop
/// `TE`/`Trailer` were removed); `Ok(true)` once the body ended (its last chunk queued). A
/// `Length` counts down what is left of it.
///
/// Errors: the body's own, or one that yields more or fewer bytes than the `Content-Length`
/// written for it: the rest would be read upstream as the next request on the connection (each
/// body type checks its length; this holds whatever a body's size hint says).
pub(super) fn queue_frame(
    frame: Option<Result<Frame<Bytes>, BoxError>>,
    framing: &mut BodyFraming,
    out: &mut Out,
) -> Result<bool, BoxError> {
    match frame {
        Some(Ok(frame)) => {
            if let Ok(data) = frame.into_data() {
                if data.is_empty() {
                    return Ok(false);
                }
                match framing {
                    BodyFraming::Chunked => {
                        out.push(Bytes::from(format!("{:x}\r\n", data.len())));
                        out.push(data);
                        out.push(Bytes::from_static(b"\r\n"));
                    }
                    BodyFraming::Length(left) => {
                        *left = left
                            .checked_sub(data.len() as u64)
                            .ok_or("request body longer than its Content-Length")?;
                        out.push(data);
                    }
                    BodyFraming::None => return Err("request body where none was framed".into()),
                }
            }
            Ok(false)
        }
        Some(Err(e)) => Err(e),
        None => match framing {
            BodyFraming::Chunked => {
                out.push(Bytes::from_static(b"0\r\n\r\n"));
                Ok(true)
            }
            BodyFraming::Length(1..) => Err("request body shorter than its Content-Length".into()),
            _ => Ok(true),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Option<Result<Frame<Bytes>, BoxError>> {
        Some(Ok(Frame::data(Bytes::from(vec![b'x'; n]))))
    }

    /// A body whose size hint is wrong cannot write past, or stop short of, the length its
    /// head announced: the connection would carry the difference into the next request.
    #[test]
    fn a_length_framed_body_must_yield_exactly_its_length() {
        let mut out = Out::default();
        let mut exact = BodyFraming::Length(5);
        assert!(!queue_frame(data(3), &mut exact, &mut out).unwrap());
        assert!(!queue_frame(data(2), &mut exact, &mut out).unwrap());
        assert!(queue_frame(None, &mut exact, &mut out).unwrap());
        let mut long = BodyFraming::Length(5);
        assert!(queue_frame(data(6), &mut long, &mut out).is_err());
        let mut short = BodyFraming::Length(5);
        assert!(!queue_frame(data(4), &mut short, &mut out).unwrap());
        assert!(queue_frame(None, &mut short, &mut out).is_err());
        let mut chunked = BodyFraming::Chunked;
        assert!(!queue_frame(data(9), &mut chunked, &mut out).unwrap());
        assert!(queue_frame(None, &mut chunked, &mut out).unwrap());
    }
}
