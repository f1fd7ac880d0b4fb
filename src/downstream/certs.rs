//! Certificates for the TLS listener: an [`Identity`]'s PEM chain and key loaded into rustls's
//! [`CertifiedKey`] (the key checked against the leaf), its names and expiry read for
//! `check-config`, and the SNI choice between identities. Must never: serve a key that does not
//! match its certificate, or put key material in an error message.

use std::collections::HashMap;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use super::settings::Identity;

/// A certificate or key that cannot be served: the config key it came from and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{problem}")]
pub struct CertError {
    /// Dotted config key (`tls.certificate`, `tls.sni[1].private_key`).
    pub key: String,
    /// What is wrong and how to fix it.
    pub problem: String,
}

/// What `check-config` reports of one certificate: its names and when it expires.
#[derive(Debug, Clone)]
pub struct CertSummary {
    /// The config key of the chain.
    pub key: String,
    /// DNS names of the leaf's subjectAltName (RFC 5280 section 4.2.1.6); the subject's CN when
    /// it has none.
    pub names: Vec<String>,
    /// The leaf's notAfter, seconds since the Unix epoch.
    pub not_after: i64,
}

impl Identity {
    /// The chain and key as rustls serves them.
    ///
    /// Errors: no certificate in the chain's PEM, no or an unsupported key, or a key that does
    /// not belong to the leaf certificate.
    pub fn certified_key(&self) -> Result<CertifiedKey, CertError> {
        let key_key = self.key_name.replace("certificate", "private_key");
        let chain = CertificateDer::pem_slice_iter(self.chain_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.error(&self.key_name, format!("is not PEM certificates: {e}")))?;
        if chain.is_empty() {
            return Err(self.error(
                &self.key_name,
                "holds no `BEGIN CERTIFICATE` block; give the PEM chain, leaf first".into(),
            ));
        }
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).map_err(|_| {
            self.error(
                &key_key,
                "holds no PEM private key (PKCS#8, RSA or EC); give the key of the certificate"
                    .into(),
            )
        })?;
        let signer = rustls::crypto::ring::sign::any_supported_type(&key)
            .map_err(|e| self.error(&key_key, format!("is a key rustls cannot sign with: {e}")))?;
        let certified = CertifiedKey::new(chain, signer);
        certified.keys_match().map_err(|_| {
            self.error(
                &key_key,
                format!(
                    "does not match the first certificate of {}; give the key it was issued for",
                    self.key_name
                ),
            )
        })?;
        Ok(certified)
    }

    /// The leaf's names and expiry (see [`CertSummary`]).
    ///
    /// Errors: as [`Identity::certified_key`], or a leaf that is no X.509 certificate.
    pub fn summary(&self) -> Result<CertSummary, CertError> {
        let certified = self.certified_key()?;
        let leaf = certified
            .end_entity_cert()
            .map_err(|_| self.error(&self.key_name, "holds no certificate".into()))?;
        let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref())
            .map_err(|e| self.error(&self.key_name, format!("is no X.509 certificate: {e}")))?;
        let mut names = Vec::new();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                if let x509_parser::extensions::GeneralName::DNSName(n) = name {
                    names.push(n.to_ascii_lowercase());
                }
            }
        }
        if names.is_empty() {
            names.extend(
                cert.subject()
                    .iter_common_name()
                    .filter_map(|cn| cn.as_str().ok())
                    .map(str::to_ascii_lowercase),
            );
        }
        Ok(CertSummary {
            key: self.key_name.clone(),
            names,
            not_after: cert.validity().not_after.timestamp(),
        })
    }

    fn error(&self, key: &str, problem: String) -> CertError {
        CertError {
            key: key.to_string(),
            problem,
        }
    }
}

/// Whether `name` (lowercase) is covered by `pattern` (a certificate name or an SNI entry):
/// equal, or `*.rest` with exactly one label in place of the star (RFC 6125 section 6.4.3).
pub fn name_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(rest) => name
            .split_once('.')
            .is_some_and(|(label, tail)| !label.is_empty() && tail == rest),
        None => pattern == name,
    }
}

