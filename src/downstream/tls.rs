//! The TLS listener's server side: rustls (ring provider) with ALPN `h2` and `http/1.1`, TLS 1.2
//! and 1.3 from `tls.min_version`, a certificate per SNI name ([`super::certs`]), and resumption
//! by both the session cache and stateless tickets. One cache and the process's own ticket keys
//! live for the process (ticket keys shared by several instances come from the configuration,
//! [`super::tickets`]), so a certificate reload (SIGHUP) forgets no session. Must never: accept early data
//! (tokio-rustls never reads it: a client would think its request sent), or drop an open
//! connection on a reload.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::server::{ProducesTickets, StoresServerSessions};
use rustls::ServerConfig;
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

use super::certs::{CertError, CertSummary, Certificates};
use super::session_cache::AgingCache;
use super::settings::{TlsConfig, TlsVersion};
use super::tickets::SharedTickets;
use crate::telemetry::TlsCounts;

/// Sessions the server-side cache keeps for resumption (nginx's `ssl_session_cache` holds about
/// 4,000 per MB), each for at most 12 hours; an entry is a few hundred bytes.
const SESSION_CACHE: usize = 20_000;

/// How long a NEW_TOKEN address token stays good (RFC 9000 section 8.1.3): a client back within
/// a day skips the Retry round trip.
const ADDRESS_TOKEN_LIFETIME: Duration = Duration::from_secs(24 * 60 * 60);

/// Bytes of the log that makes each address token single-use (two Bloom filters of half that
/// each), and its hash count: 6 suits 2,000,000 uses per filter period (the token lifetime),
/// with 2 % false positives, each of which only takes that client for unvalidated.
const ADDRESS_TOKEN_LOG: (usize, u32) = (4 << 20, 6);

/// ALPN protocol ids (RFC 7301), preferred first.
pub(super) const ALPN_H2: &[u8] = b"h2";
const ALPN_HTTP11: &[u8] = b"http/1.1";
/// Offered alone by `curl --http1.0` (7.88 to 8.4, Debian 12's): without it rustls would end
/// such a handshake with `no_application_protocol`, where nginx serves it. Served as any
/// HTTP/1.x.
const ALPN_HTTP10: &[u8] = b"http/1.0";
const ALPN_H3: &[u8] = b"h3";

/// The TLS server: the current rustls configuration (replaced whole on reload), and what
/// outlives a reload.
pub struct TlsServer {
    current: RwLock<Arc<ServerConfig>>,
    /// The process's own ticket keys (rustls rotates them every 6 hours), for when
    /// `tls.session_ticket_keys` lists none.
    ticketer: Option<Arc<dyn ProducesTickets>>,
    cache: Arc<dyn StoresServerSessions>,
    /// QUIC's own session cache: its sessions carry QUIC transport parameters and, with 0-RTT,
    /// must be resumed statefully (rustls refuses early data on stateless tickets).
    quic_cache: Arc<dyn StoresServerSessions>,
    /// The key of QUIC's Retry and address tokens when `http3.host_key` is unset (HKDF over 64 random bytes, as quinn makes it), the same
    /// for every configuration made: a token issued just before a reload stays good after it.
    quic_token_key: Arc<ring::hkdf::Prk>,
    /// The address tokens (NEW_TOKEN) used so far, so that none is accepted twice; kept across
    /// reloads with the key.
    quic_token_log: Arc<dyn quinn::TokenLog>,
    /// `Alt-Svc` for responses over TLS when HTTP/3 is served (RFC 7838).
    alt_svc: Option<http::HeaderValue>,
    /// The names and expiry of the certificates in place.
    certificates: RwLock<Vec<CertSummary>>,
}

impl std::fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsServer")
            .field("tickets", &self.ticketer.is_some())
            .finish_non_exhaustive()
    }
}

