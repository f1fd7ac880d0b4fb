//! The TLS client of `https://` upstreams: rustls (ring provider), ALPN `http/1.1`, the
//! upstream's certificate checked against `upstream.ca` or the system's roots for
//! `upstream.server_name` (default: the URL's host), an optional client certificate (mTLS), and
//! session resumption (rustls's in-memory client cache: tickets and session ids). Handshakes are
//! counted, full and resumed. Must never: skip the certificate check.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::ClientConfig;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// Sessions the client keeps for resumption, one or two per upstream connection.
const SESSIONS: usize = 1024;

/// The settings an `https://` upstream's client is made from (PEM text, resolved secrets).
#[derive(Clone, Default)]
pub struct UpstreamTlsSettings {
    /// `upstream.ca`: the CA certificates trusted (alone); `None`: the system's roots.
    pub ca_pem: Option<String>,
    /// `upstream.server_name`: sent in SNI and checked in the certificate.
    pub server_name: String,
    /// `upstream.client_certificate` and `upstream.client_private_key` (mTLS): a PEM chain, leaf
    /// first, and its key.
    pub client_identity: Option<(String, zeroize::Zeroizing<String>)>,
}

/// An `https://` upstream's TLS client, shared by every connection of its pool.
pub struct TlsClient {
    /// Replaced whole on SIGHUP ([`TlsClient::take_trust_of`]); read once per new connection.
    connector: RwLock<tokio_rustls::TlsConnector>,
    name: ServerName<'static>,
    full: AtomicU64,
    resumed: AtomicU64,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsClient")
            .field("server_name", &self.name)
            .finish_non_exhaustive()
    }
}

/// A setting the TLS client cannot be made from: its config key and what is wrong.
#[derive(Debug)]
pub struct TlsSettingError {
    /// `upstream.ca`, `upstream.server_name`, `upstream.client_certificate`, ...
    pub key: &'static str,
    /// What is wrong and how to fix it.
    pub problem: String,
}

fn problem(key: &'static str, problem: impl Into<String>) -> TlsSettingError {
    TlsSettingError {
        key,
        problem: problem.into(),
    }
}

impl TlsClient {
    /// The client for `s`.
    ///
    /// Errors: a CA file with no certificate, an empty system store, a server name that is no
    /// DNS name or IP address, or a client key that does not match its certificate.
    pub fn new(s: &UpstreamTlsSettings) -> Result<Self, TlsSettingError> {
        let name = ServerName::try_from(s.server_name.clone()).map_err(|_| {
            problem(
                "upstream.server_name",
                format!("`{}` is no DNS name or IP address", s.server_name),
            )
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| problem("upstream.url", e.to_string()))?
            .with_root_certificates(roots(s.ca_pem.as_deref())?);
        let mut cfg = match &s.client_identity {
            None => builder.with_no_client_auth(),
            Some((chain, key)) => {
                let (chain, key) = identity(chain, key)?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    problem(
                        "upstream.client_private_key",
                        format!("does not fit upstream.client_certificate: {e}"),
                    )
                })?
            }
        };
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        cfg.resumption = rustls::client::Resumption::in_memory_sessions(SESSIONS);
        Ok(Self {
            connector: RwLock::new(tokio_rustls::TlsConnector::from(Arc::new(cfg))),
            name,
            full: AtomicU64::new(0),
            resumed: AtomicU64::new(0),
        })
    }

    /// The client side of a handshake on `tcp` (the caller bounds its time), counted.
    ///
    /// Errors: the handshake failed (certificate refused, protocol error, connection closed).
    pub async fn handshake(&self, tcp: TcpStream) -> std::io::Result<TlsStream<TcpStream>> {
        let connector = self
            .connector
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let stream = connector.connect(self.name.clone(), tcp).await?;
        let resumed = stream.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
        match resumed {
            true => self.resumed.fetch_add(1, Ordering::Relaxed),
            false => self.full.fetch_add(1, Ordering::Relaxed),
        };
        Ok(stream)
    }

    /// Puts `new`'s trusted roots and client certificate in place for the handshakes from now
    /// on (a reload: files renewed at the same paths included); connections open keep theirs.
    /// Sessions kept for resumption are dropped with the old settings, so none resumes under
    /// a trust that is gone. Refused (false, nothing changed) when `new` checks another server
    /// name: that trust is for the upstream a restart will connect to, not this one.
    pub fn take_trust_of(&self, new: &TlsClient) -> bool {
        if new.name != self.name {
            return false;
        }
        let connector = new
            .connector
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        *self
            .connector
            .write()
            .unwrap_or_else(PoisonError::into_inner) = connector;
        true
    }

    /// Handshakes done: (full, resumed).
    pub fn handshakes(&self) -> (u64, u64) {
        (
            self.full.load(Ordering::Relaxed),
            self.resumed.load(Ordering::Relaxed),
        )
    }
}

/// The trusted roots: the CA certificates in `ca` alone, or the system's store.
fn roots(ca: Option<&str>) -> Result<rustls::RootCertStore, TlsSettingError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(pem) => {
            let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| problem("upstream.ca", format!("is not PEM certificates: {e}")))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(problem(
                    "upstream.ca",
                    "holds no usable CA certificate (PEM, \"-----BEGIN CERTIFICATE-----\")",
                ));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err(problem(
                    "upstream.ca",
                    "is not set and the system store holds no root certificate: install the \
                     ca-certificates package, or set upstream.ca to the upstream's CA file",
                ));
            }
        }
    }
    Ok(roots)
}

/// The client certificate chain and key (mTLS).
fn identity(
    chain: &str,
    key: &str,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsSettingError> {
    let chain = CertificateDer::pem_slice_iter(chain.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .ok()
        .filter(|c| !c.is_empty())
        .ok_or_else(|| {
            problem(
                "upstream.client_certificate",
                "holds no PEM certificate; give the client chain, leaf first",
            )
        })?;
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|_| {
        problem(
            "upstream.client_private_key",
            "holds no PEM private key (PKCS#8, RSA or EC)",
        )
    })?;
    Ok((chain, key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reloaded_trust_for_another_server_name_is_refused() {
        let ca = rcgen::generate_simple_self_signed(vec!["ca".into()]).unwrap();
        let client = |name: &str| {
            TlsClient::new(&UpstreamTlsSettings {
                ca_pem: Some(ca.cert.pem()),
                server_name: name.into(),
                client_identity: None,
            })
            .unwrap()
        };
        let running = client("mail.internal");
        assert!(running.take_trust_of(&client("mail.internal")));
        assert!(!running.take_trust_of(&client("other.internal")));
    }
}
