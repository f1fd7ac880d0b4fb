//! The requests of one connection served by hyper, as its checks see them: how many started,
//! how many are open, and the response bodies being sent, so that a stalled body can be cut
//! and an HTTP/1 response whose session ended can reset its connection.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::Body;
use tokio::time::Instant;

use crate::upstream::ProxyBody;

/// The requests (HTTP/1 requests or HTTP/2 streams) of one connection served by hyper: how many
/// reached the proxy, how many of them are still open (from their head until their response
/// body has been sent, dropped or cut), and the response bodies being sent. Read by the checks.
#[derive(Default)]
pub(super) struct Streams {
    pub(super) started: AtomicU64,
    pub(super) open: AtomicUsize,
    /// The response bodies given to hyper; an entry whose [`Tracked`] is gone is pruned at the
    /// next check, or when the list would grow.
    sending: Mutex<Vec<Arc<Mutex<Sending>>>>,
    /// Whether an HTTP/1 response was given to hyper: until then (an h2c connection) nothing is
    /// watched for [`Streams::poll_h1_session_end`].
    any_h1: AtomicBool,
}

impl Streams {
    /// Counts a request in; it stays open until the returned guard is dropped.
    pub(super) fn open(this: &Arc<Self>) -> Open {
        this.started.fetch_add(1, Ordering::Relaxed);
        this.open.fetch_add(1, Ordering::Relaxed);
        Open(this.clone())
    }

