//! The `tessera` binary: parse the command line, load config, call the library. Nothing else.
//! Exit codes: 0 ok, 1 runtime failure, 2 configuration or usage error.

#![forbid(unsafe_code)]
#![warn(clippy::too_many_lines)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use session_cli::SessionCommand;
use tessera::{admin, telemetry, Config};

mod session_cli;

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

fn load(path: &std::path::Path) -> Result<Config, ExitCode> {
    Config::load(path).map_err(|e| {
        eprintln!("tessera: {e}");
        ExitCode::from(2)
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Before any thread starts: taking them edits the environment.
    let inherited = match &cli.command {
        Command::Serve { .. } => match tessera::downstream::Inherited::from_env() {
            Ok(inherited) => inherited,
            Err(e) => {
                eprintln!("tessera: {e}");
                return ExitCode::from(2);
            }
        },
        _ => Default::default(),
    };
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
            Command::Serve { config } => serve(config, inherited).await,
            Command::CheckConfig { config } => check_config(&config).await,
            Command::Session(cmd) => session_cli::session(cmd).await,
            Command::Keygen => {
                print!("{}", admin::keygen());
                ExitCode::SUCCESS
            }
            Command::Demo {
                listen,
                tls,
                tls_listen,
            } => {
                telemetry::init("warn", telemetry::LogFormat::Text);
                tessera::downstream::raise_open_files_limit();
                // Before the directory is made: a signal's default action would leave it.
                let stop = demo_stop_signal();
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
                let result = tessera::demo::run(listen, tls, dir.path(), stop).await;
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

async fn serve(config: PathBuf, inherited: tessera::downstream::Inherited) -> ExitCode {
    // The handlers first, before anything slow (the store, the first JWKS fetch): a signal
    // during start-up is then taken (SIGTERM: a shutdown as soon as serving begins) instead of
    // its default action, which ends the process unlogged.
    #[cfg(unix)]
    let stop = {
        use tokio::signal::unix::SignalKind;
        first_signal_of(&[SignalKind::interrupt(), SignalKind::terminate()], true)
    };
    #[cfg(not(unix))]
    let stop = shutdown_signal();
    #[cfg(unix)]
    let hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
    let cfg = match load(&config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    telemetry::init(&cfg.log.level, cfg.log.format);
    // What the process runs with, to name the keys a reload leaves for the next restart.
    let running = std::fs::read_to_string(&config).unwrap_or_default();
    warn_exposed(&running, &config);
    tessera::downstream::raise_open_files_limit();
    let (reload_tx, reloads) = tokio::sync::mpsc::channel(1);
    #[cfg(unix)]
    match hangups {
        Ok(hangups) => {
            tokio::spawn(reload_on_hangup(
                hangups,
                config.clone(),
                running,
                reload_tx,
            ));
        }
        Err(e) => {
            tracing::warn!(cause = %e, "cannot handle SIGHUP; keys and TLS settings reload only by restart")
        }
    }
    #[cfg(not(unix))]
    drop(reload_tx);
    let listeners = match tessera::open_listeners(&cfg, inherited).await {
        Ok(listeners) => listeners,
        Err(e) => {
            telemetry::fatal(&e.to_string());
            return ExitCode::from(2);
        }
    };
    match tessera::run(cfg, listeners, reloads, stop).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            telemetry::fatal(&e.to_string());
            ExitCode::from(e.exit_code())
        }
    }
}

/// On each SIGHUP (which would otherwise end the process and every request in flight), reads
/// the configuration file `path` again and sends it, or why it did not load (the key and the
/// fix), to the server, which puts its keys in place or logs why not and keeps running as is.
/// Warns of what the reload cannot do, by key: changes to keys that apply at the next restart
/// (against `running`, the text the process started with), and reloaded keys given as `env:`.
#[cfg(unix)]
async fn reload_on_hangup(
    mut hangups: tokio::signal::unix::Signal,
    path: PathBuf,
    running: String,
    reloads: tokio::sync::mpsc::Sender<tessera::ConfigReload>,
) {
    let mut env_warned = false;
    while hangups.recv().await.is_some() {
        // The server stops taking reloads when its drain begins (docs/operations.md, Signals).
        if reloads.is_closed() {
            tracing::info!("SIGHUP ignored: shutting down");
            continue;
        }
        tracing::info!(config = %path.display(), "SIGHUP: reloading the keys and TLS settings");
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        warn_exposed(&text, &path);
        let later = tessera::config::restart_only_changes(&running, &text);
        if !later.is_empty() {
            tracing::warn!(
                keys = %later.join(", "),
                "SIGHUP: changed keys a reload does not apply; they take effect at the next restart"
            );
        }
        let from_env = tessera::config::reloaded_from_env(&text);
        if !from_env.is_empty() {
            // Said at WARN once: a deployment that never rotates them by reload (certbot's
            // daily SIGHUP) is not told again each day.
            let keys = from_env.join(", ");
            let said = "SIGHUP: keys given as env: keep the values the process started with \
                        (its environment is fixed at start); give them as file: to rotate them \
                        by reload";
            match std::mem::replace(&mut env_warned, true) {
                false => tracing::warn!(%keys, "{said}"),
                true => tracing::info!(%keys, "{said}"),
            }
        }
        let reload = Config::load(&path);
        if reloads.send(reload).await.is_err() {
            return;
        }
    }
}

/// `tessera check-config`: the file loads, its store, upstream and key sources answer (exit 2
/// naming the key otherwise); secrets any local user can read are warned of on stderr.
async fn check_config(config: &std::path::Path) -> ExitCode {
    let cfg = match load(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let text = std::fs::read_to_string(config).unwrap_or_default();
    for e in tessera::config::exposed_secrets(&text, config) {
        eprintln!(
            "tessera: warning: config key `{}` ({}): {EXPOSED}",
            e.key, e.path
        );
    }
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

/// Logs each secret of the configuration `text` (read from `path`) that every local user can
/// read, naming its key and the file to `chmod`.
fn warn_exposed(text: &str, path: &std::path::Path) {
    for e in tessera::config::exposed_secrets(text, path) {
        tracing::warn!(key = %e.key, path = %e.path, "{EXPOSED}");
    }
}

/// What [`warn_exposed`] and `check-config` say of a secret readable by all.
const EXPOSED: &str = "a secret is readable by every local user: chmod o-r the file (and keep \
                       its group to tessera's), or give the key as file: with a file only \
                       tessera can read";

/// Resolves on Ctrl-C (where there are no Unix signals).
#[cfg(not(unix))]
async fn shutdown_signal() {
    let _ = tokio::signal::ctrl_c().await;
}

/// Resolves on the first of `kinds` to arrive from now on: each handler is in place when this
/// returns, not at the first poll. With `forced`, a second one after it ends the process at
/// once, with exit code 1, as Caddy's second SIGINT does: an operator who asks twice does not
/// want to wait for the drain.
#[cfg(unix)]
fn first_signal_of(
    kinds: &[tokio::signal::unix::SignalKind],
    forced: bool,
) -> impl std::future::Future<Output = ()> {
    let mut each: Vec<_> = kinds
        .iter()
        .filter_map(|kind| tokio::signal::unix::signal(*kind).ok())
        .collect();
    async move {
        if each.is_empty() {
            // No handler could be set: Ctrl-C at least.
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
        let any = each.iter_mut().map(|s| Box::pin(s.recv()));
        futures_util::future::select_all(any).await;
        if !forced {
            return;
        }
        tokio::spawn(async move {
            let any = each.iter_mut().map(|s| Box::pin(s.recv()));
            futures_util::future::select_all(any).await;
            telemetry::fatal("a second signal: exiting now, requests in flight are cut");
            std::process::exit(1);
        });
    }
}

/// What ends `tessera demo`: SIGINT, SIGTERM, or SIGHUP (its terminal closed), each listened for
/// from now on, so none kills it with its private directory left behind.
fn demo_stop_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::SignalKind;
        first_signal_of(
            &[
                SignalKind::interrupt(),
                SignalKind::terminate(),
                SignalKind::hangup(),
            ],
            false,
        )
    }
    #[cfg(not(unix))]
    shutdown_signal()
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
        assert_eq!(sid.as_deref(), Some("-Oq3x"));
    }

    #[test]
    fn revoke_takes_exactly_one_of_sid_sid_hash_and_user() {
        let parse = |more: &[&str]| {
            let args = [
                &["tessera", "session", "revoke", "--config", "t.toml"],
                more,
            ]
            .concat();
            Cli::try_parse_from(args).is_ok()
        };
        assert!(parse(&["--user", "alice"]));
        assert!(parse(&["--sid-hash", "0a1b2c3d4e5f"]));
        assert!(!parse(&[]));
        assert!(!parse(&["--user", "alice", "--sid", "x"]));
    }
}