impl TlsServer {
    /// The server for `cfg`: certificates loaded, a new ticketer when `tls.session_tickets`.
    ///
    /// Errors: a certificate or key that cannot be served (naming its config key), or no
    /// randomness for the ticket keys.
    pub fn new(cfg: &TlsConfig) -> Result<Self, CertError> {
        let ticketer = match cfg.session_tickets {
            true => Some(
                rustls::crypto::ring::Ticketer::new().map_err(|e| CertError {
                    key: "tls.session_tickets".into(),
                    problem: format!("cannot make ticket keys: {e}; set it to false"),
                })?,
            ),
            false => None,
        };
        let cache: Arc<dyn StoresServerSessions> = AgingCache::new(SESSION_CACHE);
        let first = build(
            cfg,
            &Resumption::tcp(tickets(cfg, ticketer.as_ref()), &cache),
        )?;
        let certificates = super::expiry::summaries(cfg);
        super::expiry::log(&certificates, crate::unix_now() as i64, true);
        Ok(Self {
            current: RwLock::new(first),
            ticketer,
            cache,
            quic_cache: AgingCache::new(SESSION_CACHE),
            quic_token_key: token_key(),
            quic_token_log: Arc::new(quinn::BloomTokenLog::new(
                ADDRESS_TOKEN_LOG.0,
                ADDRESS_TOKEN_LOG.1,
            )),
            alt_svc: None,
            certificates: RwLock::new(certificates),
        })
    }

    /// Advertises HTTP/3 on UDP `port` to clients over TLS: `Alt-Svc: h3=":PORT"; ma=MAX_AGE`
    /// on every response (RFC 7838; the host is the one the client used).
    pub fn with_alt_svc(self, port: u16, max_age: u64) -> Self {
        let value = format!("h3=\":{port}\"; ma={max_age}");
        Self {
            alt_svc: http::HeaderValue::from_str(&value).ok(),
            ..self
        }
    }

    /// The `Alt-Svc` value responses over TLS carry, if any.
    pub(super) fn alt_svc(&self) -> Option<&http::HeaderValue> {
        self.alt_svc.as_ref()
    }

    /// Puts `cfg`'s certificates, version floor and ticket keys in place for new handshakes; open
    /// connections keep theirs, and tickets and cached sessions stay valid (shared tickets:
    /// those under a key `tls.session_ticket_keys` still lists). `tls.listen` and
    /// `tls.session_tickets` apply at the next restart.
    ///
    /// Errors: as [`TlsServer::new`], or an expired certificate not served already
    /// ([`super::expiry::refuse_expired`]); the running certificates are kept then.
    pub fn reload(&self, cfg: &TlsConfig) -> Result<(), CertError> {
        if cfg.session_tickets != self.ticketer.is_some() {
            tracing::warn!(
                "tls.session_tickets changed: it applies at the next restart (and with it \
                 tls.session_ticket_keys, when tickets were off at start)"
            );
        }
        let tickets = tickets(cfg, self.ticketer.as_ref());
        let next = build(cfg, &Resumption::tcp(tickets, &self.cache))?;
        let certificates = super::expiry::summaries(cfg);
        let now = crate::unix_now() as i64;
        super::expiry::refuse_expired(&self.certificates(), &certificates, now)?;
        super::expiry::log(&certificates, now, true);
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = next;
        *self.certificates.write().unwrap_or_else(|p| p.into_inner()) = certificates;
        Ok(())
    }

