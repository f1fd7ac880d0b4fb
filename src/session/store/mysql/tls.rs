//! TLS to MySQL / MariaDB from MySQL's connection-URI parameters (rustls with ring, through
//! mysql_async): `ssl-mode` `REQUIRED`, `VERIFY_CA` or `VERIFY_IDENTITY` connect over TLS and
//! always verify the server's certificate and name, as `VERIFY_IDENTITY` (MySQL's `REQUIRED`
//! alone verifies nothing); `DISABLED` and `PREFERRED` (MySQL's default) connect without it.
//! `ssl-ca` (PEM) is trusted instead of the system's store; `ssl-cert` + `ssl-key` (PEM) are
//! presented as the client certificate, for accounts created `REQUIRE X509`.

use mysql_async::{ClientIdentity, SslOpts};

use super::{err, StoreError};

const MODE: &str = "ssl-mode";
const CA: &str = "ssl-ca";
const CERT: &str = "ssl-cert";
const KEY: &str = "ssl-key";

/// `url` without the TLS parameters (mysql_async refuses parameters it does not know), and the
/// TLS to use; files are read now, so that a bad one stops the start.
///
/// Errors: an unknown `ssl-mode`, `ssl-ca` / `ssl-cert` / `ssl-key` without a TLS mode, a
/// certificate without its key (or the reverse), a file that cannot be read, an empty system
/// store.
pub(super) fn split(url: &str) -> Result<(String, Option<SslOpts>), StoreError> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let (mut kept, mut given) = (Vec::new(), [None, None, None, None]);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
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
        (Some(cert), Some(key)) => Some(ClientIdentity::new(
            read(CERT, &cert)?.into(),
            read(KEY, &key)?.into(),
        )),
        (None, None) => None,
        _ => return Err(err(format!("{CERT} and {KEY} go together: give both"))),
    };
    let roots = match ca {
        Some(ca) => vec![read(CA, &ca)?],
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

/// The system's trust store (what the operator manages), each certificate as DER.
fn system_roots() -> Result<Vec<Vec<u8>>, StoreError> {
    let found = rustls_native_certs::load_native_certs();
    if found.certs.is_empty() {
        return Err(err(format!(
            "no certificate in the system's trust store: give {CA}=FILE"
        )));
    }
    Ok(found.certs.into_iter().map(|c| c.to_vec()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_are_taken_out_and_need_a_tls_mode() {
        let (url, ssl) = split("mysql://u@h/db?prefer_socket=false").unwrap();
        assert_eq!(
            (url.as_str(), ssl.is_none()),
            ("mysql://u@h/db?prefer_socket=false", true)
        );
        let (url, ssl) = split("mysql://u@h/db?ssl-mode=DISABLED").unwrap();
        assert_eq!((url.as_str(), ssl.is_none()), ("mysql://u@h/db", true));
        let (url, ssl) = split("mysql://u@h/db?ssl-mode=verify_identity&a=1").unwrap();
        assert_eq!(url, "mysql://u@h/db?a=1");
        let ssl = ssl.expect("TLS");
        assert!(ssl.disable_built_in_roots() && !ssl.root_certs().is_empty());
        for (url, why) in [
            ("mysql://u@h/db?ssl-ca=/x", "need TLS"),
            ("mysql://u@h/db?ssl-mode=ON", "expected DISABLED"),
            ("mysql://u@h/db?ssl-mode=REQUIRED&ssl-key=/x", "go together"),
            (
                "mysql://u@h/db?ssl-mode=REQUIRED&ssl-ca=/nonexistent.pem",
                "ssl-ca=/nonexistent",
            ),
        ] {
            let e = split(url).unwrap_err();
            assert!(e.0.contains(why), "{url}: {e}");
        }
    }
}
