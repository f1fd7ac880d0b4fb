//! An upstream connection's transport: TCP, or TLS over it (`https://` upstreams). Writes
//! must be flushed at the end of a request (TLS holds records back; TCP's flush does nothing).
//! Must never: read TLS records as plain bytes (a raw `recv` is asked of TCP only).

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// An upstream connection's transport.
pub enum UpIo {
    /// `http://`.
    Tcp(TcpStream),
    /// `https://`: boxed, being about 1 KiB.
    Tls(Box<TlsStream<TcpStream>>),
}

impl UpIo {
    /// The TCP socket underneath: readiness, `SO_LINGER`, busy polling.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Self::Tcp(s) => s,
            Self::Tls(s) => s.get_ref().0,
        }
    }

    /// Reads what has already arrived, without waiting: `Err(WouldBlock)` when nothing has.
    /// TCP asks the kernel directly (`recv` with `MSG_DONTWAIT`: the runtime's readiness may
    /// lag); TLS reads through the session (a record still in flight is nothing yet).
    pub fn read_now(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => rustix::net::recv(&*s, buf, rustix::net::RecvFlags::DONTWAIT)
                .map(|(n, _)| n)
                .map_err(io::Error::from),
            Self::Tls(s) => {
                let mut cx = Context::from_waker(Waker::noop());
                let mut read = ReadBuf::new(buf);
                match Pin::new(&mut **s).poll_read(&mut cx, &mut read) {
                    Poll::Ready(Ok(())) => Ok(read.filled().len()),
                    Poll::Ready(Err(e)) => Err(e),
                    Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
                }
            }
        }
    }

    /// Whether an idle connection is still usable: nothing arrived, or (TLS) only what the
    /// session consumes itself (a TLS 1.3 session ticket). Costs a read only when the socket
    /// has signalled readiness since it went idle.
    pub fn is_idle_open(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        match self.tcp().poll_read_ready(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Err(_)) => false,
            Poll::Ready(Ok(())) => {
                let mut probe = [0u8; 1];
                match self {
                    Self::Tcp(s) => {
                        matches!(s.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
                    }
                    Self::Tls(_) => {
                        matches!(self.read_now(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
                    }
                }
            }
        }
    }
}

impl AsyncRead for UpIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Tcp(s) => s.is_write_vectored(),
            Self::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}
