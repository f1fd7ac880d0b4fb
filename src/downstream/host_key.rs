//! `http3.host_key` (nginx's `quic_host_key`): QUIC's server keys from one configured secret,
//! so that they outlive a restart of the instance that has it (one per instance: instances
//! sharing one would reset each other's connections, RFC 9000 section 21.11). From it, by HKDF
//! (RFC 5869) under a label each: the key of Retry and NEW_TOKEN address tokens (a returning
//! client's token is good after a restart); the key of stateless resets (RFC 9000 section 10.3: after a restart, a client's next packet on a
//! connection the process no longer has is answered with a reset it can verify, so it learns
//! at once instead of at its idle timeout); and the key connection ids are made and checked
//! with (quinn drops a packet whose id it did not make, before any reset). Without the secret
//! each process makes its own. Must never: use the secret itself as a key, or one derived key
//! for two purposes.

use std::sync::Arc;

use ring::{hkdf, hmac};

use super::settings::{Http3Config, Secret};
use super::tickets::Len;

/// The key of QUIC's Retry and address tokens, from `secret`.
pub(super) fn token_key(secret: &Secret) -> Arc<hkdf::Prk> {
    let salt = hkdf::Salt::new(hkdf::HKDF_SHA256, b"tessera quic address tokens");
    Arc::new(salt.extract(secret.as_ref()))
}

/// The QUIC endpoint's configuration for `h3`: its stateless reset and connection id keys from
/// `http3.host_key` when set, else quinn's (random, per process). Made once, at start.
pub fn endpoint_config(h3: &Http3Config) -> quinn::EndpointConfig {
    let Some(secret) = &h3.host_key else {
        return quinn::EndpointConfig::default();
    };
    let salt = hkdf::Salt::new(hkdf::HKDF_SHA256, b"tessera quic endpoint");
    let prk = salt.extract(secret.as_ref());
    let reset = prk
        .expand(&[b"stateless reset key"], hmac::HMAC_SHA256)
        .expect("an HMAC-SHA256 key is within HKDF-SHA256's output");
    let mut cid_key = [0u8; 8];
    prk.expand(&[b"connection id key"], Len(cid_key.len()))
        .and_then(|okm| okm.fill(&mut cid_key))
        .expect("8 bytes are within HKDF-SHA256's output");
    let cid_key = u64::from_le_bytes(cid_key);
    let mut endpoint = quinn::EndpointConfig::new(Arc::new(hmac::Key::from(reset)));
    endpoint.cid_generator(move || {
        Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key))
    });
    endpoint
}
