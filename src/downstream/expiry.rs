//! Certificate expiry on the TLS listener: each certificate's names and notAfter read at start
//! and reload, logged then and once a day after (a warning from 14 days before expiry on), and
//! a reload refused that would put in place an expired certificate not served already. Must
//! never: refuse a reload for a certificate that was already served when it ran (that would
//! block every key rotation until the certificate is renewed).

use super::certs::{CertError, CertSummary};
use super::settings::TlsConfig;

/// From how long before its notAfter a certificate is warned about, seconds.
pub const WARN_BEFORE: i64 = 14 * 24 * 60 * 60;

/// How often the certificates in place are checked again for expiry.
pub const RECHECK: std::time::Duration = std::time::Duration::from_secs(24 * 60 * 60);

/// The names and expiry of each certificate `cfg` serves, the default one first; one that
/// cannot be read is left out (loading it refuses the configuration first).
pub(super) fn summaries(cfg: &TlsConfig) -> Vec<CertSummary> {
    std::iter::once(&cfg.default)
        .chain(&cfg.sni)
        .filter_map(|identity| identity.summary().ok())
        .collect()
}

impl CertSummary {
    /// The notAfter as RFC 3339, UTC (`2027-01-31T12:00:00Z`).
    pub fn until(&self) -> String {
        let secs = self.not_after.max(0) as u64;
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
        humantime::format_rfc3339_seconds(at).to_string()
    }
}

/// Where a certificate stands at a moment.
#[derive(Debug, PartialEq, Eq)]
enum Standing {
    Expired,
    /// Expires within [`WARN_BEFORE`]; whole days left.
    Soon(i64),
    Valid(i64),
}

fn standing(c: &CertSummary, now: i64) -> Standing {
    let days_left = (c.not_after - now) / 86_400;
    match c.not_after - now {
        left if left <= 0 => Standing::Expired,
        left if left <= WARN_BEFORE => Standing::Soon(days_left),
        _ => Standing::Valid(days_left),
    }
}

/// Logs each certificate of `certs` at `now`: a warning when it has expired (clients refuse
/// it) or expires within [`WARN_BEFORE`]; the others at info level when `all`.
pub(super) fn log(certs: &[CertSummary], now: i64, all: bool) {
    for c in certs {
        let names = c.names.join(", ");
        let until = c.until();
        match standing(c, now) {
            Standing::Expired => {
                tracing::warn!(key = %c.key, %names, %until, "certificate has EXPIRED: clients refuse it; renew it, then SIGHUP");
            }
            Standing::Soon(days_left) => {
                tracing::warn!(key = %c.key, %names, %until, days_left, "certificate expires soon; renew it, then SIGHUP");
            }
            Standing::Valid(days_left) if all => {
                tracing::info!(key = %c.key, %names, %until, days_left, "certificate in place");
            }
            Standing::Valid(_) => {}
        }
    }
}

/// Refuses `next` when it would put in place an expired certificate that is not served now
/// (the same names and notAfter among `running`): clients of its names would all fail. One
/// already served, expired or not, is no reason to refuse (a key rotation goes on), wherever it
/// moved in the configuration.
///
/// Errors: the first such certificate's key, with its expiry and the fix.
pub(super) fn refuse_expired(
    running: &[CertSummary],
    next: &[CertSummary],
    now: i64,
) -> Result<(), CertError> {
    let served = |c: &CertSummary| {
        running
            .iter()
            .any(|r| r.names == c.names && r.not_after == c.not_after)
    };
    match next.iter().find(|c| c.not_after <= now && !served(c)) {
        None => Ok(()),
        Some(c) => Err(CertError {
            key: c.key.clone(),
            problem: format!(
                "expired at {}: renew it, then SIGHUP (the certificates served now are kept)",
                c.until()
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(key: &str, not_after: i64) -> CertSummary {
        CertSummary {
            key: key.into(),
            names: vec!["a.example".into()],
            not_after,
        }
    }

    #[test]
    fn a_certificate_is_warned_of_from_14_days_before_its_end() {
        let now = 1_000_000;
        let at = |secs| standing(&cert("tls.certificate", now + secs), now);
        assert_eq!(at(0), Standing::Expired);
        assert_eq!(at(-1), Standing::Expired);
        assert_eq!(at(WARN_BEFORE), Standing::Soon(14));
        assert_eq!(at(86_399), Standing::Soon(0));
        assert_eq!(at(WARN_BEFORE + 1), Standing::Valid(14));
    }

    #[test]
    fn an_expired_certificate_is_refused_unless_it_is_served_already() {
        let now = 1_000_000;
        let named = |key: &str, name: &str, not_after| CertSummary {
            names: vec![name.into()],
            ..cert(key, not_after)
        };
        let running = [
            named("tls.sni[0].certificate", "a.example", now + 10),
            named("tls.sni[1].certificate", "b.example", now - 5),
        ];
        let renewed_wrongly = [named("tls.sni[0].certificate", "a.example", now - 1)];
        let err = refuse_expired(&running, &renewed_wrongly, now).unwrap_err();
        assert_eq!(err.key, "tls.sni[0].certificate");
        assert!(
            err.problem.contains("1970-01-12T13:46:39Z"),
            "{}",
            err.problem
        );
        // Already expired when it ran, and moved up when a.example's entry was removed: a
        // reload (a key rotation) still goes through.
        let moved = [named("tls.sni[0].certificate", "b.example", now - 5)];
        refuse_expired(&running, &moved, now).unwrap();
        // An expired one new to the configuration is refused; a valid one never.
        let added = [named("tls.sni[2].certificate", "c.example", 0)];
        assert!(refuse_expired(&running, &added, now).is_err());
        refuse_expired(
            &running,
            &[named("tls.certificate", "c.example", now + 1)],
            now,
        )
        .unwrap();
    }
}
