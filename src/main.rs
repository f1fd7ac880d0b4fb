//! The `tessera` binary: parse the command line, load config, call the library. Nothing else.
//! Exit codes: 0 ok, 1 runtime failure, 2 configuration or usage error.

#![forbid(unsafe_code)]
#![warn(clippy::too_many_lines)]

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tessera::{admin, telemetry, Config};

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Authenticating reverse proxy: a client's JWT becomes the upstream's own credentials"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Serve {
        /// TOML configuration file.
        #[arg(long)]
        config: PathBuf,
    },
    /// Validate the configuration, the store and the upstream address; exit 2 on any problem.
    CheckConfig {
        #[arg(long)]
        config: PathBuf,
    },
    /// Create, revoke, list or re-seal sessions in the configured store.
    #[command(subcommand)]
    Session(SessionCommand),
    /// Print fresh random key material for the config.
    Keygen,
    /// Run the whole job locally with a built-in Basic-auth upstream; prints a ready curl line.
    Demo {
        /// Proxy listen address.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        /// Also serve TLS and HTTP/3 (at --tls-listen) with a self-signed certificate made now.
        #[arg(long)]
        tls: bool,
        /// TLS (TCP) and HTTP/3 (UDP) address with --tls.
        #[arg(long, default_value = "127.0.0.1:8443")]
        tls_listen: std::net::SocketAddr,
    },
}

#[derive(Subcommand)]
enum SessionCommand {
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
    /// Delete a session; every request with its token is refused from then on.
    Revoke {
        #[arg(long)]
        config: PathBuf,
        /// The session id (base64url, so it may begin with `-`).
        #[arg(long, allow_hyphen_values = true)]
        sid: String,
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

fn load(path: &std::path::Path) -> Result<Config, ExitCode> {
    Config::load(path).map_err(|e| {
        eprintln!("tessera: {e}");
        ExitCode::from(2)
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tessera: cannot start runtime: {e}");
            return ExitCode::from(1);
        }
    };
    rt.block_on(async move {
        match cli.command {
            Command::Serve { config } => serve(config).await,
            Command::CheckConfig { config } => {
                let cfg = match load(&config) {
                    Ok(c) => c,
                    Err(code) => return code,
                };
                match admin::check(&cfg).await {
                    Ok(lines) => {
                        lines.iter().for_each(|l| println!("{l}"));
                        ExitCode::SUCCESS
                    }
                    Err(e) => {
                        eprintln!("tessera: {e}");
                        ExitCode::from(2)
                    }
                }
            }
            Command::Session(cmd) => session(cmd).await,
            Command::Keygen => {
                print!("{}", admin::keygen());
                ExitCode::SUCCESS
            }
            Command::Demo {
                listen,
                tls,
                tls_listen,
            } => {
                telemetry::init("warn");
                tessera::downstream::raise_open_files_limit();
                // A fresh private directory (removed when dropped): a name another local user
                // could guess and make first would hand them the demo's key and store.
                let mut builder = tempfile::Builder::new();
                builder.prefix("tessera-demo-");
                #[cfg(unix)]
                builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700));
                let dir = match builder.tempdir() {
                    Ok(dir) => dir,
                    Err(e) => {
                        eprintln!("tessera demo: cannot make a temporary directory: {e}");
                        return ExitCode::from(1);
                    }
                };
                let tls = tls.then_some(tls_listen);
                let result = tessera::demo::run(listen, tls, dir.path(), shutdown_signal()).await;
                drop(dir);
                match result {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("tessera demo: {e}");
                        ExitCode::from(1)
                    }
                }
            }
        }
    })
}