    /// The names and expiry of the certificates in place, the default one first.
    pub fn certificates(&self) -> Vec<CertSummary> {
        let certificates = self.certificates.read();
        certificates.unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Warns of each certificate in place that has expired or expires within 14 days; run once a
    /// day, as the same warnings at start and reload would otherwise be the last.
    pub fn recheck_expiry(&self) {
        super::expiry::log(&self.certificates(), crate::unix_now() as i64, false);
    }

    /// The QUIC server's configuration (RFC 9001): TLS 1.3 only, ALPN `h3`, the same
    /// certificates; 0-RTT accepted when `h3.early_data` (then resumption is stateful, as rustls
    /// requires for early data; otherwise tickets as over TCP); two NEW_TOKEN address tokens
    /// sent to each client once its handshake is done, each good once for a day. Made at start
    /// and on each reload ([`quinn::Endpoint::set_server_config`]).
    ///
    /// Errors: as [`TlsServer::new`].
    pub fn quic_config(
        &self,
        cfg: &TlsConfig,
        h3: &super::Http3Config,
    ) -> Result<quinn::ServerConfig, CertError> {
        let resumption = Resumption {
            ticketer: (!h3.early_data)
                .then(|| tickets(cfg, self.ticketer.as_ref()))
                .flatten(),
            cache: &self.quic_cache,
            alpn: &[ALPN_H3],
            versions: &[&rustls::version::TLS13],
            early_data: h3.early_data,
        };
        let tls = build(cfg, &resumption)?;
        let crypto =
            quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| CertError {
                key: "http3".into(),
                problem: format!("no TLS 1.3 cipher suite QUIC can use: {e}"),
            })?;
        let mut transport = quinn::TransportConfig::default();
        transport
            .max_concurrent_bidi_streams(h3.max_concurrent_streams.into())
            .max_idle_timeout(quinn::IdleTimeout::try_from(h3.idle_timeout).ok())
            // What one connection may have unread: quinn's default has no connection-wide
            // bound (100 streams of 1.25 MB each: 125 MB); HTTP/3 takes no DATAGRAM frames, whose
            // buffer quinn would fill for a reader that never comes; and the client needs 3
            // unidirectional streams (control, QPACK's two; RFC 9114 section 6.2), not 100.
            .receive_window(CONNECTION_WINDOW.into())
            .datagram_receive_buffer_size(None)
            .max_concurrent_uni_streams(MAX_UNI_STREAMS.into());
        let mut tokens = quinn::ValidationTokenConfig::default();
        tokens
            .log(self.quic_token_log.clone())
            .lifetime(ADDRESS_TOKEN_LIFETIME);
        let token_key = match &h3.host_key {
            Some(secret) => super::host_key::token_key(secret),
            None => self.quic_token_key.clone(),
        };
        let mut server = quinn::ServerConfig::new(Arc::new(crypto), token_key);
        server
            .transport_config(Arc::new(transport))
            .validation_token_config(tokens);
        Ok(server)
    }

    /// The acceptor for one handshake, with the configuration in place now.
    pub(super) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        let cfg = self.current.read().unwrap_or_else(|p| p.into_inner());
        tokio_rustls::TlsAcceptor::from(cfg.clone())
    }
}

/// The flow-control window of one QUIC connection, bytes: what its client may send ahead of
/// what tessera has read, over all its streams (each has quinn's 1.25 MB window within it):
/// room for six request bodies no one reads yet (waiting for an upstream connection) before
/// the connection's other streams wait too.
const CONNECTION_WINDOW: u32 = 8 << 20;

/// Unidirectional streams a client may have open at once: HTTP/3's three and room for
/// extensions and grease (RFC 9114 section 6.2.3), which h3 stops.
const MAX_UNI_STREAMS: u32 = 8;

/// A fresh key for QUIC's Retry and NEW_TOKEN tokens (see [`TlsServer::quic_config`]).
fn token_key() -> Arc<ring::hkdf::Prk> {
    let mut master = [0u8; 64];
    getrandom::getrandom(&mut master).expect("the OS random source");
    let key = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, &[]).extract(&master);
    master.fill(0);
    Arc::new(key)
}

/// The ticketer for `cfg`: one under `tls.session_ticket_keys` when it lists any (made anew
/// on each reload: the same keys open the same tickets), else the process's own; `None` when
/// the process started with tickets off (`tls.session_tickets` applies at a restart: `own` is
/// made at start exactly when it was on).
fn tickets(
    cfg: &TlsConfig,
    own: Option<&Arc<dyn ProducesTickets>>,
) -> Option<Arc<dyn ProducesTickets>> {
    let own = own?;
    match cfg.session_ticket_keys.as_slice() {
        [] => Some(own.clone()),
        keys => Some(Arc::new(SharedTickets::new(keys))),
    }
}

/// How one rustls configuration resumes sessions and what it offers.
struct Resumption<'a> {
    ticketer: Option<Arc<dyn ProducesTickets>>,
    cache: &'a Arc<dyn StoresServerSessions>,
    alpn: &'a [&'a [u8]],
    /// `None`: from `tls.min_version`.
    versions: &'a [&'static rustls::SupportedProtocolVersion],
    early_data: bool,
}

