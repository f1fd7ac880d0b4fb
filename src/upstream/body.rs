//! Response bodies tessera sends downstream: either a short local answer or the upstream's body,
//! streamed frame by frame, holding the pooled connection until its last frame.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::HeaderName;
use http_body::{Body, Frame, SizeHint};

use super::conn::{self as h1, Framing};
use super::pool::{Closed, Conn};
use super::raw::RawHead;
use super::BoxError;
use crate::session::Watch;

/// The downstream response body.
pub enum ProxyBody {
    /// A local answer (errors, health); `None` once sent.
    Full(Option<Bytes>),
    /// The upstream's body; the connection returns to the pool when it ends. Boxed: a response
    /// is moved about twenty times between the upstream reader and the client writer (async
    /// frames, `Result`s), and 288 bytes of body in each move cost more than the allocation.
    Upstream(Box<UpstreamBody>),
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

    /// Whether this body may still wait for the upstream: an upstream body not yet read in
    /// full (a local answer, or an upstream body already in memory, never waits).
    pub fn may_wait(&mut self) -> bool {
        match self {
            Self::Upstream(u) => u
                .conn
                .as_mut()
                .is_some_and(|c| !c.h1().holds_body(u.framing)),
            Self::Full(_) => false,
        }
    }

    /// Ties an upstream body that may still wait ([`ProxyBody::may_wait`]) to its session: it
    /// ends with an error (see [`Watch`]) when the session is revoked or expires while the body
    /// is open. A local body, or one already complete, ignores it.
    pub fn end_with_session(&mut self, watch: Watch) {
        if let Self::Upstream(u) = self {
            if u.conn.is_some() {
                u.watch = Some(watch);
            }
        }
    }

    /// Ready when the session this body ends with has ended, asked without reading a frame: a
    /// writer blocked on a slow client asks it, so a revocation does not wait for the client to
    /// drain the socket's send buffer (the kernel may size it in megabytes). Registers a watch
    /// that was only armed; never ready for a body with no watch.
    pub fn poll_session_end(&mut self, cx: &mut Context<'_>) -> Poll<crate::session::Ended> {
        match self {
            Self::Upstream(u) => match u.watch.as_mut() {
                Some(w) => w.poll_ended(cx, true, false, true),
                None => Poll::Pending,
            },
            Self::Full(_) => Poll::Pending,
        }
    }

    /// The upstream connection of a response that switched protocols (101, see
    /// [`super::Tunnel`]), taken out of the body; `None` for any other response, or once taken.
    pub fn take_tunnel(&mut self) -> Option<super::Tunnel> {
        match self {
            Self::Upstream(u) if u.switched => u.conn.take().map(super::Tunnel::new),
            _ => None,
        }
    }

    /// Has the trailers of a chunked upstream body (the only kind with trailers) lose the
    /// fields `names` gives for its head (before that head is screened): those the head lost
    /// too. The hop-by-hop and framing names go in any case (`chunked.rs`).
    pub fn screen_trailers(&mut self, names: impl FnOnce(&RawHead) -> Vec<HeaderName>) {
        if let Self::Upstream(u) = self {
            if let (Framing::Chunked(_), Some(head)) = (u.framing, &u.fields) {
                u.unlisted_trailers = names(head);
            }
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
    /// The session this body ends with ([`ProxyBody::end_with_session`]).
    watch: Option<Watch>,
    /// A 101 response's: it has no body, and its connection is kept (never reused) for
    /// [`ProxyBody::take_tunnel`].
    switched: bool,
    /// Names removed from the trailers ([`ProxyBody::screen_trailers`]).
    unlisted_trailers: Vec<HeaderName>,
}

impl UpstreamBody {
    pub(super) fn new(fields: RawHead, conn: Conn, framing: Framing, keep_alive: bool) -> Self {
        let mut this = Self {
            fields: Some(fields),
            conn: Some(conn),
            framing,
            keep_alive,
            watch: None,
            switched: false,
            unlisted_trailers: Vec::new(),
        };
        if framing == Framing::Done {
            this.release(None);
        }
        this
    }

    /// The body of a 101 response: none, but the connection stays with it until
    /// [`ProxyBody::take_tunnel`] takes it (dropped untaken, it is closed).
    pub(super) fn switched(fields: RawHead, mut conn: Conn) -> Self {
        conn.close_as(Closed::Tunnel);
        Self {
            fields: Some(fields),
            conn: Some(conn),
            framing: Framing::Done,
            keep_alive: false,
            watch: None,
            switched: true,
            unlisted_trailers: Vec::new(),
        }
    }

    /// Gives the connection back: to the pool when the body was read to its end (`broken` is
    /// `None`) and the upstream keeps the connection open, else closed (for `broken`'s reason,
    /// or [`Closed::Upstream`]). The body no longer waits, so its session watch (if registered)
    /// ends too.
    fn release(&mut self, broken: Option<Closed>) {
        self.watch = None;
        if let Some(mut conn) = self.conn.take() {
            match broken {
                None if self.keep_alive => conn.set_reusable(),
                None => conn.close_as(Closed::Upstream),
                Some(reason) => conn.close_as(reason),
            }
        }
    }
}

impl Drop for UpstreamBody {
    /// A body dropped before its end (the client went away, or its answer was replaced) leaves
    /// its rest to be read in the background if it is short (see [`super::conn::worth_finishing`]) and
    /// the exchange young (see `Conn::finish_later`, which decides both), so the connection can
    /// be kept; otherwise the connection is closed (counted for the upstream when its response
    /// ended the connection anyway).
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            if self.switched {
                // A tunnel never started: closed as the tunnel's.
            } else if self.keep_alive {
                tracing::debug!(framing = ?self.framing, "response body dropped before its end");
                conn.finish_later(h1::Unfinished::Body(self.framing));
            } else {
                conn.close_as(Closed::Upstream);
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
                let polled = conn.h1().poll_body(cx, &mut u.framing);
                if let Some(watch) = u.watch.as_mut() {
                    // Registers at the body's first wait, or once it goes on past its frames
                    // (see `Watch::poll_ended`); from then on every poll checks it.
                    let went_on =
                        matches!(polled, Poll::Ready(Some(Ok(_)))) && u.framing != Framing::Done;
                    let drained = !conn.h1().has_leftover();
                    if let Poll::Ready(ended) =
                        watch.poll_ended(cx, polled.is_pending(), went_on, drained)
                    {
                        u.release(Some(Closed::Abandoned));
                        return Poll::Ready(Some(Err(ended.into())));
                    }
                }
                let mut frame = ready!(polled);
                if let Some(map) = frame.as_mut().and_then(|f| f.as_mut().ok()?.trailers_mut()) {
                    for name in &u.unlisted_trailers {
                        map.remove(name);
                    }
                }
                match &frame {
                    Some(Err(_)) => u.release(Some(Closed::Error)),
                    _ if u.framing == Framing::Done => u.release(None),
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
