//! WebSocket tunnels: once the upstream has answered a WebSocket upgrade with 101 Switching
//! Protocols (RFC 6455 section 4, RFC 9110 section 7.8), the downstream and the upstream
//! connection carry bytes both ways, unchanged, until one side closes.
//!
//! Owns: the copy, the idle timeout, the cut when the session ends or the server shuts down.
//! When one side closes, its close is passed on to the other (a TCP FIN, after the bytes it sent
//! before it), which gets [`HALF_CLOSED_GRACE`] from then to close too: WebSocket has its own
//! closing handshake and no use for a half-closed connection, and a client that keeps its end
//! open must not keep holding an upstream connection. The upstream connection keeps its pool
//! slot for the tunnel's life (it counts toward `upstream.max_connections`, as it holds an
//! upstream process or thread) and is closed, never reused, when the tunnel ends.
//!
//! A cut ends with a WebSocket Close frame (RFC 6455 section 5.5.1) to each side whose stream is
//! between frames, so that a client learns why (1008 for its session's end, 1001 for an idle
//! timeout or a shutdown) instead of seeing 1006: each direction's written bytes are followed
//! frame header by frame header ([`FrameEdge`]; payloads are skipped, never read). The frame
//! header is 2 to 14 bytes of a fixed layout, so it is followed here rather than through a
//! WebSocket library. Must never: rewrite or inject bytes into a frame (a Close frame goes only
//! between frames, and not to a side that was already sent one, its peer's, passed through), or
//! keep copying after the session that opened the tunnel was revoked or expired.

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::pool::Conn;
use crate::stall::SendTimed;

use super::frames::{close_frame, FrameEdge};

/// A WebSocket tunnel's client side: any byte stream (the client's socket, or hyper's upgraded
/// connection).
pub trait ClientIo: AsyncRead + AsyncWrite + Unpin + Send {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send> ClientIo for T {}

/// The client side of a tunnel, boxed: the downstream decides what it is
/// (`downstream::client_side`), the proxy only passes it on.
pub type ClientSide = Box<dyn ClientIo>;

/// Turns hyper's upgraded connection into a tunnel's client side, given `server.send_timeout_ms`
/// (what the downstream gives the proxy, so that the proxy need not know the downstream's
/// socket types).
pub type ClientSideFn = fn(hyper::upgrade::Upgraded, Duration) -> ClientSide;

/// The [`ClientSideFn`] for a connection of unknown kind (tests driving the proxy directly):
/// hyper's upgraded stream as it is, without a send timeout.
pub fn upgraded_as_is(upgraded: hyper::upgrade::Upgraded, _: Duration) -> ClientSide {
    Box::new(hyper_util::rt::TokioIo::new(upgraded))
}

use crate::session::{Ended, Watch};

/// How long a tunnel stays open after one side closed, for the other side to close as well;
/// the other direction's bytes are still carried meanwhile.
pub const HALF_CLOSED_GRACE: Duration = Duration::from_secs(1);

/// How long a cut tunnel waits for both sides to answer its Close frames (or just close) before
/// it drops their sockets.
pub const CLOSING_WAIT: Duration = Duration::from_secs(1);

/// Close status codes (RFC 6455 section 7.4.1).
const GOING_AWAY: u16 = 1001;

pub(super) const POLICY_VIOLATION: u16 = 1008;

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
    /// The server is shutting down.
    Shutdown,
}

impl TunnelEnd {
    /// The Close frame a cut sends: `(code to the client, reason)` (the upstream gets 1001,
    /// going away, with the same reason); `None` when a side closed or failed by itself.
    fn goodbye(&self) -> Option<(u16, &'static str)> {
        match self {
            Self::Closed | Self::Failed(_) => None,
            Self::Idle => Some((GOING_AWAY, "idle timeout")),
            Self::Session(Ended::Revoked) => Some((POLICY_VIOLATION, "session revoked")),
            Self::Session(Ended::Expired) => Some((POLICY_VIOLATION, "session expired")),
            Self::Shutdown => Some((GOING_AWAY, "server shutting down")),
        }
    }
}

impl std::fmt::Display for TunnelEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Closed => f.write_str("closed"),
            Self::Failed(e) => write!(f, "failed: {e}"),
            Self::Idle => f.write_str("idle timeout"),
            Self::Session(e) => write!(f, "{e}"),
            Self::Shutdown => f.write_str("shutdown"),
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
    /// The Close code sent to the client when the tunnel was cut; `None` when it was not cut,
    /// or the client's stream was inside a frame or had its Close frame already.
    pub close_code: Option<u16>,
}

/// Byte counts and the time of the last byte, shared by both directions of one tunnel.
struct Activity {
    start: Instant,
    up: AtomicU64,
    down: AtomicU64,
    /// Milliseconds after `start` of the last byte read from either side.
    last_ms: AtomicU64,
    /// Notified when a side's close was passed on to the other (its last bytes written).
    closed: tokio::sync::Notify,
}

impl Activity {
    fn saw(&self, counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Resolves [`HALF_CLOSED_GRACE`] after the first side's close was passed on.
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

/// One side of a tunnel, counting what is read from it and following the frames read from it
/// and written to it.
struct Counted<'a, T> {
    io: T,
    activity: &'a Activity,
    read: &'a AtomicU64,
    read_edge: FrameEdge,
    written: FrameEdge,
}

impl<T: AsyncRead + AsyncWrite + Unpin> Counted<'_, T> {
    /// A cut tunnel's Close frame to this side, with `code` and `reason`, if its stream is
    /// between frames and has no Close frame yet; masked when `masked` (frames to the upstream
    /// are a client's, RFC 6455 section 5.3). Returns whether it was written.
    async fn send_close(&mut self, code: u16, reason: &str, masked: bool) -> bool {
        let frame = (self.written.at_edge() && !self.written.close_seen)
            .then(|| close_frame(code, reason, masked))
            .flatten();
        match frame {
            Some(frame) => self.io.write_all(&frame).await.is_ok() && self.io.flush().await.is_ok(),
            None => false,
        }
    }

