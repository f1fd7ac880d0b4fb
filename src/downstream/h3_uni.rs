//! The client's unidirectional HTTP/3 streams, their type read before h3 gets them. h3 0.0.8
//! keeps a QPACK encoder or decoder stream (RFC 9204 section 4.2) and never reads from it after
//! its type: quinn then holds what the client sends on it, up to the stream's receive window
//! (1.25 MB), for the connection's life. Two such streams park 2.5 MB per connection, from any
//! client, no token needed. Here each of them is read, and what it carries dropped, by a task
//! of its own (tessera's QPACK is stateless: no dynamic table, RFC 9204 section 3.2.3, so the
//! encoder stream has nothing to tell it; a decoder stream's acknowledgements and
//! cancellations are of no use either), and h3 gets a stand-in that yields the stream's type
//! and then nothing. Every other stream passes whole, its first bytes given back first.
//! Must never: stop a QPACK stream (section 4.2 forbids closing it), or change a byte h3 reads.

use std::future::poll_fn;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use h3::quic::{self, StreamErrorIncoming, StreamId};

/// QPACK's unidirectional stream types (RFC 9204 section 4.2): encoder, decoder.
const QPACK_STREAMS: [u64; 2] = [0x02, 0x03];

/// A unidirectional stream whose type is still being read (at most quinn's limit of them at
/// once, `max_concurrent_uni_streams`).
pub(super) struct Typing {
    inner: h3_quinn::RecvStream,
    /// The bytes read so far.
    read: Vec<u8>,
    /// What the reads came to, once they did.
    outcome: Option<Outcome>,
}

/// What reading a stream's type came to.
enum Outcome {
    /// Its type and the length of its encoding.
    Kind(u64, usize),
    /// It ended or failed first: the last read's result.
    Ended(Result<Option<Bytes>, StreamErrorIncoming>),
}

/// A unidirectional stream as h3 gets it.
pub(super) enum UniStream {
    /// Passed to h3: `first`, the bytes read to learn its type (or how that read ended), before
    /// the rest.
    Passed {
        first: Option<Result<Option<Bytes>, StreamErrorIncoming>>,
        inner: h3_quinn::RecvStream,
    },
    /// A QPACK stream read and dropped elsewhere: its type, then nothing.
    StandIn { id: StreamId, kind: Option<Bytes> },
}

impl Typing {
    pub(super) fn new(inner: h3_quinn::RecvStream) -> Self {
        Self {
            inner,
            read: Vec::new(),
            outcome: None,
        }
    }

    /// Ready once the stream's type is read, or it ended or failed first.
    pub(super) fn poll_typed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        while self.outcome.is_none() {
            match ready!(quic::RecvStream::poll_data(&mut self.inner, cx)) {
                Ok(Some(bytes)) => {
                    self.read.extend_from_slice(&bytes);
                    self.outcome = varint(&self.read).map(|(kind, len)| Outcome::Kind(kind, len));
                }
                ended => self.outcome = Some(Outcome::Ended(ended)),
            }
        }
        Poll::Ready(())
    }

    /// The stream as h3 is to get it ([`Typing::poll_typed`] ready): a QPACK stream's stand-in,
    /// the stream itself read to its end and dropped by a task on the current runtime; any
    /// other passed.
    pub(super) fn sorted(self) -> UniStream {
        let Self {
            mut inner,
            read,
            outcome,
        } = self;
        match outcome {
            Some(Outcome::Kind(kind, len)) if QPACK_STREAMS.contains(&kind) => {
                let id = quic::RecvStream::recv_id(&inner);
                tokio::spawn(async move {
                    // Until the client ends it, or the connection ends.
                    while let Ok(Some(_)) =
                        poll_fn(|cx| quic::RecvStream::poll_data(&mut inner, cx)).await
                    {
                    }
                });
                UniStream::StandIn {
                    id,
                    kind: Some(Bytes::copy_from_slice(&read[..len])),
                }
            }
            // Ended or failed before a byte: h3 is told so (RFC 9114 section 6.2).
            Some(Outcome::Ended(ended)) if read.is_empty() => UniStream::Passed {
                first: Some(ended),
                inner,
            },
            _ => UniStream::Passed {
                first: Some(Ok(Some(Bytes::from(read)))),
                inner,
            },
        }
    }
}

/// A QUIC variable-length integer at the start of `bytes` (RFC 9000 section 16) and its
/// length; `None` while `bytes` holds less than its length.
fn varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let first = *bytes.first()?;
    let len = 1 << (first >> 6);
    let raw = bytes.get(..len)?;
    let value = raw[1..]
        .iter()
        .fold(u64::from(first & 0x3f), |v, &b| (v << 8) | u64::from(b));
    Some((value, len))
}

impl quic::RecvStream for UniStream {
    type Buf = Bytes;

    fn poll_data(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Bytes>, StreamErrorIncoming>> {
        match self {
            Self::Passed { first, inner } => match first.take() {
                Some(first) => Poll::Ready(first),
                None => inner.poll_data(cx),
            },
            // h3 reads nothing after a QPACK stream's type: never woken again is right.
            Self::StandIn { kind, .. } => match kind.take() {
                Some(kind) => Poll::Ready(Ok(Some(kind))),
                None => Poll::Pending,
            },
        }
    }

    fn stop_sending(&mut self, error_code: u64) {
        if let Self::Passed { inner, .. } = self {
            inner.stop_sending(error_code);
        }
    }

    fn recv_id(&self) -> StreamId {
        match self {
            Self::Passed { inner, .. } => inner.recv_id(),
            Self::StandIn { id, .. } => *id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_type_is_read_in_any_of_its_encodings() {
        assert_eq!(varint(&[0x02]), Some((2, 1)));
        assert_eq!(varint(&[0x40, 0x03, 0xff]), Some((3, 2)));
        assert_eq!(varint(&[0x80, 0, 0, 0x02]), Some((2, 4)));
        assert_eq!(varint(&[0xc0, 0, 0, 0, 0, 0, 0]), None, "7 of 8 bytes");
        assert_eq!(varint(&[]), None);
    }
}
