//! One request-response exchange on an upstream connection ([`H1::send`]): the request head
//! and body written with `writev`, heads that arrive early read as they come (1xx skipped, an
//! error ends the sending at once), a 101 checked against the request's `Upgrade`. Must never:
//! mark a connection reusable when the request was not written in full.

use std::future::poll_fn;
use std::io::{self};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::header::{self};
use http::{HeaderMap, Method, Request, StatusCode};

use super::{ForwardError, Transport, UpBody};

use super::codec::{final_head, head_complete};
use super::conn::{broken, Framing, Head, SendError, Sending, H1, MAX_HEAD, READ_CHUNK};
use super::encode::encode_head;

use super::outgoing::{body_framing, failed, poll_queue, BodyFraming, Fail};

/// A 101 answer to a request whose `Upgrade` field is `upgrade`: accepted only when both name
/// `websocket` (RFC 9110 section 15.2.2: a server switches only to a protocol the client listed;
/// tessera asks for nothing else), and the 101 completes the handshake as RFC 6455 section 4.1
/// has a client check: `Connection` lists `upgrade`, and one `Sec-WebSocket-Accept` answers the
/// request's key (checked here for every client, since over HTTP/2 the key is tessera's and no
/// one else could). The connection then belongs to the new protocol and never goes back to the
/// pool.
///
/// Errors (502): a 101 to a request that asked for no upgrade, to another protocol, or that
/// does not answer the request's key.
fn switched(mut head: Head, request: &HeaderMap) -> Result<Head, ForwardError> {
    let websocket = |v: &[u8]| crate::fields::has_token(v, b"websocket");
    if !request
        .get_all(header::UPGRADE)
        .iter()
        .any(|v| websocket(v.as_bytes()))
    {
        return Err(broken("upstream switched protocols unasked"));
    }
    if !head.fields.get_all(b"upgrade").any(websocket) {
        return Err(broken(
            "upstream switched to a protocol other than websocket",
        ));
    }
    let upgrade = |v: &[u8]| crate::fields::has_token(v, b"upgrade");
    let expected = request
        .get(header::SEC_WEBSOCKET_KEY)
        .map(|k| accept(k.as_bytes()));
    let answered = {
        let mut accepts = head.fields.get_all(b"sec-websocket-accept");
        match (expected, accepts.next(), accepts.next()) {
            (Some(expected), Some(got), None) => got == expected.as_bytes(),
            _ => false,
        }
    };
    if !answered || !head.fields.get_all(b"connection").any(upgrade) {
        return Err(broken(
            "upstream's 101 does not complete the WebSocket handshake (Sec-WebSocket-Accept, \
             Connection)",
        ));
    }
    head.keep_alive = false;
    head.framing = Framing::Done;
    Ok(head)
}

/// The `Sec-WebSocket-Accept` that answers `key` (RFC 6455 section 4.2.2): the base64 of the
/// SHA-1 of the key and the protocol's GUID.
fn accept(key: &[u8]) -> String {
    use base64::Engine;
    const GUID: &[u8] = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
    ctx.update(key);
    ctx.update(GUID);
    base64::engine::general_purpose::STANDARD.encode(ctx.finish())
}

/// Whether a final head that arrives while the request is still being sent ends the sending
/// (RFC 9112 section 9.5): an error (>= 400) or a 101 does; any other is kept while the body is
/// still sent in full.
fn stops_sending(status: StatusCode) -> bool {
    status.as_u16() >= 400 || status == StatusCode::SWITCHING_PROTOCOLS
}

/// Where a sending stands while its response head is awaited: the exchange can be finished in
/// the background ([`Sending::HeadDue`]) only if the request was written to its end and the
/// upstream did not close; else nothing can save the connection ([`Sending::Idle`]).
fn awaiting_head(complete: bool, eof: bool, head_request: bool) -> Sending {
    if complete && !eof {
        Sending::HeadDue { head_request }
    } else {
        Sending::Idle
    }
}