/// The certificate for a handshake: the SNI entry naming the ClientHello's server name (exact
/// names first, then `*.` wildcards), else the default one, as nginx's default server.
#[derive(Debug)]
pub(super) struct Certificates {
    default: Arc<CertifiedKey>,
    exact: HashMap<String, Arc<CertifiedKey>>,
    wildcard: Vec<(String, Arc<CertifiedKey>)>,
}

impl Certificates {
    /// Loads every identity.
    ///
    /// Errors: the first that cannot be served ([`Identity::certified_key`]).
    pub(super) fn load(default: &Identity, sni: &[Identity]) -> Result<Self, CertError> {
        let mut certs = Self {
            default: Arc::new(default.certified_key()?),
            exact: HashMap::new(),
            wildcard: Vec::new(),
        };
        for identity in sni {
            let key = Arc::new(identity.certified_key()?);
            for name in &identity.names {
                let name = name.to_ascii_lowercase();
                if name.starts_with("*.") {
                    certs.wildcard.push((name, key.clone()));
                } else {
                    certs.exact.entry(name).or_insert_with(|| key.clone());
                }
            }
        }
        Ok(certs)
    }

    fn choose(&self, server_name: Option<&str>) -> Arc<CertifiedKey> {
        let Some(name) = server_name.map(str::to_ascii_lowercase) else {
            return self.default.clone();
        };
        if let Some(key) = self.exact.get(&name) {
            return key.clone();
        }
        self.wildcard
            .iter()
            .find(|(pattern, _)| name_matches(pattern, &name))
            .map_or_else(|| self.default.clone(), |(_, key)| key.clone())
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.choose(hello.server_name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(names: &[&str], key_name: &str) -> Identity {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let cert = rcgen::generate_simple_self_signed(names.clone()).unwrap();
        Identity {
            names,
            key_name: key_name.into(),
            chain_pem: cert.cert.pem(),
            key_pem: cert.signing_key.serialize_pem().into(),
        }
    }

    #[test]
    fn wildcards_cover_one_label_only() {
        assert!(name_matches("*.example.com", "mail.example.com"));
        assert!(!name_matches("*.example.com", "a.mail.example.com"));
        assert!(!name_matches("*.example.com", "example.com"));
        assert!(name_matches("example.com", "example.com"));
    }

    #[test]
    fn sni_picks_exact_then_wildcard_then_the_default() {
        let default = identity(&["default.test"], "tls.certificate");
        let exact = identity(&["mail.example.com"], "tls.sni[0].certificate");
        let wild = identity(&["*.example.com"], "tls.sni[1].certificate");
        let certs = Certificates::load(&default, &[exact.clone(), wild.clone()]).unwrap();
        let leaf = |k: Arc<CertifiedKey>| k.end_entity_cert().unwrap().to_vec();
        let of = |i: &Identity| leaf(Arc::new(i.certified_key().unwrap()));
        assert_eq!(leaf(certs.choose(Some("MAIL.example.com"))), of(&exact));
        assert_eq!(leaf(certs.choose(Some("cal.example.com"))), of(&wild));
        assert_eq!(leaf(certs.choose(Some("other.test"))), of(&default));
        assert_eq!(leaf(certs.choose(None)), of(&default));
    }

    #[test]
    fn a_key_of_another_certificate_is_refused_naming_its_key() {
        let mut one = identity(&["a.test"], "tls.sni[2].certificate");
        one.key_pem = identity(&["b.test"], "x").key_pem;
        let e = one.certified_key().unwrap_err();
        assert_eq!(e.key, "tls.sni[2].private_key");
        assert!(e.problem.contains("does not match"), "{}", e.problem);
        one.chain_pem = "not pem".into();
        assert_eq!(
            one.certified_key().unwrap_err().key,
            "tls.sni[2].certificate"
        );
    }

    #[test]
    fn a_summary_names_the_leaf_and_its_expiry() {
        let s = identity(
            &["mail.example.com", "*.cal.example.com"],
            "tls.certificate",
        )
        .summary()
        .unwrap();
        assert_eq!(s.names, ["mail.example.com", "*.cal.example.com"]);
        assert!(s.not_after > crate::unix_now() as i64);
    }
}
