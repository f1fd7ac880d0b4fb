//! `[upstream]`: where requests go and how the pool behaves, as validated by `config`.

use std::time::Duration;

/// `[upstream]`.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Base URL, `http://host:port` or `https://host:port` (an optional path prefix is
    /// prepended to every request path).
    pub url: http::Uri,
    /// The TLS client of an `https://` upstream (`upstream.ca`, `server_name`,
    /// `client_certificate`, `client_private_key`); `None` for `http://`.
    pub tls: Option<std::sync::Arc<super::TlsClient>>,
    /// Hard cap on open upstream connections (idle + busy); requests beyond it queue FIFO.
    /// Keep it at or below the upstream's own limit (Cyrus `maxchild`). Default 64.
    pub max_connections: usize,
    /// Most upstream connections one user (one upstream credential) or one HTTP/2 connection
    /// holds at once; its further requests wait for one of its own (see `upstream::share`).
    /// 1..=max_connections (equal: no bound). Default three quarters of `max_connections`,
    /// rounded up.
    pub max_connections_per_user: usize,
    /// Most requests for an event stream (a `GET` with `Accept: text/event-stream`, what a
    /// page's `EventSource` sends: a JMAP push channel) forwarded at once; each holds an upstream
    /// connection for its life, so past it one is answered 503 and the rest of the pool stays
    /// for API calls. 1..=max_connections (equal: no bound). Default half of `max_connections`.
    pub max_event_streams: usize,
    /// TCP connect + HTTP handshake timeout. Default 5 s.
    pub connect_timeout: Duration,
    /// Longest wait for the upstream's response head with no request-body progress (pool queue
    /// included); past it -> 504. Default 60 s.
    pub response_header_timeout: Duration,
    /// Idle pooled connections older than this are closed; keep it below the upstream's
    /// keep-alive timeout (nginx: 75 s). A response's `Keep-Alive: timeout=N` shortens it for
    /// that connection (see `upstream::conn::H1::idle_limit`). Default 30 s.
    pub idle_timeout: Duration,
    /// Most idle connections kept: past it, the longest idle are closed at the pool's next
    /// check (within 1 s), so an idle tessera holds few of a process-per-connection upstream's
    /// workers (a Cyrus child each). 0..=max_connections. Default a quarter of
    /// `max_connections`, rounded up (16 of 64).
    pub max_idle_connections: usize,
    /// `upstream.probe_timeout_ms`: a new connection is first asked `OPTIONS *` and used only if
    /// answered within this long (see `upstream::pool` probe); one that is not is closed and the
    /// pool's cap lowered by one for a minute. For upstreams that accept more connections than
    /// they serve (Cyrus past `maxchild`). `None` (0, the default): no probe.
    pub probe_timeout: Option<Duration>,
    /// Forward the client's `Host` (true, default) or the upstream URL's authority (false).
    pub preserve_host: bool,
    /// A request id under this name (`upstream.request_id_header`, e.g. `X-Request-Id`;
    /// nginx's `$request_id`): 32 random hex digits, or the one a trusted proxy sent; sent
    /// upstream, returned to the client, logged as `request_id=`. Default none.
    pub request_id_header: Option<http::HeaderName>,
    /// Request fields removed besides hop-by-hop and forwarding ones: identity and routing
    /// fields a client must not set (lowercase; a trailing `*` makes a prefix; `_` matches `-`).
    /// Default `screen::identity::DEFAULT_STRIPPED`.
    pub strip_request_headers: Vec<String>,
    /// Response headers removed besides hop-by-hop ones. Default `["alt-svc"]`.
    pub strip_response_headers: Vec<http::HeaderName>,
    /// `"none"` (default: any idle connection serves any request) or `"session"`: a connection
    /// only carries requests with the same upstream credential, so it never carries two users'
    /// requests. At the cap, a request whose user holds its share waits up to
    /// `affinity_wait_ms` (0..=1000, default 5) for one of its own connections (see
    /// `upstream::pool` and docs/benchmarks.md, "Upstream affinity").
    pub affinity: crate::upstream::Affinity,
    /// Exchanges whose client went away, finished in the background so that their connection is
    /// kept: `drain_wait_ms` (0..=10000, default 250; 0 turns it off) bounds how young an
    /// exchange must be and how long its rest is read, `drain_max_bytes` (0..=16777216, default
    /// 65536; an error with `drain_wait_ms = 0`) how much of a body rest is read (see
    /// `upstream::pool`).
    pub drain: crate::upstream::Drain,
}

impl UpstreamConfig {
    /// Where to connect: `host:port` of `url` (port 443 for `https://`, 80 for `http://` when
    /// the URL names none; an IPv6 host without its brackets).
    pub fn addr(&self) -> String {
        let authority = self
            .url
            .authority()
            .expect("validated: upstream.url has a host");
        let default = if self.tls.is_some() { 443 } else { 80 };
        let port = authority.port_u16().unwrap_or(default);
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        format!("{host}:{port}")
    }
}
