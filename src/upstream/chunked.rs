//! Response bodies as framed on the wire: `Content-Length`, close-delimited, or chunked (RFC 9112
//! section 7.1, chunk extensions ignored, trailers dropped). Must never: pass a byte past a
//! body's end, or accept a chunk-size line over its bound.

use std::task::Poll;

use bytes::{Buf, Bytes, BytesMut};
use http::header::HeaderName;
use http::{HeaderMap, HeaderValue};
use http_body::Frame;

use super::BoxError;

use super::codec::{find_crlf, MAX_HEADERS};
use super::conn::{Chunk, Framing, MAX_HEAD};

/// Longest chunk-size line (size + extensions), bytes.
const MAX_CHUNK_LINE: usize = 4096;

/// The next body frame from the bytes in `buf`, consuming them and advancing `framing`:
/// `Ready(None)` once the body ended (then `framing` is [`Framing::Done`]), `Pending` when more
/// bytes are needed. Errors: the chunked coding is malformed.
pub(crate) fn decode_body(
    buf: &mut BytesMut,
    framing: &mut Framing,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    loop {
        match *framing {
            Framing::Done => return Poll::Ready(None),
            Framing::Length(left) => {
                if buf.is_empty() {
                    return Poll::Pending;
                }
                let n = (buf.len() as u64).min(left) as usize;
                *framing = match left - n as u64 {
                    0 => Framing::Done,
                    left => Framing::Length(left),
                };
                return Poll::Ready(Some(Ok(Frame::data(buf.split_to(n).freeze()))));
            }
            Framing::Close => {
                if buf.is_empty() {
                    return Poll::Pending;
                }
                return Poll::Ready(Some(Ok(Frame::data(buf.split().freeze()))));
            }
            Framing::Chunked(state) => match chunk_step(buf, state) {
                Ok(Step::Next(next)) => *framing = next,
                Ok(Step::Data(data, next)) => {
                    *framing = next;
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(Step::Trailers(trailers)) => {
                    *framing = Framing::Done;
                    return Poll::Ready(trailers.map(|t| Ok(Frame::trailers(t))));
                }
                Ok(Step::More) => return Poll::Pending,
                Err(e) => return Poll::Ready(Some(Err(e.into()))),
            },
        }
    }
}

/// What the end of the connection means for a body in `framing` that [`decode_body`] could take
/// no further: the end of a close-delimited body, else an error (the body was cut short).
pub(crate) fn body_eof(framing: &mut Framing) -> Option<Result<Frame<Bytes>, BoxError>> {
    match *framing {
        Framing::Close | Framing::Done => {
            *framing = Framing::Done;
            None
        }
        _ => Some(Err(
            "upstream closed the connection before the body's end".into()
        )),
    }
}

/// One step of the chunked decoder over the buffered bytes.
fn chunk_step(buf: &mut BytesMut, state: Chunk) -> Result<Step, String> {
    match state {
        Chunk::Size => {
            let end = match find_crlf(buf) {
                Some(end) if end <= MAX_CHUNK_LINE => end,
                None if buf.len() <= MAX_CHUNK_LINE => return Ok(Step::More),
                _ => return Err("chunk-size line too long".into()),
            };
            let size = chunk_size(&buf[..end])?;
            buf.advance(end + 2);
            Ok(Step::Next(Framing::Chunked(if size == 0 {
                Chunk::Trailers
            } else {
                Chunk::Data(size)
            })))
        }
        Chunk::Data(left) => {
            if buf.is_empty() {
                return Ok(Step::More);
            }
            let n = (buf.len() as u64).min(left) as usize;
            let next = match left - n as u64 {
                0 => Chunk::DataEnd,
                left => Chunk::Data(left),
            };
            Ok(Step::Data(buf.split_to(n).freeze(), Framing::Chunked(next)))
        }
        Chunk::DataEnd => {
            if buf.len() < 2 {
                return Ok(Step::More);
            }
            if &buf[..2] != b"\r\n" {
                return Err("chunk data not followed by CRLF".into());
            }
            buf.advance(2);
            Ok(Step::Next(Framing::Chunked(Chunk::Size)))
        }
        Chunk::Trailers => {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            match httparse::parse_headers(buf, &mut headers) {
                Ok(httparse::Status::Complete((len, fields))) => {
                    let mut map = HeaderMap::new();
                    for h in fields.iter().filter(|h| !connection_or_framing(h.name)) {
                        if let (Ok(name), Ok(value)) = (
                            HeaderName::from_bytes(h.name.as_bytes()),
                            HeaderValue::from_bytes(h.value),
                        ) {
                            map.append(name, value);
                        }
                    }
                    buf.advance(len);
                    Ok(Step::Trailers((!map.is_empty()).then_some(map)))
                }
                Ok(httparse::Status::Partial) if buf.len() <= MAX_HEAD => Ok(Step::More),
                Ok(httparse::Status::Partial) => Err("trailer section too large".into()),
                Err(e) => Err(format!("invalid trailer section: {e}")),
            }
        }
    }
}

/// A trailer field that is the connection's or the message framing's, never the response's:
/// hop-by-hop fields, which HTTP/2 and HTTP/3 refuse outright (a trailer with one would reset a
/// stream whose data all arrived, RFC 9113 section 8.2.2), and `Content-Length` and `Host`,
/// which a trailer must not carry (RFC 9110 section 6.5.1). Dropped.
pub(crate) fn connection_or_framing(name: &str) -> bool {
    crate::fields::HOP_BY_HOP
        .iter()
        .chain(&["content-length", "host"])
        .any(|n| name.eq_ignore_ascii_case(n))
}

/// What one step of the chunked decoder produced.
enum Step {
    /// A new state; keep decoding.
    Next(Framing),
    /// Chunk data and the state after it.
    Data(Bytes, Framing),
    /// The body ended, with its trailer fields if any.
    Trailers(Option<HeaderMap>),
    /// More bytes are needed.
    More,
}

/// `chunk-size [ chunk-ext ]` (RFC 9112 section 7.1): hex digits, then nothing, or whitespace
/// or `;` starting extensions (ignored).
fn chunk_size(line: &[u8]) -> Result<u64, String> {
    if line.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f) {
        return Err("invalid chunk size".into());
    }
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || digits > 16 {
        return Err("invalid chunk size".into());
    }
    match line.get(digits) {
        None | Some(b';' | b' ' | b'\t') => {}
        Some(_) => return Err("invalid chunk size".into()),
    }
    let text = std::str::from_utf8(&line[..digits]).map_err(|_| "invalid chunk size")?;
    u64::from_str_radix(text, 16).map_err(|_| "invalid chunk size".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_size_lines() {
        assert_eq!(chunk_size(b"1a").unwrap(), 26);
        assert_eq!(chunk_size(b"0").unwrap(), 0);
        assert_eq!(chunk_size(b"A;name=value").unwrap(), 10);
        assert_eq!(chunk_size(b"a \t; x").unwrap(), 10);
        for bad in [
            &b""[..],
            b"g",
            b";",
            b"-1",
            b"1x",
            b"11111111111111111",
            b"a;x\ry",
            b"a;\n",
        ] {
            assert!(chunk_size(bad).is_err(), "{bad:?}");
        }
        assert_eq!(chunk_size(b"ffffffffffffffff").unwrap(), u64::MAX);
    }

    #[test]
    fn trailers_keep_the_responses_fields_and_drop_the_connections() {
        let mut buf = BytesMut::from(
            &b"Server-Timing: db;dur=5\r\nKeep-Alive: timeout=5\r\nConnection: close\r\n\
               content-length: 9\r\nX-Checksum: abc\r\n\r\n"[..],
        );
        let Ok(Step::Trailers(Some(map))) = chunk_step(&mut buf, Chunk::Trailers) else {
            panic!("no trailers");
        };
        let names: Vec<&str> = map.keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["server-timing", "x-checksum"]);
        assert!(buf.is_empty());
        let mut only = BytesMut::from(&b"Upgrade: h2c\r\n\r\n"[..]);
        assert!(matches!(
            chunk_step(&mut only, Chunk::Trailers),
            Ok(Step::Trailers(None))
        ));
    }
}
