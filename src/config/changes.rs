//! What a reload (SIGHUP) cannot do, said by key: the keys changed in the file that apply only
//! at the next restart, and the reloaded secrets given as `env:`, which a running process reads
//! from the environment it started with. Keys are named, values never (they may be secrets).

use std::collections::BTreeMap;

/// The keys a reload puts in place (README and operations.md, "Without a restart"); an entry
/// covers its sub-keys and array entries.
const RELOADED: [&str; 14] = [
    "token.secret",
    "token.keys",
    "token.active_kid",
    "token.jwks_ca",
    "credentials.keys",
    "credentials.active",
    "tls.certificate",
    "tls.private_key",
    "tls.sni",
    "tls.min_version",
    "tls.session_ticket_keys",
    "upstream.ca",
    "upstream.client_certificate",
    "upstream.client_private_key",
];

/// The dotted keys whose values differ between the configuration texts `running` (the one
/// the process started with) and `new`, that a reload does not put in place: added, removed
/// or changed, sorted. Empty when either text is not TOML (the load reports that).
pub fn restart_only_changes(running: &str, new: &str) -> Vec<String> {
    let (Some(running), Some(new)) = (leaves(running), leaves(new)) else {
        return Vec::new();
    };
    let mut keys: Vec<String> = running
        .keys()
        .chain(new.keys())
        .filter(|k| !reloaded(k) && running.get(*k) != new.get(*k))
        .cloned()
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// The keys a reload puts in place that `text` gives as `env:NAME`: read from the process's
/// environment, fixed at its start, so a reload finds them as they were.
pub fn reloaded_from_env(text: &str) -> Vec<String> {
    let Some(leaves) = leaves(text) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (key, value) in &leaves {
        if reloaded(key) && mentions_env(value) {
            out.push(key.clone());
        }
    }
    out
}

/// Whether a reload puts `key` in place.
fn reloaded(key: &str) -> bool {
    RELOADED.iter().any(|r| {
        key == *r
            || key
                .strip_prefix(r)
                .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
    })
}

/// Whether `value` is, or holds, a string starting with `env:`.
fn mentions_env(value: &toml::Value) -> bool {
    match value {
        toml::Value::String(s) => s.starts_with("env:"),
        toml::Value::Array(items) => items.iter().any(mentions_env),
        toml::Value::Table(t) => t.values().any(mentions_env),
        _ => false,
    }
}

/// Every value of the document by dotted key; a table's entries apart, an array whole.
fn leaves(text: &str) -> Option<BTreeMap<String, toml::Value>> {
    fn walk(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, toml::Value>) {
        for (name, value) in table {
            let key = match prefix.is_empty() {
                true => name.clone(),
                false => format!("{prefix}.{name}"),
            };
            match value {
                toml::Value::Table(inner) => walk(&key, inner, out),
                other => {
                    out.insert(key, other.clone());
                }
            }
        }
    }
    let table: toml::Table = text.parse().ok()?;
    let mut out = BTreeMap::new();
    walk("", &table, &mut out);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUNNING: &str = r#"
[server]
listen = "127.0.0.1:8080"
[token]
secret = "env:JWT"
issuer = "a"
[credentials]
keys = { k1 = "env:K1" }
active = "k1"
"#;

    #[test]
    fn only_keys_a_reload_skips_are_named() {
        let new = RUNNING
            .replace("8080", "9090")
            .replace("issuer = \"a\"", "issuer = \"b\"\nleeway_seconds = 5")
            .replace("env:JWT", "file:/jwt")
            .replace("active = \"k1\"", "active = \"k2\"");
        assert_eq!(
            restart_only_changes(RUNNING, &new),
            ["server.listen", "token.issuer", "token.leeway_seconds"]
        );
        assert!(restart_only_changes(RUNNING, RUNNING).is_empty());
        assert!(restart_only_changes(RUNNING, "not = [toml").is_empty());
    }

    #[test]
    fn reloaded_keys_given_as_env_are_named() {
        assert_eq!(
            reloaded_from_env(RUNNING),
            ["credentials.keys.k1", "token.secret"]
        );
    }
}
