//! What an upstream request is made of besides its head: its body's progress (which the
//! response-head timeout reads), and the header maps recycled per serving thread. Must never:
//! hand a map back with a previous request's fields in it.

use std::cell::RefCell;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use super::{BoxError, UpBody};

/// Request-body progress, for the response-head timeout (which restarts while the body still
/// moves): the frames taken from the body so far. Whether the body was sent to its end decides
/// reuse in the upstream client (`Head::keep_alive` in `h1.rs`).
#[derive(Default)]
pub(super) struct Progress {
    pub(super) frames: AtomicU64,
}

/// A request body that reports its progress.
pub(super) struct Tracked {
    pub(super) inner: UpBody,
    pub(super) progress: Arc<Progress>,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &frame {
            self.progress.frames.fetch_add(1, Ordering::Relaxed);
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

thread_local! {
    /// Request header maps given back after their request was written upstream, cleared with
    /// their allocation kept, for the next request read on this thread.
    static SPARE_MAPS: RefCell<Vec<HeaderMap>> = const { RefCell::new(Vec::new()) };
}

/// Most spare maps kept per thread.
pub(super) const MAX_SPARE_MAPS: usize = 64;

/// Largest map kept, in entries: a map grown by an unusually large request is dropped.
pub(super) const MAX_SPARE_CAPACITY: usize = 64;

/// An empty header map with room for at least `fields` fields: a spare one of this thread's
/// when there is one (no allocation unless it is smaller than `fields`), else a new one.
pub fn spare_header_map(fields: usize) -> HeaderMap {
    let mut map = SPARE_MAPS
        .with(|s| s.borrow_mut().pop())
        .unwrap_or_default();
    map.reserve(fields);
    map
}

/// Gives a request's header map back for [`spare_header_map`] (cleared here); kept only while
/// this thread holds fewer than 64 and the map has room for at most 64 entries and held at most
/// 64 values (`capacity` does not count the storage of a repeated name's further values, which
/// clearing keeps: up to 200 lines of an HTTP/2 request).
pub fn recycle_header_map(mut map: HeaderMap) {
    if map.capacity() > MAX_SPARE_CAPACITY || map.len() > MAX_SPARE_CAPACITY {
        return;
    }
    map.clear();
    SPARE_MAPS.with(|s| {
        let mut spare = s.borrow_mut();
        if spare.len() < MAX_SPARE_MAPS {
            spare.push(map);
        }
    });
}

/// An empty request body.
pub fn empty_body() -> UpBody {
    http_body_util::Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}

/// Whether a request of `method` with `fields` asks for an event stream: a `GET` whose `Accept`
/// has a `text/event-stream` media range (ASCII case ignored) not weighted `q=0` (RFC 9110
/// section 12.5.1), as a page's `EventSource` sends (HTML, "Server-sent events").
pub(super) fn asks_for_event_stream(method: &http::Method, fields: &HeaderMap) -> bool {
    method == http::Method::GET
        && fields.get_all(http::header::ACCEPT).iter().any(|v| {
            v.as_bytes().split(|&b| b == b',').any(|range| {
                let mut parts = range.split(|&b| b == b';').map(<[u8]>::trim_ascii);
                let kind = parts.next().unwrap_or_default();
                kind.eq_ignore_ascii_case(b"text/event-stream") && !parts.any(weighs_nothing)
            })
        })
}

/// Whether a media-range parameter is `q=0` (`0`, `0.0`, `0.00` or `0.000`).
fn weighs_nothing(param: &[u8]) -> bool {
    let Some(q) = param
        .strip_prefix(b"q=")
        .or_else(|| param.strip_prefix(b"Q="))
    else {
        return false;
    };
    q.first() == Some(&b'0') && q[1..].iter().all(|&b| b == b'.' || b == b'0')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_stream_is_asked_for_by_its_media_type_in_accept() {
        let fields = |values: &[&'static str]| {
            let mut fields = HeaderMap::new();
            for v in values {
                fields.append(http::header::ACCEPT, http::HeaderValue::from_static(v));
            }
            fields
        };
        let asks =
            |values: &[&'static str]| asks_for_event_stream(&http::Method::GET, &fields(values));
        assert!(asks(&["text/event-stream"]));
        assert!(asks(&["application/json", "Text/Event-Stream ; q=0.9"]));
        assert!(!asks(&["application/json, */*"]));
        assert!(!asks(&["text/event-strea", "text/event-streams"]));
        assert!(!asks(&["application/json, text/event-stream;q=0"]));
        assert!(!asks(&["text/event-stream; q=0.000"]));
        assert!(!asks(&[]));
        let post = fields(&["application/json, text/event-stream"]);
        assert!(!asks_for_event_stream(&http::Method::POST, &post));
        assert!(!asks_for_event_stream(&http::Method::HEAD, &post));
    }

    #[test]
    fn a_recycled_header_map_comes_back_empty_with_its_room_and_a_large_one_is_dropped() {
        let mut map = HeaderMap::with_capacity(20);
        map.insert("x-secret", http::HeaderValue::from_static("1"));
        let room = map.capacity();
        recycle_header_map(map);
        let again = spare_header_map(4);
        assert!(again.is_empty(), "a previous request's field came back");
        assert_eq!(again.capacity(), room, "not the recycled allocation");
        let big = HeaderMap::with_capacity(4 * MAX_SPARE_CAPACITY);
        recycle_header_map(big);
        assert!(spare_header_map(0).capacity() <= MAX_SPARE_CAPACITY);
        // One name, many values: small by its capacity, large by what clearing keeps.
        let mut repeated = HeaderMap::new();
        for _ in 0..200 {
            repeated.append("x-a", http::HeaderValue::from_static("1"));
        }
        recycle_header_map(repeated);
        assert_eq!(
            spare_header_map(0).capacity(),
            0,
            "the repeated values' map came back"
        );
    }
}