    /// Ready, with the connection's reset flag set, when the session of an HTTP/1 response
    /// body that hyper is not polling has ended (revoked, expired): one it took a frame of and
    /// has not come back to, its write buffer full behind a slow client. Registers `cx` with
    /// those bodies' session watches otherwise. A body hyper polls finds its session's end
    /// itself ([`Tracked`]); HTTP/2 bodies end with `RST_STREAM` when hyper next polls them.
    pub(super) fn poll_h1_session_end(&self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.any_h1.load(Ordering::Relaxed) {
            return Poll::Pending;
        }
        for s in lock(&self.sending).iter() {
            let mut s = lock(s);
            let Sending {
                body: Some(body),
                handed: Some(_),
                reset: Some(reset),
                ..
            } = &mut *s
            else {
                continue;
            };
            if body.poll_session_end(cx).is_ready() {
                reset.store(true, Ordering::Relaxed);
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }

    /// Cuts every HTTP/2 response body that hyper took a frame of at least `send` before `now`
    /// and has not asked for the next one since: the client grants it no flow-control window.
    /// HTTP/1 bodies are left to [`super::io::Prefixed`]'s send timeout, which counts any byte
    /// the socket takes as progress: hyper asks for the next frame only once a whole buffered
    /// one is written, so a client taking a few bytes a minute would look stalled here (nginx's
    /// `send_timeout` also times only the gap between two writes). The body is dropped, which closes its
    /// upstream connection if it was mid-body, and ends its request's open count; hyper's next
    /// poll of it, if any, gets an error (HTTP/2: `RST_STREAM`; HTTP/1: the connection ends).
    /// Checked once per tick, so a cut comes up to a quarter of `send` late.
    pub(super) fn cut_stalled(&self, now: Instant, send: Duration) {
        let mut cut = Vec::new();
        let mut sending = lock(&self.sending);
        sending.retain(|s| {
            if Arc::strong_count(s) == 1 {
                return false; // hyper dropped its body
            }
            let mut s = lock(s);
            if s.reset.is_none()
                && s.handed
                    .is_some_and(|t| now.saturating_duration_since(t) >= send)
            {
                s.handed = None;
                cut.push((s.body.take(), s.open.take()));
            }
            true
        });
        drop(sending);
        if !cut.is_empty() {
            tracing::debug!(
                responses = cut.len(),
                "client took no response bytes for server.send_timeout_ms; response cut"
            );
        }
    }
}

/// Locks `m`; a panic while it was held leaves plain data behind, still usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One open request of [`Streams`]; dropping it closes the request.
pub(super) struct Open(Arc<Streams>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body being sent by hyper, shared with the connection's checks.
struct Sending {
    /// `None` once cut for a stall.
    body: Option<ProxyBody>,
    /// Keeps the request open (see [`Streams`]) until hyper drops the body, or it is cut.
    open: Option<Open>,
    /// When hyper took a frame, while it has not asked for the next one since.
    handed: Option<Instant>,
    /// An HTTP/1 response's: its connection's reset flag ([`super::io::Prefixed`]), set when
    /// the body ends with its session, since HTTP/1 can end a response only by closing.
    reset: Option<Arc<AtomicBool>>,
}

/// A response body that keeps its request open (see [`Streams`]) until hyper has taken its last
/// frame or dropped it (the last bytes may still wait to be written), and that the connection's
/// checks can cut when the client stops taking it (see [`Streams::cut_stalled`]); everything
/// else is the body's own.
pub(super) struct Tracked(Arc<Mutex<Sending>>);

impl Tracked {
    /// `reset`: the connection's reset flag for an HTTP/1 response, `None` for HTTP/2.
    pub(super) fn new(
        streams: &Streams,
        body: ProxyBody,
        open: Open,
        reset: Option<Arc<AtomicBool>>,
    ) -> Self {
        if reset.is_some() {
            streams.any_h1.store(true, Ordering::Relaxed);
        }
        let sending = Arc::new(Mutex::new(Sending {
            body: Some(body),
            open: Some(open),
            handed: None,
            reset,
        }));
        let mut all = lock(&streams.sending);
        if all.len() == all.capacity() {
            // Bodies hyper has dropped since the last check, pruned before the list grows: it
            // stays within about twice the open responses on a busy connection.
            all.retain(|s| Arc::strong_count(s) > 1);
        }
        all.push(sending.clone());
        drop(all);
        Self(sending)
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut s = lock(&self.0);
        let gone = (s.body.take(), s.open.take());
        drop(s);
        drop(gone);
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = crate::upstream::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let mut s = lock(&self.0);
        s.handed = None;
        let Some(body) = s.body.as_mut() else {
            return Poll::Ready(Some(Err(
                "response cut: the client took no bytes for server.send_timeout_ms".into(),
            )));
        };
        let frame = Pin::new(body).poll_frame(cx);
        match &frame {
            Poll::Ready(Some(Ok(_))) => s.handed = Some(Instant::now()),
            Poll::Ready(Some(Err(e))) if e.is::<crate::session::Ended>() => {
                if let Some(reset) = &s.reset {
                    reset.store(true, Ordering::Relaxed);
                }
            }
            _ => {}
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        lock(&self.0)
            .body
            .as_ref()
            .is_some_and(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        lock(&self.0)
            .body
            .as_ref()
            .map_or_else(http_body::SizeHint::default, |b| b.size_hint())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hands one frame of a `full` body to "hyper", then checks after `send` has passed.
    fn cut_after_stall(reset: Option<Arc<AtomicBool>>) -> bool {
        let streams = Arc::new(Streams::default());
        let open = Streams::open(&streams);
        let mut body = Tracked::new(&streams, ProxyBody::full("abc"), open, reset);
        let waker = futures_util::task::noop_waker();
        let frame = Pin::new(&mut body).poll_frame(&mut Context::from_waker(&waker));
        assert!(matches!(frame, Poll::Ready(Some(Ok(_)))));
        let send = Duration::from_secs(60);
        streams.cut_stalled(Instant::now() + send, send);
        let cut = lock(&body.0).body.is_none();
        cut
    }

    #[test]
    fn an_http2_body_not_polled_for_send_timeout_is_cut() {
        assert!(cut_after_stall(None));
    }

    #[test]
    fn an_http1_body_is_left_to_the_socket_send_timeout() {
        assert!(!cut_after_stall(Some(Arc::new(AtomicBool::new(false)))));
    }
}
