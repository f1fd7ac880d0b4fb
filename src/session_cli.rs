//! `tessera session ...`: the operator's commands on stored sessions. Part of the `tessera`
//! binary (`main.rs`), not of the library: it parses, calls [`tessera::admin`] and prints.

use std::io::{BufRead, IsTerminal};
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
        /// {"revoked","sid_hashes","failed"}.
        #[arg(long)]
        sid_hash: Option<String>,
        /// Every session of this upstream user; prints {"revoked","sid_hashes","failed"}.
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
        SessionCommand::Reseal { config } => session_reseal(&config).await,
        SessionCommand::Revoke {
            config,
            sid,
            sid_hash,
            user,
        } => {
            let cfg = match load_with_store(&config, false) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if let Some(sid) = sid {
                let revoked = admin::revoke_session(&cfg, &sid).await;
                if let Ok(false) = revoked {
                    nothing_matched();
                }
                return print_or_fail(revoked.map(|existed| {
                    serde_json::json!({ "sid": sid, "revoked": existed }).to_string()
                }));
            }
            let revoked =
                match admin::revoke_sessions(&cfg, sid_hash.as_deref(), user.as_deref()).await {
                    Ok(r) => r,
                    Err(e) => return print_or_fail::<String, _>(Err(e)),
                };
            let line = serde_json::json!({
                "revoked": revoked.sid_hashes.len(),
                "sid_hashes": revoked.sid_hashes,
                "failed": revoked.failed,
            });
            if revoked.sid_hashes.is_empty() && revoked.failed.is_empty() {
                nothing_matched();
            }
            let code = print_or_fail::<_, String>(Ok(line));
            match revoked.failed.is_empty() {
                true => code,
                false => {
                    eprintln!("tessera: some revocations failed (see \"failed\"); run it again");
                    ExitCode::from(1)
                }
            }
        }
    }
}

/// Says on stderr that a revoke found no session (exit 0 all the same: the session is gone
/// either way), so a typo in a user name or sid is not mistaken for a revocation.
fn nothing_matched() {
    eprintln!("tessera: no session matched; nothing was revoked");
}

/// The configuration at `path`, for a command on its store: warnings (a store open to other
/// users, a write no replica confirmed) to stderr, and an embedded store checked present
/// ([`admin::store_present`]): exit 2 if not, unless the command `makes` one (`create`, which
/// says so when it did).
fn load_with_store(path: &std::path::Path, makes: bool) -> Result<tessera::Config, ExitCode> {
    let cfg = load(path)?;
    tessera::telemetry::init("warn", cfg.log.format);
    match admin::store_present(&cfg, makes) {
        Err(e) => {
            eprintln!("tessera: {e}");
            Err(ExitCode::from(2))
        }
        Ok(()) => Ok(cfg),
    }
}

/// `tessera session reseal`: the report as one JSON line; exit 1 when any record could not be
/// opened (a sealing key missing from this config: removing the old key now would lose them).
async fn session_reseal(config: &std::path::Path) -> ExitCode {
    let cfg = match load_with_store(config, false) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let report = match admin::reseal_sessions(&cfg).await {
        Ok(r) => r,
        Err(e) => return print_or_fail::<String, _>(Err(e)),
    };
    let code = print_or_fail::<_, String>(Ok(json_line(&report)));
    if report.unreadable == 0 {
        return code;
    }
    eprintln!(
        "tessera: {} session(s) could not be opened with this config's credentials.keys (see \
         `session list`, column KEY); keep their key until they are resealed or expire",
        report.unreadable
    );
    ExitCode::from(1)
}

/// `tessera session create`: the password from standard input, one JSON line out.
async fn session_create(
    config: &std::path::Path,
    user: String,
    ttl: Option<std::time::Duration>,
) -> ExitCode {
    let cfg = match load_with_store(config, true) {
        Ok(c) => c,
        Err(code) => return code,
    };
    // Usage checked before a password is asked for.
    if ttl.is_some_and(|d| d.as_secs() == 0) {
        eprintln!("tessera: --ttl must be at least 1s");
        return ExitCode::from(2);
    }
    let ttl = ttl.map_or(cfg.session.ttl_seconds, |d| d.as_secs());
    if ttl > tessera::config::MAX_TTL_SECONDS {
        // As `session.ttl_seconds`: the expiry must stay a valid Redis `EX` and SQL integer.
        eprintln!(
            "tessera: --ttl must be at most ten years ({} s)",
            tessera::config::MAX_TTL_SECONDS
        );
        return ExitCode::from(2);
    }
    // One line, as documented: a password typed at a terminal ends with Enter, not Ctrl-D, and
    // is not shown (nor left in the terminal's scrollback).
    let mut password = zeroize::Zeroizing::new(String::new());
    let read = match std::io::stdin().is_terminal() {
        true => rpassword::prompt_password("password: ").map(|p| *password = p),
        false => std::io::stdin().lock().read_line(&mut password).map(drop),
    };
    if let Err(e) = read {
        eprintln!("tessera: cannot read password from stdin: {e}");
        return ExitCode::from(1);
    }
    let trimmed = password.trim_end_matches(['\r', '\n']).to_string();
    if trimmed.is_empty() {
        // As the login endpoint: a session whose upstream credential has no password.
        eprintln!("tessera: the password on stdin is empty (nothing, or an empty line)");
        return ExitCode::from(2);
    }
    let absent = admin::absent_store(&cfg);
    let created = admin::create_session(&cfg, user, trimmed, ttl).await;
    if let (Some(admin::Absent::NotMade(path)), Ok(_)) = (absent, &created) {
        eprintln!(
            "tessera: made a new embedded store at {path}; `tessera serve` must use the same one \
             (run it from this working directory, or give session.store an absolute path)"
        );
    }
    match created {
        // Usage and configuration errors (README: exit 2), not a failure of the store.
        Err(e @ (admin::AdminError::Credentials | admin::AdminError::Sign(_))) => {
            eprintln!("tessera: {e}");
            ExitCode::from(2)
        }
        created => print_or_fail(created.map(|c| json_line(&c))),
    }
}

/// `tessera session list`: a table, or one JSON line per session.
async fn session_list(config: &std::path::Path, json: bool) -> ExitCode {
    let cfg = match load_with_store(config, false) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let list = match admin::list_sessions(&cfg).await {
        Ok(list) => list,
        Err(e) => return print_or_fail::<String, _>(Err(e)),
    };
    match write_list(&list, json, &mut std::io::stdout().lock()) {
        Ok(()) => ExitCode::SUCCESS,
        // `session list | head`: the reader has what it wanted.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tessera: cannot write the list: {e}");
            ExitCode::from(1)
        }
    }
}

/// Writes `list` as a table, or one JSON line per session. A subject's control characters are
/// shown as `?` (another writer to a shared store could put terminal escapes there).
fn write_list(
    list: &[tessera::session::Listed],
    json: bool,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    if json {
        for l in list {
            writeln!(out, "{}", json_line(l))?;
        }
        return Ok(());
    }
    writeln!(
        out,
        "{:<14} {:<24} {:<22} KEY",
        "SID_HASH", "SUB", "EXPIRES_AT"
    )?;
    for l in list {
        let expires = l.expires_at.map_or_else(|| "-".to_string(), expires_text);
        let sub: String = l
            .sub
            .as_deref()
            .unwrap_or("-")
            .chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .collect();
        writeln!(
            out,
            "{:<14} {:<24} {:<22} {}",
            l.sid_hash,
            sub,
            expires,
            l.key_id.as_deref().unwrap_or("plaintext")
        )?;
    }
    out.flush()
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
