//! The access log (`log.access_log`): one line per answered request on stderr, in the format of
//! the `tracing` lines around it, for target `tessera::access`:
//!
//! ```text
//! 2026-11-22T09:11:55.906182Z  INFO tessera::access: peer=127.0.0.1 method=GET path=/1k status=200 duration_us=156 sid_hash="edc661386fce" reason="-"
//! ```
//!
//! (UTC, µs; `duration_us` from the request head read to the response head ready; `sid_hash` the
//! first 12 hex digits of the sid's SHA-256, `"-"` without a session; `reason` why a request was
//! refused or failed, `"-"` when it was not; both quoted and escaped as Rust's `{:?}` does.)
//! With `log.format = "json"`, a line is the JSON object tracing-subscriber's JSON formatter
//! writes for an event, the same fields under `fields` (`sid_hash` and `reason` `null` when
//! absent):
//!
//! ```text
//! {"timestamp":"2026-11-22T09:11:55.906182Z","level":"INFO","fields":{"peer":"127.0.0.1","method":"GET","path":"/1k","status":200,"duration_us":156,"proto":"HTTP/1.1","sid_hash":"edc661386fce","reason":null},"target":"tessera::access"}
//! ```
//!
//! Why not `tracing::info!`: with the access log on, CPU per request at 8 clients went from about
//! 32 to 43 µs, about 6 µs in `tracing-subscriber`'s formatter and 4 µs in one `write(2)` per
//! line (docs/benchmarks.md, "Access log"). Here a line is written with a few copies, and a serving
//! thread keeps its lines in a buffer of its own that goes out in one `write(2)`:
//! - when the thread is about to park (nothing left to run; at light load that is right after
//!   each response, so a line is out within microseconds of its request),
//! - when the buffer reaches [`FLUSH_AT`] bytes (a thread that never idles),
//! - and when the thread ends.
//!
//! A crash that kills the process (SIGKILL, abort) loses what is buffered: at most [`FLUSH_AT`]
//! bytes per serving thread, from the current busy stretch. Any other thread writes each line at
//! once. Lines are whole: each `write_all` holds stderr's lock, as `tracing`'s writer does; but
//! two threads' batches, and the other log lines, may be out of timestamp order by up to one
//! batch. The lines go to the process's stderr, not through the installed `tracing` subscriber
//! (whose filter only decides whether they are written): never coloured, and a program embedding
//! tessera with a subscriber of its own gets them as text (JSON only when `telemetry::init`
//! installed its JSON subscriber).

use std::cell::{Cell, RefCell};
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

/// Bytes of buffered lines at which a serving thread writes them out without waiting to park.
pub const FLUSH_AT: usize = 32 * 1024;

/// One request's access line.
#[derive(Debug)]
pub struct Line<'a> {
    /// The client's address (the TCP peer).
    pub peer: IpAddr,
    /// The request method.
    pub method: &'a str,
    /// The request path (no query), as received.
    pub path: &'a str,
    /// The status code sent downstream.
    pub status: u16,
    /// From the request head read to the response head ready, µs.
    pub duration_us: u64,
    /// The HTTP version the client spoke: `HTTP/1.0`, `HTTP/1.1`, `HTTP/2` or `HTTP/3`
    /// (nginx's `$server_protocol`).
    pub proto: &'static str,
    /// The session the token named, if it got that far (logged as its hash).
    pub sid: Option<&'a str>,
    /// Why the request was refused or failed (`None`: it was not).
    pub reason: Option<&'a str>,
    /// The request id (`upstream.request_id_header`), when kept; visible ASCII.
    pub request_id: Option<&'a str>,
}

/// The calling thread's buffer; written out when the thread ends.
struct Buffer(Vec<u8>);

impl Drop for Buffer {
    fn drop(&mut self) {
        write_out(&mut self.0);
    }
}

thread_local! {
    static BUFFER: RefCell<Buffer> = const { RefCell::new(Buffer(Vec::new())) };
    /// Whether this thread batches (a serving thread that calls [`flush`] from its park hook).
    static BATCHED: Cell<bool> = const { Cell::new(false) };
}

/// `log.format = "json"` (set with the subscriber, at start).
static JSON: AtomicBool = AtomicBool::new(false);

/// Writes lines as JSON objects (`true`) or text, as the installed subscriber does.
pub(crate) fn set_json(json: bool) {
    JSON.store(json, Ordering::Relaxed);
}

/// Whether lines are written as JSON ([`set_json`]).
pub(crate) fn json() -> bool {
    JSON.load(Ordering::Relaxed)
}

/// Whether an access line would be written: the log filter lets target `tessera::access` at
/// INFO through (`log.level = "warn"` does not).
pub fn enabled() -> bool {
    tracing::enabled!(target: "tessera::access", tracing::Level::INFO)
}

