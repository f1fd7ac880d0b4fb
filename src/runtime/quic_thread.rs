//! The threads HTTP/3 runs on (`http3.threads`): a runtime of its own for quinn's endpoint
//! driver, its connection drivers and every request over them. With one thread (the default) a
//! datagram, its connection and its request are handled without cross-thread wake-ups, as the
//! serving threads do for TCP; more threads spread many connections over more cores.

use super::{quic_endpoint, StartError};
use crate::{downstream, Config};

/// The HTTP/3 threads and the endpoint made on them, when `[http3]` has its socket.
///
/// Errors: the threads cannot be started, or the endpoint cannot be made (see `quic_endpoint`).
pub(super) fn start(
    cfg: &Config,
    tls: Option<&downstream::TlsServer>,
    socket: Option<std::net::UdpSocket>,
) -> Result<(Option<QuicThreads>, Option<quinn::Endpoint>), StartError> {
    let (Some(h3), Some(_)) = (&cfg.http3, &socket) else {
        return Ok((None, None));
    };
    let threads = QuicThreads::start(h3.threads).map_err(|source| StartError::Threads {
        key: "http3.threads",
        source,
    })?;
    let endpoint = {
        let _on = threads.handle().enter();
        quic_endpoint(cfg, tls, socket)?
    };
    Ok((Some(threads), endpoint))
}

/// A running HTTP/3 runtime; stopped when dropped (its remaining tasks are dropped with it).
pub(super) struct QuicThreads {
    handle: tokio::runtime::Handle,
    /// One thread: the thread driving the current-thread runtime ends when this is sent.
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// More: the multi-thread runtime itself, shut down without waiting (drop may run on an
    /// async thread, where waiting is not allowed).
    runtime: Option<tokio::runtime::Runtime>,
}

impl QuicThreads {
    /// Starts `threads` threads named `tessera-http3`: a current-thread runtime driven by its
    /// own thread for 1, a multi-thread runtime with that many workers otherwise.
    ///
    /// Errors: the runtime or its thread cannot be made (out of memory or threads).
    pub(super) fn start(threads: usize) -> std::io::Result<Self> {
        if threads > 1 {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .thread_name("tessera-http3")
                .enable_all()
                .build()?;
            return Ok(Self {
                handle: rt.handle().clone(),
                stop: None,
                runtime: Some(rt),
            });
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("tessera-http3".into())
            .spawn(move || {
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })?;
        Ok(Self {
            handle,
            stop: Some(stop),
            runtime: None,
        })
    }

    /// The runtime: enter it to make the endpoint (quinn spawns its drivers on the runtime
    /// current when it is made) and spawn the serving task on it.
    pub(super) fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

impl Drop for QuicThreads {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}
