use super::*;

/// A QUIC variable-length integer in its shortest form but one: `len` bytes (1, 2, 4 or 8).
fn varint(v: u64, len: u8, out: &mut Vec<u8>) {
    let tag = u64::from(len.trailing_zeros()) << (8 * u32::from(len) - 2);
    out.extend_from_slice(&(v | tag).to_be_bytes()[8 - usize::from(len)..]);
}

fn frame(ty: u64, payload_len: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    varint(ty, 1, &mut out);
    varint(payload_len, 8, &mut out);
    out.extend_from_slice(payload);
    out
}

/// Reads `bytes` whole, then one byte at a time: both must agree.
fn read(mut frames: impl FnMut() -> Frames, bytes: &[u8]) -> Result<(), TooLarge> {
    let whole = frames().read(bytes);
    let mut one = frames();
    let by_byte = bytes.chunks(1).try_for_each(|b| one.read(b));
    assert_eq!(whole, by_byte);
    whole
}

#[test]
fn a_headers_frame_up_to_the_limit_passes_and_one_byte_more_does_not() {
    let ok = frame(0x1, 100, &[0; 100]);
    assert_eq!(read(|| Frames::request(100), &ok), Ok(()));
    let over = frame(0x1, 101, &[0; 3]);
    assert_eq!(read(|| Frames::request(100), &over), Err(TooLarge));
}

#[test]
fn data_passes_whatever_its_length_and_frames_after_it_are_read() {
    let mut bytes = frame(0x1, 10, &[0; 10]);
    bytes.extend(frame(0x0, 1000, &[7; 1000]));
    assert_eq!(read(|| Frames::request(100), &bytes), Ok(()));
    // A frame of 2^62 - 1 bytes declared after the DATA frame (a reserved type, RFC 9114
    // section 7.2.8): refused from its header, before any of its payload.
    bytes.extend(frame(0x21, (1 << 62) - 1, &[]));
    assert_eq!(read(|| Frames::request(100), &bytes), Err(TooLarge));
}

#[test]
fn an_endless_data_frame_is_never_refused() {
    let bytes = frame(0x0, (1 << 62) - 1, &[1; 5000]);
    assert_eq!(read(|| Frames::request(100), &bytes), Ok(()));
}

#[test]
fn the_control_stream_is_read_after_its_type() {
    let mut bytes = vec![0x00]; // control stream
    bytes.extend(frame(0x4, 2, &[0x6, 0x0])); // SETTINGS
    bytes.extend(frame(0x21, 50, &[0; 50]));
    assert_eq!(read(|| Frames::unidirectional(100), &bytes), Ok(()));
    bytes.extend(frame(0x21, 1 << 40, &[0; 64]));
    assert_eq!(read(|| Frames::unidirectional(100), &bytes), Err(TooLarge));
}

#[test]
fn other_unidirectional_streams_and_webtransport_streams_are_not_read() {
    // QPACK's encoder stream: instructions, not frames (h3 reads only the type).
    let mut qpack = vec![0x02];
    qpack.extend(frame(0x1, 1 << 40, &[]));
    assert_eq!(read(|| Frames::unidirectional(100), &qpack), Ok(()));
    let mut webtransport = Vec::new();
    varint(0x41, 2, &mut webtransport);
    webtransport.extend(frame(0x1, 1 << 40, &[]));
    assert_eq!(read(|| Frames::request(100), &webtransport), Ok(()));
}
