//! Where WebSocket frames begin (RFC 6455 section 5.2), followed without reading payloads, so a
//! tunnel knows when it may write a Close frame of its own between two frames, and the Close
//! frames it writes. Must never: change or buffer a payload.

/// Where a stream of WebSocket frames (RFC 6455 section 5.2) stands, fed with the bytes written
/// to one side in order: whether the next byte would start a frame, and whether a Close frame
/// (opcode 0x8) was begun. Only headers are looked at; payload bytes are counted off.
#[derive(Debug, Default)]
pub(super) struct FrameEdge {
    /// The current header's bytes so far: 2 to 14 (2, then 0, 2 or 8 of extended length, then
    /// 0 or 4 of masking key).
    pub(super) head: [u8; 14],
    pub(super) have: usize,
    /// Payload bytes of the current frame still to come.
    pub(super) left: u64,
    pub(super) close_seen: bool,
}

impl FrameEdge {
    pub(super) fn feed(&mut self, mut bytes: &[u8]) {
        while let Some((&first, rest)) = bytes.split_first() {
            if self.left > 0 {
                let k = usize::try_from(self.left).map_or(bytes.len(), |l| l.min(bytes.len()));
                self.left -= k as u64;
                bytes = &bytes[k..];
                continue;
            }
            self.head[self.have] = first;
            self.have += 1;
            bytes = rest;
            if let Some(payload) = header_done(&self.head[..self.have]) {
                self.close_seen |= self.head[0] & 0x0f == 0x8;
                self.left = payload;
                self.have = 0;
            }
        }
    }

    /// Whether everything written so far ends on a frame's last byte.
    pub(super) fn at_edge(&self) -> bool {
        self.have == 0 && self.left == 0
    }
}

/// [`FrameEdge`]'s answers after each of `pieces` is fed in turn: at a frame's edge, and a
/// Close frame begun (for the fuzz targets, see `crate::fuzz`).
pub(crate) fn frame_edges(pieces: &[&[u8]]) -> Vec<(bool, bool)> {
    let mut edge = FrameEdge::default();
    pieces
        .iter()
        .map(|piece| {
            edge.feed(piece);
            (edge.at_edge(), edge.close_seen)
        })
        .collect()
}

/// The payload length once `head` is a whole frame header, `None` while it is not yet.
pub(super) fn header_done(head: &[u8]) -> Option<u64> {
    let [_, b1, rest @ ..] = head else {
        return None;
    };
    let ext = match b1 & 0x7f {
        126 => 2,
        127 => 8,
        _ => 0,
    };
    let key = if b1 & 0x80 != 0 { 4 } else { 0 };
    if rest.len() < ext + key {
        return None;
    }
    Some(match ext {
        0 => u64::from(b1 & 0x7f),
        _ => rest[..ext]
            .iter()
            .fold(0u64, |len, &b| len << 8 | u64::from(b)),
    })
}

