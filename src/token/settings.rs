//! `[token]`: how tokens are found and verified, as validated by `config`.

use super::keys::{JwksConfig, KeySpec};
use super::{Algorithm, TokenSource};

/// `[token]`.
#[derive(Clone)]
pub struct TokenConfig {
    /// Accepted JWS algorithms (pinned; the token's `alg` must be one of them). Default: the
    /// algorithms of the configured keys (`HS512` for `token.secret`), plus RS256, RS384, RS512,
    /// PS256, PS384, PS512, ES256, ES384 and EdDSA when `token.jwks` is set.
    pub algorithms: Vec<Algorithm>,
    /// Verification keys: the legacy `token.secret` (no `kid`, HMAC; bytes of the configured
    /// string, at least the hash size, RFC 7518 3.2) and every `[[token.keys]]` entry.
    pub keys: Vec<KeySpec>,
    /// `kid` of the key that signs tokens tessera issues. `None`: `token.secret` signs (no `kid`
    /// header), or nothing can sign when it is absent.
    pub active_kid: Option<String>,
    /// External identity provider's key set, when `token.jwks` is set.
    pub jwks: Option<JwksConfig>,
    /// Verified-token cache entries (0 = off). Default 100000. An entry lives until the token's
    /// `exp` + leeway, so a warm token costs a keyed hash and a lookup (about 0.3 µs), not a
    /// signature check (HS512 about 3 µs with its JSON, RS256/EdDSA 30-100 µs). About 0.16 KiB
    /// of RSS per cached token (docs/benchmarks.md, "Memory").
    pub cache_max_entries: u64,
    /// Cache HS* tokens too (default true). With false, HS* tokens are verified on every request
    /// (about 2.8 µs more per warm request in benches/hot_path.rs, 1.2-1.3x fewer req/s in
    /// bench/ab.sh) and only RS*/PS*/ES*/EdDSA tokens are cached.
    pub cache_hmac: bool,
    /// Where tokens are looked for, in order. Default `bearer`, `cookie:tessera`, `cookie-b64:Authorization`.
    pub sources: Vec<TokenSource>,
    /// Claim holding the session id. Default `sid`.
    pub sid_claim: String,
    /// Clock skew allowed on `exp`/`nbf`/`iat`, seconds. Default 5.
    pub leeway_seconds: u64,
    /// Required `iss`, when set.
    pub issuer: Option<String>,
    /// Required member of `aud`, when set.
    pub audience: Option<String>,
    /// Longest accepted token, bytes. Default 8192.
    pub max_token_bytes: usize,
}

impl std::fmt::Debug for TokenConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenConfig")
            .field("algorithms", &self.algorithms)
            .field("keys", &self.keys)
            .field("active_kid", &self.active_kid)
            .field("sources", &self.sources)
            .field("sid_claim", &self.sid_claim)
            .finish_non_exhaustive()
    }
}
