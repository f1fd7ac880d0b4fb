//! TLS to PostgreSQL (`sslmode=require`, or libpq's `verify-ca` / `verify-full`, which mean the
//! same here): rustls with ring through tokio-postgres-rustls. The server's certificate is
//! always verified, against `sslrootcert=FILE` (PEM) when the URL gives it, else the system's
//! store: libpq's `require` alone does not verify, tessera does as libpq's `verify-full`.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
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

/// The URL without the parameters tokio-postgres does not know (`sslrootcert`), `verify-ca` and
/// `verify-full` turned to `require`; and the `sslrootcert` file if given.
pub(super) fn split_url(url: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), None);
    };
    let mut root_cert = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("sslrootcert", file)) => {
                root_cert = Some(
                    percent_encoding::percent_decode_str(file)
                        .decode_utf8_lossy()
                        .into_owned(),
                );
            }
            Some(("sslmode", "verify-ca" | "verify-full")) => kept.push("sslmode=require"),
            _ => kept.push(pair),
        }
    }
    let url = match kept.is_empty() {
        true => base.to_owned(),
        false => format!("{base}?{}", kept.join("&")),
    };
    (url, root_cert)
}

/// The TLS connector trusting `root_cert` (a PEM file) or the system's store.
///
/// Errors: the file cannot be read or holds no certificate; the system store is empty.
pub(super) fn connector(root_cert: Option<&str>) -> Result<MakeRustlsConnect, StoreError> {
    let mut roots = rustls::RootCertStore::empty();
    match root_cert {
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
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(err)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslrootcert_is_taken_out_and_verify_modes_become_require() {
        let (url, root) = split_url(
            "postgres://u@h/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x",
        );
        assert_eq!(url, "postgres://u@h/db?sslmode=require&application_name=x");
        assert_eq!(root.as_deref(), Some("/etc/ca.pem"));
        assert_eq!(split_url("postgres://u@h/db").0, "postgres://u@h/db");
        assert_eq!(
            split_url("postgres://u@h/db?sslrootcert=a").0,
            "postgres://u@h/db"
        );
    }
}