/// Makes the calling thread keep its lines until [`flush`] (which its runtime's park hook must
/// call), [`FLUSH_AT`] bytes, or its end.
pub fn batch_on_this_thread() {
    BATCHED.with(|b| b.set(true));
}

/// Writes `line` (see the module docs for when it reaches stderr).
pub fn write(line: &Line<'_>) {
    BUFFER.with(|b| {
        let Ok(mut b) = b.try_borrow_mut() else {
            return;
        };
        let out = &mut b.0;
        format_line(out, SystemTime::now(), line);
        if out.len() >= FLUSH_AT || !BATCHED.with(Cell::get) {
            write_out(out);
        }
    });
}

/// Writes out the calling thread's buffered lines, if any (one `write(2)`, under stderr's lock).
pub fn flush() {
    BUFFER.with(|b| {
        if let Ok(mut b) = b.try_borrow_mut() {
            write_out(&mut b.0);
        }
    });
}

fn write_out(out: &mut Vec<u8>) {
    if out.is_empty() {
        return;
    }
    // A log that cannot be written (a closed pipe, a full disk) is not the request's failure.
    // (Unit tests keep their lines off the test runner's output.)
    if !cfg!(test) {
        let _ = std::io::stderr().lock().write_all(out);
    }
    out.clear();
    // A burst's buffer is not kept for good.
    if out.capacity() > 2 * FLUSH_AT {
        out.shrink_to(FLUSH_AT);
    }
}

/// A path as the log shows it: visible ASCII as it is, unquoted; a path with any other
/// character (controls, C1 codes such as CSI, line and bidi separators, all non-ASCII), `\\`,
/// `"` or `=` in double quotes, those escaped as Rust does (`\u{9b}`, `\"`), so that a client
/// can neither write terminal codes or a fake line into the log nor break a logfmt reader's
/// `key=value` pairs (go-logfmt, Loki's `| logfmt`).
struct Escaped<'a>(&'a str);

impl std::fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let plain = |c: char| c.is_ascii_graphic() && !matches!(c, '\\' | '"' | '=');
        // Most paths: one byte scan, then written whole.
        if self.0.bytes().all(|b| plain(char::from(b))) {
            return f.write_str(self.0);
        }
        f.write_char('"')?;
        for c in self.0.chars() {
            match c {
                '=' => f.write_char(c)?,
                c if plain(c) => f.write_char(c)?,
                c => write!(f, "{}", c.escape_default())?,
            }
        }
        f.write_char('"')
    }
}

/// Most bytes of a path an access line shows: a longer one is cut there (at a character's
/// start) and told by `...(+N bytes)` (so written in quotes), so that no line outgrows what log
/// shippers take whole (Docker splits at 16 KiB, journald at 48 KiB; an escaped byte takes up
/// to 10).
pub const MAX_LOGGED_PATH: usize = 1024;

/// `path` as an access line keeps it: whole up to [`MAX_LOGGED_PATH`] bytes, else cut.
pub fn logged_path(path: &str) -> String {
    if path.len() <= MAX_LOGGED_PATH {
        return path.to_owned();
    }
    let mut cut = MAX_LOGGED_PATH;
    while !path.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}...(+{} bytes)", &path[..cut], path.len() - cut)
}

/// Appends `line`, stamped `now`, with its newline, in the log's format.
fn format_line(out: &mut Vec<u8>, now: SystemTime, line: &Line<'_>) {
    if JSON.load(Ordering::Relaxed) {
        format_json(out, now, line);
    } else {
        format_text(out, now, line);
    }
}

/// `now` as the log stamps it: RFC 3339, UTC, microseconds.
fn stamp(now: SystemTime) -> humantime::Rfc3339Timestamp {
    // (humantime panics on a time before 1970: a clock set that far back logs 1970.)
    humantime::format_rfc3339_micros(now.max(std::time::UNIX_EPOCH))
}

/// [`format_line`] as text.
fn format_text(out: &mut Vec<u8>, now: SystemTime, line: &Line<'_>) {
    // Writing into a Vec cannot fail.
    let _ = write!(
        out,
        "{}  INFO tessera::access: peer={} method={} path={} status={} duration_us={} proto={} \
         sid_hash=",
        stamp(now),
        line.peer,
        line.method,
        Escaped(line.path),
        line.status,
        line.duration_us,
        line.proto,
    );
    sid_hash(out, line.sid, b"\"-\"");
    out.extend_from_slice(b" reason=");
    quoted(out, line.reason.unwrap_or("-"));
    if let Some(id) = line.request_id {
        out.extend_from_slice(b" request_id=");
        quoted(out, id);
    }
    out.push(b'\n');
}

