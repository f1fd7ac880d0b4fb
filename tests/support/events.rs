//! An open `/events` response read as a client does, to see events arrive and the stream end.

use std::time::Duration;

/// An open `/events` response (server-sent events) over its own HTTP/1.1 connection.
pub struct EventStream {
    sock: std::net::TcpStream,
    seen: Vec<u8>,
}

impl EventStream {
    /// Opens `/events` on `t` with `token` and waits for the head and a first event.
    pub fn open(t: &super::Tessera, token: &str) -> Self {
        use std::io::Write;
        let mut sock = std::net::TcpStream::connect(("127.0.0.1", t.port)).unwrap();
        write!(
            sock,
            "GET /events HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\
             Accept: text/event-stream\r\n\r\n"
        )
        .unwrap();
        let mut s = Self {
            sock,
            seen: Vec::new(),
        };
        assert!(s.events_within(1, Duration::from_secs(5)), "no first event");
        let head = String::from_utf8_lossy(&s.seen).to_string();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(head.contains("text/event-stream"), "{head}");
        s
    }

    /// Reads what already arrived (without waiting), so that [`EventStream::events_within`]
    /// counts only events sent after this.
    pub fn drain(&mut self) {
        use std::io::Read;
        let mut buf = [0u8; 4096];
        self.sock.set_nonblocking(true).unwrap();
        while let Ok(n @ 1..) = self.sock.read(&mut buf) {
            self.seen.extend_from_slice(&buf[..n]);
        }
        self.sock.set_nonblocking(false).unwrap();
    }

    pub fn events(&self) -> usize {
        String::from_utf8_lossy(&self.seen)
            .matches("data: ")
            .count()
    }

    /// Reads until `more` events beyond those seen arrived (true) or `within` passed or the
    /// stream ended (false).
    pub fn events_within(&mut self, more: usize, within: Duration) -> bool {
        self.more_events(more, within).is_ok()
    }

    /// Reads until `more` events beyond those seen arrived; else says whether the stream ended
    /// (and how) or stayed open without them for `within`.
    pub fn more_events(&mut self, more: usize, within: Duration) -> Result<(), String> {
        use std::io::{ErrorKind, Read};
        let want = self.events() + more;
        let deadline = std::time::Instant::now() + within;
        let mut buf = [0u8; 4096];
        while self.events() < want {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(format!("open, but no event within {within:?}"));
            }
            self.sock.set_read_timeout(Some(left)).unwrap();
            match self.sock.read(&mut buf) {
                Ok(0) => return Err("ended (EOF)".into()),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) => return Err(format!("ended ({e})")),
                Ok(n) => self.seen.extend_from_slice(&buf[..n]),
            }
        }
        Ok(())
    }

    /// How long until the connection ended (EOF or reset), `None` if it was open after
    /// `within`. Asserts the body was cut short: no last chunk.
    pub fn ended_within(&mut self, within: Duration) -> Option<Duration> {
        use std::io::{ErrorKind, Read};
        let start = std::time::Instant::now();
        let mut buf = [0u8; 4096];
        loop {
            let left = within.saturating_sub(start.elapsed());
            if left.is_zero() {
                return None;
            }
            self.sock.set_read_timeout(Some(left)).unwrap();
            match self.sock.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => self.seen.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return None
                }
                Err(_) => break,
            }
        }
        assert!(
            !self.seen.ends_with(b"0\r\n\r\n"),
            "the stream ended cleanly, as if complete"
        );
        Some(start.elapsed())
    }
}
