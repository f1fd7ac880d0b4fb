//! Session tickets under keys the operator gives (`tls.session_ticket_keys`): every instance
//! behind one load balancer opens the others' tickets, so a client resumes wherever its next
//! connection lands (nginx's `ssl_session_ticket_key`, HAProxy's `tls-ticket-keys`). The first
//! key seals new tickets and every listed key opens them (rotation: docs/operations.md). rustls
//! checks no ticket's age, and these keys live as long as the operator lists them, so each
//! ticket carries the time it was sealed and is refused past [`LIFETIME_SECS`]. Must never:
//! open a ticket under a key no longer listed or past its lifetime, or use a configured secret
//! as a cipher key itself (each key and its name are derived from it by HKDF, RFC 5869).
//!
//! A ticket is `name (16 bytes) || nonce (12) || ChaCha20-Poly1305(sealed at (8, seconds since
//! the epoch, big-endian) || state) || tag (16)`, the name authenticated as associated data (RFC
//! 5077 section 4's layout with an AEAD).

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use ring::hkdf;
use rustls::server::ProducesTickets;

/// How long a ticket resumes, seconds: sent to clients as the lifetime hint (RFC 8446 section
/// 4.6.1) and enforced when it comes back; the same 12 hours as rustls' own ticketer.
const LIFETIME_SECS: u32 = 12 * 60 * 60;

/// How far in the future a ticket's sealing time may lie (another instance's clock ahead of
/// this one's), seconds.
const CLOCK_SKEW_SECS: u64 = 5 * 60;

/// Bytes of the sealing time in front of the state.
const TIME_LEN: usize = 8;

/// Bytes of a key's name, which leads each ticket so that the key that opens it is found.
const NAME_LEN: usize = 16;

/// Fewest bytes a configured ticket or QUIC host key secret has: a secret is read as text, so
/// 32 of them are 192 bits when base64 (`openssl rand -base64 48` gives 64 characters, 384
/// bits).
pub const MIN_SECRET_BYTES: usize = 32;

/// One configured key: its name and cipher.
struct TicketKey {
    name: [u8; NAME_LEN],
    cipher: LessSafeKey,
}

/// [`ProducesTickets`] under the configured keys; the first seals.
pub(super) struct SharedTickets {
    keys: Vec<TicketKey>,
}

impl std::fmt::Debug for SharedTickets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedTickets")
            .field("keys", &self.keys.len())
            .finish()
    }
}

/// An HKDF output length (ring asks for it as a type); also for [`super::host_key`].
pub(super) struct Len(pub(super) usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

impl SharedTickets {
    /// The ticketer for `secrets` (at least one, each of at least [`MIN_SECRET_BYTES`], as the
    /// configuration checks), the first sealing.
    pub(super) fn new<S: AsRef<[u8]>>(secrets: &[S]) -> Self {
        let keys = secrets.iter().map(|s| derive(s.as_ref())).collect();
        Self { keys }
    }
}

/// A key's name and cipher from its secret, each under its own HKDF label.
fn derive(secret: &[u8]) -> TicketKey {
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, b"tessera session tickets").extract(secret);
    let mut name = [0u8; NAME_LEN];
    prk.expand(&[b"key name"], Len(NAME_LEN))
        .and_then(|okm| okm.fill(&mut name))
        .expect("16 bytes are within HKDF-SHA256's output");
    let okm = prk
        .expand(&[b"chacha20-poly1305 key"], &CHACHA20_POLY1305)
        .expect("a ChaCha20 key is within HKDF-SHA256's output");
    TicketKey {
        name,
        cipher: LessSafeKey::new(UnboundKey::from(okm)),
    }
}

impl ProducesTickets for SharedTickets {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        LIFETIME_SECS
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        self.seal(plain, crate::unix_now())
    }

    fn decrypt(&self, ticket: &[u8]) -> Option<Vec<u8>> {
        self.open(ticket, crate::unix_now())
    }
}

