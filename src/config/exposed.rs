//! Secrets any local user can read: a private key's `file:` that is readable by all, or a
//! configuration file readable by all that holds a private key inline. Warned of, not refused
//! (nginx reads such files silently; OpenSSH and PostgreSQL refuse their own keys then), so
//! that a deployment that works keeps working while the log says what to `chmod`.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// A secret other local users can read: its dotted key (`tls.private_key`,
/// `credentials.keys.k1`) and the file that shows it (its own `file:`, or the configuration).
#[derive(Debug, PartialEq, Eq)]
pub struct Exposed {
    /// The dotted key, `[[array]]` entries numbered from 0 (`token.keys[1].secret`).
    pub key: String,
    /// The file readable by every local user.
    pub path: String,
}

/// The private keys of the configuration `text`, read from `config_path`, that every local user
/// can read (the "others" read bit). Private: `secret`, `private_key`, `client_private_key`,
/// `host_key`, the values of `credentials.keys` and of `tls.session_ticket_keys`, and
/// `session.store` when its URL holds a password (inline, or in its `file:`). Certificates,
/// CA files and public keys are not secrets. `env:` values are the environment's; files that
/// cannot be read are the load's to report. Empty when `text` is not TOML.
pub fn exposed_secrets(text: &str, config_path: &Path) -> Vec<Exposed> {
    let Ok(table) = text.parse::<toml::Table>() else {
        return Vec::new();
    };
    let config_open = readable_by_all(config_path);
    let mut out = Vec::new();
    let mut note = |key: &str, value: &str| {
        let path = match value.strip_prefix("file:") {
            Some(path) if readable_by_all(Path::new(path)) => path,
            Some(_) => return,
            None if value.starts_with("env:") || !config_open => return,
            None => &*config_path.to_string_lossy(),
        };
        out.push(Exposed {
            key: key.to_owned(),
            path: path.to_owned(),
        });
    };
    walk("", &toml::Value::Table(table), &mut |key, value| {
        let store_secret = key == "session.store"
            && match value.strip_prefix("file:") {
                Some(path) => std::fs::read_to_string(path).is_ok_and(|url| has_password(&url)),
                None => has_password(value),
            };
        if private(key) || store_secret {
            note(key, value);
        }
    });
    out
}

/// Calls `f` with every string of `value` by its dotted key.
fn walk(key: &str, value: &toml::Value, f: &mut dyn FnMut(&str, &str)) {
    match value {
        toml::Value::String(s) => f(key, s),
        toml::Value::Table(t) => {
            for (name, v) in t {
                match key.is_empty() {
                    true => walk(name, v, f),
                    false => walk(&format!("{key}.{name}"), v, f),
                }
            }
        }
        toml::Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                walk(&format!("{key}[{i}]"), v, f);
            }
        }
        _ => {}
    }
}

/// Whether the value at `key` is a secret (see [`exposed_secrets`]).
fn private(key: &str) -> bool {
    let last = key.rsplit('.').next().unwrap_or(key);
    matches!(
        last,
        "secret" | "private_key" | "client_private_key" | "host_key"
    ) || key.starts_with("credentials.keys.")
        || key.starts_with("tls.session_ticket_keys")
}

/// Whether a store URL carries a password: in its userinfo (`redis://:pw@host`), or as a
/// query parameter (`sentinel_password=`, `password=`).
fn has_password(url: &str) -> bool {
    let authority = url.split_once("://").map_or("", |(_, rest)| rest);
    let authority = authority.split(['/', '?']).next().unwrap_or("");
    let userinfo = authority.rsplit_once('@').map_or("", |(user, _)| user);
    userinfo.contains(':') || url.contains("password=")
}

/// Whether every local user may read `path`: others may read the file and search each
/// directory above it (a file in a private directory is not exposed, whatever its mode).
fn readable_by_all(path: &Path) -> bool {
    let mode = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.permissions().mode());
    let Ok(path) = path.canonicalize() else {
        return false;
    };
    mode(&path) & 0o004 != 0 && path.ancestors().skip(1).all(|dir| mode(dir) & 0o001 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_keys_in_files_or_inline_readable_by_all_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, mode: u32| {
            let path = dir.path().join(name);
            std::fs::write(&path, "x").unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            path.display().to_string()
        };
        let (open, closed, cert) = (file("open", 0o644), file("closed", 0o640), file("c", 0o644));
        let text = format!(
            "[session]\nstore = \"redis://:pw@h/0\"\n[token]\nsecret = \"file:{open}\"\n[[token.keys]]\nkid = \"a\"\nsecret = \"inline\"\n\
             [credentials]\nkeys = {{ k1 = \"file:{closed}\", k2 = \"env:K2\" }}\n\
             [tls]\ncertificate = \"file:{cert}\"\nprivate_key = \"file:{open}\"\n\
             session_ticket_keys = [\"file:{open}\"]\n"
        );
        let config = |mode| Path::new(&file("tessera.toml", mode)).to_path_buf();
        let keys = |mode| -> Vec<String> {
            exposed_secrets(&text, &config(mode))
                .into_iter()
                .map(|e| e.key)
                .collect()
        };
        let in_files = [
            "tls.private_key",
            "tls.session_ticket_keys[0]",
            "token.secret",
        ];
        assert_eq!(keys(0o640), in_files);
        let mut all = keys(0o644);
        all.sort();
        assert_eq!(
            all,
            [
                "session.store",
                "tls.private_key",
                "tls.session_ticket_keys[0]",
                "token.keys[0].secret",
                "token.secret"
            ]
        );
        assert!(exposed_secrets("not = [toml", &config(0o644)).is_empty());
        assert!(!has_password("redis://h:6379/0") && !has_password("postgres://u@h/db"));
        assert!(has_password("postgres://u@h/db?password=x"));
        // The same files in a directory others may not enter.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(keys(0o644).is_empty());
    }
}
