//! The serving threads: one current-thread tokio runtime each, accepting plain and TLS
//! connections from its own copies of the listeners until the drain. Must never: count a thread
//! as serving before its runtime runs and its listeners are registered (`/readyz` says ready
//! from there), or start with none serving.

use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

use super::{clone_edges, StartError};
use crate::{access_log, busy_poll, downstream, telemetry, upstream, Proxy};

/// One listener as a serving thread holds it: the socket and what it serves.
type StdEdge = (std::net::TcpListener, downstream::Edge);

/// Starts `cfg.threads` serving threads, each on its own copy of `edges` (closed here: this one
/// would keep the sockets listening through the drain, connections completed by the kernel and
/// never served, instead of refused at once), and waits until each serves or failed to.
///
/// Errors: [`StartError::Threads`] when none serves (an exit status of 0 would tell systemd's
/// `Restart=on-failure` and monitoring that tessera stopped as asked, and `/readyz` would say
/// ready); some missing are logged.
pub(super) async fn start(
    edges: Vec<StdEdge>,
    proxy: &Arc<Proxy>,
    cfg: &downstream::ServerConfig,
    phase: &watch::Receiver<telemetry::Phase>,
) -> Result<Vec<JoinHandle<()>>, StartError> {
    let mut threads = Vec::with_capacity(cfg.threads);
    let mut serving = Vec::with_capacity(cfg.threads);
    let mut failed = None;
    for index in 0..cfg.threads {
        let (ready, serves) = oneshot::channel();
        let spawned = clone_edges(&edges).and_then(|edges| {
            let (proxy, server, phase) = (proxy.clone(), cfg.clone(), phase.clone());
            std::thread::Builder::new()
                .name(format!("tessera-serve-{index}"))
                .spawn(move || serving_thread(index, edges, proxy, server, phase, ready))
        });
        match spawned {
            Ok(handle) => {
                threads.push(handle);
                serving.push(serves);
            }
            Err(e) => {
                tracing::error!(cause = %e, index, "cannot start a serving thread");
                failed = Some(e);
            }
        }
    }
    drop(edges);
    let mut any = false;
    for serves in serving {
        // A thread that ended without a word (a panic) does not serve.
        any |= serves.await.unwrap_or(false);
    }
    if any {
        return Ok(threads);
    }
    for t in threads {
        let _ = t.join();
    }
    Err(StartError::Threads {
        key: "server.threads",
        source: failed.unwrap_or_else(|| {
            std::io::Error::other("no serving thread could start (the errors above say why)")
        }),
    })
}

/// One serving thread: a current-thread runtime accepting from its clones of the listeners,
/// until `phase` says the drain began. Says on `ready` whether it serves.
fn serving_thread(
    index: usize,
    edges: Vec<StdEdge>,
    proxy: Arc<Proxy>,
    cfg: downstream::ServerConfig,
    phase: watch::Receiver<telemetry::Phase>,
    ready: oneshot::Sender<bool>,
) {
    upstream::set_serving_thread(index);
    access_log::batch_on_this_thread();
    busy_poll::enable(cfg.busy_poll);
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(|| {
            access_log::flush();
            busy_poll::before_park();
        })
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(cause = %e, index, "cannot start a serving thread's runtime");
            let _ = ready.send(false);
            return;
        }
    };
    rt.block_on(async move {
        let listeners = match register(edges) {
            Ok(listeners) => listeners,
            Err(e) => {
                tracing::error!(cause = %e, index, "cannot register a listener");
                let _ = ready.send(false);
                return;
            }
        };
        let _ = ready.send(true);
        let mut accepting = listeners.into_iter().map(|(listener, edge)| {
            let (proxy, cfg, mut phase) = (proxy.clone(), cfg.clone(), phase.clone());
            async move {
                let shutdown = async move {
                    let _ = phase.wait_for(|p| *p == telemetry::Phase::Draining).await;
                };
                // A new connection ends a busy poll too.
                busy_poll::watch(&listener);
                downstream::serve(listener, edge, proxy, &cfg, shutdown).await
            }
        });
        // At most two: the plain and the TLS listener.
        let (first, second) = (accepting.next(), accepting.next());
        tokio::join!(
            async move {
                if let Some(f) = first {
                    f.await
                }
            },
            async move {
                if let Some(f) = second {
                    f.await
                }
            }
        );
    });
    access_log::flush();
}

/// `edges` registered with the current runtime, all or none.
fn register(edges: Vec<StdEdge>) -> std::io::Result<Vec<(TcpListener, downstream::Edge)>> {
    edges
        .into_iter()
        .map(|(listener, edge)| Ok((TcpListener::from_std(listener)?, edge)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proxy on an embedded store in `dir` (no request reaches it), serving on 2 threads.
    fn proxy_in(dir: &std::path::Path) -> (Arc<Proxy>, downstream::ServerConfig) {
        let text = format!(
            "[server]\nthreads = 2\n[upstream]\nurl = \"http://127.0.0.1:9\"\n\
             [token]\nsecret = \"{}\"\n[session]\nstore = \"embedded:{}/s\"\n\
             [credentials]\nkeys = {{ k1 = \"AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\" }}\n",
            "s".repeat(64),
            dir.display()
        );
        let cfg = crate::Config::from_toml(&text).unwrap();
        (Arc::new(Proxy::from_config(&cfg).unwrap()), cfg.server)
    }

    /// A thread whose listener cannot be registered (here a file, which epoll refuses) does not
    /// serve; with none serving, start-up fails naming the key.
    #[tokio::test]
    async fn start_up_fails_when_no_thread_serves() {
        let dir = tempfile::tempdir().unwrap();
        let (proxy, cfg) = proxy_in(dir.path());
        let (_phase, phase_rx) = watch::channel(telemetry::Phase::Starting);
        let file = std::fs::File::create(dir.path().join("not-a-socket")).unwrap();
        let not_a_socket = std::net::TcpListener::from(std::os::fd::OwnedFd::from(file));
        // Non-blocking, as a listener given to tokio is: what fails is the registration.
        not_a_socket.set_nonblocking(true).unwrap();
        let edges = vec![(not_a_socket, downstream::Edge::Plain)];
        let err = start(edges, &proxy, &cfg, &phase_rx).await.unwrap_err();
        assert!(
            err.to_string()
                .starts_with("config key `server.threads`: cannot start its threads: "),
            "{err}"
        );
    }

    /// Every thread serves a real listener, and ends at the drain.
    #[tokio::test]
    async fn threads_serve_until_the_drain() {
        let dir = tempfile::tempdir().unwrap();
        let (proxy, cfg) = proxy_in(dir.path());
        let (phase, phase_rx) = watch::channel(telemetry::Phase::Starting);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let edges = vec![(listener, downstream::Edge::Plain)];
        let threads = start(edges, &proxy, &cfg, &phase_rx).await.unwrap();
        assert_eq!(threads.len(), 2);
        phase.send_replace(telemetry::Phase::Draining);
        tokio::task::spawn_blocking(move || threads.into_iter().for_each(|t| t.join().unwrap()))
            .await
            .unwrap();
    }
}