/// The sid's hash, quoted (hex needs no escape in either format), or `none`.
fn sid_hash(out: &mut Vec<u8>, sid: Option<&str>, none: &[u8]) {
    match sid {
        Some(sid) => {
            out.push(b'"');
            out.extend_from_slice(&crate::session::sid_hash_hex(sid));
            out.push(b'"');
        }
        None => out.extend_from_slice(none),
    }
}

/// [`format_line`] as JSON (RFC 8259), in tracing-subscriber's layout for an event.
fn format_json(out: &mut Vec<u8>, now: SystemTime, line: &Line<'_>) {
    let _ = write!(
        out,
        "{{\"timestamp\":\"{}\",\"level\":\"INFO\",\"fields\":{{\"peer\":\"{}\",\"method\":",
        stamp(now),
        line.peer
    );
    json_string(out, Some(line.method));
    out.extend_from_slice(b",\"path\":");
    json_string(out, Some(line.path));
    let _ = write!(
        out,
        ",\"status\":{},\"duration_us\":{},\"proto\":\"{}\",\"sid_hash\":",
        line.status, line.duration_us, line.proto
    );
    sid_hash(out, line.sid, b"null");
    out.extend_from_slice(b",\"reason\":");
    json_string(out, line.reason);
    if let Some(id) = line.request_id {
        out.extend_from_slice(b",\"request_id\":");
        json_string(out, Some(id));
    }
    out.extend_from_slice(b"},\"target\":\"tessera::access\"}\n");
}

