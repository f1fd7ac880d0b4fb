//! The JWKS document of an external identity provider (RFC 7517): fetched over https (rustls,
//! the system roots or `token.jwks_ca`), http or a file, parsed into verifying keys by `kid`,
//! cached and refreshed. Must never: take a key without a `kid`, a symmetric key, or one of an
//! algorithm not pinned.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use sha2::Digest;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

use super::Algorithm;

use super::jwk_set::parse_jwks;
use super::keys::{KeyError, VerifyKey};

/// Where the JWKS document comes from.
#[derive(Debug, Clone)]
pub enum JwksSource {
    /// `file:PATH`, re-read on refresh.
    File(PathBuf),
    /// `https://host[:port]/path` (with the TLS client settings of [`jwks_tls`]) or
    /// `http://host[:port]/path` (`None`: plain HTTP, for loopback or a sidecar).
    Url(http::Uri, Option<Arc<ClientConfig>>),
}

/// TLS client settings for fetching a JWKS over https: TLS 1.2 and 1.3 (rustls' safe defaults,
/// ring provider), ALPN `http/1.1`, the server's certificate checked against the CA certificates
/// in the PEM file `ca` (they alone are trusted) or, without it, the system's trust store
/// (`rustls-native-certs`: `SSL_CERT_FILE`/`SSL_CERT_DIR`, else the distribution's bundle).
///
/// Errors, as a sentence for the config key: `ca` unreadable or holding no certificate; no
/// usable root certificate in the system store.
pub fn jwks_tls(ca: Option<&Path>) -> Result<Arc<ClientConfig>, String> {
    use tokio_rustls::rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut roots = RootCertStore::empty();
    match ca {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("cannot read CA certificates from {}: {e}", path.display()))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(format!(
                    "{} holds no usable CA certificate (PEM, \"-----BEGIN CERTIFICATE-----\")",
                    path.display()
                ));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                let why = found
                    .errors
                    .first()
                    .map_or(String::new(), |e| format!(" ({e})"));
                return Err(format!("no trusted root certificate in the system store{why}: install the ca-certificates package, or set token.jwks_ca to the provider's CA file"));
            }
        }
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS settings: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// `token.jwks*` settings.
#[derive(Debug, Clone)]
pub struct JwksConfig {
    /// The document's location.
    pub source: JwksSource,
    /// Periodic refresh interval. Default 300 s.
    pub refresh: Duration,
    /// Least time between two refreshes caused by an unknown `kid`. Default 30 s.
    pub min_refresh: Duration,
}

pub(super) struct Jwks {
    pub(super) cfg: JwksConfig,
    /// An https source's TLS settings now: `cfg`'s at start, a reload's after it
    /// ([`Jwks::replace_tls`]: `token.jwks_ca` read again).
    tls: RwLock<Option<Arc<ClientConfig>>>,
    pub(super) allowed: Vec<Algorithm>,
    pub(super) keys: RwLock<Arc<HashMap<String, VerifyKey>>>,
    /// Serialises fetches; holds what the last one found.
    pub(super) last: tokio::sync::Mutex<LastFetch>,
    /// The keys changed since a caller last learned of it (and cleared the verified-token
    /// cache): set by the fetch, taken by the caller in its own future, so that a caller gone
    /// meanwhile (a client that disconnected during an unknown-`kid` fetch) leaves it to the
    /// next one instead of losing it.
    pub(super) uncleared: std::sync::atomic::AtomicBool,
}

/// The last JWKS fetch: when it was tried, and the SHA-256 of the document last loaded.
#[derive(Default)]
pub(super) struct LastFetch {
    at: Option<Instant>,
    loaded: Option<[u8; 32]>,
}

/// Whether a refresh for an unknown `kid` may fetch ([`Jwks::refresh_for_unknown_kid`]).
enum Turn {
    Free,
    /// Tried within `token.jwks_min_refresh_seconds`.
    Taken,
    /// A fetch holds the lock now.
    Fetching,
}