    /// Our FIN, then reads and drops what the peer still sends until its Close frame is whole
    /// or it closes, so that our close does not reset the connection under the frames. The
    /// caller bounds it in time.
    async fn finish(&mut self) {
        let _ = self.io.shutdown().await;
        let mut sink = [0u8; 1024];
        while !(self.read_edge.close_seen && self.read_edge.at_edge()) {
            match self.io.read(&mut sink).await {
                Ok(n) if n > 0 => self.read_edge.feed(&sink[..n]),
                _ => break,
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<'_, T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.activity.saw(self.read, n);
            let this = &mut *self;
            this.read_edge.feed(&buf.filled()[before..]);
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
        let this = &mut *self;
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            this.written.feed(&buf[..n]);
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// The other side's close passed on, once every byte it sent before it is written here:
    /// the half-closed grace starts then, not at the close itself, so that a slow reader still
    /// gets the last bytes (a Close frame among them).
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_shutdown(cx);
        if polled.is_ready() {
            // `notify_one` keeps a permit when nobody waits yet.
            self.activity.closed.notify_one();
        }
        polled
    }
}

impl Tunnel {
    pub(super) fn new(conn: Conn) -> Self {
        Self { conn }
    }

    /// Copies bytes between `downstream` (the client's upgraded connection) and the upstream
    /// until both sides have closed (or one, and the other not within [`HALF_CLOSED_GRACE`]), a
    /// socket fails (a write to the upstream that makes no progress for `send_timeout` fails
    /// too: the downstream's own writes are bounded by the downstream), no byte moves either
    /// way for `idle` (`None`: no limit), `watch` reports the session's end, or `stop` is
    /// cancelled (shutdown). The last three are cuts: each side between frames gets a Close
    /// frame (the client 1008 for the session's end, else 1001; the upstream 1001) and at most
    /// [`CLOSING_WAIT`] to answer. Either way both connections are closed when this returns.
    pub async fn run<D>(
        mut self,
        downstream: D,
        idle: Option<Duration>,
        send_timeout: Duration,
        watch: Option<Watch>,
        stop: CancellationToken,
    ) -> TunnelReport
    where
        D: AsyncRead + AsyncWrite + Unpin,
    {
        let (upstream, early) = self.conn.h1().switched_io();
        let upstream = SendTimed::new(upstream, send_timeout);
        carry(downstream, upstream, &early, idle, watch, stop).await
    }
}

/// [`Tunnel::run`] between any two byte streams, `early` (bytes the upstream sent with its 101)
/// first to the downstream.
async fn carry<D, U>(
    downstream: D,
    upstream: U,
    early: &[u8],
    idle: Option<Duration>,
    mut watch: Option<Watch>,
    stop: CancellationToken,
) -> TunnelReport
where
    D: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let activity = Activity {
        start: Instant::now(),
        up: AtomicU64::new(0),
        down: AtomicU64::new(0),
        last_ms: AtomicU64::new(0),
        closed: tokio::sync::Notify::new(),
    };
    let mut down = Counted {
        io: downstream,
        activity: &activity,
        read: &activity.up,
        read_edge: FrameEdge::default(),
        written: FrameEdge::default(),
    };
    let mut up = Counted {
        io: upstream,
        activity: &activity,
        read: &activity.down,
        read_edge: FrameEdge::default(),
        written: FrameEdge::default(),
    };
    let copy = async {
        if !early.is_empty() {
            activity.saw(&activity.down, early.len());
            up.read_edge.feed(early);
            down.write_all(early).await?;
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
        () = stop.cancelled() => TunnelEnd::Shutdown,
    };
    let mut close_code = None;
    if let Some((code, reason)) = end.goodbye() {
        let deadline = Instant::now() + CLOSING_WAIT;
        let sending = async {
            tokio::join!(
                down.send_close(code, reason, false),
                up.send_close(GOING_AWAY, reason, true)
            )
        };
        if let Ok((true, _)) = tokio::time::timeout_at(deadline, sending).await {
            close_code = Some(code);
        }
        let finishing = async { tokio::join!(down.finish(), up.finish()) };
        let _ = tokio::time::timeout_at(deadline, finishing).await;
    }
    TunnelReport {
        end,
        up_bytes: activity.up.load(Ordering::Relaxed),
        down_bytes: activity.down.load(Ordering::Relaxed),
        duration: activity.start.elapsed(),
        close_code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The upstream sends its last bytes and closes while the client reads none: the tunnel
    /// stays open until the client has taken them all, and the grace for the client to close
    /// too starts only then.
    #[tokio::test(start_paused = true)]
    async fn a_slow_client_gets_every_byte_sent_before_the_upstreams_close() {
        let (down, mut client) = tokio::io::duplex(16);
        let (up, mut origin) = tokio::io::duplex(1024);
        let tunnel = tokio::spawn(carry(down, up, b"", None, None, CancellationToken::new()));
        let sent = [7u8; 100];
        origin.write_all(&sent).await.unwrap();
        origin.shutdown().await.unwrap();
        tokio::time::sleep(HALF_CLOSED_GRACE * 5).await;
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, sent);
        drop(client);
        let report = tunnel.await.unwrap();
        assert!(matches!(report.end, TunnelEnd::Closed), "{}", report.end);
        assert_eq!(report.down_bytes, 100);
    }
}
