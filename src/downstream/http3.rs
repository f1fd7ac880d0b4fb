//! One HTTP/3 request stream: the 0-RTT policy, the request body as an [`http_body::Body`] the
//! phases read (streamed; the size limits are the proxy's, as over h1 and h2), and the response
//! written back with the send timeout. A response cut by its session's end resets the stream, so
//! what is queued for it never arrives. Must never: forward a request that is not safe to
//! replay before the handshake completes, or end a cut response as if it were whole.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::{HeaderValue, Method, Request, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;

use crate::proxy::Peer;
use crate::upstream::ProxyBody;

use super::quic::Quic;
use super::quic_handshake::Handshake;

use super::h3_guard::Guarded;

type Stream<S> = h3::server::RequestStream<S, Bytes>;

/// Serves one request: held until the handshake completes when it arrived early and is not
/// safe to replay, or comes from a trusted proxy's address not yet proven; marked
/// `Early-Data: 1` when it goes on early.
pub(super) async fn serve(
    quic: &Quic,
    mut req: Request<()>,
    stream: Stream<Guarded<h3_quinn::BidiStream<Bytes>>>,
    peer: &Peer,
    mut handshake: Handshake,
) {
    let head = req.method() == Method::HEAD;
    let (mut send, recv) = stream.split();
    // Only the body's size: a malformed `content-length` is refused by the screen (400), and
    // the body then never forwarded.
    let left = crate::screen::h3::content_length(req.headers())
        .ok()
        .flatten();
    let mut body = RequestBody::new(recv, left);
    // First: a request whose handshake completes meanwhile goes on as a late one.
    let expecting = crate::screen::body::expects_continue(req.headers());
    body.settle(quic, req.method(), expecting).await;
    if !handshake.complete() {
        // A trusted proxy's word on its client (`X-Forwarded-For`) is taken only from a proven
        // address: an early flight's keys need no answer from the server, so its source may be
        // forged by anyone holding a ticket.
        if is_safe(req.method()) && (!peer.is_trusted() || handshake.address_proven()) {
            // RFC 8470 section 5.1: the upstream may answer 425 Too Early, which passes.
            req.headers_mut()
                .insert("early-data", HeaderValue::from_static("1"));
        } else {
            // Browsers show a 425 to their users instead of retrying (caddy#7481): wait.
            match tokio::time::timeout(quic.header_read_timeout, handshake.wait()).await {
                Ok(true) => {}
                Ok(false) => {
                    return tracing::debug!(
                        "HTTP/3 connection ended before its handshake completed; early request \
                         dropped"
                    )
                }
                Err(_) => {
                    return tracing::debug!(
                        "HTTP/3 handshake not done in time; early request dropped"
                    )
                }
            }
        }
    }
    // RFC 9110 section 10.1.1: a client that expects `100 Continue` gets it when its body is
    // first read (the request authenticated and on its way upstream), not before: a refusal
    // goes out without it.
    let (read, first_read) = tokio::sync::oneshot::channel();
    if expecting && !body.is_end_stream() {
        body.first_read = Some(read);
    }
    let req = req.map(|()| body);
    let handling = std::pin::pin!(quic.proxy.handle(req, peer));
    let resp = continued(quic, &mut send, handling, first_read).await;
    respond(quic, &mut send, super::handoff::bodyless_if(head, resp)).await;
}

/// The answer of `handling`, with a `100 Continue` sent on `send` first if the request's body
/// is read before the answer is ready (`first_read`; never, for a request that expects none).
async fn continued(
    quic: &Quic,
    send: &mut Stream<h3_quinn::SendStream<Bytes>>,
    mut handling: Pin<&mut impl std::future::Future<Output = Response<ProxyBody>>>,
    first_read: tokio::sync::oneshot::Receiver<()>,
) -> Response<ProxyBody> {
    tokio::select! {
        resp = handling.as_mut() => return resp,
        read = first_read => if read.is_ok() {
            let interim = Response::builder().status(http::StatusCode::CONTINUE).body(());
            let interim = interim.expect("a status alone");
            // A client that takes no answer takes none of its body either: the body's own
            // timeout then answers.
            let _ = tokio::time::timeout(quic.send_timeout, send.send_response(interim)).await;
        }
    }
    handling.await
}

