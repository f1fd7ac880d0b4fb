//! `[server]`: the downstream listener's settings and request limits, as validated by `config`.

use std::net::SocketAddr;
use std::time::Duration;

/// `[server]`.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address `tessera serve` binds for plain HTTP/1.1 and h2c. Default `127.0.0.1:8080`;
    /// with `[tls]`, none unless set.
    pub listen: Option<SocketAddr>,
    /// `server.redirect_to_https`: the plain listener answers every request with a 308 to the
    /// same host and path on https, at this port (`tls.listen`'s). Default off.
    pub redirect_to_https: Option<u16>,
    /// `server.fastopen`: TCP Fast Open (RFC 7413) on the plain and the TLS listener, as
    /// nginx's `listen ... fastopen`: a returning client's first bytes ride in its SYN. Needs the
    /// kernel's server side on (`net.ipv4.tcp_fastopen` with bit 2, e.g. 3). Default off.
    pub fastopen: bool,
    /// Cap on the sum of request header names + values, bytes; above -> 431. Default 16384.
    pub max_header_bytes: usize,
    /// Cap on the request-target length, bytes; above -> 414. Default 8192.
    pub max_uri_bytes: usize,
    /// Cap on the request body, bytes; above -> 413. `0` = unlimited. Default 0.
    pub max_body_bytes: u64,
    /// HTTP/1.1: time a client has to send a request head, from its first byte (then 408 and
    /// close; on the fast path also for a buffered body); an idle keep-alive connection is closed
    /// after the same time. h2c: a connection with no request open for this time is sent
    /// GOAWAY, and dropped when idle for the same time again. Default 30 s.
    pub header_read_timeout: Duration,
    /// Longest a response waits for the client to take its next bytes (nginx's `send_timeout`,
    /// counted between two successive writes, not for the whole response). A write that the
    /// client's full socket buffer does not take for this long ends the connection with a reset
    /// (also a WebSocket tunnel's), and the response's upstream connection is closed (it was
    /// mid-body). HTTP/2: a stream whose client grants no flow-control window is cut once hyper
    /// has held its next bytes this long (checked every quarter of it): its body is dropped, the
    /// other streams go on. So a client that stops reading holds an upstream connection for
    /// about this long at most. Default 60 s.
    pub send_timeout: Duration,
    /// How long a shutdown keeps serving, with `/readyz` answering 503, before its drain
    /// (Caddy's `shutdown_delay`): a balancer that polls readiness, or Kubernetes, whose
    /// endpoints lag the signal, stops sending new connections meanwhile instead of having
    /// them refused. 0..=600 s; default 0 (the drain begins at once).
    pub shutdown_delay: Duration,
    /// How long open connections get to finish once the drain begins (nginx's
    /// `worker_shutdown_timeout`, Caddy's `grace_period`); those still open then are closed
    /// (TCP and QUIC alike). 1 ms..=3600 s; default 10 s.
    pub shutdown_timeout: Duration,
    /// Most streams one h2c connection may have open at once, announced in the server's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` (RFC 9113 section 6.5.2; nginx's
    /// `http2_max_concurrent_streams`); a client that opens more has them refused with
    /// `REFUSED_STREAM`. 1..=1000. Default 200 (hyper's). Each open stream may hold an upstream
    /// connection, so one h2c connection asks for at most this many at once.
    pub http2_max_concurrent_streams: u32,
    /// Serving threads, each a single-threaded runtime that accepts from the shared listener and
    /// runs its connections start to finish (thread per core). Default: the number of CPUs.
    pub threads: usize,
    /// How long a serving thread checks its sockets for readiness before it sleeps (busy
    /// polling, `server.busy_poll_us`, 0..=1000 µs): lower latency at low load for a busy core
    /// between requests. Default 0 (off).
    pub busy_poll: Duration,
    /// Peers (addresses or CIDR blocks) whose `X-Forwarded-For` and `X-Forwarded-Proto` are
    /// believed: a load balancer or TLS terminator in front of tessera. For a request from one
    /// of them, the client is the rightmost `X-Forwarded-For` entry that is not itself trusted
    /// (nginx's `set_real_ip_from` + `real_ip_recursive on`). Default empty: every peer is the
    /// client, and client-sent forwarding headers are dropped.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Every connection on the TCP listeners (`server.listen`, `tls.listen`) starts with a
    /// PROXY protocol header (HAProxy's v1 or v2) from a peer in `trusted_proxies` naming the
    /// client (`server.proxy_protocol`, nginx's `listen ... proxy_protocol`): a load balancer
    /// that passes TCP on (AWS NLB, HAProxy in TCP mode). Default false.
    pub proxy_protocol: bool,
    /// Fields set on every response tessera answers (`server.response_headers`, nginx's
    /// `add_header ... always`), replacing an upstream field of the same name: e.g.
    /// `Strict-Transport-Security` once tessera terminates TLS. Default none.
    pub response_headers: Vec<(http::HeaderName, http::HeaderValue)>,
    /// Which proxied answers get `Cache-Control: private` (`server.private_responses`), so that
    /// a cache in front does not serve one user's answer to another. Default
    /// [`PrivateResponses::Unmarked`](crate::screen::PrivateResponses).
    pub private_responses: crate::screen::PrivateResponses,
    /// Forward a path holding an encoded slash (`%2F`, `%5C`, their overlong and full-width
    /// forms) or a backslash outside a dot segment, instead of refusing it with 400 (false,
    /// the default, as Tomcat and Apache's `AllowEncodedSlashes Off`). Dot segments in any
    /// encoding are refused either way (`screen::path`).
    pub allow_encoded_slashes: bool,
    /// Path prefixes (`server.allow_encoded_slashes_under`, each starting and ending with `/`)
    /// under which a request's path is let through as with `allow_encoded_slashes`: a JMAP
    /// download's file name (`/jmap/download/{accountId}/{blobId}/{name}`), whose `/` a client
    /// sends as `%2F` (RFC 8620 section 6.2, RFC 6570). Default none.
    pub allow_encoded_slashes_under: Vec<String>,
    /// Longest wait between two reads of a request body (nginx's `client_body_timeout`): a
    /// body that stalls this long ends its request with 408 and closes its upstream connection.
    /// Default 60 s.
    pub client_body_timeout: Duration,
    /// Most client connections open at once (all serving threads together); past it no
    /// connection is accepted until one closes (they wait in the listen backlog). 0: no limit.
    /// Default 10000 (each holds a descriptor and about 6 KB while idle).
    pub max_connections: usize,
    /// Most client connections one address (IPv6: one /64) has open at once
    /// (`server.max_connections_per_ip`, nginx's `limit_conn`); past it a new one is closed
    /// unanswered (QUIC: closed once its handshake completes, which proves its address).
    /// Connections from `trusted_proxies` (which relay many clients) are not counted. 0 (the
    /// default): no limit.
    pub max_connections_per_ip: usize,
}

