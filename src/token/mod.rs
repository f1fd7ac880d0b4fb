//! Tokens: where they are found ([`extract`]) and how they are verified ([`verify`]).
//!
//! Owns the JWT policy of RFC 8725 (pinned algorithms, strict parsing, time claims). Must never:
//! log a token, accept `alg: none`, or let a token choose its own key.

pub mod extract;
pub mod verify;

pub use extract::{extract, strip_token_cookies, TokenSource};
pub use verify::{sign, Claims, TokenError, VerifiedToken, Verifier};

/// A JWS algorithm tessera accepts (RFC 7518 section 3). Only HMAC ones for now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// HMAC with SHA-256.
    HS256,
    /// HMAC with SHA-384.
    HS384,
    /// HMAC with SHA-512 (the default; what the published JMAP proxy uses).
    HS512,
}

impl Algorithm {
    /// Parses the JOSE name (`HS512`, ...); `None` for anything unsupported.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "HS256" => Some(Self::HS256),
            "HS384" => Some(Self::HS384),
            "HS512" => Some(Self::HS512),
            _ => None,
        }
    }

    /// The JOSE `alg` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::HS256 => "HS256",
            Self::HS384 => "HS384",
            Self::HS512 => "HS512",
        }
    }

    /// Smallest HMAC key, bytes: the hash output size (RFC 7518 section 3.2).
    pub fn min_secret_bytes(self) -> usize {
        match self {
            Self::HS256 => 32,
            Self::HS384 => 48,
            Self::HS512 => 64,
        }
    }

    pub(crate) fn jwt(self) -> jsonwebtoken::Algorithm {
        match self {
            Self::HS256 => jsonwebtoken::Algorithm::HS256,
            Self::HS384 => jsonwebtoken::Algorithm::HS384,
            Self::HS512 => jsonwebtoken::Algorithm::HS512,
        }
    }
}