impl H1 {
    /// Sends `req` (origin-form URI, final headers) and reads the response head. The body is then
    /// read with [`H1::poll_body`].
    ///
    /// Framing sent: no body for a bodyless GET/HEAD/DELETE/OPTIONS/TRACE, else
    /// `Content-Length` when the body's size is known, else `Transfer-Encoding: chunked`; the
    /// client's framing headers are replaced. Heads that arrive while the body is being sent:
    /// 1xx are skipped; an error (>= 400) ends the sending and is returned at once; another
    /// final head waits until the body was sent. The connection is marked reusable
    /// ([`Head::keep_alive`]) only if the whole request was written before its final head came.
    ///
    /// `sending` says, should this future be dropped (its requester went away), whether the
    /// connection can be kept as it is ([`Sending::Unsent`]), or after the exchange is finished
    /// ([`Sending::HeadDue`]); it is [`Sending::Idle`] when this returns. `sent_ms` is set to
    /// [`super::pool::coarse_ms`] when the first bytes are written, and left as it is if none
    /// are. (Both the caller's, not fields of this struct: the pool's connection has room for
    /// them in its padding, and this struct, moved with every checkout, none.)
    ///
    /// Errors: see [`SendError`]; request-body errors are [`ForwardError::BodyTooLarge`] when the
    /// body exceeded its limit, else [`ForwardError::ClientBody`].
    pub async fn send(
        &mut self,
        req: Request<UpBody>,
        sending: &mut Sending,
        sent_ms: &mut u32,
    ) -> Result<Head, SendError> {
        let head_request = req.method() == Method::HEAD;
        let (parts, mut body) = req.into_parts();
        let framing = body_framing(&parts.method, &body);
        let mut out = std::mem::take(&mut self.out);
        out.push(encode_head(&parts, framing));
        let mut sent_any = false;
        let mut body_done = matches!(framing, BodyFraming::None | BodyFraming::Length(0));
        // Counted down as the body is queued.
        let mut left = framing;
        let mut polled_body = false;
        let mut eof = false;
        // A final response head that arrived while the request was still being sent.
        let mut early: Option<Head> = None;
        *sending = Sending::Unsent;
        let result = poll_fn(|cx| {
            while !(body_done && out.is_empty()) {
                // Watch for an answer while sending (RFC 9112 section 9.5): interim (1xx) heads
                // are consumed, an error (>= 400, or 101) stops the sending, any other final head
                // is kept and the body is still sent in full.
                if !eof && early.is_none() {
                    match self.poll_early(cx, sent_any, head_request) {
                        Early::Nothing => {}
                        Early::Eof => eof = true,
                        Early::Read => continue,
                        Early::Head(head) => {
                            let stop = stops_sending(head.response.status());
                            early = Some(head);
                            if stop {
                                return Poll::Ready(Ok(()));
                            }
                            continue;
                        }
                        Early::Failed(fail) => return Poll::Ready(Err(fail)),
                    }
                }
                if !out.is_empty() {
                    match self.poll_write_out(cx, &mut out) {
                        Poll::Ready(Ok(_)) => {
                            if !sent_any {
                                *sent_ms = super::pool::coarse_ms();
                            }
                            sent_any = true;
                            *sending = Sending::Idle;
                            continue;
                        }
                        Poll::Ready(Err(e)) => {
                            // An upstream that answered early (413, 401, even 200) and closed
                            // with the body unread makes the write fail (EPIPE, ECONNRESET); its
                            // answer came before the close, so it is in the receive queue. With
                            // none of this request written, what is queued answers nothing of
                            // it (an idle connection's 408): the request is unsent.
                            if early.is_none() && !eof && sent_any {
                                early = self.queued_head(head_request);
                            }
                            if early.is_some() {
                                return Poll::Ready(Ok(()));
                            }
                            return Poll::Ready(Err(Fail::Io(e)));
                        }
                        Poll::Pending => return Poll::Pending,
                    }
                }
                // TLS records held back go out before the body's next frame is awaited.
                ready!(self.poll_flush_io(cx)).map_err(Fail::Io)?;
                polled_body = true;
                match ready!(poll_queue(Pin::new(&mut body), cx, &mut left, &mut out)) {
                    Ok(done) => body_done = done,
                    Err(e) => return Poll::Ready(Err(Fail::Body(e))),
                }
            }
            self.poll_flush_io(cx).map_err(Fail::Io)
        })
        .await;
        *sending = Sending::Idle;
        if let Err(fail) = result {
            let unsent = (!sent_any && !polled_body).then(|| Request::from_parts(parts, body));
            return Err(failed(fail, unsent));
        }
        // The upstream may take another request only if this one was written to its end.
        let sent = Sent {
            complete: body_done && out.is_empty(),
            early,
            eof,
            polled_body,
            head_request,
        };
        out.queue.clear();
        self.out = out;
        self.answer(sent, parts, body, sending).await
    }