/// GET, HEAD and OPTIONS: safe to forward from early data (Cloudflare's and Envoy's rule).
fn is_safe(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Writes `resp` on `send`: the head, each data frame, the trailers if the body has any, and
/// the end of the stream, each within `server.send_timeout_ms`; a body that fails or is cut by
/// its session's end resets the stream instead (`H3_REQUEST_CANCELLED`, RFC 9114 section 8.1).
async fn respond(
    quic: &Quic,
    send: &mut Stream<h3_quinn::SendStream<Bytes>>,
    resp: Response<ProxyBody>,
) {
    let (parts, mut body) = resp.into_parts();
    let head = send.send_response(Response::from_parts(parts, ()));
    match tokio::time::timeout(quic.send_timeout, head).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return tracing::debug!(cause = %e, "HTTP/3 response head not sent"),
        Err(_) => return stalled(send),
    }
    loop {
        let frame = match body.frame().await {
            None => break,
            Some(Ok(frame)) => frame,
            Some(Err(e)) => {
                tracing::debug!(cause = %e, "HTTP/3 response body ended early; stream reset");
                return send.stop_stream(h3::error::Code::H3_REQUEST_CANCELLED);
            }
        };
        let data = match frame.into_data() {
            Ok(data) => data,
            // The body's last frame (RFC 9114 section 4.1: a HEADERS frame after the data).
            Err(frame) => match frame.into_trailers() {
                Ok(trailers) => {
                    let sent = send.send_trailers(trailers);
                    match tokio::time::timeout(quic.send_timeout, sent).await {
                        Ok(Ok(())) => break,
                        // Refused here (larger than the client takes) or the client is gone:
                        // a reset either way, never an end that looks whole without them.
                        Ok(Err(e)) => {
                            tracing::debug!(cause = %e, "HTTP/3 trailers not sent; stream reset");
                            return send.stop_stream(h3::error::Code::H3_REQUEST_CANCELLED);
                        }
                        Err(_) => return stalled(send),
                    }
                }
                Err(_) => continue,
            },
        };
        match tokio::time::timeout(quic.send_timeout, send.send_data(data)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return tracing::debug!(cause = ?e, "HTTP/3 client went away"),
            Err(_) => return stalled(send),
        }
    }
    match tokio::time::timeout(quic.send_timeout, send.finish()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(cause = %e, "HTTP/3 response end not sent"),
        Err(_) => stalled(send),
    }
}

/// A client that took no response bytes (head, data, or the end) for `server.send_timeout_ms`:
/// its stream is reset, which frees the response's upstream connection.
fn stalled(send: &mut Stream<h3_quinn::SendStream<Bytes>>) {
    tracing::debug!("client took no response bytes for server.send_timeout_ms; stream reset");
    send.stop_stream(h3::error::Code::H3_REQUEST_CANCELLED);
}

/// An HTTP/3 request body as the phases read it: the client's DATA frames, in order; an error
/// when the client resets the stream, breaks the framing, or sends more or less than its
/// `Content-Length` (RFC 9114 section 4.1.2), so the upstream request is never completed with
/// a truncated body. Its size is the `Content-Length`'s, and none once the stream is known to
/// have ended, so that the upstream request is framed as the client's was (RFC 9112 section 6).
/// Trailers the client sends are dropped, as over HTTP/1.1 and HTTP/2.
struct RequestBody {
    recv: Stream<Guarded<h3_quinn::RecvStream>>,
    done: bool,
    /// Bytes the `Content-Length` still announces, if it had one.
    left: Option<u64>,
    /// What [`RequestBody::settle`] read, given out first.
    first: Option<Result<Frame<Bytes>, BoxError>>,
    /// How many times in a row h3 said "no more data" (see [`RequestBody::poll_frame`]).
    nones: u8,
    /// Told when the body is first read, for a client that expects `100 Continue`.
    first_read: Option<tokio::sync::oneshot::Sender<()>>,
}

