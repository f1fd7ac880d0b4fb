//! What systemd is told of the service's state (sd_notify(3)), when it started tessera with
//! `NOTIFY_SOCKET` set (`Type=notify` or `Type=notify-reload`): ready once the listeners serve,
//! reloading and ready again around each SIGHUP, stopping when the shutdown begins. Without
//! `NOTIFY_SOCKET` each is nothing. A failed send is logged at debug level, never fatal.

use sd_notify::NotifyState;

/// The listeners serve.
pub(super) fn ready() {
    send(&[NotifyState::Ready]);
}

/// A SIGHUP's reload begins (`Type=notify-reload` waits for the `READY=1` that follows; systemd
/// 253 and later want the monotonic time with it).
pub(super) fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[NotifyState::Reloading, now]),
        Err(_) => send(&[NotifyState::Reloading]),
    }
}

/// The shutdown begins.
pub(super) fn stopping() {
    send(&[NotifyState::Stopping]);
}

fn send(state: &[NotifyState<'_>]) {
    // `false`: NOTIFY_SOCKET stays set for the reloads and the stop to come.
    if let Err(e) = sd_notify::notify(false, state) {
        tracing::debug!(cause = %e, "cannot notify the service manager");
    }
}
