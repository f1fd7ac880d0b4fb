//! `tessera session ...`: the operator's commands on stored sessions. Part of the `tessera`
//! binary (`main.rs`), not of the library: it parses, calls [`tessera::admin`] and prints.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;
use tessera::admin;

use crate::load;

#[derive(Subcommand)]
pub enum SessionCommand {
    /// Seal and store credentials; print {"sid","token","expires_at"} as one JSON line.
    Create {
        #[arg(long)]
        config: PathBuf,
        /// Upstream user name.
        #[arg(long)]
        user: String,
        /// Read the password from standard input (one line).
        #[arg(long, required = true)]
        password_stdin: bool,
        /// Session lifetime, e.g. `12h`, `30m` (default: session.ttl_seconds).
        #[arg(long, value_parser = humantime::parse_duration)]
        ttl: Option<std::time::Duration>,
    },
    /// Delete sessions; every request with their tokens is refused from then on. Exactly one
    /// of --sid, --sid-hash, --user.
    #[command(group(clap::ArgGroup::new("which").required(true).args(["sid", "sid_hash", "user"])))]
    Revoke {
        #[arg(long)]
        config: PathBuf,
        /// The session id (base64url, so it may begin with `-`); prints {"sid","revoked"}.
        #[arg(long, allow_hyphen_values = true)]
        sid: Option<String>,
        /// The session whose hash `session list` and the logs show; prints
        /// {"revoked","sid_hashes"}.
        #[arg(long)]
        sid_hash: Option<String>,
        /// Every session of this upstream user; prints {"revoked","sid_hashes"}.
        #[arg(long)]
        user: Option<String>,
    },
    /// List live sessions: sid hash, subject, expiry, sealing key id (never credentials).
    List {
        #[arg(long)]
        config: PathBuf,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Re-seal every stored session under the active sealing key (credentials.active), keeping
    /// expiries; prints {"total","resealed","already_active","unreadable","gone"}.
    Reseal {
        #[arg(long)]
        config: PathBuf,
    },
}

/// Runs one `tessera session` command.
pub async fn session(cmd: SessionCommand) -> ExitCode {
    match cmd {
        SessionCommand::Create {
            config,
            user,
            password_stdin: _,
            ttl,
        } => session_create(&config, user, ttl).await,
        SessionCommand::List { config, json } => session_list(&config, json).await,
        SessionCommand::Reseal { config } => {
            let cfg = match load(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            print_or_fail(admin::reseal_sessions(&cfg).await.map(|r| json_line(&r)))
        }
        SessionCommand::Revoke {
            config,
            sid,
            sid_hash,
            user,
        } => {
            let cfg = match load(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if let Some(sid) = sid {
                let revoked = admin::revoke_session(&cfg, &sid).await;
                return print_or_fail(revoked.map(|existed| {
                    serde_json::json!({ "sid": sid, "revoked": existed }).to_string()
                }));
            }
            let revoked = admin::revoke_sessions(&cfg, sid_hash.as_deref(), user.as_deref()).await;
            print_or_fail(revoked.map(|hashes| {
                serde_json::json!({ "revoked": hashes.len(), "sid_hashes": hashes }).to_string()
            }))
        }
    }
}

/// `tessera session create`: the password from standard input, one JSON line out.
async fn session_create(
    config: &std::path::Path,
    user: String,
    ttl: Option<std::time::Duration>,
) -> ExitCode {
    let cfg = match load(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let mut password = zeroize::Zeroizing::new(String::new());
    if let Err(e) = std::io::stdin().read_to_string(&mut password) {
        eprintln!("tessera: cannot read password from stdin: {e}");
        return ExitCode::from(1);
    }
    let trimmed = password.trim_end_matches(['\r', '\n']).to_string();
    let ttl = ttl.map_or(cfg.session.ttl_seconds, |d| d.as_secs().max(1));
    if ttl > tessera::config::MAX_TTL_SECONDS {
        // As `session.ttl_seconds`: the expiry must stay a valid Redis `EX` and SQL integer.
        eprintln!(
            "tessera: --ttl must be at most ten years ({} s)",
            tessera::config::MAX_TTL_SECONDS
        );
        return ExitCode::from(2);
    }
    let created = admin::create_session(&cfg, user, trimmed, ttl).await;
    print_or_fail(created.map(|c| json_line(&c)))
}

/// `tessera session list`: a table, or one JSON line per session.
async fn session_list(config: &std::path::Path, json: bool) -> ExitCode {
    let cfg = match load(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let list = match admin::list_sessions(&cfg).await {
        Ok(list) => list,
        Err(e) => return print_or_fail::<String, _>(Err(e)),
    };
    if json {
        for l in &list {
            println!("{}", json_line(l));
        }
        return ExitCode::SUCCESS;
    }
    println!("{:<14} {:<24} {:<22} KEY", "SID_HASH", "SUB", "EXPIRES_AT");
    for l in &list {
        let expires = l.expires_at.map_or_else(|| "-".to_string(), expires_text);
        println!(
            "{:<14} {:<24} {:<22} {}",
            l.sid_hash,
            l.sub.as_deref().unwrap_or("-"),
            expires,
            l.key_id.as_deref().unwrap_or("plaintext")
        );
    }
    ExitCode::SUCCESS
}

/// `expires_at` (seconds since the Unix epoch) as RFC 3339 UTC, or the number itself past
/// 9999-12-31 (RFC 3339 has four-digit years; a record may hold milliseconds by mistake).
fn expires_text(expires_at: u64) -> String {
    match std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_secs(expires_at)) {
        Some(at) if expires_at < 253_402_300_800 => {
            humantime::format_rfc3339_seconds(at).to_string()
        }
        _ => expires_at.to_string(),
    }
}

/// `value` as one line of JSON.
fn json_line(value: &impl serde::Serialize) -> String {
    serde_json::to_string(value).expect("serializable")
}

/// Prints the line on success (exit 0), or the error on stderr (exit 1).
pub fn print_or_fail<T: std::fmt::Display, E: std::fmt::Display>(result: Result<T, E>) -> ExitCode {
    match result {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tessera: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expiry_rfc_3339_cannot_write_is_printed_as_the_number() {
        assert_eq!(expires_text(0), "1970-01-01T00:00:00Z");
        assert_eq!(expires_text(253_402_300_799), "9999-12-31T23:59:59Z");
        assert_eq!(expires_text(1_700_000_000_000), "1700000000000");
        assert_eq!(expires_text(u64::MAX), u64::MAX.to_string());
    }
}