    /// The response head of a request sent ([`Sent`]): the one that came early, or the next one
    /// read; a 101 checked against the request's `Upgrade`. Its connection is reusable only if
    /// the request was written to its end.
    async fn answer(
        &mut self,
        sent: Sent,
        parts: http::request::Parts,
        body: UpBody,
        sending: &mut Sending,
    ) -> Result<Head, SendError> {
        let Sent {
            complete,
            early,
            eof,
            polled_body,
            head_request,
        } = sent;
        // An upstream that answers before it has the whole request and keeps its connection
        // must read the rest as this request's body (RFC 9112 section 9.5); one that does not
        // would take it for the next request, whoever sends that. Not worth the risk.
        let complete = complete && early.is_none();
        let head = match early {
            Some(head) => Ok(head),
            None => {
                *sending = awaiting_head(complete, eof, head_request);
                let head = self.read_head(head_request, eof).await;
                *sending = Sending::Idle;
                match head {
                    Err(SendError::ClosedBeforeResponse(None, e)) if !polled_body => {
                        return Err(SendError::ClosedBeforeResponse(
                            Some(Request::from_parts(parts, body)),
                            e,
                        ))
                    }
                    other => other,
                }
            }
        };
        let head = match head {
            Ok(head) if head.response.status() == StatusCode::SWITCHING_PROTOCOLS => {
                switched(head, &parts.headers).map_err(SendError::Failed)
            }
            other => other,
        };
        super::recycle_header_map(parts.headers);
        if let Ok(head) = &head {
            self.announced_idle = head.announced_idle;
        }
        head.map(|mut head| {
            head.keep_alive &= complete;
            head
        })
    }

    /// Consumes the complete response heads buffered while the request is being sent: interim
    /// (1xx, but 101) heads are dropped; the first other one is returned. `None`: no final head
    /// yet. A head growing past [`MAX_HEAD`] is an error here, not a reason to read on.
    fn early_head(&mut self, head_request: bool) -> Result<Option<Head>, ForwardError> {
        if !head_complete(&self.buf) && self.buf.len() <= MAX_HEAD {
            return Ok(None);
        }
        final_head(&mut self.buf, head_request)
    }

    /// Reads what the kernel already holds for the socket, without waiting, until a final
    /// response head is complete, and returns that head (`None`: no complete, valid final head
    /// is there). Used after a write failed: an upstream that answered early and closed sent its
    /// answer before the close (RFC 9112 section 9.5), but the runtime may not have seen the
    /// socket readable yet (its readiness is only updated when its event loop next polls), so a
    /// readiness-gated read would report nothing. A `recv` with `MSG_DONTWAIT` asks the kernel.
    fn queued_head(&mut self, head_request: bool) -> Option<Head> {
        loop {
            if let Some(head) = self.early_head(head_request).ok()? {
                return Some(head);
            }
            let start = self.buf.len();
            self.buf.resize(start + READ_CHUNK, 0);
            let got = self.io.read_now(&mut self.buf[start..]).unwrap_or(0);
            self.buf.truncate(start + got);
            if got == 0 {
                return None;
            }
        }
    }

