//! Responses on the fast path: the head encoded by tessera (the upstream's raw fields first, as
//! received and screened), the body framed by its exact length when known, else chunked;
//! bodyless for `HEAD`, 204 and 304. Writes wait at most `server.send_timeout_ms` for a client
//! that takes no byte. Must never: frame a body two ways, or keep a connection whose response was
//! cut short.

use std::future::{poll_fn, Future};
use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body::Body;
use tokio::io::AsyncWrite;

use crate::upstream::{ProxyBody, RawHead};

use super::conn::{ClientWatch, Conn};
use super::format::{chunk_size_line, http_date, itoa};
use super::io::Socket;
use crate::stall::Stall;

impl<S: Socket> Conn<S> {
    /// Writes `parts` ([`send`]); `false` when that failed or timed out (then `reset`).
    pub(super) async fn send(&mut self, parts: &[&[u8]]) -> bool {
        match send(&mut self.io, parts, self.send_timeout).await {
            Ok(()) => true,
            Err(stalled) => {
                self.reset |= stalled;
                false
            }
        }
    }

    /// Writes a body's `parts` ([`Conn::send`]), cut short when the body's session ends while
    /// the client is slow to take them: then `false`, and the connection is reset.
    async fn send_body(&mut self, parts: &[&[u8]], body: &mut ProxyBody) -> bool {
        let mut ended = false;
        let sent = {
            let send = self.send(parts);
            tokio::pin!(send);
            poll_fn(|cx| {
                if let Poll::Ready(ok) = send.as_mut().poll(cx) {
                    return Poll::Ready(ok);
                }
                if body.poll_session_end(cx).is_ready() {
                    ended = true;
                    return Poll::Ready(false);
                }
                Poll::Pending
            })
            .await
        };
        if ended {
            tracing::debug!(
                "response body ended with its session while being written; connection reset"
            );
            self.reset = true;
        }
        sent
    }

    /// The body's next data frame ([`next_data`]); `Err` when it cannot go on, and then `reset`
    /// when the body was cut by its session's end.
    async fn next_of(
        &mut self,
        body: &mut ProxyBody,
        watch: &mut ClientWatch,
    ) -> Result<Option<Bytes>, ()> {
        next_data(body, &mut self.io, &mut self.incoming.buf, watch)
            .await
            .map_err(|cut| {
                self.reset |= cut == Cut::SessionEnded;
            })
    }

    /// The body's next data, as [`Conn::next_of`]; while `head` is still held for the first
    /// data, it is sent alone when none is ready now: an event stream's head must not wait for
    /// its first event (an `EventSource` stays connecting, clients with a header timeout
    /// reconnect), as hyper sends it too. For chunked bodies, where event streams are. `Err`
    /// also when that write fails.
    async fn next_after_head(
        &mut self,
        body: &mut ProxyBody,
        watch: &mut ClientWatch,
        head: &mut Option<Vec<u8>>,
    ) -> Result<Option<Bytes>, ()> {
        if let Some(h) = head.take() {
            // Polled once: a pending poll takes nothing from the body or the client.
            let now = futures_util::FutureExt::now_or_never(self.next_of(body, watch));
            if let Some(ready) = now {
                *head = Some(h);
                return ready;
            }
            let sent = self.send(&[&h[..]]).await;
            self.out = h;
            if !sent {
                return Err(());
            }
        }
        self.next_of(body, watch).await
    }