/// Answers of "no more data" in a row taken as the body's end: h3 gives one for each
/// zero-length DATA frame too, and a client has no use for a run of 3. (Every body's end pays
/// this many calls, so it stays small.)
const EMPTY_DATA_RUN: u8 = 4;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl RequestBody {
    fn new(recv: Stream<Guarded<h3_quinn::RecvStream>>, left: Option<u64>) -> Self {
        Self {
            recv,
            done: false,
            left,
            first: None,
            nones: 0,
            first_read: None,
        }
    }

    /// The stream's end, confirmed: an error if the `Content-Length` promised more.
    fn end(&mut self) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.left.is_some_and(|left| left > 0) {
            return Poll::Ready(Some(Err("body shorter than its content-length".into())));
        }
        self.done = true;
        Poll::Ready(None)
    }

    /// Reads what the stream already says of its body before the request goes on: a stream
    /// that ended with its head (nearly every GET) then goes upstream without a body rather
    /// than as an empty chunked one, which some servers refuse on a GET. For a method that
    /// seldom has a body (RFC 9110 section 9.3) and no `Content-Length`, this waits for the
    /// first frame or the end (at most `server.header_read_timeout_ms`, as the head); for any
    /// other, or a client that holds its body back for a `100 Continue` (`expecting`), it only
    /// looks.
    async fn settle(&mut self, quic: &Quic, method: &Method, expecting: bool) {
        let rarely_has_body = !expecting
            && matches!(
                *method,
                Method::GET | Method::HEAD | Method::OPTIONS | Method::DELETE | Method::TRACE
            );
        // None: not known yet; Some(None): the stream ended; Some(Some(frame)).
        let next = if rarely_has_body && self.left.is_none() {
            let read = std::future::poll_fn(|cx| Pin::new(&mut *self).poll_frame(cx));
            tokio::time::timeout(quic.header_read_timeout, read)
                .await
                .ok()
        } else {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            match Pin::new(&mut *self).poll_frame(&mut cx) {
                Poll::Ready(next) => Some(next),
                Poll::Pending => None,
            }
        };
        self.first = next.flatten();
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(first));
        }
        if self.done {
            return Poll::Ready(None);
        }
        if let Some(read) = self.first_read.take() {
            let _ = read.send(());
        }
        // h3 0.0.8 says "no more data" at a zero-length DATA frame as at the end (and at
        // trailers): the end says so again each time it is asked, so it is asked until a run
        // of answers no client sends as empty frames. (Not by reading trailers: at a FIN cut
        // into a DATA frame, h3 asserts and panics there. It reports that cut as an end too:
        // a client that ends its stream inside a frame, a malformed message, has its body end
        // there, refused only against a `content-length`.)
        loop {
            if self.nones >= EMPTY_DATA_RUN {
                return self.end();
            }
            match std::task::ready!(self.recv.poll_recv_data(cx)) {
                Ok(Some(mut buf)) => {
                    self.nones = 0;
                    let n = buf.remaining() as u64;
                    if let Some(left) = &mut self.left {
                        if n > *left {
                            let e = "more body than its content-length";
                            return Poll::Ready(Some(Err(e.into())));
                        }
                        *left -= n;
                    }
                    let data = buf.copy_to_bytes(buf.remaining());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(None) => self.nones += 1,
                Err(e) => return Poll::Ready(Some(Err(Box::new(e)))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.first.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let first = match &self.first {
            Some(Ok(frame)) => frame.data_ref().map_or(0, |d| d.len() as u64),
            _ => 0,
        };
        match (self.done, self.left) {
            (true, _) => http_body::SizeHint::with_exact(first),
            (false, Some(left)) => http_body::SizeHint::with_exact(first + left),
            (false, None) => http_body::SizeHint::default(),
        }
    }
}