impl<'a> Resumption<'a> {
    /// TLS over TCP: ALPN `h2` and `http/1.1`, no early data (tokio-rustls never reads it).
    fn tcp(
        ticketer: Option<Arc<dyn ProducesTickets>>,
        cache: &'a Arc<dyn StoresServerSessions>,
    ) -> Self {
        Self {
            ticketer,
            cache,
            alpn: &[ALPN_H2, ALPN_HTTP11, ALPN_HTTP10],
            versions: &[],
            early_data: false,
        }
    }
}

/// One rustls server configuration.
fn build(cfg: &TlsConfig, r: &Resumption<'_>) -> Result<Arc<ServerConfig>, CertError> {
    let certs = Certificates::load(&cfg.default, &cfg.sni)?;
    let versions: &[&rustls::SupportedProtocolVersion] = match (r.versions, cfg.min_version) {
        ([], TlsVersion::Tls12) => &[&rustls::version::TLS13, &rustls::version::TLS12],
        ([], TlsVersion::Tls13) => &[&rustls::version::TLS13],
        (fixed, _) => fixed,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut server = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|e| CertError {
            key: "tls.min_version".into(),
            problem: e.to_string(),
        })?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(certs));
    server.alpn_protocols = r.alpn.iter().map(|p| p.to_vec()).collect();
    server.session_storage = r.cache.clone();
    if let Some(t) = &r.ticketer {
        server.ticketer = t.clone();
    }
    // QUIC allows 0 or u32::MAX (RFC 9001 section 4.6.1).
    server.max_early_data_size = if r.early_data { u32::MAX } else { 0 };
    Ok(Arc::new(server))
}

/// What came of a connection to the TLS listener.
pub(super) enum Handshaken {
    /// The handshake is done; `true` when the client chose HTTP/2 by ALPN.
    Tls(Box<TlsStream<TcpStream>>, bool),
    /// The client spoke plain HTTP (its first byte is an upper-case letter, a method's; a TLS
    /// record starts with its type, 22 for a handshake): answered 400 as nginx does.
    PlainHttp(TcpStream),
    /// Refused, broken (logged at debug), not done within the timeout, or closed before its
    /// first byte.
    Failed,
}

/// Runs the server side of a handshake on `tcp`, for at most `timeout` (the head-read timeout:
/// a client that opens a connection and sends nothing holds it no longer than on plain HTTP).
/// Counts each outcome in `counts`, but for a connection closed or reset before its first byte
/// (a TCP health check).
pub(super) async fn handshake(
    tls: &TlsServer,
    tcp: TcpStream,
    timeout: Duration,
    counts: Option<&TlsCounts>,
) -> Handshaken {
    let count = |c: fn(&TlsCounts) -> &AtomicU64| counts.map(|n| TlsCounts::add(c(n)));
    let handshake = async {
        let mut first = [0u8; 1];
        // One peek per connection, beside a handshake's tens of microseconds of crypto.
        match tcp.peek(&mut first).await {
            // Closed or reset before a byte (a balancer's health check ends either way).
            Ok(0) | Err(_) => return Ok(Handshaken::Failed),
            Ok(_) if first[0].is_ascii_uppercase() => {
                count(|c| &c.plain_http);
                return Ok(Handshaken::PlainHttp(tcp));
            }
            _ => {}
        }
        let stream = tls.acceptor().accept(tcp).await?;
        let server = stream.get_ref().1;
        match server.handshake_kind() == Some(rustls::HandshakeKind::Resumed) {
            true => count(|c| &c.resumed),
            false => count(|c| &c.full),
        };
        let h2 = server.alpn_protocol() == Some(ALPN_H2);
        Ok::<_, std::io::Error>(Handshaken::Tls(Box::new(stream), h2))
    };
    match tokio::time::timeout(timeout, handshake).await {
        Ok(Ok(done)) => done,
        Ok(Err(e)) => {
            count(|c| &c.failed);
            tracing::debug!(cause = %e, "TLS handshake failed");
            Handshaken::Failed
        }
        Err(_) => {
            count(|c| &c.timed_out);
            tracing::debug!("TLS handshake not done within server.header_read_timeout_ms");
            Handshaken::Failed
        }
    }
}
