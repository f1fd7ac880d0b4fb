//! Limits on a request body as it streams upstream: its size (`server.max_body_bytes`, 413) and
//! the longest pause between two of its reads (`server.client_body_timeout_ms`, 408, as nginx's
//! `client_body_timeout`). Must never: let a stalled body hold an upstream connection past the
//! pause bound.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::time::{Instant, Sleep};

use crate::upstream::{BodyStalled, BoxError, UpBody};

/// `body` bounded to `max_bytes` (0: no bound) and to pauses of at most `stall` between reads.
pub fn limit<B>(body: B, max_bytes: u64, stall: Duration) -> UpBody
where
    B: Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    if body.is_end_stream() {
        // Nothing will be read: no timer.
        return body.map_err(Into::into).boxed();
    }
    let paced = Paced {
        inner: body.map_err(Into::into).boxed(),
        stall,
        timer: None,
        restart: false,
    };
    if max_bytes > 0 {
        http_body_util::Limited::new(paced, max_bytes as usize).boxed()
    } else {
        paced.boxed()
    }
}

/// Most body bytes an early answer waits to read and drop ([`discard`]): a larger body is
/// answered over (its stream reset with `NO_ERROR`, RFC 9113 8.1).
pub const DISCARD_MAX_BYTES: u64 = 64 * 1024;
/// Longest wait, in all, for the rest of a body an early answer reads and drops.
pub const DISCARD_WAIT: Duration = Duration::from_secs(1);

/// Whether `fields` hold `Expect: 100-continue` (case ignored, RFC 9110 section 10.1.1): a
/// client that sends its body only after a `100 Continue`, or after its own wait.
pub fn expects_continue(fields: &http::HeaderMap) -> bool {
    fields
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// Reads and drops what is left of the body of a request answered without it (a refusal, a
/// redirect), up to [`DISCARD_MAX_BYTES`] within [`DISCARD_WAIT`], as nginx discards an
/// unwanted body. Why, for HTTP/2 and HTTP/3: the stream's framing is still checked while it
/// is read, so a body that breaks it (a `content-length` its DATA frames do not match) ends
/// in the stream error RFC 9113 8.1.1 asks for rather than in an answer; and a short body
/// sent with its head is taken whole instead of reset. Read errors end the wait.
pub async fn discard<B: Body>(body: B) {
    let read = async {
        tokio::pin!(body);
        let mut seen = 0u64;
        while seen <= DISCARD_MAX_BYTES {
            match body.frame().await {
                Some(Ok(frame)) => {
                    seen += frame.data_ref().map_or(0, |d| d.remaining() as u64);
                }
                Some(Err(_)) | None => return,
            }
        }
    };
    let _ = tokio::time::timeout(DISCARD_WAIT, read).await;
}

/// A body whose reads may pause at most `stall` each: the timer starts at the first read that
/// must wait and restarts after every frame.
struct Paced {
    inner: UpBody,
    stall: Duration,
    /// Boxed and made at the first wait: a body that never waits costs no timer.
    timer: Option<Pin<Box<Sleep>>>,
    /// A frame was handed over since the timer was last set: the next wait for the client starts
    /// the timer anew (time the upstream side took to ask for more is not the client's).
    restart: bool,
}

impl Body for Paced {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.restart = true;
                Poll::Ready(frame)
            }
            Poll::Pending => {
                let stall = this.stall;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
                if std::mem::take(&mut this.restart) {
                    timer.as_mut().reset(Instant::now() + stall);
                }
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(BodyStalled(stall).into()))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;

    /// A body fed by a channel: the test decides when each frame comes.
    fn channel_body() -> (
        tokio::sync::mpsc::Sender<Result<Frame<Bytes>, BoxError>>,
        UpBody,
    ) {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        (
            tx,
            limit(StreamBody::new(stream), 0, Duration::from_secs(60)),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_pauses_less_than_the_timeout_goes_on_and_a_stall_ends_it() {
        let (tx, mut body) = channel_body();
        let feeder = tokio::spawn(async move {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_secs(59)).await;
                tx.send(Ok(Frame::data(Bytes::from_static(b"x"))))
                    .await
                    .unwrap();
            }
            // Then silence, the sender kept open.
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(tx);
        });
        for _ in 0..3 {
            let frame = body.frame().await.expect("a frame").expect("no error");
            assert_eq!(frame.into_data().unwrap(), "x");
        }
        let started = Instant::now();
        let err = body.frame().await.expect("an error").unwrap_err();
        assert!(err.is::<BodyStalled>(), "{err}");
        assert_eq!(started.elapsed(), Duration::from_secs(60));
        feeder.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn time_the_reader_takes_to_ask_for_more_is_not_the_clients() {
        let (tx, mut body) = channel_body();
        let first = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(10)).await;
            tx.send(Ok(Frame::data(Bytes::from_static(b"a"))))
                .await
                .unwrap();
            tx
        });
        // The body waits for its first frame (the timer runs), which comes 10 s later.
        assert!(body.frame().await.unwrap().is_ok());
        let tx = first.await.unwrap();
        // The upstream side asks for the next frame only 90 s later (a slow upstream socket);
        // the client then sends within the minute: no timeout.
        tokio::time::sleep(Duration::from_secs(90)).await;
        let feeder = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            tx.send(Ok(Frame::data(Bytes::from_static(b"b"))))
                .await
                .unwrap();
            tx
        });
        let frame = body.frame().await.expect("a frame").expect("no timeout");
        assert_eq!(frame.into_data().unwrap(), "b");
        drop(feeder.await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_with_nothing_to_read_has_no_timer() {
        let mut body = limit(
            http_body_util::Empty::<Bytes>::new(),
            0,
            Duration::from_secs(1),
        );
        assert!(body.is_end_stream());
        assert!(body.frame().await.is_none());
    }

    type Frames = tokio_stream::wrappers::ReceiverStream<Result<Frame<Bytes>, BoxError>>;

    /// A body fed by a channel, unbounded: the frames `discard` pulled are the ones sent.
    fn plain_channel_body() -> (
        tokio::sync::mpsc::Sender<Result<Frame<Bytes>, BoxError>>,
        StreamBody<Frames>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        (tx, StreamBody::new(Frames::new(rx)))
    }

    #[tokio::test(start_paused = true)]
    async fn discard_reads_a_short_body_to_its_end_at_once() {
        let (tx, body) = plain_channel_body();
        let feeder = tokio::spawn(async move {
            tx.send(Ok(Frame::data(Bytes::from_static(b"rest"))))
                .await
                .unwrap();
        });
        let started = Instant::now();
        discard(body).await;
        assert_eq!(started.elapsed(), Duration::ZERO);
        feeder.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn discard_waits_for_a_silent_body_only_so_long() {
        let (tx, body) = plain_channel_body();
        let started = Instant::now();
        discard(body).await;
        assert_eq!(started.elapsed(), DISCARD_WAIT);
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn discard_stops_reading_past_its_byte_bound() {
        let (tx, body) = plain_channel_body();
        let feeder = tokio::spawn(async move {
            let mut sent = 0u64;
            let chunk = Bytes::from(vec![0u8; 16 * 1024]);
            while tx.send(Ok(Frame::data(chunk.clone()))).await.is_ok() {
                sent += chunk.len() as u64;
            }
            sent
        });
        discard(body).await;
        let sent = feeder.await.unwrap();
        // The channel holds one frame more than was read.
        assert!(sent > DISCARD_MAX_BYTES, "{sent}");
        assert!(sent <= DISCARD_MAX_BYTES + 3 * 16 * 1024, "{sent}");
    }
}
