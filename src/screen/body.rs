//! Limits on a request body as it streams upstream: its size (`server.max_body_bytes`, 413) and
//! the longest pause between two of its reads (`server.client_body_timeout_ms`, 408, as nginx's
//! `client_body_timeout`). Must never: let a stalled body hold an upstream connection past the
//! pause bound.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
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
}