impl Jwks {
    /// No keys yet; those of `cfg`'s document that verify one of `allowed` once fetched.
    pub(super) fn new(cfg: JwksConfig, allowed: &[Algorithm]) -> Self {
        let tls = match &cfg.source {
            JwksSource::Url(_, tls) => tls.clone(),
            JwksSource::File(_) => None,
        };
        Self {
            cfg,
            tls: RwLock::new(tls),
            allowed: allowed.to_vec(),
            keys: RwLock::new(Arc::new(HashMap::new())),
            last: Default::default(),
            uncleared: Default::default(),
        }
    }

    /// Takes the TLS settings of `new` (a reloaded configuration's, its `token.jwks_ca` read
    /// again) for the next fetches, when both fetch the same `https://` URL; whether it did.
    pub(super) fn replace_tls(&self, new: &JwksConfig) -> bool {
        match (&self.cfg.source, &new.source) {
            (JwksSource::Url(now, Some(_)), JwksSource::Url(next, Some(tls))) if now == next => {
                *self.tls.write().unwrap_or_else(|p| p.into_inner()) = Some(tls.clone());
                true
            }
            _ => false,
        }
    }

    /// Where to fetch from now: `cfg`'s source with the TLS settings in place.
    fn source(&self) -> JwksSource {
        match &self.cfg.source {
            JwksSource::Url(uri, Some(_)) => {
                let tls = self.tls.read().unwrap_or_else(|p| p.into_inner()).clone();
                JwksSource::Url(uri.clone(), tls)
            }
            other => other.clone(),
        }
    }

    /// A refresh asked by an unknown `kid` (at most one per `token.jwks_min_refresh_seconds`);
    /// whether the keys changed since a caller last learned of it (the caller then clears the
    /// verified-token cache). The fetch is a task of its own: a request that goes away (a reset
    /// HTTP/2 stream) must not cancel a fetch that has taken the rate limit's turn. No task is
    /// spawned when the turn is taken (no valid signature is needed to name an unknown `kid`,
    /// and a task per such request would queue behind a fetch by the thousand): refused at once
    /// if one was tried within the limit; if a fetch is under way (a rotation's first token
    /// started it, or the periodic refresh), its end is awaited here, so the caller's second
    /// attempt finds the key it brings.
    pub(super) async fn refresh_for_unknown_kid(self: Arc<Self>) -> bool {
        let turn = match self.last.try_lock() {
            Ok(last) => match last
                .at
                .is_some_and(|at| at.elapsed() < self.cfg.min_refresh)
            {
                true => Turn::Taken,
                false => Turn::Free,
            },
            Err(_) => Turn::Fetching,
        };
        match turn {
            Turn::Taken => {}
            Turn::Fetching => drop(self.last.lock().await),
            Turn::Free => {
                let jwks = self.clone();
                let fetch = async move { jwks.refresh(Some(jwks.cfg.min_refresh)).await };
                let _ = tokio::spawn(fetch).await;
            }
        }
        self.take_changed()
    }

    /// Fetches now (at start and every `token.jwks_refresh_seconds`); whether the keys changed
    /// since a caller last learned of it.
    pub(super) async fn refresh_now(&self) -> bool {
        self.refresh(None).await;
        self.take_changed()
    }

    fn take_changed(&self) -> bool {
        self.uncleared
            .swap(false, std::sync::atomic::Ordering::AcqRel)
    }

