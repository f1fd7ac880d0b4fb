//! TLS to PostgreSQL (`sslmode=require`, or libpq's `verify-ca` / `verify-full`, which mean the
//! same here): rustls with ring through tokio-postgres-rustls. The server's certificate is
//! always verified, against `sslrootcert=FILE` (PEM) when the URL gives it, else the system's
//! store: libpq's `require` alone does not verify, tessera does as libpq's `verify-full`.
//! `sslcert=FILE` + `sslkey=FILE` (PEM, libpq's names) are presented as the client certificate,
//! for roles that log in with `cert` in `pg_hba.conf`.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{err, StoreError};

/// How the store's connections are made.
#[derive(Clone)]
pub(super) enum Tls {
    /// Plain TCP or a Unix socket (`sslmode` `disable` or `prefer`).
    Off,
    /// TLS, verified.
    On(MakeRustlsConnect),
}

/// The TLS files a URL names (libpq's parameters), each a PEM file path.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Files {
    /// `sslrootcert`: the CAs to trust instead of the system's store.
    pub(super) root_cert: Option<String>,
    /// `sslcert`: the client certificate chain.
    pub(super) cert: Option<String>,
    /// `sslkey`: the client certificate's private key.
    pub(super) key: Option<String>,
}

/// The URL without the parameters tokio-postgres does not know (`sslrootcert`, `sslcert`,
/// `sslkey`), `verify-ca` and `verify-full` turned to `require`; and the files they name.
pub(super) fn split_url(url: &str) -> (String, Files) {
    let mut files = Files::default();
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), files);
    };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let decoded = |file: &str| {
            let file = percent_encoding::percent_decode_str(file).decode_utf8_lossy();
            Some(file.into_owned())
        };
        match pair.split_once('=') {
            Some(("sslrootcert", file)) => files.root_cert = decoded(file),
            Some(("sslcert", file)) => files.cert = decoded(file),
            Some(("sslkey", file)) => files.key = decoded(file),
            Some(("sslmode", "verify-ca" | "verify-full")) => kept.push("sslmode=require"),
            _ => kept.push(pair),
        }
    }
    let url = match kept.is_empty() {
        true => base.to_owned(),
        false => format!("{base}?{}", kept.join("&")),
    };
    (url, files)
}

/// The TLS connector trusting `files.root_cert` or the system's store, presenting the client
/// certificate `files.cert` + `files.key` when given.
///
/// Errors: a file cannot be read or holds no certificate (or key); only one of `sslcert` and
/// `sslkey`; the system store is empty.
pub(super) fn connector(files: &Files) -> Result<MakeRustlsConnect, StoreError> {
    let mut roots = rustls::RootCertStore::empty();
    match files.root_cert.as_deref() {
        Some(file) => {
            let certs = CertificateDer::pem_file_iter(file)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| err(format!("sslrootcert {file}: {e}")))?;
            roots.add_parsable_certificates(certs);
            if roots.is_empty() {
                return Err(err(format!(
                    "sslrootcert {file} holds no CA certificate (PEM)"
                )));
            }
        }
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            if roots.is_empty() {
                return Err(err(
                    "sslmode=require and the system store holds no root certificate: install \
                     ca-certificates, or give sslrootcert=FILE in the URL",
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(err)?
        .with_root_certificates(roots);
    let config = match (files.cert.as_deref(), files.key.as_deref()) {
        (None, None) => builder.with_no_client_auth(),
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| err(format!("sslcert {cert}: {e}")))?;
            let key =
                PrivateKeyDer::from_pem_file(key).map_err(|e| err(format!("sslkey {key}: {e}")))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| err(format!("sslcert / sslkey: {e}")))?
        }
        _ => return Err(err("sslcert and sslkey go together: give both")),
    };
    Ok(MakeRustlsConnect::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_files_are_taken_out_and_verify_modes_become_require() {
        let (url, files) = split_url(
            "postgres://u@h/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x\
             &sslcert=/c.pem&sslkey=/k.pem",
        );
        assert_eq!(url, "postgres://u@h/db?sslmode=require&application_name=x");
        assert_eq!(files.root_cert.as_deref(), Some("/etc/ca.pem"));
        assert_eq!(
            (files.cert.as_deref(), files.key.as_deref()),
            (Some("/c.pem"), Some("/k.pem"))
        );
        assert_eq!(split_url("postgres://u@h/db").0, "postgres://u@h/db");
        assert_eq!(
            split_url("postgres://u@h/db?sslrootcert=a").0,
            "postgres://u@h/db"
        );
    }
}
