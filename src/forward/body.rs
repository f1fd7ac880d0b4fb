//! Response bodies tessera sends downstream: either a short local answer or the upstream's body,
//! streamed frame by frame, holding the pooled connection until its last frame.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use super::pool::Conn;

/// The downstream response body.
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
}

/// The upstream body plus the connection it arrives on.
pub struct UpstreamBody {
    body: Incoming,
    conn: Option<Conn>,
}

impl UpstreamBody {
    pub(super) fn new(body: Incoming, conn: Conn) -> Self {
        let mut this = Self {
            body,
            conn: Some(conn),
        };
        if this.body.is_end_stream() {
            this.release(true);
        }
        this
    }

    fn release(&mut self, complete: bool) {
        if let Some(mut conn) = self.conn.take() {
            if complete {
                conn.set_reusable();
            }
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            Self::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Self::Upstream(u) => {
                let frame = ready!(Pin::new(&mut u.body).poll_frame(cx));
                match &frame {
                    None => u.release(true),
                    Some(Err(_)) => u.release(false),
                    Some(Ok(_)) if u.body.is_end_stream() => u.release(true),
                    Some(Ok(_)) => {}
                }
                Poll::Ready(frame)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Full(b) => b.is_none(),
            Self::Upstream(u) => u.body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(None) => SizeHint::with_exact(0),
            Self::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Self::Upstream(u) => u.body.size_hint(),
        }
    }
}
