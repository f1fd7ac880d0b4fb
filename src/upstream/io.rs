//! An upstream connection's transport: TCP, or TLS over it (`https://` upstreams). Writes
//! must be flushed at the end of a request (TLS holds records back; TCP's flush does nothing).
//! Must never: read TLS records as plain bytes (a raw `recv` is asked of TCP only).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_util::either::Either;

/// An upstream connection's transport: `Left`, TCP (`http://`); `Right`, TLS over it
/// (`https://`, boxed: about 1 KiB). Reads and writes go through tokio-util's `Either`.
pub type UpIo = Either<TcpStream, Box<TlsStream<TcpStream>>>;

/// What the pool and the HTTP/1.1 driver ask of a transport beyond reading and writing.
pub trait Transport {
    /// The TCP socket underneath: readiness, `SO_LINGER`, busy polling.
    fn tcp(&self) -> &TcpStream;

    /// Reads what has already arrived, without waiting: `Err(WouldBlock)` when nothing has.
    /// TCP asks the kernel directly (`recv` with `MSG_DONTWAIT`: the runtime's readiness may
    /// lag); TLS reads through the session (a record still in flight is nothing yet).
    fn read_now(&mut self, buf: &mut [u8]) -> io::Result<usize>;

    /// Whether an idle connection is still usable: nothing arrived, or (TLS) only what the
    /// session consumes itself (a TLS 1.3 session ticket). Costs a read only when the socket
    /// has signalled readiness since it went idle.
    fn is_idle_open(&mut self) -> bool;

    /// Whether bytes already read off the socket wait to be read (TLS: plaintext the session
    /// decrypted beyond what the caller took, or the peer's `close_notify`). The socket then
    /// signals nothing more: rustls stops reading while it holds plaintext. Always false for
    /// TCP, whose unread bytes stay in the kernel for [`Transport::is_idle_open`] to find.
    fn holds_unread(&self) -> bool;
}

impl Transport for UpIo {
    fn tcp(&self) -> &TcpStream {
        match self {
            Either::Left(s) => s,
            Either::Right(s) => s.get_ref().0,
        }
    }

    fn read_now(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Either::Left(s) => rustix::net::recv(&*s, buf, rustix::net::RecvFlags::DONTWAIT)
                .map(|(n, _)| n)
                .map_err(io::Error::from),
            Either::Right(s) => {
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

    fn holds_unread(&self) -> bool {
        match self {
            Either::Left(_) => false,
            // Established, so rustls wants to read unless it holds plaintext or saw the close.
            Either::Right(s) => !s.get_ref().1.wants_read(),
        }
    }

    fn is_idle_open(&mut self) -> bool {
        if self.holds_unread() {
            return false;
        }
        let mut cx = Context::from_waker(Waker::noop());
        match self.tcp().poll_read_ready(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Err(_)) => false,
            Poll::Ready(Ok(())) => {
                let mut probe = [0u8; 1];
                let would_block = |r: io::Result<usize>| matches!(r, Err(e) if e.kind() == io::ErrorKind::WouldBlock);
                match self {
                    Either::Left(s) => would_block(s.try_read(&mut probe)),
                    Either::Right(_) => would_block(self.read_now(&mut probe)),
                }
            }
        }
    }
}
