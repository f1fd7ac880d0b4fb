//! Numbers and dates as the fast path writes them into response heads, without allocating:
//! decimal lengths, chunk-size lines, and the `Date` value (formatted once a second per thread).

/// `{n:x}\r\n`, the size line of a chunk (RFC 9112 section 7.1), written into `buf`.
pub(super) fn chunk_size_line(mut n: usize, buf: &mut [u8; 18]) -> &[u8] {
    let mut i = buf.len() - 2;
    buf[i..].copy_from_slice(b"\r\n");
    loop {
        i -= 1;
        buf[i] = b"0123456789abcdef"[n % 16];
        n /= 16;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// `n` in decimal, written into the end of `buf`.
pub(super) fn itoa(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// The current time as an IMF-fixdate (RFC 9110 section 5.6.7), formatted once a second per
/// thread.
pub(super) fn http_date() -> [u8; 29] {
    use std::cell::Cell;
    use std::time::{SystemTime, UNIX_EPOCH};
    thread_local! {
        static CACHED: Cell<(u64, [u8; 29])> = const { Cell::new((u64::MAX, [0; 29])) };
    }
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHED.with(|c| {
        let (at, text) = c.get();
        if at == secs {
            return text;
        }
        let mut text = [0u8; 29];
        text.copy_from_slice(&httpdate::fmt_http_date(now).as_bytes()[..29]);
        c.set((secs, text));
        text
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_and_chunk_size_lines() {
        for n in [0u64, 7, 10, 1024, u64::MAX] {
            assert_eq!(itoa(n, &mut [0; 20]), n.to_string().as_bytes());
        }
        for n in [0usize, 9, 10, 255, 65536, usize::MAX] {
            assert_eq!(
                chunk_size_line(n, &mut [0; 18]),
                format!("{n:x}\r\n").as_bytes()
            );
        }
    }
}
