//! A guard between h3 and quinn that bounds what h3 holds of one client frame. h3 0.0.8 keeps a
//! frame other than DATA in memory until the whole length it declares has arrived, whatever
//! that length (its `Frame::decode`), and checks a HEADERS frame against the field section limit
//! only once it is complete: a client declaring a frame of 2^62 bytes on its control stream
//! could grow the process's memory at its line rate for as long as it liked, no token needed.
//! The guard reads the frame headers as the bytes go by (RFC 9114 section 7.1: type and length,
//! each a variable-length integer) and refuses the first frame other than DATA that declares
//! more than its stream's limit with `H3_EXCESSIVE_LOAD` (section 8.1): on the control stream
//! the connection is closed; on a request stream only that stream is stopped, and its limit is
//! twice the field section limit, so that a head somewhat over it still reaches h3, which
//! answers it 431 as before. DATA payload is never held (h3 hands it on as it arrives) and
//! passes unchecked.

use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use h3::quic::{self, ConnectionErrorIncoming, StreamErrorIncoming, StreamId, WriteBuf};

use super::h3_uni::{Typing, UniStream};

/// HTTP/3's code for a peer that causes excessive load (RFC 9114 section 8.1).
const H3_EXCESSIVE_LOAD: u32 = 0x107;

/// h3-quinn's connection (`C` = [`h3_quinn::Connection`], what the server is built on) or its
/// stream opener (`C` = [`h3_quinn::OpenStreams`], which h3 asks the connection for), with the
/// streams it accepts or opens [`Guarded`].
pub(super) struct Guarding<C> {
    inner: C,
    guard: Guard,
    /// Unidirectional streams accepted, their type not yet read (the connection's only).
    typing: Vec<Typing>,
}

/// The connection h3 serves on.
pub(super) type GuardedConnection = Guarding<h3_quinn::Connection>;

impl GuardedConnection {
    /// `max_field_section`: the field section limit h3 applies (a HEADERS frame's QPACK
    /// encoding is never longer than the size the limit counts, RFC 9114 section 4.2.2).
    pub(super) fn new(conn: quinn::Connection, max_field_section: u64) -> Self {
        Self {
            inner: h3_quinn::Connection::new(conn.clone()),
            guard: Guard {
                conn,
                max_field_section,
            },
            typing: Vec::new(),
        }
    }
}

/// What guarding a stream takes: the connection to close, and the limit.
#[derive(Clone)]
struct Guard {
    conn: quinn::Connection,
    max_field_section: u64,
}

impl Guard {
    fn guard<S>(&self, inner: S, frames: Frames) -> Guarded<S> {
        Guarded {
            inner,
            frames,
            conn: self.conn.clone(),
        }
    }

    /// A request stream's frame reader.
    fn request(&self) -> Frames {
        Frames::request(request_limit(self.max_field_section))
    }
}

impl<B: Buf> quic::Connection<B> for GuardedConnection {
    type RecvStream = Guarded<UniStream>;
    type OpenStreams = Guarding<h3_quinn::OpenStreams>;