/// `[tls]`: the TLS listener (HTTP/1.1 and HTTP/2 chosen by ALPN), as validated by `config`.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// Address the TLS listener binds (`tls.listen`, TCP).
    pub listen: SocketAddr,
    /// The certificate served when the client names no host, or one no `[[tls.sni]]` entry
    /// lists (`tls.certificate` + `tls.private_key`); `names` is empty.
    pub default: Identity,
    /// `[[tls.sni]]`: a certificate per group of host names, chosen by the ClientHello's SNI
    /// (RFC 6066 section 3), exact names before `*.` wildcards.
    pub sni: Vec<Identity>,
    /// Oldest protocol version accepted (`tls.min_version`, "1.2" or "1.3"). Default 1.2.
    pub min_version: TlsVersion,
    /// Stateless session tickets (RFC 5077 / RFC 8446 section 4.6.1) besides the server's
    /// session cache (`tls.session_tickets`, nginx's `ssl_session_tickets`). Default true.
    pub session_tickets: bool,
    /// `tls.session_ticket_keys`: the secrets tickets are sealed under (the first) and opened
    /// under (any), shared by every instance that lists them (nginx's
    /// `ssl_session_ticket_key`); empty (the default): keys of this process's own, made at
    /// start and rotated every 6 hours.
    pub session_ticket_keys: Vec<Secret>,
}

