//! Verified tokens remembered until their `exp`, keyed by a keyed 128-bit hash of the token text
//! (SipHash-2-4-128 under a random key), so a warm request costs a lookup, not a signature
//! check. Must never: keep a token's text, or answer for a token past its `exp`.

use super::extract::Carried;
use super::verify::VerifiedToken;

/// The verified-token cache: `exp` is checked on every hit, so an entry is never served after
/// its token's `exp` + leeway.
///
/// Keyed by SipHash-2-4 with 128-bit output (the reference implementation's `siphash` with
/// `outlen` 16) of the token text under a random 128-bit key drawn at start: 16 bytes per entry
/// instead of the token (0.3-1 KiB). SipHash is a keyed PRF (Aumasson and Bernstein, "SipHash: a
/// fast short-input PRF", 2012); a forged token would need a second preimage of a cached token's
/// 128-bit tag under a key it never sees.
pub(super) struct TokenCache {
    pub(super) entries: quick_cache::sync::Cache<u128, VerifiedToken>,
    pub(super) k0: u64,
    pub(super) k1: u64,
    /// Bumped by every clear: a verification that began before a clear (under a key set since
    /// changed) is not kept after it (see [`super::Verifier::verify`]).
    pub(super) generation: std::sync::atomic::AtomicU64,
}

impl TokenCache {
    /// A cache of at most `max_entries` verified tokens.
    pub(super) fn new(max_entries: u64) -> Self {
        let mut k = [0u8; 16];
        getrandom::getrandom(&mut k).expect("the OS random source works");
        let (a, b) = k.split_at(8);
        Self {
            entries: quick_cache::sync::Cache::new(
                usize::try_from(max_entries).unwrap_or(usize::MAX),
            ),
            k0: u64::from_le_bytes(a.try_into().expect("8 bytes")),
            k1: u64::from_le_bytes(b.try_into().expect("8 bytes")),
            generation: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The cache key of a token as carried: its text, or a base64 cookie's bytes after a 0xFF
    /// byte (which UTF-8 text never holds, so the two forms never share a key).
    pub(super) fn key(&self, token: &Carried<'_>) -> u128 {
        use siphasher::sip128::Hasher128;
        use std::hash::Hasher;
        let mut h = siphasher::sip128::SipHasher24::new_with_keys(self.k0, self.k1);
        match token {
            Carried::Text(t) => h.write(t.as_bytes()),
            Carried::Base64(b) => {
                h.write(&[0xFF]);
                h.write(b);
            }
        }
        h.finish128().into()
    }
}