/// `s` as a JSON string, or `null`: printable ASCII as it is, `"` and `\\` escaped, and every
/// other character as `\\uXXXX` (UTF-16, RFC 8259 section 7), so that, as in the text format, no
/// control, C1 code (a terminal's CSI) or line separator reaches the file raw.
pub(crate) fn json_string(out: &mut Vec<u8>, s: Option<&str>) {
    let Some(s) = s else {
        return out.extend_from_slice(b"null");
    };
    out.push(b'"');
    if s.bytes()
        .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
    {
        out.extend_from_slice(s.as_bytes());
    } else {
        for c in s.chars() {
            match c {
                '"' => out.extend_from_slice(b"\\\""),
                '\\' => out.extend_from_slice(b"\\\\"),
                ' '..='~' => out.push(c as u8),
                _ => {
                    for unit in c.encode_utf16(&mut [0; 2]) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
            }
        }
    }
    out.push(b'"');
}

/// `s` as `{:?}` writes it: quoted, with `"`, `\` and control characters escaped; plain text
/// (the usual case) is copied as it is.
fn quoted(out: &mut Vec<u8>, s: &str) {
    if s.bytes()
        .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
    {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        let _ = write!(out, "{s:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn line<'a>(sid: Option<&'a str>, reason: Option<&'a str>) -> Line<'a> {
        Line {
            peer: "127.0.0.1".parse().unwrap(),
            method: "GET",
            path: "/jmap/api",
            status: 200,
            duration_us: 156,
            proto: "HTTP/2",
            request_id: None,
            sid,
            reason,
        }
    }

    #[test]
    fn a_line_reads_like_the_tracing_lines_around_it() {
        let now = UNIX_EPOCH + Duration::from_micros(1_795_342_315_906_182);
        let mut out = Vec::new();
        format_line(&mut out, now, &line(Some("s1"), None));
        let expected = format!(
            "2026-11-22T10:11:55.906182Z  INFO tessera::access: peer=127.0.0.1 method=GET \
             path=/jmap/api status=200 duration_us=156 proto=HTTP/2 sid_hash=\"{}\" \
             reason=\"-\"\n",
            crate::session::sid_hash("s1")
        );
        assert_eq!(String::from_utf8(out).unwrap(), expected);
    }

    #[test]
    fn reasons_are_quoted_and_escaped_as_debug_does() {
        for reason in [
            "invalid token: token expired",
            "a \"quoted\" word",
            "two\nlines\r\tand a \\ and \u{7f} and é",
        ] {
            let mut out = Vec::new();
            format_line(&mut out, UNIX_EPOCH, &line(None, Some(reason)));
            let text = String::from_utf8(out).unwrap();
            assert!(
                text.ends_with(&format!(" sid_hash=\"-\" reason={reason:?}\n")),
                "{text}"
            );
            assert_eq!(text.matches('\n').count(), 1, "one line: {text}");
        }
    }

    #[test]
    fn a_path_with_control_or_non_ascii_characters_is_escaped() {
        for (path, shown) in [
            ("/a\u{9b}2J", "\"/a\\u{9b}2J\""),
            ("/x\u{2028}y\u{202e}", "\"/x\\u{2028}y\\u{202e}\""),
            ("/caf\u{e9}", "\"/caf\\u{e9}\""),
            ("/a\\b", "\"/a\\\\b\""),
            ("/a\"b=c", "\"/a\\\"b=c\""),
            ("/plain/%41?", "/plain/%41?"),
        ] {
            let mut out = Vec::new();
            format_line(
                &mut out,
                UNIX_EPOCH,
                &Line {
                    path,
                    ..line(None, None)
                },
            );
            let text = String::from_utf8(out).unwrap();
            assert!(
                text.contains(&format!(" path={shown} status=")),
                "{path:?}: {text}"
            );
        }
    }

    #[test]
    fn a_long_path_is_cut_at_a_characters_start_and_says_how_much() {
        assert_eq!(logged_path("/short"), "/short");
        let long = format!("/{}", "\u{e9}".repeat(MAX_LOGGED_PATH));
        let kept = logged_path(&long);
        let (head, tail) = kept.split_once("...").unwrap();
        assert!(head.len() <= MAX_LOGGED_PATH && long.starts_with(head));
        assert_eq!(tail, format!("(+{} bytes)", long.len() - head.len()));
        let mut out = Vec::new();
        let plain = format!("/{}", "a".repeat(2 * MAX_LOGGED_PATH));
        let path = logged_path(&plain);
        format_line(
            &mut out,
            UNIX_EPOCH,
            &Line {
                path: &path,
                ..line(None, None)
            },
        );
        let text = String::from_utf8(out).unwrap();
        let shown = format!(
            " path=\"/{}...(+{} bytes)\" status=",
            "a".repeat(1023),
            1025
        );
        assert!(text.contains(&shown), "{text}");
    }

    #[test]
    fn a_json_line_is_one_object_in_tracing_subscribers_layout() {
        let now = UNIX_EPOCH + Duration::from_micros(1_795_342_315_906_182);
        let mut out = Vec::new();
        format_json(&mut out, now, &line(Some("s1"), None));
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.matches('\n').count(), 1);
        // tracing-subscriber's key order: timestamp, level, fields, target.
        assert!(text.starts_with("{\"timestamp\":\"2026-11-22T10:11:55.906182Z\",\"level\":\"INFO\",\"fields\":{\"peer\":"), "{text}");
        assert!(
            text.ends_with("},\"target\":\"tessera::access\"}\n"),
            "{text}"
        );
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["timestamp"], "2026-11-22T10:11:55.906182Z");
        assert_eq!(
            (&v["level"], &v["target"]),
            (&"INFO".into(), &"tessera::access".into())
        );
        let f = &v["fields"];
        assert_eq!(
            (&f["peer"], &f["method"], &f["path"]),
            (&"127.0.0.1".into(), &"GET".into(), &"/jmap/api".into())
        );
        assert_eq!(
            (&f["status"], &f["duration_us"], &f["proto"]),
            (&200.into(), &156.into(), &"HTTP/2".into())
        );
        assert_eq!(f["sid_hash"], crate::session::sid_hash("s1").to_string());
        assert!(
            f["reason"].is_null() && f.get("request_id").is_none(),
            "{text}"
        );
    }

    #[test]
    fn json_strings_keep_controls_and_non_ascii_out_of_the_file() {
        for s in [
            "a \"q\" \\ b",
            "/a\u{9b}2J\n\r\t",
            "/x\u{2028}\u{202e}caf\u{e9}\u{1f600}",
        ] {
            let mut out = Vec::new();
            format_json(
                &mut out,
                UNIX_EPOCH,
                &Line {
                    path: s,
                    ..line(None, Some(s))
                },
            );
            assert!(
                out.iter().all(|b| (b' '..=b'~').contains(b) || *b == b'\n'),
                "{out:?}"
            );
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(
                (&v["fields"]["path"], &v["fields"]["reason"]),
                (&s.into(), &s.into())
            );
        }
    }

    #[test]
    fn a_batching_thread_keeps_its_lines_until_flush_or_the_size_limit() {
        std::thread::spawn(|| {
            batch_on_this_thread();
            let held = || BUFFER.with(|b| b.borrow().0.len());
            write(&line(None, None));
            let one = held();
            assert!(one > 100, "kept: {one} bytes");
            flush();
            assert_eq!(held(), 0);
            // Lines pile up to the limit, then go out together.
            let mut most = 0;
            for _ in 0..2 * FLUSH_AT / one {
                write(&line(None, None));
                most = most.max(held());
            }
            assert!(most < FLUSH_AT && held() < FLUSH_AT, "{most}");
            assert!(most >= FLUSH_AT - one, "{most}");
        })
        .join()
        .unwrap();
        // Any other thread writes at once.
        std::thread::spawn(|| {
            write(&line(None, None));
            assert_eq!(BUFFER.with(|b| b.borrow().0.len()), 0);
        })
        .join()
        .unwrap();
    }
}