    /// Fetches the document (not within `min_gap` of the last try, when given) and loads its
    /// keys. Returns whether the keys changed: `false` for the same document as before (a
    /// refresh asked by an unknown `kid` finds that most of the time; answered `true`, the
    /// verified-token cache would be emptied every `jwks_min_refresh_seconds` by anyone sending
    /// made-up kids), and when the fetch or the document failed (logged; the keys stay).
    pub(super) async fn refresh(&self, min_gap: Option<Duration>) -> bool {
        let mut last = self.last.lock().await;
        if let (Some(gap), Some(at)) = (min_gap, last.at) {
            if at.elapsed() < gap {
                return false;
            }
        }
        last.at = Some(Instant::now());
        let doc = match fetch(&self.source()).await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "JWKS refresh failed; keeping the previous keys");
                return false;
            }
        };
        let digest: [u8; 32] = sha2::Sha256::digest(&doc).into();
        if last.loaded == Some(digest) {
            return false;
        }
        match parse_jwks(&doc, &self.allowed) {
            Ok(keys) => {
                tracing::info!(keys = keys.len(), "JWKS loaded");
                *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
                self.uncleared
                    .store(true, std::sync::atomic::Ordering::Release);
                last.loaded = Some(digest);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "JWKS document rejected; keeping the previous keys");
                false
            }
        }
    }
}

/// Fetches the JWKS `cfg` names once and parses it as a refresh would, for `check-config`:
/// how many of its keys verify one of `allowed`.
///
/// Errors: the document cannot be fetched (its URL or file named), or is not a JWKS.
pub async fn check_jwks(cfg: &JwksConfig, allowed: &[Algorithm]) -> Result<usize, String> {
    let doc = fetch(&cfg.source).await.map_err(|e| e.0)?;
    Ok(parse_jwks(&doc, allowed).map_err(|e| e.0)?.len())
}

/// Largest JWKS document accepted, bytes.
pub(super) const MAX_JWKS_BYTES: usize = 1 << 20;

pub(super) async fn fetch(source: &JwksSource) -> Result<Vec<u8>, KeyError> {
    match source {
        // Bounded as a URL's: requests naming a new kid wait for a fetch under way.
        JwksSource::File(path) => {
            tokio::time::timeout(Duration::from_secs(5), tokio::fs::read(path))
                .await
                .map_err(|_| KeyError(format!("{}: not read within 5 s", path.display())))?
                .map_err(|e| KeyError(format!("cannot read {}: {e}", path.display())))
        }
        JwksSource::Url(uri, tls) => {
            tokio::time::timeout(Duration::from_secs(5), fetch_http(uri, tls.as_ref()))
                .await
                .map_err(|_| KeyError(format!("{uri}: no answer within 5 s")))?
        }
    }
}

/// GET `uri` (HTTP/1.1; over TLS when `tls` is given, the certificate checked for the URL's
/// host, a name or an IP address): the body of a 2xx answer, at most [`MAX_JWKS_BYTES`].
pub(super) async fn fetch_http(
    uri: &http::Uri,
    tls: Option<&Arc<ClientConfig>>,
) -> Result<Vec<u8>, KeyError> {
    let err = |e: &dyn std::fmt::Display| KeyError(format!("{uri}: {e}"));
    let auth = uri.authority().ok_or_else(|| err(&"no host"))?;
    let host = auth.host().trim_start_matches('[').trim_end_matches(']');
    let port = auth
        .port_u16()
        .unwrap_or(if tls.is_some() { 443 } else { 80 });
    let tcp = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| err(&e))?;
    match tls {
        None => get(tcp, uri, auth).await.map_err(|e| err(&e)),
        Some(cfg) => {
            let name = ServerName::try_from(host.to_owned()).map_err(|e| err(&e))?;
            let stream = tokio_rustls::TlsConnector::from(cfg.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| err(&format!("TLS: {e}")))?;
            get(stream, uri, auth).await.map_err(|e| err(&e))
        }
    }
}