impl SharedTickets {
    /// A ticket for `plain` sealed at `now` (seconds since the epoch) under the first key.
    fn seal(&self, plain: &[u8], now: u64) -> Option<Vec<u8>> {
        let key = self.keys.first()?;
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::getrandom(&mut nonce).ok()?;
        let mut out = Vec::with_capacity(NAME_LEN + NONCE_LEN + TIME_LEN + plain.len() + 16);
        out.extend_from_slice(&key.name);
        out.extend_from_slice(&nonce);
        let mut sealed = Vec::with_capacity(TIME_LEN + plain.len() + 16);
        sealed.extend_from_slice(&now.to_be_bytes());
        sealed.extend_from_slice(plain);
        key.cipher
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(key.name),
                &mut sealed,
            )
            .ok()?;
        out.extend_from_slice(&sealed);
        Some(out)
    }

    /// The state in `ticket` if a listed key opens it and it was sealed at most
    /// [`LIFETIME_SECS`] before `now` (and not after `now` plus the clock skew).
    fn open(&self, ticket: &[u8], now: u64) -> Option<Vec<u8>> {
        let (name, rest) = ticket.split_at_checked(NAME_LEN)?;
        let (nonce, sealed) = rest.split_at_checked(NONCE_LEN)?;
        let key = self.keys.iter().find(|k| k.name == name)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut plain = sealed.to_vec();
        let len = key
            .cipher
            .open_in_place(nonce, Aad::from(key.name), &mut plain)
            .ok()?
            .len();
        plain.truncate(len);
        let (time, _) = plain.split_at_checked(TIME_LEN)?;
        let sealed_at = u64::from_be_bytes(time.try_into().ok()?);
        let fresh = sealed_at <= now.saturating_add(CLOCK_SKEW_SECS)
            && now.saturating_sub(sealed_at) <= u64::from(LIFETIME_SECS);
        fresh.then(|| plain.split_off(TIME_LEN))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "first-secret-0123456789-0123456789-abcdef";
    const B: &str = "second-secret-0123456789-0123456789-abcdef";

    #[test]
    fn a_ticket_opens_under_any_listed_key_and_no_other() {
        let a = SharedTickets::new(&[A]);
        let ticket = a.encrypt(b"session state").unwrap();
        assert_eq!(ticket.len(), NAME_LEN + NONCE_LEN + TIME_LEN + 13 + 16);
        // Another instance with the same key, or with a new key listed first (rotation).
        assert_eq!(
            SharedTickets::new(&[A]).decrypt(&ticket).unwrap(),
            b"session state"
        );
        assert_eq!(
            SharedTickets::new(&[B, A]).decrypt(&ticket).unwrap(),
            b"session state"
        );
        // The old key dropped, or never listed.
        assert!(SharedTickets::new(&[B]).decrypt(&ticket).is_none());
        // New tickets are sealed under the first key only.
        let rotated = SharedTickets::new(&[B, A]).encrypt(b"x").unwrap();
        assert!(a.decrypt(&rotated).is_none());
    }

    #[test]
    fn a_changed_or_cut_ticket_opens_to_nothing() {
        let t = SharedTickets::new(&[A]);
        let ticket = t.encrypt(b"session state").unwrap();
        for i in [0, NAME_LEN, NAME_LEN + NONCE_LEN, ticket.len() - 1] {
            let mut bent = ticket.clone();
            bent[i] ^= 1;
            assert!(t.decrypt(&bent).is_none(), "byte {i} flipped");
        }
        for len in [0, NAME_LEN, NAME_LEN + NONCE_LEN + 15] {
            assert!(t.decrypt(&ticket[..len]).is_none(), "cut to {len}");
        }
        // Two tickets of one state differ (a fresh nonce each).
        assert_ne!(t.encrypt(b"s").unwrap(), t.encrypt(b"s").unwrap());
    }

    #[test]
    fn a_ticket_opens_for_its_lifetime_only() {
        let t = SharedTickets::new(&[A]);
        let now = 1_800_000_000;
        let ticket = t.seal(b"state", now).unwrap();
        let life = u64::from(LIFETIME_SECS);
        assert_eq!(t.open(&ticket, now + life).unwrap(), b"state");
        assert!(t.open(&ticket, now + life + 1).is_none(), "too old");
        // Sealed by an instance whose clock is ahead: within the skew, opened.
        assert!(t.open(&ticket, now - CLOCK_SKEW_SECS).is_some());
        assert!(t.open(&ticket, now - CLOCK_SKEW_SECS - 1).is_none());
    }
}
