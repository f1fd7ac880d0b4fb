//! `[upstream]`'s TLS keys -> the [`TlsClient`] of an `https://` upstream.

use std::sync::Arc;

use crate::upstream::{TlsClient, UpstreamTlsSettings};

use super::raw::RawUpstream;
use super::{resolve_pem, ConfigError};

/// The TLS client of an `https://` upstream: `upstream.ca` (default: the system's roots),
/// `upstream.server_name` (default: the URL's host), `upstream.client_certificate` and
/// `client_private_key` together (mTLS). They are refused on an `http://` upstream.
pub(super) fn upstream_tls(
    url: &http::Uri,
    u: &mut RawUpstream,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Arc<TlsClient>>, ConfigError> {
    let secret =
        |key: &str, v: &Option<String>| v.as_deref().map(|v| resolve_pem(key, v, env)).transpose();
    if url.scheme_str() != Some("https") {
        let set = [
            ("upstream.ca", &u.ca),
            ("upstream.server_name", &u.server_name),
            ("upstream.client_certificate", &u.client_certificate),
            ("upstream.client_private_key", &u.client_private_key),
        ];
        if let Some((key, _)) = set.iter().find(|(_, v)| v.is_some()) {
            return Err(ConfigError::new(
                key,
                "applies to https:// upstreams only; use https:// in upstream.url or remove it",
            ));
        }
        return Ok(None);
    }
    if u.client_certificate.is_some() != u.client_private_key.is_some() {
        return Err(ConfigError::new(
            "upstream.client_certificate",
            "and upstream.client_private_key go together (mTLS): set both or neither",
        ));
    }
    let client_identity = match (
        secret("upstream.client_certificate", &u.client_certificate)?,
        secret("upstream.client_private_key", &u.client_private_key)?,
    ) {
        (Some(chain), Some(key)) => Some((chain.to_string(), key)),
        _ => None,
    };
    let host = url.host().unwrap_or_default();
    let settings = UpstreamTlsSettings {
        ca_pem: secret("upstream.ca", &u.ca)?.map(|pem| pem.to_string()),
        server_name: u.server_name.take().unwrap_or_else(|| {
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_string()
        }),
        client_identity,
    };
    TlsClient::new(&settings)
        .map(|c| Some(Arc::new(c)))
        .map_err(|e| ConfigError::new(e.key, e.problem))
}