/// A configured secret (`env:`, `file:` or literal): zeroed when dropped, never shown by
/// `Debug`, so that a configuration printed whole shows no key.
#[derive(Clone)]
pub struct Secret(zeroize::Zeroizing<String>);

impl Secret {
    /// Wraps a resolved secret.
    pub fn new(text: zeroize::Zeroizing<String>) -> Self {
        Self(text)
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl AsRef<[u8]> for Secret {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// A certificate chain and its private key, as PEM text read from the configured files.
#[derive(Clone)]
pub struct Identity {
    /// Host names this identity serves (`[[tls.sni]] server_names`; `*.example.com` matches one
    /// label); empty for the default certificate.
    pub names: Vec<String>,
    /// The config key of the chain (`tls.certificate`, `tls.sni[0].certificate`), for errors.
    pub key_name: String,
    /// PEM: the leaf certificate first, then its intermediates.
    pub chain_pem: String,
    /// PEM: PKCS#8, PKCS#1 (RSA) or SEC1 (EC) private key.
    pub key_pem: zeroize::Zeroizing<String>,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("names", &self.names)
            .field("key_name", &self.key_name)
            .finish_non_exhaustive()
    }
}

/// `tls.min_version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsVersion {
    /// TLS 1.2 (RFC 5246) and 1.3.
    Tls12,
    /// TLS 1.3 (RFC 8446) only.
    Tls13,
}

/// `[http3]`: HTTP/3 over QUIC on UDP (RFC 9114), with the `[tls]` certificates.
#[derive(Debug, Clone)]
pub struct Http3Config {
    /// UDP address (`http3.listen`). Default: `tls.listen`'s address, on UDP.
    pub listen: SocketAddr,
    /// Threads of HTTP/3's own runtime (`http3.threads`). Default 1: no cross-thread wake-ups
    /// between quinn's drivers and the requests (about 30 % less CPU per upload measured on 2
    /// cores, docs/benchmarks-edge.md); more spread many connections over more cores (one
    /// connection's packets are always handled by one task). 1..=1024.
    pub threads: usize,
    /// 0-RTT (`http3.early_data`): requests a resuming client sends before the handshake
    /// completes; GET, HEAD and OPTIONS go on at once with `Early-Data: 1` (RFC 8470), any other
    /// method waits for the handshake. Default true.
    pub early_data: bool,
    /// `ma` of the `Alt-Svc: h3=":PORT"` field added to responses over TLS, seconds
    /// (`http3.alt_svc_max_age`). Default 86400.
    pub alt_svc_max_age: u64,
    /// Request streams one connection may have open at once (`http3.max_concurrent_streams`,
    /// QUIC's `initial_max_streams_bidi`). Default 100; 1..=10000.
    pub max_concurrent_streams: u32,
    /// A connection with no packet for this long is closed (`http3.idle_timeout_ms`, QUIC's
    /// `max_idle_timeout`). Default 30 s.
    pub idle_timeout: Duration,
    /// When a new connection must first prove it receives at its address (`http3.retry`).
    pub retry: Retry,
    /// `http3.host_key` (nginx's `quic_host_key`): a secret (32+ bytes) the keys of QUIC's
    /// Retry and address tokens, stateless resets and connection ids are derived from, so that
    /// they outlive a restart; one per instance (docs/protocols.md says why). Read at start.
    /// Default none: keys of the process's own.
    pub host_key: Option<Secret>,
}

/// When a QUIC handshake is answered with a Retry first (RFC 9000 section 8.1.2): the client
/// must come back with the token it carries, which proves that it receives at its source
/// address. It costs that client one round trip, and spares the server a spoofed address's
/// handshake (its CPU, its place under `server.max_connections`, the bytes sent to a victim).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Only while many handshakes from unvalidated addresses are in progress (a flood of
    /// spoofed Initials): 128, or an eighth of `server.max_connections` if fewer. Default.
    Auto,
    /// Every new connection (nginx's `quic_retry on`): one round trip more for each.
    Always,
}
