//! TLS to MySQL / MariaDB from MySQL's connection-URI parameters (rustls with ring, through
//! mysql_async): `ssl-mode` `REQUIRED`, `VERIFY_CA` or `VERIFY_IDENTITY` connect over TLS and
//! always verify the server's certificate and name, as `VERIFY_IDENTITY` (MySQL's `REQUIRED`
//! alone verifies nothing); `DISABLED` and `PREFERRED` (MySQL's default) connect without it.
//! `ssl-ca` (PEM) is trusted instead of the system's store; `ssl-cert` + `ssl-key` (PEM) are
//! presented as the client certificate, for accounts created `REQUIRE X509`.

use mysql_async::{ClientIdentity, SslOpts};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::{err, StoreError};

const MODE: &str = "ssl-mode";
const CA: &str = "ssl-ca";
const CERT: &str = "ssl-cert";
const KEY: &str = "ssl-key";

/// mysql_async's own TLS switches, which this store's `ssl-mode` replaces: honoured as given,
/// `require_ssl` without the certificate checks above would be silently undone.
const DRIVER_OWN: [&str; 4] = [
    "require_ssl",
    "verify_ca",
    "verify_identity",
    "built_in_roots",
];

/// `url` without the TLS parameters (mysql_async refuses parameters it does not know), and the
/// TLS to use; files are read and parsed now, so that a bad one stops the start.
///
/// Errors: an unknown `ssl-mode`, one of mysql_async's own TLS parameters, `ssl-ca` /
/// `ssl-cert` / `ssl-key` without a TLS mode, a certificate without its key (or the reverse), a
/// file that cannot be read or holds no certificate (or key), an empty system store.
pub(super) fn split(url: &str) -> Result<(String, Option<SslOpts>), StoreError> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let (mut kept, mut given) = (Vec::new(), [None, None, None, None]);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if DRIVER_OWN.contains(&k) {
            return Err(err(format!(
                "{k}: use {MODE}=VERIFY_IDENTITY (with {CA}=FILE for a private CA) instead"
            )));
        }
        match [MODE, CA, CERT, KEY].iter().position(|name| *name == k) {
            Some(i) => {
                let v = percent_encoding::percent_decode_str(v).decode_utf8_lossy();
                given[i] = Some(v.into_owned());
            }
            None => kept.push(pair),
        }
    }
    let url = match kept.is_empty() {
        true => base.to_owned(),
        false => format!("{base}?{}", kept.join("&")),
    };
    let [mode, ca, cert, key] = given;
    let on = match mode.as_deref().map(str::to_ascii_uppercase).as_deref() {
        Some("REQUIRED" | "VERIFY_CA" | "VERIFY_IDENTITY") => true,
        None | Some("DISABLED" | "PREFERRED") => false,
        Some(other) => {
            return Err(err(format!(
                "{MODE}={other}: expected DISABLED, PREFERRED, REQUIRED, VERIFY_CA or \
                 VERIFY_IDENTITY"
            )))
        }
    };
    if !on {
        return match ca.or(cert).or(key) {
            Some(_) => Err(err(format!(
                "{CA}, {CERT} and {KEY} need TLS: add {MODE}=VERIFY_IDENTITY"
            ))),
            None => Ok((url, None)),
        };
    }
    let identity = match (cert, key) {
        (Some(cert), Some(key)) => {
            let (cert, key) = (read(CERT, &cert)?, read(KEY, &key)?);
            PrivateKeyDer::from_pem_slice(&key).map_err(|e| err(format!("{KEY}: {e}")))?;
            certificates(CERT, &cert)?;
            Some(ClientIdentity::new(cert.into(), key.into()))
        }
        (None, None) => None,
        _ => return Err(err(format!("{CERT} and {KEY} go together: give both"))),
    };
    let roots = match ca {
        Some(ca) => certificates(CA, &read(CA, &ca)?)?,
        None => system_roots()?,
    };
    let ssl = SslOpts::default()
        .with_root_certs(roots.into_iter().map(Into::into).collect())
        .with_disable_built_in_roots(true)
        .with_client_identity(identity);
    Ok((url, Some(ssl)))
}

/// The PEM file at `path`, its parameter named in the error.
fn read(param: &str, path: &str) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path).map_err(|e| err(format!("{param}={path}: {e}")))
}

/// The certificates of PEM `bytes`, each as DER.
///
/// Errors: not PEM, or no certificate in it.
fn certificates(param: &str, bytes: &[u8]) -> Result<Vec<Vec<u8>>, StoreError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .map(|c| c.map(|c| c.to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("{param}: {e}")))?;
    match certs.is_empty() {
        true => Err(err(format!("{param}: no certificate (PEM) in the file"))),
        false => Ok(certs),
    }
}

/// The system's trust store (what the operator manages), each certificate as DER; those
/// rustls cannot use are left out (mysql_async would refuse every connection for one of them).
fn system_roots() -> Result<Vec<Vec<u8>>, StoreError> {
    let usable: Vec<Vec<u8>> = rustls_native_certs::load_native_certs()
        .certs
        .into_iter()
        .filter(|c| rustls::RootCertStore::empty().add(c.clone()).is_ok())
        .map(|c| c.to_vec())
        .collect();
    match usable.is_empty() {
        true => Err(err(format!(
            "no certificate in the system's trust store: give {CA}=FILE"
        ))),
        false => Ok(usable),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_are_taken_out_and_need_a_tls_mode() {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let ca = rcgen::CertificateParams::new(vec!["ca".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let (ca_file, junk) = (dir.path().join("ca.pem"), dir.path().join("junk.pem"));
        std::fs::write(&ca_file, ca.pem()).unwrap();
        std::fs::write(&junk, "not a certificate").unwrap();
        let (url, ssl) = split("mysql://u@h/db?prefer_socket=false").unwrap();
        assert_eq!(
            (url.as_str(), ssl.is_none()),
            ("mysql://u@h/db?prefer_socket=false", true)
        );
        let (url, ssl) = split("mysql://u@h/db?ssl-mode=DISABLED").unwrap();
        assert_eq!((url.as_str(), ssl.is_none()), ("mysql://u@h/db", true));
        let with_ca = format!(
            "mysql://u@h/db?ssl-mode=verify_identity&a=1&ssl-ca={}",
            ca_file.display()
        );
        let (url, ssl) = split(&with_ca).unwrap();
        assert_eq!(url, "mysql://u@h/db?a=1");
        let ssl = ssl.expect("TLS");
        assert!(ssl.disable_built_in_roots() && ssl.root_certs().len() == 1);
        let junk_ca = format!("mysql://u@h/db?ssl-mode=REQUIRED&ssl-ca={}", junk.display());
        for (url, why) in [
            ("mysql://u@h/db?ssl-ca=/x", "need TLS"),
            ("mysql://u@h/db?ssl-mode=ON", "expected DISABLED"),
            (
                "mysql://u@h/db?require_ssl=true",
                "use ssl-mode=VERIFY_IDENTITY",
            ),
            ("mysql://u@h/db?ssl-mode=REQUIRED&ssl-key=/x", "go together"),
            (
                "mysql://u@h/db?ssl-mode=REQUIRED&ssl-ca=/nonexistent.pem",
                "ssl-ca=/nonexistent",
            ),
            (junk_ca.as_str(), "no certificate"),
        ] {
            let e = split(url).unwrap_err();
            assert!(e.0.contains(why), "{url}: {e}");
        }
    }
}
