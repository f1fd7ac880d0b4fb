//! HTTP/3 written and read by hand on a bare QUIC connection, for what the h3 client does not
//! show: the stream id in a server's GOAWAY (RFC 9114 section 5.2). Requests use only QPACK's
//! static table and literals (RFC 9204 section 4.5), so no encoder stream is needed.

use quinn::{Connection, RecvStream, SendStream};

/// A QUIC variable-length integer (RFC 9000 section 16).
fn varint(v: u64, out: &mut Vec<u8>) {
    match v {
        0..=63 => out.push(v as u8),
        64..=16_383 => out.extend_from_slice(&(v as u16 | 0x4000).to_be_bytes()),
        _ => out.extend_from_slice(&(v as u32 | 0x8000_0000).to_be_bytes()),
    }
}

/// A QPACK prefixed integer (RFC 9204 section 4.1.1, as HPACK's): `first` holds the pattern
/// bits above a `bits`-bit prefix.
fn prefixed(first: u8, bits: u32, v: usize, out: &mut Vec<u8>) {
    let max = (1usize << bits) - 1;
    if v < max {
        return out.push(first | v as u8);
    }
    out.push(first | max as u8);
    let mut rest = v - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// A literal field line naming static entry `index` (section 4.5.4), value not Huffman-coded.
fn literal(index: usize, value: &str, out: &mut Vec<u8>) {
    prefixed(0x50, 4, index, out);
    prefixed(0x00, 7, value.len(), out);
    out.extend_from_slice(value.as_bytes());
}

/// Opens the client's control stream (an empty SETTINGS) and sends `GET path` with a bearer
/// `token` on a new request stream, its sending side finished. Keep the returned control
/// stream: closing it is a connection error.
pub async fn get(conn: &Connection, path: &str, token: &str) -> (SendStream, RecvStream) {
    request(conn, 17, path, token, &[], &[]).await
}

/// A DATA frame for each of `parts` (empty ones too, RFC 9114 section 7.2.1), one after another.
pub fn data_frames(parts: &[&[u8]]) -> Vec<u8> {
    let mut frames = Vec::new();
    for part in parts {
        frames.push(0x00); // DATA
        varint(part.len() as u64, &mut frames);
        frames.extend_from_slice(part);
    }
    frames
}

/// [`get`] for `POST path`, with `fields` (static entry index, value) after the authorization
/// and `tail` after the HEADERS frame as it is (e.g. [`data_frames`]).
pub async fn post(
    conn: &Connection,
    path: &str,
    token: &str,
    fields: &[(usize, &str)],
    tail: &[u8],
) -> (SendStream, RecvStream) {
    request(conn, 20, path, token, fields, tail).await
}

/// A request with the static table's `:method` entry `method` (17 GET, 20 POST).
async fn request(
    conn: &Connection,
    method: u8,
    path: &str,
    token: &str,
    more: &[(usize, &str)],
    tail: &[u8],
) -> (SendStream, RecvStream) {
    let mut control = conn.open_uni().await.unwrap();
    control.write_all(&[0x00, 0x04, 0x00]).await.unwrap();
    let mut fields = vec![0x00, 0x00]; // required insert count 0, base 0
    fields.push(0xC0 | method); // :method
    fields.push(0xC0 | 23); // :scheme https
    literal(0, "localhost", &mut fields); // :authority
    literal(1, path, &mut fields); // :path
    literal(84, &format!("Bearer {token}"), &mut fields); // authorization
    for (index, value) in more {
        literal(*index, value, &mut fields);
    }
    let mut frames = vec![0x01]; // HEADERS
    varint(fields.len() as u64, &mut frames);
    frames.extend_from_slice(&fields);
    frames.extend_from_slice(tail);
    let (mut send, recv) = conn.open_bi().await.unwrap();
    send.write_all(&frames).await.unwrap();
    send.finish().unwrap();
    (control, recv)
}

/// Opens the client's control stream and a request stream holding the first 5 bytes of a
/// HEADERS frame announced as 100 bytes long, never finished (a client stalling its head).
pub async fn partial_head(conn: &Connection) -> (SendStream, SendStream) {
    let mut control = conn.open_uni().await.unwrap();
    control.write_all(&[0x00, 0x04, 0x00]).await.unwrap();
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(&[0x01, 0x40, 100, 0x00, 0x00, 0xC0 | 17, 0xC0 | 23])
        .await
        .unwrap();
    (control, send)
}

/// Opens the client's control stream with an empty SETTINGS and then sends a frame announced
/// as 1 GiB long, up to `bytes` of its payload: a reserved frame (type 0x21, RFC 9114 section
/// 7.2.8) on the control stream itself, or a HEADERS frame on a request stream when `request`.
/// The streams sent on, the request stream's receive half when `request` (the frame's own
/// write may have been refused: the server stops it early), or the error that ended the
/// setting up.
pub async fn oversized_frame(
    conn: &Connection,
    request: bool,
    bytes: usize,
) -> Result<(Vec<SendStream>, Option<RecvStream>), String> {
    let e = |e: quinn::WriteError| e.to_string();
    let mut control = conn.open_uni().await.map_err(|e| e.to_string())?;
    control.write_all(&[0x00, 0x04, 0x00]).await.map_err(e)?;
    // The frame's type, then its length as an 8-byte variable-length integer (tag 0b11): 2^30.
    let mut head = vec![if request { 0x01 } else { 0x21 }];
    head.extend_from_slice(&[0xC0, 0, 0, 0, 0x40, 0, 0, 0]);
    head.resize(head.len() + bytes, 0);
    let mut streams = vec![control];
    let mut answer = None;
    if request {
        let (send, recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        streams.push(send);
        answer = Some(recv);
    }
    let _ = streams.last_mut().unwrap().write_all(&head).await;
    Ok((streams, answer))
}

/// Reads one QUIC variable-length integer from `recv`.
async fn read_varint(recv: &mut RecvStream) -> u64 {
    let mut first = [0u8; 1];
    recv.read_exact(&mut first).await.unwrap();
    let len = 1usize << (first[0] >> 6);
    let mut rest = vec![0u8; len - 1];
    recv.read_exact(&mut rest).await.unwrap();
    rest.iter()
        .fold(u64::from(first[0] & 0x3f), |v, b| v << 8 | u64::from(*b))
}

/// The stream id of the first GOAWAY the server sends: its unidirectional streams are taken
/// until the control stream (type 0), whose frames are read until a GOAWAY (type 7). The other
/// streams (QPACK's) are returned, to be kept open as long as the connection.
pub async fn goaway(conn: &Connection) -> (u64, Vec<RecvStream>) {
    let mut others = Vec::new();
    loop {
        let mut recv = conn.accept_uni().await.unwrap();
        if read_varint(&mut recv).await != 0x00 {
            others.push(recv);
            continue;
        }
        loop {
            let (kind, len) = (read_varint(&mut recv).await, read_varint(&mut recv).await);
            if kind == 0x07 {
                return (read_varint(&mut recv).await, others);
            }
            let mut skip = vec![0u8; len as usize];
            recv.read_exact(&mut skip).await.unwrap();
        }
    }
}

/// The status of the answer on `recv` when its QPACK field section names it by static index
/// (`:status 200` is entry 25, section A); `None` for any other shape.
pub async fn status_index(recv: &mut RecvStream) -> Option<u8> {
    let answer = recv.read_to_end(1 << 20).await.ok()?;
    // HEADERS (type 1), its length, the prefix (no dynamic table: two zero bytes), then the
    // first field line: `11` and a 6-bit static index.
    if answer.first() != Some(&0x01) {
        return None;
    }
    let after_len = 1 + (1usize << (answer.get(1)? >> 6));
    let line = *answer.get(after_len + 2)?;
    (line & 0xC0 == 0xC0).then_some(line & 0x3f)
}
