//! WebSocket tunnels: once the upstream has answered a WebSocket upgrade with 101 Switching
//! Protocols (RFC 6455 section 4, RFC 9110 section 7.8), the downstream and the upstream
//! connection carry bytes both ways, unchanged, until one side closes.
//!
//! Owns: the copy, the idle timeout, the cut when the session ends. When one side closes, its
//! close is passed on to the other (a TCP FIN), which gets [`HALF_CLOSED_GRACE`] to close too:
//! WebSocket has its own closing handshake and no use for a half-closed connection, and a client
//! that keeps its end open must not keep holding an upstream connection. The upstream connection keeps
//! its pool slot for the tunnel's life (it counts toward `upstream.max_connections`, as it holds
//! an upstream process or thread) and is closed, never reused, when the tunnel ends. Must never:
//! read or rewrite the frames (the WebSocket protocol is the two ends' business), or keep copying
//! after the session that opened the tunnel was revoked or expired.

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::Instant;

use super::pool::Conn;

/// How long a tunnel stays open after one side closed, for the other side to close as well;
/// the other direction's bytes are still carried meanwhile.
pub const HALF_CLOSED_GRACE: Duration = Duration::from_secs(1);
use crate::session::{Ended, Watch};

/// An upstream connection that switched to the WebSocket protocol, with the bytes the upstream
/// sent after its 101 head. Dropped without [`Tunnel::run`], the connection is closed.
pub struct Tunnel {
    conn: Conn,
}

/// Why a tunnel ended.
#[derive(Debug)]
pub enum TunnelEnd {
    /// Both sides closed (each side's close was passed on to the other), or one did and the
    /// other did not follow within [`HALF_CLOSED_GRACE`].
    Closed,
    /// A socket failed (a reset, a broken pipe).
    Failed(io::Error),
    /// No byte went either way for the idle timeout (`websocket.idle_timeout_ms`).
    Idle,
    /// The session that opened the tunnel was revoked or expired.
    Session(Ended),
}

impl std::fmt::Display for TunnelEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Closed => f.write_str("closed"),
            Self::Failed(e) => write!(f, "failed: {e}"),
            Self::Idle => f.write_str("idle timeout"),
            Self::Session(e) => write!(f, "{e}"),
        }
    }
}

/// What a tunnel carried, when it ended.
#[derive(Debug)]
pub struct TunnelReport {
    /// Why it ended.
    pub end: TunnelEnd,
    /// Bytes read from the downstream client and sent upstream.
    pub up_bytes: u64,
    /// Bytes read from the upstream and sent downstream (the bytes that came with the 101
    /// included).
    pub down_bytes: u64,
    /// From the start of [`Tunnel::run`] to its end.
    pub duration: Duration,
}

/// Byte counts and the time of the last byte, shared by both directions of one tunnel.
struct Activity {
    start: Instant,
    up: AtomicU64,
    down: AtomicU64,
    /// Milliseconds after `start` of the last byte read from either side.
    last_ms: AtomicU64,
    /// Notified when a side's read ends (end of stream).
    closed: tokio::sync::Notify,
}

impl Activity {
    fn saw(&self, counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Resolves [`HALF_CLOSED_GRACE`] after the first side closed.
    async fn half_closed(&self) {
        self.closed.notified().await;
        tokio::time::sleep(HALF_CLOSED_GRACE).await;
    }

    /// Resolves once no byte was read for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let deadline = self.start + last + idle;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    }
}

/// One side of a tunnel, counting what is read from it.
struct Counted<'a, T> {
    io: T,
    activity: &'a Activity,
    read: &'a AtomicU64,
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<'_, T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let room = buf.remaining() > 0;
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.activity.saw(self.read, n);
        } else if room && matches!(polled, Poll::Ready(Ok(()))) {
            // `notify_one` keeps a permit when nobody waits yet.
            self.activity.closed.notify_one();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<'_, T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl Tunnel {
    pub(super) fn new(conn: Conn) -> Self {
        Self { conn }
    }

    /// Copies bytes between `downstream` (the client's upgraded connection) and the upstream
    /// until both sides have closed (or one, and the other not within [`HALF_CLOSED_GRACE`]), a
    /// socket fails, no byte moves either way for `idle`
    /// (`None`: no limit), or `watch` reports the session's end. Either way both connections are
    /// closed when this returns; a cut is a plain TCP close (no WebSocket close frame: the
    /// tunnel does not know where frames begin).
    pub async fn run<D>(
        mut self,
        downstream: D,
        idle: Option<Duration>,
        mut watch: Option<Watch>,
    ) -> TunnelReport
    where
        D: AsyncRead + AsyncWrite + Unpin,
    {
        let activity = Activity {
            start: Instant::now(),
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
            closed: tokio::sync::Notify::new(),
        };
        let (upstream, early) = self.conn.h1().switched_io();
        let mut down = Counted {
            io: downstream,
            activity: &activity,
            read: &activity.up,
        };
        let mut up = Counted {
            io: upstream,
            activity: &activity,
            read: &activity.down,
        };
        let copy = async {
            if !early.is_empty() {
                activity.saw(&activity.down, early.len());
                down.write_all(&early).await?;
            }
            tokio::io::copy_bidirectional(&mut down, &mut up).await
        };
        let ended = poll_fn(|cx| match watch.as_mut() {
            // Registered at once: a tunnel waits on both sides from its start.
            Some(w) => w.poll_ended(cx, true, false, true),
            None => Poll::Pending,
        });
        let idle_out = async {
            match idle {
                Some(idle) => activity.idle_for(idle).await,
                None => std::future::pending().await,
            }
        };
        let end = tokio::select! {
            copied = copy => match copied {
                Ok(_) => TunnelEnd::Closed,
                Err(e) => TunnelEnd::Failed(e),
            },
            () = activity.half_closed() => TunnelEnd::Closed,
            why = ended => TunnelEnd::Session(why),
            () = idle_out => TunnelEnd::Idle,
        };
        TunnelReport {
            end,
            up_bytes: activity.up.load(Ordering::Relaxed),
            down_bytes: activity.down.load(Ordering::Relaxed),
            duration: activity.start.elapsed(),
        }
    }
}
