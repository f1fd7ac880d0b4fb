//! `[tls]` -> [`TlsConfig`]: the listener, the certificates (read, and checked against their
//! keys, here, so that `check-config` and a SIGHUP reload refuse a bad file), the version floor.

use crate::downstream::{
    name_matches, CertError, Http3Config, Identity, Retry, Secret, TlsConfig, TlsVersion,
    MIN_TICKET_SECRET_BYTES,
};

use super::raw::{RawHttp3, RawSni, RawTls};
use super::{in_range, ms, resolve_pem, resolve_secret, socket_addr, ConfigError};

type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

pub(super) fn validate_tls(t: RawTls, env: Env) -> Result<TlsConfig, ConfigError> {
    let Some(listen) = t.listen.as_deref() else {
        return Err(ConfigError::new(
            "tls.listen",
            "is required in [tls]: the address of the TLS listener, e.g. \"0.0.0.0:8443\"",
        ));
    };
    let listen = socket_addr("tls.listen", listen, "0.0.0.0:8443")?;
    let default = identity(
        Vec::new(),
        "tls",
        t.certificate.as_deref(),
        t.private_key.as_deref(),
        env,
    )?;
    let mut sni: Vec<Identity> = Vec::new();
    for (i, entry) in t.sni.unwrap_or_default().into_iter().enumerate() {
        let entry = sni_entry(i, entry, env)?;
        // The first entry naming a host would serve it, silently: one added below never would.
        let earlier = sni.iter().enumerate().find_map(|(j, e)| {
            let same = entry.names.iter().find(|n| e.names.contains(n))?;
            Some((j, same.clone()))
        });
        if let Some((j, name)) = earlier {
            return Err(ConfigError::new(
                &format!("tls.sni[{i}].server_names"),
                format!("`{name}` is named by tls.sni[{j}] too; name each host in one entry"),
            ));
        }
        sni.push(entry);
    }
    let min_version = match t.min_version.as_deref().unwrap_or("1.2") {
        "1.2" => TlsVersion::Tls12,
        "1.3" => TlsVersion::Tls13,
        other => {
            return Err(ConfigError::new(
                "tls.min_version",
                format!("`{other}` is not \"1.2\" or \"1.3\" (leave it out for 1.2)"),
            ))
        }
    };
    let session_tickets = t.session_tickets.unwrap_or(true);
    let session_ticket_keys = ticket_keys(t.session_ticket_keys, session_tickets, env)?;
    Ok(TlsConfig {
        listen,
        default,
        sni,
        min_version,
        session_tickets,
        session_ticket_keys,
    })
}

/// `tls.session_ticket_keys`: each a secret (`env:`, `file:` or literal) of at least
/// [`MIN_TICKET_SECRET_BYTES`] bytes; none with tickets off.
fn ticket_keys(
    keys: Option<Vec<String>>,
    tickets: bool,
    env: Env,
) -> Result<Vec<Secret>, ConfigError> {
    let keys = keys.unwrap_or_default();
    if !tickets && !keys.is_empty() {
        return Err(ConfigError::new(
            "tls.session_ticket_keys",
            "needs tls.session_tickets = true (tickets are off); remove one of the two",
        ));
    }
    keys.iter()
        .enumerate()
        .map(|(i, value)| {
            let key = format!("tls.session_ticket_keys[{i}]");
            let secret = resolve_secret(&key, value, env)?;
            if secret.len() < MIN_TICKET_SECRET_BYTES {
                return Err(ConfigError::new(
                    &key,
                    format!(
                        "is {} bytes; a ticket key needs at least {MIN_TICKET_SECRET_BYTES} \
                         (e.g. `openssl rand -base64 48`, the same on every instance)",
                        secret.len()
                    ),
                ));
            }
            Ok(Secret::new(secret))
        })
        .collect()
}