/// One GET on a fresh connection `io`.
pub(super) async fn get<IO>(
    io: IO,
    uri: &http::Uri,
    auth: &http::uri::Authority,
) -> Result<Vec<u8>, String>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use http_body_util::BodyExt;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
        .await
        .map_err(|e| err(&e))?;
    tokio::spawn(conn);
    let req = http::Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header(http::header::HOST, auth.as_str())
        .header(http::header::ACCEPT, "application/json")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| err(&e))?;
    let resp = send.send_request(req).await.map_err(|e| err(&e))?;
    if !resp.status().is_success() {
        return Err(err(&format!("status {}", resp.status())));
    }
    let body = http_body_util::Limited::new(resp.into_body(), MAX_JWKS_BYTES)
        .collect()
        .await
        .map_err(|e| err(&e))?;
    Ok(body.to_bytes().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A JWKS read from a file holding no key (the directory kept alive by the caller).
    fn empty_file_jwks() -> (tempfile::TempDir, Arc<Jwks>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jwks.json");
        std::fs::write(&path, r#"{"keys":[]}"#).unwrap();
        (dir, file_jwks(path))
    }

    fn file_jwks(path: std::path::PathBuf) -> Arc<Jwks> {
        let cfg = JwksConfig {
            source: JwksSource::File(path),
            refresh: Duration::from_secs(300),
            min_refresh: Duration::from_secs(30),
        };
        Arc::new(Jwks::new(cfg, &[Algorithm::EdDSA]))
    }

    #[tokio::test]
    async fn a_refresh_says_changed_only_for_another_document() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jwks.json");
        let key = |kid: &str| {
            format!(
                r#"{{"kty":"OKP","crv":"Ed25519","kid":"{kid}","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}}"#
            )
        };
        std::fs::write(&path, format!(r#"{{"keys":[{}]}}"#, key("a"))).unwrap();
        let jwks = file_jwks(path.clone());
        assert!(jwks.refresh(None).await, "first load");
        assert!(!jwks.refresh(None).await, "the same document");
        let two = format!(r#"{{"keys":[{},{}]}}"#, key("a"), key("b"));
        std::fs::write(&path, two).unwrap();
        assert!(jwks.refresh(None).await, "a key added");
        std::fs::write(&path, "not json").unwrap();
        assert!(!jwks.refresh(None).await, "a broken document");
        assert_eq!(jwks.keys.read().unwrap().len(), 2, "kept");
    }

    /// A token of a rotated key arriving while another request's fetch is under way waits for
    /// that fetch (its second attempt finds the key), rather than being refused at once; one
    /// arriving after it, within the rate limit, is refused at once.
    #[tokio::test]
    async fn an_unknown_kid_during_a_fetch_waits_for_it() {
        let (_dir, jwks) = empty_file_jwks();
        let fetching = jwks.last.lock().await; // a fetch under way
        let waiter = tokio::spawn(jwks.clone().refresh_for_unknown_kid());
        tokio::task::yield_now().await;
        assert!(
            !waiter.is_finished(),
            "refused while the fetch was under way"
        );
        drop(fetching);
        assert!(!waiter.await.unwrap());
        // A fetch by this path takes the turn; the next one within the limit is refused at once.
        assert!(
            jwks.clone().refresh_for_unknown_kid().await,
            "the first load"
        );
        assert!(jwks.last.lock().await.at.is_some());
        let again = tokio::time::timeout(Duration::from_secs(1), jwks.refresh_for_unknown_kid());
        assert_eq!(again.await, Ok(false));
    }

    /// A change loaded by a fetch whose requester went away (its client disconnected) is told
    /// to the next caller, which clears the verified-token cache: else tokens of a withdrawn
    /// key would be served from it until they expire.
    #[tokio::test]
    async fn a_change_no_caller_learned_of_is_told_to_the_next() {
        let (_dir, jwks) = empty_file_jwks();
        // The spawned fetch of a requester that is gone: it loads, nobody hears.
        assert!(jwks.refresh(Some(Duration::from_secs(30))).await);
        // The next unknown kid, within the rate limit: no fetch, but it learns of the change.
        assert!(jwks.clone().refresh_for_unknown_kid().await);
        assert!(!jwks.refresh_for_unknown_kid().await, "told once");
    }
}