    /// Writes the response; `false` when the connection cannot carry another request (a write
    /// failed, or the body ended early, failed or ran long).
    pub(super) async fn write_response(
        &mut self,
        resp: Response<ProxyBody>,
        head: bool,
        close: bool,
        watch: &mut ClientWatch,
    ) -> bool {
        let (mut parts, mut body) = resp.into_parts();
        let status = parts.status;
        let framing =
            if head || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
                Framing::Bodyless
            } else {
                match body.size_hint().exact() {
                    Some(n) => Framing::Length(n),
                    None => Framing::Chunked,
                }
            };
        let local = matches!(body, ProxyBody::Full(_));
        let fields = body.take_fields();
        // Not for the upstream's answer whose fields were moved to the map (a repointed
        // redirect): its body is empty as sent to a HEAD, not as its GET would be.
        if head && local && !parts.headers.contains_key(header::CONTENT_LENGTH) {
            // A local answer to HEAD states the length its GET would have, as hyper did.
            if let Some(n) = body.size_hint().exact() {
                parts
                    .headers
                    .insert(header::CONTENT_LENGTH, HeaderValue::from(n));
            }
        }
        encode_head(
            &mut self.out,
            status,
            fields.as_ref(),
            &parts.headers,
            framing,
            close,
        );
        match framing {
            Framing::Bodyless | Framing::Length(0) => {
                drop(body);
                let out = std::mem::take(&mut self.out);
                let ok = self.send(&[&out]).await;
                self.out = out;
                ok
            }
            Framing::Length(n) => self.write_sized(body, n, watch).await,
            Framing::Chunked => self.write_chunked(&mut body, watch).await,
        }
    }

    /// A body of exactly `n` bytes, its first frame in the head's write. (A sized body is a
    /// download, not an event stream: its head waits for its first bytes rather than cost a
    /// write of its own when they come a moment later.)
    async fn write_sized(&mut self, mut body: ProxyBody, n: u64, watch: &mut ClientWatch) -> bool {
        let mut head = Some(std::mem::take(&mut self.out));
        let mut left = n;
        let complete = loop {
            let data = match self.next_of(&mut body, watch).await {
                Ok(Some(d)) => d,
                Ok(None) => break left == 0,
                Err(()) => break false,
            };
            if data.len() as u64 > left {
                tracing::debug!("response body longer than its length; connection closed");
                break false;
            }
            left -= data.len() as u64;
            let sent = match head.take() {
                Some(h) => {
                    let ok = self.send_body(&[&h[..], &data[..]], &mut body).await;
                    self.out = h;
                    ok
                }
                None => self.send_body(&[&data[..]], &mut body).await,
            };
            if !sent {
                return false;
            }
        };
        if let Some(h) = head {
            // The body ended before its first byte: the head alone, then the connection closes.
            let _ = self.send(&[&h[..]]).await;
            self.out = h;
        }
        if !complete {
            tracing::debug!("response body ended before its length; connection closed");
        }
        complete
    }

    /// A body of unknown length, chunked (RFC 9112 section 7.1); the head goes with the first
    /// chunk when it is ready.
    async fn write_chunked(&mut self, body: &mut ProxyBody, watch: &mut ClientWatch) -> bool {
        let mut head = Some(std::mem::take(&mut self.out));
        loop {
            let data = match self.next_after_head(body, watch, &mut head).await {
                Ok(Some(d)) if d.is_empty() => continue,
                Ok(Some(d)) => d,
                Ok(None) => break,
                Err(()) => {
                    if let Some(h) = head {
                        let _ = self.send(&[&h[..]]).await;
                        self.out = h;
                    }
                    return false;
                }
            };
            let mut size = [0u8; 18];
            let size = chunk_size_line(data.len(), &mut size);
            let h = head.take().unwrap_or_default();
            let parts = [&h[..], size, &data[..], b"\r\n"];
            let ok = self.send_body(&parts, body).await;
            if !h.is_empty() {
                self.out = h;
            }
            if !ok {
                return false;
            }
        }
        let h = head.take().unwrap_or_default();
        let ok = self.send(&[&h[..], b"0\r\n\r\n"]).await;
        if !h.is_empty() {
            self.out = h;
        }
        ok
    }
}

