//! TLS for the `rediss://`, `rediss+sentinel://` and `rediss+cluster://` schemes (rustls, ring
//! provider): every connection, to a Sentinel, a master, a cluster node or a tracker, is made
//! over TLS; the server's certificate and name are verified against the system's roots, or the
//! PEM file `ssl_ca_certs` names; a client certificate (`ssl_certfile` + `ssl_keyfile`, PEM) is
//! presented when given, which Redis asks for by default (`tls-auth-clients yes`). The parameter
//! names are redis-py's URL parameters.

use redis::{ClientTlsConfig, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, TlsCertificates};

use super::{err, StoreError};

/// The TLS every connection of a store uses; `None`: plain TCP.
pub(super) type Tls = Option<TlsCertificates>;

const CA: &str = "ssl_ca_certs";
const CERT: &str = "ssl_certfile";
const KEY: &str = "ssl_keyfile";

/// `url` without the TLS parameters, and its TLS: `Some` for a `rediss` scheme.
///
/// Errors: a TLS parameter on a plain scheme, a certificate without its key (or a key without
/// its certificate), a file that cannot be read or holds no usable PEM.
pub(super) fn split(url: &str) -> Result<(String, Tls), StoreError> {
    let secure = url.starts_with("rediss://") || url.starts_with("rediss+");
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let (mut kept, mut files) = (Vec::new(), [None, None, None]);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match [CA, CERT, KEY].iter().position(|name| *name == k) {
            Some(i) => files[i] = Some(super::url::decode(v)),
            None => kept.push(pair),
        }
    }
    let url = match kept.is_empty() {
        true => base.to_owned(),
        false => format!("{base}?{}", kept.join("&")),
    };
    let [ca, cert, key] = files;
    if secure && url.contains('#') {
        // redis-rs reads `#insecure` as "skip the certificate checks".
        return Err(err(
            "a #fragment is not taken (#insecure would turn the certificate checks off): \
             remove it; give ssl_ca_certs for a server whose CA the system does not trust",
        ));
    }
    if !secure {
        return match ca.or(cert).or(key) {
            Some(_) => Err(err(format!(
                "{CA}, {CERT} and {KEY} need TLS: use rediss://, rediss+sentinel:// or \
                 rediss+cluster://"
            ))),
            None => Ok((url, None)),
        };
    }
    let client_tls = match (cert, key) {
        (Some(cert), Some(key)) => Some(ClientTlsConfig {
            client_cert: read(CERT, &cert)?,
            client_key: read(KEY, &key)?,
        }),
        (None, None) => None,
        _ => return Err(err(format!("{CERT} and {KEY} go together: give both"))),
    };
    let root_cert = ca.map(|path| read(CA, &path)).transpose()?;
    let certs = TlsCertificates {
        client_tls,
        root_cert,
    };
    check(&certs)?;
    Ok((url, Some(certs)))
}

/// The PEM files read as rustls will use them, so that a wrong one stops the start: redis-rs
/// reads them only at the first connect, where a CA file with no certificate or a key that is
/// not the certificate's reads as the server's certificate refused (`UnknownIssuer`).
fn check(certs: &TlsCertificates) -> Result<(), StoreError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let pem_certs = |pem: &[u8]| -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_slice_iter(pem)
            .filter_map(Result::ok)
            .collect()
    };
    let mut roots = rustls::RootCertStore::empty();
    if let Some(ca) = &certs.root_cert {
        if roots.add_parsable_certificates(pem_certs(ca)).0 == 0 {
            return Err(err(format!(
                "{CA}: holds no PEM certificate (\"-----BEGIN CERTIFICATE-----\")"
            )));
        }
    }
    let Some(client) = &certs.client_tls else {
        return Ok(());
    };
    let chain = pem_certs(&client.client_cert);
    if chain.is_empty() {
        return Err(err(format!("{CERT}: holds no PEM certificate")));
    }
    let key = PrivateKeyDer::from_pem_slice(&client.client_key)
        .map_err(|_| err(format!("{KEY}: holds no PEM private key")))?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(err)?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| err(format!("{KEY} is not the key of {CERT}: {e}")))?;
    Ok(())
}

fn read(param: &str, path: &str) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path).map_err(|e| err(format!("{param}={path}: {e}")))
}

/// Connection info for `host:port`: over TLS with `tls`, else plain TCP.
pub(super) fn info(host: String, port: u16, tls: &Tls) -> Result<ConnectionInfo, StoreError> {
    let Some(certs) = tls else {
        return ConnectionAddr::Tcp(host, port)
            .into_connection_info()
            .map_err(err);
    };
    let addr = ConnectionAddr::TcpTls {
        host,
        port,
        insecure: false,
        tls_params: None,
    };
    let client = redis::Client::build_with_tls(addr, certs.clone()).map_err(err)?;
    Ok(client.get_connection_info().clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_are_taken_out_and_need_a_rediss_scheme() {
        let (url, tls) = split("redis://h:1/0?protocol=resp3").unwrap();
        assert_eq!(
            (url.as_str(), tls.is_none()),
            ("redis://h:1/0?protocol=resp3", true)
        );
        let (url, tls) = split("rediss+cluster://h:1,h:2").unwrap();
        assert_eq!(url, "rediss+cluster://h:1,h:2");
        let certs = tls.expect("TLS");
        assert!(certs.root_cert.is_none() && certs.client_tls.is_none());
        let e = split("redis://h/0?ssl_ca_certs=/x").unwrap_err();
        assert!(e.0.contains("need TLS"), "{e}");
        let e = split("rediss://h/0?ssl_certfile=/x").unwrap_err();
        assert!(e.0.contains("go together"), "{e}");
        let e = split("rediss://h/0?a=1&ssl_ca_certs=/nonexistent/ca.pem").unwrap_err();
        assert!(e.0.contains("ssl_ca_certs=/nonexistent/ca.pem"), "{e}");
        let e = split("rediss://h/0#insecure").unwrap_err();
        assert!(e.0.contains("#insecure"), "{e}");
    }

    #[test]
    fn tls_files_are_checked_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path.display().to_string()
        };
        let ca = rcgen::generate_simple_self_signed(vec!["ca".into()]).unwrap();
        let leaf = rcgen::generate_simple_self_signed(vec!["client".into()]).unwrap();
        let (ca_pem, ca_key) = (
            write("ca.pem", &ca.cert.pem()),
            write("ca.key", &ca.signing_key.serialize_pem()),
        );
        let (cert, key) = (
            write("c.pem", &leaf.cert.pem()),
            write("c.key", &leaf.signing_key.serialize_pem()),
        );
        let url = |ca: &str, cert: &str, key: &str| {
            format!("rediss://h/0?ssl_ca_certs={ca}&ssl_certfile={cert}&ssl_keyfile={key}")
        };
        assert!(split(&url(&ca_pem, &cert, &key)).is_ok());
        let refused = [
            (
                url(&ca_key, &cert, &key),
                "ssl_ca_certs: holds no PEM certificate",
            ),
            (
                url(&ca_pem, &key, &key),
                "ssl_certfile: holds no PEM certificate",
            ),
            (
                url(&ca_pem, &cert, &cert),
                "ssl_keyfile: holds no PEM private key",
            ),
            (
                url(&ca_pem, &cert, &ca_key),
                "ssl_keyfile is not the key of ssl_certfile",
            ),
        ];
        for (url, says) in refused {
            let e = split(&url).unwrap_err();
            assert!(e.0.contains(says), "{url}: {e}");
        }
    }
}
