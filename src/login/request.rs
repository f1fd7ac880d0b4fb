//! Reading a session-endpoint request: its body (bounded in size and time), query, cookies and
//! content type, and the same-origin check of a POST. Must never: read more than the cap.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::request::Parts;
use http_body::Body;
use http_body_util::BodyExt;
use zeroize::Zeroizing;

use crate::upstream::BoxError;

use super::{Refusal, BODY_TIMEOUT, MAX_FORM_BYTES};

pub(super) fn constant_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub(super) fn content_type_is(parts: &Parts, want: &str) -> bool {
    parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case(want))
}

pub(super) fn query_param(parts: &Parts, name: &str) -> Option<String> {
    form_urlencoded::parse(parts.uri.query()?.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

/// The first value of the cookie `name` in `headers` (its double quotes removed).
pub(super) fn cookie_value<'a>(headers: &'a http::HeaderMap, name: &'a str) -> Option<&'a str> {
    cookie_values(headers, name).next()
}

/// Every value of the cookie `name` in `headers`, in order (double quotes removed): a browser
/// sends one per path and domain that set it (RFC 6265 section 5.4).
pub(super) fn cookie_values<'a>(
    headers: &'a http::HeaderMap,
    name: &'a str,
) -> impl Iterator<Item = &'a str> + 'a {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .filter(move |(k, _)| *k == name)
        .map(|(_, v)| v.trim_matches('"'))
}

/// A state-changing POST must come from our own origin: `Origin` (when sent) names the request's
/// host, and `Sec-Fetch-Site` (when sent) is not `cross-site`.
pub(super) fn check_same_origin(parts: &Parts, host: &HeaderValue) -> Result<(), Refusal> {
    if parts
        .headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"cross-site"))
    {
        return Err(Refusal::Forbidden("cross-site request refused"));
    }
    let Some(origin) = parts.headers.get(header::ORIGIN) else {
        return Ok(());
    };
    // Only the authority is compared: behind a TLS terminator tessera cannot know the public
    // scheme. Default ports are dropped on both sides (`https://h` == `Host: h:443`).
    let strip = |a: &str, scheme: &str| -> String {
        let a = a.to_ascii_lowercase();
        let default = if scheme == "https" { ":443" } else { ":80" };
        a.strip_suffix(default).map_or(a.clone(), str::to_owned)
    };
    let (scheme, authority) = match origin.to_str().ok().and_then(|o| o.split_once("://")) {
        Some(p) => p,
        None => return Err(Refusal::Forbidden("cross-origin request refused")),
    };
    let host = host.to_str().unwrap_or_default();
    let same = strip(authority, scheme) == strip(host, scheme)
        || strip(authority, scheme)
            == strip(host, if scheme == "https" { "http" } else { "https" });
    if same {
        Ok(())
    } else {
        Err(Refusal::Forbidden("cross-origin request refused"))
    }
}

/// Reads a login or logout body: at most `MAX_FORM_BYTES` bytes, all of it within
/// `BODY_TIMEOUT`, into one buffer that is wiped when dropped, since a login body holds the
/// password. The buffer is allocated at its full size first, so it never moves and leaves no
/// unwiped copy of its own behind. The bytes it copies from are not wiped: the connection's
/// read buffer (the fast path's in `downstream::h1`, or hyper's), which is reused for later requests.
/// Errors: `Refusal::TooLarge` for a body over the cap (by its declared length, before any of it
/// is read, or as it arrives), `Refusal::Bad` for one cut or too slow. Trailers are ignored.
pub(super) async fn read_body<B>(body: B) -> Result<Zeroizing<Vec<u8>>, Refusal>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > MAX_FORM_BYTES as u64 {
        return Err(Refusal::TooLarge);
    }
    let read = async {
        let mut body = std::pin::pin!(http_body_util::Limited::new(body, MAX_FORM_BYTES));
        // Sized whole at the first data, so the password is never left behind in a buffer
        // outgrown; not before, so a body that never comes holds nothing.
        let mut out = Zeroizing::new(Vec::new());
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    Refusal::TooLarge
                } else {
                    Refusal::Bad("body broken")
                }
            })?;
            if let Ok(data) = frame.into_data() {
                if out.capacity() == 0 {
                    out.reserve_exact(MAX_FORM_BYTES);
                }
                out.extend_from_slice(&data);
            }
        }
        Ok(out)
    };
    tokio::time::timeout(BODY_TIMEOUT, read)
        .await
        .unwrap_or(Err(Refusal::Bad("body not sent in time")))
}