fn sni_entry(i: usize, entry: RawSni, env: Env) -> Result<Identity, ConfigError> {
    let at = format!("tls.sni[{i}]");
    let names: Vec<String> = entry
        .server_names
        .unwrap_or_default()
        .iter()
        .map(|n| n.trim_end_matches('.').to_ascii_lowercase())
        .collect();
    if names.is_empty() || names.iter().any(|n| n.is_empty() || n.contains([':', '/'])) {
        return Err(ConfigError::new(
            &format!("{at}.server_names"),
            "must list host names (no port), e.g. [\"mail.example.com\", \"*.example.com\"]",
        ));
    }
    let identity = identity(
        names,
        &at,
        entry.certificate.as_deref(),
        entry.private_key.as_deref(),
        env,
    )?;
    let covered = identity.summary().map_err(cert_error)?.names;
    if let Some(n) = identity
        .names
        .iter()
        .find(|n| !covered.iter().any(|c| name_matches(c, n) || c == *n))
    {
        return Err(ConfigError::new(
            &format!("{at}.server_names"),
            format!(
                "`{n}` is not among the names of {at}.certificate ({}); clients would refuse it",
                covered.join(", ")
            ),
        ));
    }
    Ok(identity)
}

/// The chain and key at `{at}.certificate` / `{at}.private_key`, loaded and matched.
fn identity(
    names: Vec<String>,
    at: &str,
    certificate: Option<&str>,
    private_key: Option<&str>,
    env: Env,
) -> Result<Identity, ConfigError> {
    let cert_key = format!("{at}.certificate");
    let key_key = format!("{at}.private_key");
    let missing = |key: &str, what: &str| {
        ConfigError::new(
            key,
            format!("is required: \"file:/etc/tessera/{what}.pem\" (PEM), or env:NAME"),
        )
    };
    let chain = certificate.ok_or_else(|| missing(&cert_key, "fullchain"))?;
    let key = private_key.ok_or_else(|| missing(&key_key, "key"))?;
    let identity = Identity {
        names,
        chain_pem: resolve_pem(&cert_key, chain, env)?.to_string(),
        key_pem: resolve_pem(&key_key, key, env)?,
        key_name: cert_key,
    };
    identity.certified_key().map_err(cert_error)?;
    Ok(identity)
}

fn cert_error(e: CertError) -> ConfigError {
    ConfigError::new(&e.key, e.problem)
}

/// `[http3]`: needs `[tls]` (its certificates; its address by default).
pub(super) fn validate_http3(
    h: RawHttp3,
    tls: Option<&TlsConfig>,
    env: Env,
) -> Result<Http3Config, ConfigError> {
    let Some(tls) = tls else {
        return Err(ConfigError::new(
            "http3",
            "needs [tls]: HTTP/3 serves its certificates; add [tls] or remove [http3]",
        ));
    };
    let listen = match h.listen.as_deref() {
        Some(text) => socket_addr("http3.listen", text, "0.0.0.0:8443")?,
        None => tls.listen,
    };
    let max_concurrent_streams = in_range(
        "http3.max_concurrent_streams",
        h.max_concurrent_streams,
        100,
        1..=10_000,
    )?;
    let threads = in_range("http3.threads", h.threads, 1, 1..=1024)?;
    let retry = match h.retry.as_deref().unwrap_or("auto") {
        "auto" => Retry::Auto,
        "always" => Retry::Always,
        other => {
            return Err(ConfigError::new(
                "http3.retry",
                format!("`{other}` is not \"auto\" or \"always\" (leave it out for auto)"),
            ))
        }
    };
    let host_key = match h.host_key.as_deref() {
        Some(value) => {
            let secret = resolve_secret("http3.host_key", value, env)?;
            if secret.len() < MIN_TICKET_SECRET_BYTES {
                return Err(ConfigError::new(
                    "http3.host_key",
                    format!(
                        "is {} bytes; it needs at least {MIN_TICKET_SECRET_BYTES} (e.g. \
                         `openssl rand -base64 48`, one per instance, never shared)",
                        secret.len()
                    ),
                ));
            }
            Some(Secret::new(secret))
        }
        None => None,
    };
    Ok(Http3Config {
        listen,
        threads,
        early_data: h.early_data.unwrap_or(true),
        alt_svc_max_age: h.alt_svc_max_age.unwrap_or(86_400),
        max_concurrent_streams,
        idle_timeout: match ms("http3.idle_timeout_ms", h.idle_timeout_ms, 30_000)? {
            // QUIC carries it in milliseconds as a variable-length integer; past a day it
            // outlives every NAT binding on the way anyway.
            d if d > std::time::Duration::from_secs(86_400) => {
                return Err(ConfigError::new(
                    "http3.idle_timeout_ms",
                    "must be at most 86400000 (a day; default 30000)",
                ))
            }
            d => d,
        },
        retry,
        host_key,
    })
}
