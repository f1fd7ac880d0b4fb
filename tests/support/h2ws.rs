//! A WebSocket over HTTP/2 (RFC 8441) for tests: an extended CONNECT sent with the h2 crate,
//! and its stream as a byte stream that tokio-tungstenite speaks WebSocket over.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// One HTTP/2 stream's data both ways, as a byte stream.
pub struct H2Io {
    send: h2::SendStream<Bytes>,
    recv: h2::RecvStream,
    pending: Bytes,
}

/// Opens an HTTP/2 connection (prior knowledge) to `port` on loopback and sends an extended
/// CONNECT for `path` (`:protocol websocket`, `sec-websocket-version: 13`) with `headers`;
/// returns the response head and, for a 200, the stream.
pub async fn connect(
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
) -> (http::response::Parts, Option<H2Io>) {
    let mut client = super::h2c_client(port).await;
    // The server's SETTINGS say whether it takes extended CONNECT; they come first.
    for _ in 0..100 {
        client = client.ready().await.unwrap();
        if client.is_extended_connect_protocol_enabled() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        client.is_extended_connect_protocol_enabled(),
        "no SETTINGS_ENABLE_CONNECT_PROTOCOL"
    );
    let mut req = http::Request::builder()
        .method("CONNECT")
        .uri(format!("http://127.0.0.1:{port}{path}"))
        .header("sec-websocket-version", "13")
        .extension(h2::ext::Protocol::from_static("websocket"));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let (resp, send) = client.send_request(req.body(()).unwrap(), false).unwrap();
    let (parts, recv) = resp.await.unwrap().into_parts();
    let io = (parts.status == 200).then(|| H2Io {
        send,
        recv,
        pending: Bytes::new(),
    });
    (parts, io)
}

impl AsyncRead for H2Io {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pending.is_empty() {
            match ready!(self.recv.poll_data(cx)) {
                None => return Poll::Ready(Ok(())),
                Some(Err(e)) => return Poll::Ready(Err(io::Error::other(e))),
                Some(Ok(data)) => {
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    self.pending = data;
                }
            }
        }
        let n = buf.remaining().min(self.pending.len());
        buf.put_slice(&self.pending[..n]);
        self.pending.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for H2Io {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.send.reserve_capacity(data.len());
        loop {
            match ready!(self.send.poll_capacity(cx)) {
                None => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
                Some(Err(e)) => return Poll::Ready(Err(io::Error::other(e))),
                Some(Ok(0)) => continue,
                Some(Ok(n)) => {
                    let n = n.min(data.len());
                    let chunk = Bytes::copy_from_slice(&data[..n]);
                    self.send
                        .send_data(chunk, false)
                        .map_err(io::Error::other)?;
                    return Poll::Ready(Ok(n));
                }
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        let _ = self.send.send_data(Bytes::new(), true);
        Poll::Ready(Ok(()))
    }
}