/// Why a response body did not go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// The client went away while the body waited.
    Gone,
    /// The body failed (the upstream broke off, or a frame was wrong).
    Failed,
    /// The body was ended by its session's end ([`crate::session::Ended`]: revoked, expired).
    SessionEnded,
}

/// The next data frame of `body` (trailers are dropped: HTTP/1.1 clients did not ask for them);
/// `Err` when the body failed or was ended, or when the client on `io` went away while waiting
/// for it (`watch`).
async fn next_data<S: Socket>(
    body: &mut ProxyBody,
    io: &mut S,
    read_buf: &mut bytes::BytesMut,
    watch: &mut ClientWatch,
) -> Result<Option<Bytes>, Cut> {
    loop {
        let frame = poll_fn(|cx| match Pin::new(&mut *body).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(Ok(frame)),
            Poll::Pending => watch.poll_gone(io, read_buf, cx).map(Err),
        })
        .await;
        let Ok(frame) = frame else {
            tracing::debug!("client closed the connection during the response body");
            return Err(Cut::Gone);
        };
        match frame {
            None => return Ok(None),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    return Ok(Some(data));
                }
            }
            Some(Err(e)) if e.is::<crate::session::Ended>() => {
                tracing::debug!(cause = %e, "response body ended with its session; connection reset");
                return Err(Cut::SessionEnded);
            }
            Some(Err(e)) => {
                tracing::debug!(cause = %e, "response body failed; connection closed");
                return Err(Cut::Failed);
            }
        }
    }
}

/// Writes every slice (at most 4), in as few `writev` calls as the socket takes. `Err(false)`
/// when a write fails; `Err(true)` when the client takes no byte for `stall`
/// (`server.send_timeout_ms`, counted from a write the socket's full send buffer could not take,
/// and again after every write it took: nginx's `send_timeout`). The timer is made only when
/// the send buffer is full, so a response the kernel takes whole costs none. Then flushes (TLS
/// records held back; nothing on TCP), under the same timeout.
async fn send<W: AsyncWrite + Unpin>(
    io: &mut W,
    parts: &[&[u8]],
    stall: Duration,
) -> Result<(), bool> {
    let mut bufs = [IoSlice::new(&[]); 4];
    let mut n = 0;
    for p in parts.iter().filter(|p| !p.is_empty()) {
        bufs[n] = IoSlice::new(p);
        n += 1;
    }
    let mut bufs = &mut bufs[..n];
    let mut timer = Stall::default();
    poll_fn(|cx| {
        while !bufs.is_empty() {
            match Pin::new(&mut *io).poll_write_vectored(cx, bufs) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(Err(false)),
                Poll::Ready(Ok(written)) => {
                    IoSlice::advance_slices(&mut bufs, written);
                    timer.progress();
                }
                Poll::Pending => return stalled(&mut timer, stall, cx),
            }
        }
        match Pin::new(&mut *io).poll_flush(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(())),
            Poll::Ready(Err(_)) => Poll::Ready(Err(false)),
            Poll::Pending => stalled(&mut timer, stall, cx),
        }
    })
    .await
}

/// A write the client did not take: `Err(true)` once `stall` has passed since the last progress.
fn stalled(timer: &mut Stall, stall: Duration, cx: &mut Context<'_>) -> Poll<Result<(), bool>> {
    if timer.poll_expired(stall, cx) {
        tracing::debug!(
            "client took no response bytes for server.send_timeout_ms; connection reset"
        );
        return Poll::Ready(Err(true));
    }
    Poll::Pending
}

#[derive(Clone, Copy)]
enum Framing {
    Bodyless,
    Length(u64),
    Chunked,
}

