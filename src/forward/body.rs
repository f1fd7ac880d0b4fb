//! Response bodies tessera sends downstream: either a short local answer or the upstream's body,
//! streamed frame by frame, holding the pooled connection until its last frame.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::h1::{self, Framing};
use super::pool::Conn;
use super::raw::RawHead;
use super::BoxError;

/// The downstream response body.
// One per response, moved a few times: boxing the upstream variant would add an allocation per
// response to save those copies.
#[allow(clippy::large_enum_variant)]
pub enum ProxyBody {
    /// A local answer (errors, health); `None` once sent.
    Full(Option<Bytes>),
    /// The upstream's body; the connection returns to the pool when it ends.
    Upstream(UpstreamBody),
}

impl ProxyBody {
    /// A local body from static or owned bytes.
    pub fn full(b: impl Into<Bytes>) -> Self {
        let b = b.into();
        Self::Full(if b.is_empty() { None } else { Some(b) })
    }

    /// An empty body.
    pub fn empty() -> Self {
        Self::Full(None)
    }

    /// The upstream response's fields not yet moved into the response's `HeaderMap` (see
    /// [`super::materialize`]); `None` for a local answer or once taken.
    pub fn fields_mut(&mut self) -> Option<&mut RawHead> {
        match self {
            Self::Upstream(u) => u.fields.as_mut(),
            Self::Full(_) => None,
        }
    }

    /// Takes the upstream response's fields out (the writer then owns them).
    pub fn take_fields(&mut self) -> Option<RawHead> {
        match self {
            Self::Upstream(u) => u.fields.take(),
            Self::Full(_) => None,
        }
    }
}

/// The upstream body, read from the connection it arrives on (held until the body's end).
pub struct UpstreamBody {
    /// The response's fields, until they are written or moved into the `HeaderMap`.
    fields: Option<RawHead>,
    conn: Option<Conn>,
    framing: Framing,
    /// Whether the connection may be reused once the body was read to its end.
    keep_alive: bool,
}

impl UpstreamBody {
    pub(super) fn new(fields: RawHead, conn: Conn, framing: Framing, keep_alive: bool) -> Self {
        let mut this = Self {
            fields: Some(fields),
            conn: Some(conn),
            framing,
            keep_alive,
        };
        if framing == Framing::Done {
            this.release(true);
        }
        this
    }

    /// Gives the connection back: to the pool when the body was read to its end and the
    /// upstream keeps the connection open, else closed.
    fn release(&mut self, complete: bool) {
        if let Some(mut conn) = self.conn.take() {
            if complete && self.keep_alive {
                conn.set_reusable();
            }
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            Self::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Self::Upstream(u) => {
                let Some(conn) = u.conn.as_mut() else {
                    return Poll::Ready(None);
                };
                let frame = ready!(conn.h1().poll_body(cx, &mut u.framing));
                match &frame {
                    Some(Err(_)) => u.release(false),
                    _ if u.framing == Framing::Done => u.release(true),
                    _ => {}
                }
                Poll::Ready(frame)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Full(b) => b.is_none(),
            Self::Upstream(u) => u.conn.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(None) => SizeHint::with_exact(0),
            Self::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Self::Upstream(u) => h1::size_hint(u.framing),
        }
    }
}
