//! Tokens: where they are found ([`mod@extract`]) and how they are verified ([`verify`]).
//!
//! Owns the JWT policy of RFC 8725 (pinned algorithms, strict parsing, time claims). Must never:
//! log a token, accept `alg: none`, or let a token choose its own key.

mod cache;
pub mod extract;
mod hmac;
mod jwk_set;
mod jwks;
mod jws;
pub mod keys;
mod settings;
pub mod verify;

pub use extract::{extract, extract_carried, strip_token_cookies, Carried, TokenSource};
pub use keys::{ConfiguredKeys, KeyMaterial, KeySpec, Keys, SignError, Signer};
pub use settings::TokenConfig;
pub use verify::{Claims, KeyReloadError, TokenError, VerifiedToken, Verifier};

/// A JWS algorithm tessera accepts (RFC 7518 section 3, RFC 8037 for EdDSA).
///
/// Every `[[token.keys]]` key is bound to exactly one algorithm (the legacy `token.secret` to the
/// configured HMAC ones); a token's `alg` must be one of its key's, so an RSA public key can never
/// be used as an HMAC secret (RFC 8725 2.1 algorithm confusion).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// HMAC with SHA-256.
    HS256,
    /// HMAC with SHA-384.
    HS384,
    /// HMAC with SHA-512 (the default; what the published JMAP proxy uses).
    HS512,
    /// RSASSA-PKCS1-v1_5 with SHA-256.
    RS256,
    /// RSASSA-PKCS1-v1_5 with SHA-384.
    RS384,
    /// RSASSA-PKCS1-v1_5 with SHA-512.
    RS512,
    /// RSASSA-PSS with SHA-256.
    PS256,
    /// RSASSA-PSS with SHA-384.
    PS384,
    /// RSASSA-PSS with SHA-512.
    PS512,
    /// ECDSA P-256 with SHA-256.
    ES256,
    /// ECDSA P-384 with SHA-384.
    ES384,
    /// Ed25519 (RFC 8037).
    EdDSA,
}

impl Algorithm {
    /// Every supported algorithm, in JOSE naming.
    pub const ALL: [Algorithm; 12] = [
        Self::HS256,
        Self::HS384,
        Self::HS512,
        Self::RS256,
        Self::RS384,
        Self::RS512,
        Self::PS256,
        Self::PS384,
        Self::PS512,
        Self::ES256,
        Self::ES384,
        Self::EdDSA,
    ];

    /// Parses the JOSE name (`HS512`, `RS256`, `EdDSA`, ...); `None` for anything unsupported
    /// (including `none`).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The JOSE `alg` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::HS256 => "HS256",
            Self::HS384 => "HS384",
            Self::HS512 => "HS512",
            Self::RS256 => "RS256",
            Self::RS384 => "RS384",
            Self::RS512 => "RS512",
            Self::PS256 => "PS256",
            Self::PS384 => "PS384",
            Self::PS512 => "PS512",
            Self::ES256 => "ES256",
            Self::ES384 => "ES384",
            Self::EdDSA => "EdDSA",
        }
    }

    /// True for the HMAC (shared-secret) algorithms.
    pub fn is_hmac(self) -> bool {
        matches!(self, Self::HS256 | Self::HS384 | Self::HS512)
    }

    /// Smallest HMAC key, bytes: the hash output size (RFC 7518 section 3.2). 0 for
    /// asymmetric algorithms.
    pub fn min_secret_bytes(self) -> usize {
        match self {
            Self::HS256 => 32,
            Self::HS384 => 48,
            Self::HS512 => 64,
            _ => 0,
        }
    }

    pub(crate) fn jwt(self) -> jsonwebtoken::Algorithm {
        use jsonwebtoken::Algorithm as J;
        match self {
            Self::HS256 => J::HS256,
            Self::HS384 => J::HS384,
            Self::HS512 => J::HS512,
            Self::RS256 => J::RS256,
            Self::RS384 => J::RS384,
            Self::RS512 => J::RS512,
            Self::PS256 => J::PS256,
            Self::PS384 => J::PS384,
            Self::PS512 => J::PS512,
            Self::ES256 => J::ES256,
            Self::ES384 => J::ES384,
            Self::EdDSA => J::EdDSA,
        }
    }
}
