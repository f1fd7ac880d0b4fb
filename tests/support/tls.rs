//! TLS for tests: a test CA and leaf certificates made with rcgen (written as PEM files for
//! tessera, curl, openssl and nginx), the `[tls]` table, and a blocking rustls client that shows
//! which certificate the server presented.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, ServerName};

/// A test CA in a directory of its own; `ca.pem` is what clients trust.
pub struct Pki {
    pub dir: tempfile::TempDir,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl Pki {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tessera test CA");
        let ca = params.self_signed(&key).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        Self {
            dir,
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// The CA certificate's path.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A leaf for `names` (the first is also its CN), written as `{file}.pem` and
    /// `{file}.key`; returns both paths.
    pub fn leaf(&self, file: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        self.leaf_files(file, names, false)
    }

    /// [`Pki::leaf`], valid only in 2020.
    pub fn expired_leaf(&self, file: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        self.leaf_files(file, names, true)
    }

    fn leaf_files(&self, file: &str, names: &[&str], expired: bool) -> (PathBuf, PathBuf) {
        let (cert, key) = self.leaf_pem_with(names, expired);
        let (c, k) = (
            self.path(&format!("{file}.pem")),
            self.path(&format!("{file}.key")),
        );
        std::fs::write(&c, cert).unwrap();
        std::fs::write(&k, key).unwrap();
        (c, k)
    }

    /// A leaf for `names` as PEM text: (certificate, private key).
    pub fn leaf_pem(&self, names: &[&str]) -> (String, String) {
        self.leaf_pem_with(names, false)
    }

    fn leaf_pem_with(&self, names: &[&str], expired: bool) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, names[0]);
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2020, 12, 31);
        }
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// The `[tls]` table for a listener on `port` with the certificate `cert` and key `key`, and
/// `extra` lines after them.
pub fn tls_table(port: u16, cert: &Path, key: &Path, extra: &str) -> String {
    format!(
        "[tls]\nlisten = \"127.0.0.1:{port}\"\ncertificate = \"file:{}\"\nprivate_key = \"file:{}\"\n{extra}\n",
        cert.display(),
        key.display()
    )
}

/// The DER of the first certificate in the PEM file at `path`.
pub fn leaf_der(path: &Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_file_iter(path)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .to_vec()
}

/// A blocking TLS 1.3/1.2 client connection to 127.0.0.1:`port`, trusting `ca`, naming
/// `server_name` in SNI, offering ALPN `http/1.1`.
pub struct Client {
    pub tls: rustls::StreamOwned<rustls::ClientConnection, TcpStream>,
}

impl Client {
    pub fn connect(port: u16, server_name: &str, ca: &Path) -> Self {
        let name = ServerName::try_from(server_name.to_string()).unwrap();
        let conn = rustls::ClientConnection::new(client_config(ca), name).unwrap();
        let tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        while tls.conn.is_handshaking() {
            tls.conn.complete_io(&mut tls.sock).unwrap();
        }
        Self { tls }
    }

    /// The leaf certificate the server presented, DER.
    pub fn leaf(&self) -> Vec<u8> {
        self.tls.conn.peer_certificates().unwrap()[0].to_vec()
    }

    /// A keep-alive `GET path` with `token` (none when empty); returns (status, body). Reads a
    /// `Content-Length` body only.
    pub fn get(&mut self, path: &str, token: &str) -> (u16, String) {
        let auth = match token {
            "" => String::new(),
            t => format!("authorization: Bearer {t}\r\n"),
        };
        write!(
            self.tls,
            "GET {path} HTTP/1.1\r\nhost: localhost\r\n{auth}\r\n"
        )
        .unwrap();
        self.tls.flush().unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            self.tls.read_exact(&mut byte).unwrap();
            head.push(byte[0]);
        }
        let head = String::from_utf8(head).unwrap();
        let status = head[9..12].parse().unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().unwrap())
            })
            .unwrap_or(0);
        let mut body = vec![0u8; len];
        self.tls.read_exact(&mut body).unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}

/// A tokio TLS client connection to 127.0.0.1:`port` for `localhost`, trusting `ca`, offering
/// ALPN `http/1.1` (for clients that take any stream, such as a WebSocket's).
pub async fn tokio_client(
    port: u16,
    ca: &Path,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(client_config(ca))
        .connect(name, tcp)
        .await
        .unwrap()
}

/// TLS 1.2 and 1.3 trusting the CA certificates in `ca` alone, ALPN `http/1.1`.
fn client_config(ca: &Path) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(cfg)
}

/// TLS for test store servers (Redis, MariaDB): one certificate for 127.0.0.1 from a test CA,
/// which every server presents and Redis also offers as its client certificate (replication,
/// the cluster bus, Sentinel to master), and which tessera and the command-line clients present
/// as theirs: Redis requires client certificates (`tls-auth-clients yes`, its default).
pub struct ServerTls {
    pub pki: Pki,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl ServerTls {
    pub fn new() -> Self {
        let pki = Pki::new();
        let (cert, key) = pki.leaf("redis", &["127.0.0.1", "localhost"]);
        Self { pki, cert, key }
    }

    /// Directives for a server listening with TLS only on `port` (`--NAME VALUE` arguments with
    /// `dashes`, `NAME VALUE` lines of a configuration file without).
    pub fn redis_server(&self, port: u16, dashes: bool) -> Vec<String> {
        let files = [
            ("tls-cert-file", self.cert.display().to_string()),
            ("tls-key-file", self.key.display().to_string()),
            ("tls-ca-cert-file", self.pki.ca().display().to_string()),
        ];
        let set = [
            ("port", "0".to_string()),
            ("tls-port", port.to_string()),
            ("tls-auth-clients", "yes".into()),
            ("tls-replication", "yes".into()),
        ];
        let prefix = if dashes { "--" } else { "" };
        files
            .into_iter()
            .chain(set)
            .flat_map(|(k, v)| match dashes {
                true => vec![format!("{prefix}{k}"), v],
                false => vec![format!("{k} {v}")],
            })
            .collect()
    }

    /// redis-cli's arguments for these certificates.
    pub fn redis_cli(&self) -> Vec<String> {
        vec![
            "--tls".into(),
            "--cacert".into(),
            self.pki.ca().display().to_string(),
            "--cert".into(),
            self.cert.display().to_string(),
            "--key".into(),
            self.key.display().to_string(),
        ]
    }

    /// tessera's store URL parameters: the CA and the client certificate.
    pub fn redis_query(&self) -> String {
        format!(
            "ssl_ca_certs={}&ssl_certfile={}&ssl_keyfile={}",
            self.pki.ca().display(),
            self.cert.display(),
            self.key.display()
        )
    }
}