    /// Reads response heads until a final (non-1xx) one, or a 101.
    pub(super) async fn read_head(
        &mut self,
        head_request: bool,
        mut eof: bool,
    ) -> Result<Head, SendError> {
        let mut received_any = !self.buf.is_empty();
        loop {
            if let Some(head) =
                final_head(&mut self.buf, head_request).map_err(SendError::Failed)?
            {
                return Ok(head);
            }
            let closed = |what: String| {
                if received_any {
                    SendError::Failed(broken(format!("{what} inside the response head")))
                } else {
                    SendError::ClosedBeforeResponse(
                        None,
                        broken(format!("{what} before a response")),
                    )
                }
            };
            if eof {
                return Err(closed("connection closed".into()));
            }
            match poll_fn(|cx| self.poll_fill(cx)).await {
                Ok(0) => eof = true,
                Ok(_) => received_any = true,
                Err(e) => return Err(closed(format!("read failed ({e})"))),
            }
        }
    }
}

/// How the sending of a request ended, for [`H1::answer`].
struct Sent {
    /// The request was written to its end.
    complete: bool,
    /// A final head that came while it was being sent.
    early: Option<Head>,
    /// The upstream closed its side meanwhile.
    eof: bool,
    /// The body was read from (it cannot be replayed).
    polled_body: bool,
    head_request: bool,
}

/// What reading while a request is being sent found ([`H1::poll_early`]).
enum Early {
    /// Nothing to read yet.
    Nothing,
    /// The upstream closed its side.
    Eof,
    /// Bytes that complete no final head yet (an interim head was consumed, or a head is partial).
    Read,
    /// A final response head, before the request was sent in full.
    Head(Head),
    /// An error, or bytes or a close before any of the request was written.
    Failed(Fail),
}

impl H1 {
    /// Reads what the upstream sent while the request is being written (RFC 9112 section 9.5):
    /// interim heads are consumed, a final head is returned. Bytes or a close before any of the
    /// request was written (`sent_any` false) fail the sending as unsent, so the request may be
    /// replayed on another connection.
    fn poll_early(&mut self, cx: &mut Context<'_>, sent_any: bool, head_request: bool) -> Early {
        match self.poll_fill(cx) {
            Poll::Ready(Ok(_)) if !sent_any => Early::Failed(Fail::Io(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "upstream spoke or closed before the request",
            ))),
            Poll::Ready(Ok(0)) => Early::Eof,
            Poll::Ready(Ok(_)) => match self.early_head(head_request) {
                Ok(None) => Early::Read,
                Ok(Some(head)) => Early::Head(head),
                Err(e) => Early::Failed(Fail::Head(e)),
            },
            Poll::Ready(Err(e)) => Early::Failed(Fail::Io(e)),
            Poll::Pending => Early::Nothing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_accept_of_the_rfcs_sample_key_is_the_rfcs() {
        // RFC 6455 section 1.3.
        assert_eq!(
            accept(b"dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn errors_and_switches_end_a_sending_other_heads_wait_for_the_body() {
        for code in [400, 401, 413, 500, 503, 101] {
            assert!(stops_sending(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        for code in [200, 204, 301, 304] {
            assert!(
                !stops_sending(StatusCode::from_u16(code).unwrap()),
                "{code}"
            );
        }
    }

    #[test]
    fn only_a_request_written_whole_to_an_open_connection_can_be_finished_later() {
        assert_eq!(
            awaiting_head(true, false, true),
            Sending::HeadDue { head_request: true }
        );
        assert_eq!(awaiting_head(true, true, false), Sending::Idle);
        assert_eq!(awaiting_head(false, false, false), Sending::Idle);
    }
}