/// The status line and header section: the upstream's raw `fields` (as received, already
/// screened), then `headers`. tessera's own framing fields replace any there (a bodyless answer
/// keeps `Content-Length`, which then describes the representation, except on 204 where RFC 9110
/// section 8.6 forbids it). Adds `Date` when missing, as hyper did.
fn encode_head(
    out: &mut Vec<u8>,
    status: StatusCode,
    fields: Option<&RawHead>,
    headers: &HeaderMap,
    framing: Framing,
    close: bool,
) {
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let keep_length = matches!(framing, Framing::Bodyless) && status != StatusCode::NO_CONTENT;
    // This writer frames the body and says whether the connection stays open.
    let passed = |name: &[u8]| {
        !(name.eq_ignore_ascii_case(b"transfer-encoding")
            || (name.eq_ignore_ascii_case(b"content-length") && !keep_length)
            || name.eq_ignore_ascii_case(b"connection"))
    };
    if let Some(fields) = fields {
        fields.write_lines(out, passed);
    }
    for (name, value) in headers {
        if passed(name.as_str().as_bytes()) {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
    }
    match framing {
        Framing::Bodyless => {}
        Framing::Length(n) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa(n, &mut [0; 20]));
            out.extend_from_slice(b"\r\n");
        }
        Framing::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    if !headers.contains_key(header::DATE) && !fields.is_some_and(|f| f.contains(b"date")) {
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(&http_date());
        out.extend_from_slice(b"\r\n");
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderName;

    #[test]
    fn head_framing_fields_are_tesseras_own() {
        let h: HeaderMap = [
            ("content-length", "999"),
            ("transfer-encoding", "chunked"),
            ("connection", "keep-alive"),
            ("date", "Sat, 21 Nov 2026 00:00:00 GMT"),
            ("x-a", "1"),
        ]
        .into_iter()
        .map(|(k, v)| (HeaderName::from_static(k), HeaderValue::from_static(v)))
        .collect();
        let text = |status, framing, close| {
            let mut out = Vec::new();
            encode_head(&mut out, status, None, &h, framing, close);
            String::from_utf8(out).unwrap()
        };
        assert_eq!(
            text(StatusCode::OK, Framing::Length(5), false),
            "HTTP/1.1 200 OK\r\ndate: Sat, 21 Nov 2026 00:00:00 GMT\r\nx-a: 1\r\ncontent-length: 5\r\n\r\n"
        );
        assert_eq!(
            text(StatusCode::OK, Framing::Chunked, true),
            "HTTP/1.1 200 OK\r\ndate: Sat, 21 Nov 2026 00:00:00 GMT\r\nx-a: 1\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        );
        // HEAD / 304 keep the representation's length; 204 may not carry one.
        assert!(text(StatusCode::NOT_MODIFIED, Framing::Bodyless, false)
            .contains("content-length: 999\r\n"));
        assert!(!text(StatusCode::NO_CONTENT, Framing::Bodyless, false).contains("content-length"));
        let mut out = Vec::new();
        encode_head(
            &mut out,
            StatusCode::BAD_GATEWAY,
            None,
            &HeaderMap::new(),
            Framing::Length(0),
            false,
        );
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\ndate: "),
            "{text}"
        );
        assert!(text.ends_with(" GMT\r\n\r\n") && text.len() == 84, "{text}");
    }

    #[test]
    fn raw_upstream_fields_go_first_as_received_minus_framing() {
        let raw = crate::upstream::raw::from_pairs(&[
            ("Server", "up"),
            ("Content-Length", "999"),
            ("Transfer-Encoding", "chunked"),
            ("Connection", "keep-alive"),
            ("Date", "Sat, 21 Nov 2026 00:00:00 GMT"),
        ]);
        let mut map = HeaderMap::new();
        map.insert("x-local", HeaderValue::from_static("1"));
        let mut out = Vec::new();
        encode_head(
            &mut out,
            StatusCode::OK,
            Some(&raw),
            &map,
            Framing::Length(3),
            false,
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 200 OK\r\nServer: up\r\nDate: Sat, 21 Nov 2026 00:00:00 GMT\r\nx-local: 1\r\ncontent-length: 3\r\n\r\n"
        );
    }
}