async fn serve(config: PathBuf) -> ExitCode {
    let cfg = match load(&config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    telemetry::init(&cfg.log.level);
    tessera::downstream::raise_open_files_limit();
    let (reload_tx, reloads) = tokio::sync::mpsc::channel(1);
    // Registered before the listener is bound, so no SIGHUP can arrive unhandled once it is.
    #[cfg(unix)]
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(hangups) => {
            tokio::spawn(reload_on_hangup(hangups, config.clone(), reload_tx));
        }
        Err(e) => tracing::warn!(cause = %e, "cannot handle SIGHUP; keys reload only by restart"),
    }
    #[cfg(not(unix))]
    drop(reload_tx);
    let fastopen = cfg.server.fastopen;
    let plain = match bind("server.listen", cfg.server.listen, fastopen).await {
        Ok(l) => l,
        Err(code) => return code,
    };
    let tls = match bind("tls.listen", cfg.tls.as_ref().map(|t| t.listen), fastopen).await {
        Ok(l) => l,
        Err(code) => return code,
    };
    let metrics_addr = cfg.metrics.as_ref().map(|m| m.listen);
    let metrics = match bind("metrics.listen", metrics_addr, false).await {
        Ok(l) => l,
        Err(code) => return code,
    };
    let quic = match cfg.http3.as_ref().map(|h| h.listen) {
        None => None,
        Some(addr) => match tessera::downstream::bind_udp(addr) {
            Ok(socket) => Some(socket),
            Err(e) => {
                eprintln!("tessera: config key `http3.listen`: cannot bind {addr} (UDP): {e}");
                return ExitCode::from(2);
            }
        },
    };
    let listeners = tessera::Listeners {
        plain,
        tls,
        quic,
        metrics,
    };
    match tessera::run(cfg, listeners, reloads, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tessera: {e}");
            ExitCode::from(2)
        }
    }
}

/// The listener for config key `key`, when it has an address (with TCP Fast Open when
/// `fastopen`); exit code 2 when it cannot be bound.
async fn bind(
    key: &str,
    addr: Option<std::net::SocketAddr>,
    fastopen: bool,
) -> Result<Option<tokio::net::TcpListener>, ExitCode> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    tessera::downstream::bind_tcp(addr, fastopen)
        .await
        .map(Some)
        .map_err(|e| {
            eprintln!("tessera: config key `{key}`: cannot listen on {addr}: {e}");
            ExitCode::from(2)
        })
}

async fn session(cmd: SessionCommand) -> ExitCode {
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
        SessionCommand::Revoke { config, sid } => {
            let cfg = match load(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let revoked = admin::revoke_session(&cfg, &sid).await;
            print_or_fail(
                revoked.map(|existed| {
                    serde_json::json!({ "sid": sid, "revoked": existed }).to_string()
                }),
            )
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
fn print_or_fail<T: std::fmt::Display, E: std::fmt::Display>(result: Result<T, E>) -> ExitCode {
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

/// On each SIGHUP (which would otherwise end the process and every request in flight), reads
/// the configuration file `path` again and sends it, or why it did not load (the key and the
/// fix), to the server, which puts its keys in place or logs why not and keeps running as is.
#[cfg(unix)]
async fn reload_on_hangup(
    mut hangups: tokio::signal::unix::Signal,
    path: PathBuf,
    reloads: tokio::sync::mpsc::Sender<tessera::ConfigReload>,
) {
    while hangups.recv().await.is_some() {
        tracing::info!(config = %path.display(), "SIGHUP: reloading the keys");
        let reload = Config::load(&path);
        if reloads.send(reload).await.is_err() {
            return;
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { () = ctrl_c => {}, () = term => {} }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sid_starting_with_a_hyphen_is_a_value_not_a_flag() {
        let cli = Cli::try_parse_from([
            "tessera", "session", "revoke", "--config", "t.toml", "--sid", "-Oq3x",
        ])
        .unwrap();
        let Command::Session(SessionCommand::Revoke { sid, .. }) = cli.command else {
            panic!("not a revoke");
        };
        assert_eq!(sid, "-Oq3x");
    }

    #[test]
    fn an_expiry_rfc_3339_cannot_write_is_printed_as_the_number() {
        assert_eq!(expires_text(0), "1970-01-01T00:00:00Z");
        assert_eq!(expires_text(253_402_300_799), "9999-12-31T23:59:59Z");
        assert_eq!(expires_text(1_700_000_000_000), "1700000000000");
        assert_eq!(expires_text(u64::MAX), u64::MAX.to_string());
    }
}