    /// The next unidirectional stream whose type is read ([`super::h3_uni`]).
    fn poll_accept_recv(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::RecvStream, ConnectionErrorIncoming>> {
        while let Poll::Ready(recv) = quic::Connection::<B>::poll_accept_recv(&mut self.inner, cx) {
            self.typing.push(Typing::new(recv?));
        }
        let Some(i) = (self.typing.iter_mut()).position(|t| t.poll_typed(cx).is_ready()) else {
            return Poll::Pending;
        };
        let recv = self.typing.swap_remove(i).sorted();
        let frames = Frames::unidirectional(self.guard.max_field_section);
        Poll::Ready(Ok(self.guard.guard(recv, frames)))
    }

    fn poll_accept_bidi(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::BidiStream, ConnectionErrorIncoming>> {
        let bidi = ready!(quic::Connection::<B>::poll_accept_bidi(&mut self.inner, cx))?;
        Poll::Ready(Ok(self.guard.guard(bidi, self.guard.request())))
    }

    fn opener(&self) -> Self::OpenStreams {
        Guarding {
            inner: quic::Connection::<B>::opener(&self.inner),
            guard: self.guard.clone(),
            typing: Vec::new(),
        }
    }
}

impl<B: Buf, C> quic::OpenStreams<B> for Guarding<C>
where
    C: quic::OpenStreams<
        B,
        BidiStream = h3_quinn::BidiStream<B>,
        SendStream = h3_quinn::SendStream<B>,
    >,
{
    type BidiStream = Guarded<h3_quinn::BidiStream<B>>;
    type SendStream = h3_quinn::SendStream<B>;

    fn poll_open_bidi(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::BidiStream, StreamErrorIncoming>> {
        let bidi = ready!(self.inner.poll_open_bidi(cx))?;
        Poll::Ready(Ok(self.guard.guard(bidi, self.guard.request())))
    }

    fn poll_open_send(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::SendStream, StreamErrorIncoming>> {
        self.inner.poll_open_send(cx)
    }

    fn close(&mut self, code: h3::error::Code, reason: &[u8]) {
        self.inner.close(code, reason);
    }
}

/// The limit of a request stream's frames: twice the field section limit, and 1 KiB.
fn request_limit(max_field_section: u64) -> u64 {
    max_field_section.saturating_mul(2).saturating_add(1024)
}

/// A stream whose incoming frames are checked by [`Frames`]: past the limit, h3 gets an error
/// instead of the bytes, and the stream (a request's) or the connection is ended.
pub(super) struct Guarded<S> {
    inner: S,
    frames: Frames,
    conn: quinn::Connection,
}

/// How a guarded stream ends when its frames are refused.
trait Refuse {
    fn refuse(&mut self, code: u64);
}

/// A unidirectional stream: the connection is closed (by [`Guarded`]); a QPACK stream's
/// stand-in is never read past its type.
impl Refuse for UniStream {
    fn refuse(&mut self, code: u64) {
        quic::RecvStream::stop_sending(self, code);
    }
}

/// A request's receive half alone (its body, the answer under way): told to stop sending.
impl Refuse for h3_quinn::RecvStream {
    fn refuse(&mut self, code: u64) {
        quic::RecvStream::stop_sending(self, code);
    }
}

/// A request stream still whole (its head): reset as well, or h3, dropping it, would end the
/// client's answer with no head at all (an empty, malformed response).
impl<B: Buf> Refuse for h3_quinn::BidiStream<B> {
    fn refuse(&mut self, code: u64) {
        quic::RecvStream::stop_sending(self, code);
        quic::SendStream::<B>::reset(self, code);
    }
}

impl<S: quic::RecvStream<Buf = Bytes> + Refuse> quic::RecvStream for Guarded<S> {
    type Buf = Bytes;

    fn poll_data(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Bytes>, StreamErrorIncoming>> {
        let data = ready!(self.inner.poll_data(cx))?;
        let Some(bytes) = &data else {
            return Poll::Ready(Ok(data));
        };
        if self.frames.read(bytes).is_ok() {
            return Poll::Ready(Ok(data));
        }
        let code = H3_EXCESSIVE_LOAD.into();
        if self.frames.request {
            self.inner.refuse(code);
            return Poll::Ready(Err(StreamErrorIncoming::StreamTerminated {
                error_code: code,
            }));
        }
        self.conn.close(
            quinn::VarInt::from_u32(H3_EXCESSIVE_LOAD),
            b"frame too large",
        );
        Poll::Ready(Err(StreamErrorIncoming::ConnectionErrorIncoming {
            connection_error: ConnectionErrorIncoming::ApplicationClose { error_code: code },
        }))
    }

    fn stop_sending(&mut self, error_code: u64) {
        self.inner.stop_sending(error_code);
    }

    fn recv_id(&self) -> StreamId {
        self.inner.recv_id()
    }
}

impl<B: Buf> quic::SendStream<B> for Guarded<h3_quinn::BidiStream<B>> {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        self.inner.poll_ready(cx)
    }

    fn send_data<T: Into<WriteBuf<B>>>(&mut self, data: T) -> Result<(), StreamErrorIncoming> {
        self.inner.send_data(data)
    }

    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        self.inner.poll_finish(cx)
    }

    fn reset(&mut self, reset_code: u64) {
        self.inner.reset(reset_code);
    }

    fn send_id(&self) -> StreamId {
        self.inner.send_id()
    }
}

impl<B: Buf> quic::BidiStream<B> for Guarded<h3_quinn::BidiStream<B>> {
    type SendStream = h3_quinn::SendStream<B>;
    type RecvStream = Guarded<h3_quinn::RecvStream>;

    fn split(self) -> (Self::SendStream, Self::RecvStream) {
        let (send, recv) = self.inner.split();
        let recv = Guarded {
            inner: recv,
            frames: self.frames,
            conn: self.conn,
        };
        (send, recv)
    }
}

/// Where a stream's reader is in its frames (RFC 9114 section 7.1).
#[derive(Debug, PartialEq)]
enum At {
    /// A variable-length integer (RFC 9000 section 16), `have` of its `need` bytes read.
    Varint {
        field: Field,
        value: u64,
        have: u8,
        need: u8,
    },
    /// Inside a frame's payload, `left` bytes of it to come.
    Payload { left: u64 },
    /// No more frames to read: a unidirectional stream other than the control stream (h3
    /// reads only its type), or a WebTransport stream (no length).
    Opaque,
}

/// Which integer [`At::Varint`] is reading.
#[derive(Debug, PartialEq, Clone, Copy)]
enum Field {
    StreamType,
    FrameType,
    Length { frame_type: u64 },
}

/// The frame reader of one stream.
#[derive(Debug)]
pub(super) struct Frames {
    at: At,
    max_frame: u64,
    /// A request stream's (else a unidirectional stream's).
    request: bool,
}

/// A frame other than DATA longer than the limit.
#[derive(Debug, PartialEq)]
pub(super) struct TooLarge;

const DATA: u64 = 0x0;
const CONTROL_STREAM: u64 = 0x0;
/// A WebTransport bidirectional stream's signal: a frame type with no length after it.
const WEBTRANSPORT_STREAM: u64 = 0x41;

impl Frames {
    /// A request stream's: frames from its first byte.
    pub(super) fn request(max_frame: u64) -> Self {
        Self {
            request: true,
            ..Self::at(Field::FrameType, max_frame)
        }
    }

    /// A unidirectional stream's: its type first; frames follow on the control stream only.
    pub(super) fn unidirectional(max_frame: u64) -> Self {
        Self::at(Field::StreamType, max_frame)
    }

    fn at(field: Field, max_frame: u64) -> Self {
        let at = At::Varint {
            field,
            value: 0,
            have: 0,
            need: 1,
        };
        Self {
            at,
            max_frame,
            request: false,
        }
    }

    /// Reads the next bytes of the stream. Errors: a frame other than DATA declares a length
    /// over the limit (the caller closes the connection; the reader is not to be used again).
    pub(super) fn read(&mut self, mut bytes: &[u8]) -> Result<(), TooLarge> {
        while let Some((&first, rest)) = bytes.split_first() {
            match &mut self.at {
                At::Opaque => return Ok(()),
                At::Payload { left } => {
                    let n = bytes
                        .len()
                        .min(usize::try_from(*left).unwrap_or(usize::MAX));
                    *left -= n as u64;
                    bytes = &bytes[n..];
                    if *left == 0 {
                        self.at = Self::at(Field::FrameType, 0).at;
                    }
                }
                At::Varint {
                    field,
                    value,
                    have,
                    need,
                } => {
                    if *have == 0 {
                        *need = 1 << (first >> 6);
                        *value = u64::from(first & 0x3f);
                    } else {
                        *value = *value << 8 | u64::from(first);
                    }
                    *have += 1;
                    bytes = rest;
                    if have == need {
                        let (field, value) = (*field, *value);
                        self.at = self.next(field, value)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Where the reader goes once `field` has been read as `value`.
    fn next(&self, field: Field, value: u64) -> Result<At, TooLarge> {
        let varint = |field| Self::at(field, 0).at;
        Ok(match field {
            Field::StreamType if value == CONTROL_STREAM => varint(Field::FrameType),
            Field::StreamType => At::Opaque,
            Field::FrameType if value == WEBTRANSPORT_STREAM => At::Opaque,
            Field::FrameType => varint(Field::Length { frame_type: value }),
            Field::Length { frame_type } if frame_type != DATA && value > self.max_frame => {
                return Err(TooLarge)
            }
            Field::Length { .. } if value == 0 => varint(Field::FrameType),
            Field::Length { .. } => At::Payload { left: value },
        })
    }
}

#[cfg(test)]
#[path = "h3_guard_tests.rs"]
mod tests;