/// A Close frame (RFC 6455 section 5.5.1): FIN and opcode 0x8, a payload of the status `code`
/// (2 bytes, big-endian) and `reason` (UTF-8, cut to 123 bytes at a character edge), masked with
/// a random key when `masked`. `None` if the system has no randomness to give.
pub(super) fn close_frame(code: u16, reason: &str, masked: bool) -> Option<Vec<u8>> {
    let mut end = reason.len().min(123);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut payload = code.to_be_bytes().to_vec();
    payload.extend_from_slice(&reason.as_bytes()[..end]);
    let mut frame = vec![0x88, payload.len() as u8];
    if masked {
        let mut key = [0u8; 4];
        getrandom::getrandom(&mut key).ok()?;
        frame[1] |= 0x80;
        frame.extend_from_slice(&key);
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= key[i % 4];
        }
    }
    frame.extend_from_slice(&payload);
    Some(frame)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::tunnel::POLICY_VIOLATION;
    use std::io::Cursor;

    use tokio_tungstenite::tungstenite::protocol::frame::coding::{CloseCode, Data, OpCode};
    use tokio_tungstenite::tungstenite::protocol::frame::{CloseFrame, Frame, FrameHeader};

    /// Frames as tungstenite writes them: text, binary of 16- and 64-bit lengths, fragments,
    /// control frames with and without payload; each masked and not.
    fn frames(masked: bool) -> Vec<Vec<u8>> {
        let mut all = vec![
            Frame::message("hello", OpCode::Data(Data::Text), true),
            Frame::message(vec![7u8; 300], OpCode::Data(Data::Binary), true),
            Frame::message(vec![1u8; 70_000], OpCode::Data(Data::Binary), false),
            Frame::ping(Vec::new()),
            Frame::message(vec![2u8; 125], OpCode::Data(Data::Continue), true),
            Frame::pong(b"p".to_vec()),
        ];
        if masked {
            for f in &mut all {
                f.header_mut().mask = Some([0x12, 0x34, 0x56, 0x78]);
            }
        }
        all.into_iter()
            .map(|f| {
                let mut out = Vec::new();
                f.format(&mut out).unwrap();
                out
            })
            .collect()
    }

    #[test]
    fn frame_edges_are_found_whatever_the_write_sizes() {
        for masked in [false, true] {
            let frames = frames(masked);
            let stream: Vec<u8> = frames.concat();
            let mut edges = std::collections::BTreeSet::new();
            let mut at = 0;
            for f in &frames {
                edges.insert(at);
                at += f.len();
            }
            edges.insert(at);
            // Fed in writes of 1, 2, 3, 7, 13 and 4096 bytes: at_edge must hold exactly after
            // each frame's last byte.
            for step in [1, 2, 3, 7, 13, 4096] {
                let mut edge = FrameEdge::default();
                let mut fed = 0;
                for chunk in stream.chunks(step) {
                    edge.feed(chunk);
                    fed += chunk.len();
                    assert_eq!(
                        edge.at_edge(),
                        edges.contains(&fed),
                        "masked {masked}, writes of {step}, after {fed} bytes"
                    );
                    assert!(!edge.close_seen);
                }
            }
        }
    }

    #[test]
    fn a_close_frame_is_noticed_and_ours_parse_as_close_frames() {
        let mut edge = FrameEdge::default();
        let mut theirs = Vec::new();
        Frame::close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "bye".into(),
        }))
        .format(&mut theirs)
        .unwrap();
        edge.feed(&theirs[..1]);
        assert!(!edge.close_seen && !edge.at_edge());
        edge.feed(&theirs[1..]);
        assert!(edge.close_seen && edge.at_edge());

        let long = "é".repeat(100); // 200 bytes: cut to 122 (123 would split a character)
        for (masked, reason) in [(false, "session revoked"), (true, long.as_str())] {
            let ours = close_frame(POLICY_VIOLATION, reason, masked).unwrap();
            let mut cursor = Cursor::new(&ours);
            let (head, len) = FrameHeader::parse(&mut cursor).unwrap().unwrap();
            assert!(head.is_final);
            assert_eq!(
                head.opcode,
                OpCode::Control(
                    tokio_tungstenite::tungstenite::protocol::frame::coding::Control::Close
                )
            );
            assert_eq!(head.mask.is_some(), masked);
            let mut payload = ours[cursor.position() as usize..].to_vec();
            assert_eq!(payload.len() as u64, len);
            assert!(len <= 125, "a control frame's payload is at most 125 bytes");
            if let Some(key) = head.mask {
                for (i, b) in payload.iter_mut().enumerate() {
                    *b ^= key[i % 4];
                }
            }
            assert_eq!(u16::from_be_bytes([payload[0], payload[1]]), 1008);
            let text = std::str::from_utf8(&payload[2..]).unwrap();
            assert!(reason.starts_with(text) && !text.is_empty());
            let mut edge = FrameEdge::default();
            edge.feed(&ours);
            assert!(edge.close_seen && edge.at_edge());
        }
    }
}
