//! The PostgreSQL store against a real server started by each test: several tessera instances
//! sharing it, revocations seen by every instance through `LISTEN`/`NOTIFY`, the listener cut
//! and the server crashed, the CLI and `check-config` on it.

mod support;

use std::process::Command;
use std::time::Duration;

use support::events::EventStream;
use support::postgres::Postgres;
use support::stores::{
    a_restricted_account_serves, hex, login, logout, on_store, on_store_with, status, until_status,
    users,
};
use support::upstream::TestUpstream;
use support::{bearer, bin, config, curl, Tessera};

fn on_postgres(up: &TestUpstream, pg: &Postgres) -> Tessera {
    on_store(up, &pg.url())
}

fn run_cli(args: &[&str]) -> std::process::Output {
    Command::new(bin()).args(args).output().unwrap()
}

#[test]
fn login_on_one_use_on_another_logout_on_a_third_refused_everywhere() {
    let up = users();
    let pg = Postgres::start();
    // C reads the store's URL from a file, as one holding a password would be given.
    let dir = tempfile::tempdir().unwrap();
    let url_file = dir.path().join("store-url");
    std::fs::write(&url_file, format!("{}\n", pg.url())).unwrap();
    let (a, b, c) = (
        on_postgres(&up, &pg),
        on_postgres(&up, &pg),
        on_store(&up, &format!("file:{}", url_file.display())),
    );
    let token = login(&a, "alice", "alice-pw");
    assert_eq!(pg.sql("SELECT count(*) FROM tessera_kv"), "1");
    for t in [&a, &b, &c] {
        assert_eq!(status(t, &token), 200);
    }
    const READ: &str = "SELECT value FROM tessera_kv";
    let reads = pg.calls(READ);
    assert!(reads >= 2, "B and C read the session: {reads}");
    for t in [&a, &b, &c, &a, &b, &c] {
        assert_eq!(status(t, &token), 200);
    }
    assert_eq!(pg.calls(READ), reads, "warm requests read no session");
    assert_eq!(
        up.stats.last_authorization.lock().unwrap().as_str(),
        support::basic("alice", "alice-pw")
    );
    assert_eq!(logout(&c, &token), 204);
    assert_eq!(pg.sql("SELECT count(*) FROM tessera_kv"), "0");
    for (name, t) in [("A", &a), ("B", &b)] {
        let after = until_status(t, &token, 401, Duration::from_secs(10));
        println!("{name} refused the token {after:?} after the logout on C");
        assert!(after.is_some(), "{name} still serves a revoked session");
    }
    // The change went through the change log, written in the same transaction.
    let logged = pg.sql("SELECT count(*) FROM tessera_kv_log WHERE key LIKE 'tessera:session:%'");
    assert!(logged.parse::<u64>().unwrap() >= 2, "{logged}");
    for t in [&a, &b, &c] {
        assert!(!t.log().contains("alice-pw") && !t.log().contains(&token));
    }
}

/// Any writer revokes: an operator's `DELETE` in psql reaches every instance's cache, since the
/// trigger that rings `NOTIFY` is on the table, not in tessera.
#[test]
fn an_operators_delete_in_psql_revokes_on_every_instance() {
    let up = users();
    let pg = Postgres::start();
    let (a, b) = (on_postgres(&up, &pg), on_postgres(&up, &pg));
    let alice = login(&a, "alice", "alice-pw");
    let bob = login(&a, "bob", "bob-pw");
    for t in [&a, &b] {
        assert_eq!(status(t, &alice), 200);
        assert_eq!(status(t, &bob), 200);
    }
    let deleted = pg.sql(&format!(
        "DELETE FROM tessera_kv WHERE key = (SELECT key FROM tessera_kv WHERE value::text LIKE '%{}%' LIMIT 1) RETURNING 1",
        hex("\"sub\":\"alice\"")
    ));
    assert_eq!(deleted, "1");
    for t in [&a, &b] {
        assert!(until_status(t, &alice, 401, Duration::from_secs(10)).is_some());
        assert_eq!(status(t, &bob), 200, "another session is untouched");
    }
}

/// `TRUNCATE tessera_kv` (every user logged out at once) fires no row trigger; a statement
/// trigger of its own tells every instance that every session changed.
#[test]
fn a_truncate_in_psql_revokes_every_session_on_every_instance() {
    let up = users();
    let pg = Postgres::start();
    let (a, b) = (on_postgres(&up, &pg), on_postgres(&up, &pg));
    let alice = login(&a, "alice", "alice-pw");
    let bob = login(&b, "bob", "bob-pw");
    for t in [&a, &b] {
        assert_eq!(status(t, &alice), 200);
        assert_eq!(status(t, &bob), 200);
    }
    pg.sql("TRUNCATE tessera_kv");
    for t in [&a, &b] {
        for token in [&alice, &bob] {
            assert!(until_status(t, token, 401, Duration::from_secs(10)).is_some());
        }
    }
}

/// Once the tables exist, a role that may only read and write them serves: no `CREATE` on the
/// schema, owning nothing (as docs/stores.md tells to run it).
#[test]
fn a_role_without_create_serves_once_the_tables_exist() {
    let up = users();
    let pg = Postgres::start();
    let owner = on_postgres(&up, &pg);
    login(&owner, "alice", "alice-pw");
    pg.sql(
        "CREATE ROLE app_rw LOGIN; REVOKE CREATE ON SCHEMA public FROM PUBLIC; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON tessera_kv, tessera_kv_log, tessera_counters \
         TO app_rw; GRANT USAGE ON SEQUENCE tessera_kv_log_id_seq TO app_rw",
    );
    let url = pg.url().replace("tessera@", "app_rw@");
    a_restricted_account_serves(&up, &url);
}

/// The listener's connection ended by `pg_terminate_backend`, then a session deleted before it
/// is back (it reconnects after 100 ms): no notification names that change, and still no
/// instance serves the session afterwards (the cache is off while the listener is lost and
/// flushed when it is back).
#[test]
fn a_revocation_while_the_listener_is_cut_is_not_missed() {
    let up = users();
    let pg = Postgres::start();
    let a = on_postgres(&up, &pg);
    let alice = login(&a, "alice", "alice-pw");
    let bob = login(&a, "bob", "bob-pw");
    assert_eq!(status(&a, &alice), 200);
    assert_eq!(status(&a, &bob), 200);
    let cut = pg.sql(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE application_name = 'tessera listener'",
    );
    assert_eq!(cut, "1");
    pg.sql(&format!(
        "DELETE FROM tessera_kv WHERE value::text LIKE '%{}%'",
        hex("\"sub\":\"alice\"")
    ));
    let after = until_status(&a, &alice, 401, Duration::from_secs(10));
    println!("refused {after:?} after the unannounced delete");
    assert!(after.is_some(), "a revoked session served: {}", a.log());
    let log = a.log_when(|l| l.contains("postgres invalidation stream lost"));
    assert!(log.contains("postgres invalidation stream lost"), "{log}");
    assert_eq!(status(&a, &bob), 200);
    let back = (0..250).any(|_| {
        std::thread::sleep(Duration::from_millis(20));
        pg.sql("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'tessera listener'")
            == "1"
    });
    assert!(back, "the listener did not come back");
}

/// A crashed server (`pg_ctl -m immediate`): requests get 503 with Retry-After (never 401, never
/// forwarded) until it is back, then the same token is served again.
#[test]
fn a_crashed_server_gives_503_then_service_again() {
    let up = users();
    let pg = Postgres::start();
    let a = on_postgres(&up, &pg);
    let alice = login(&a, "alice", "alice-pw");
    assert_eq!(status(&a, &alice), 200);
    let forwarded = up.stats.requests.load(std::sync::atomic::Ordering::SeqCst);
    pg.crash();
    let unavailable = until_status(&a, &alice, 503, Duration::from_secs(10));
    println!("503 {unavailable:?} after the crash");
    assert!(unavailable.is_some(), "{}", a.log());
    let (code, headers) = curl(&[
        "-s",
        "-D",
        "-",
        "-o",
        "/dev/null",
        "-H",
        &bearer(&alice),
        &a.url("/mail"),
    ]);
    assert_eq!(code, 503);
    assert!(
        headers.to_ascii_lowercase().contains("retry-after:"),
        "{headers}"
    );
    assert_eq!(
        up.stats.requests.load(std::sync::atomic::Ordering::SeqCst),
        forwarded,
        "forwarded while the store was down"
    );
    pg.start_again();
    let served = until_status(&a, &alice, 200, Duration::from_secs(15));
    println!("served {served:?} after the restart");
    assert!(served.is_some(), "{}", a.log());
}

/// A frozen server (every process stopped, as a hung host): the listener's heartbeat trips,
/// the cache is bypassed, and requests get 503 (the store read times out) instead of being
/// served from a cache nobody can invalidate; thawed, the same token is served again.
#[test]
fn a_frozen_server_trips_the_heartbeat_and_gives_503() {
    let up = users();
    let pg = Postgres::start();
    let a = on_postgres(&up, &pg);
    let alice = login(&a, "alice", "alice-pw");
    assert_eq!(status(&a, &alice), 200);
    pg.signal_all(rustix::process::Signal::STOP);
    let unavailable = until_status(&a, &alice, 503, Duration::from_secs(15));
    pg.signal_all(rustix::process::Signal::CONT);
    println!("503 {unavailable:?} after the freeze");
    assert!(unavailable.is_some(), "{}", a.log());
    assert!(
        a.log().contains("postgres invalidation stream lost"),
        "{}",
        a.log()
    );
    let served = until_status(&a, &alice, 200, Duration::from_secs(15));
    println!("served {served:?} after the thaw");
    assert!(served.is_some(), "{}", a.log());
}

/// A pooled connection whose call timed out on a server gone silent (its backend frozen, as a
/// lost host or a failover by DNS leaves it) is closed, not pooled again: once a new connection
/// reaches the server, requests are served, not 503 until the kernel gives up on the frozen
/// one (about 15 minutes).
#[test]
fn a_connection_frozen_mid_call_is_replaced_not_pooled_again() {
    use rustix::process::{kill_process, Pid, Signal};
    let up = users();
    let pg = Postgres::start();
    // No cache: every request reads the store.
    let a = on_store_with(&up, &pg.url(), &[("session", "cache_max_entries = 0")]);
    let alice = login(&a, "alice", "alice-pw");
    assert_eq!(status(&a, &alice), 200);
    // tessera's backends, not the postmaster: a new connection is served.
    let pids = pg.sql(
        "SELECT string_agg(pid::text, ' ') FROM pg_stat_activity \
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
    );
    let frozen: Vec<Pid> = pids
        .split_whitespace()
        .filter_map(|p| Pid::from_raw(p.parse().ok()?))
        .collect();
    assert!(!frozen.is_empty(), "no backend of tessera's: {pids}");
    let signal = |s: Signal| {
        for pid in &frozen {
            let _ = kill_process(*pid, s);
        }
    };
    signal(Signal::STOP);
    let unavailable = until_status(&a, &alice, 503, Duration::from_secs(15));
    let served = until_status(&a, &alice, 200, Duration::from_secs(30));
    signal(Signal::CONT);
    assert!(unavailable.is_some(), "no call waited on a frozen backend");
    assert!(
        served.is_some(),
        "still 503 on the frozen connection: {}",
        a.log()
    );
}

/// The CLI and `check-config` on the PostgreSQL store: a session created by the CLI serves on a
/// running instance, is listed, and its revocation by the CLI (another process) reaches the
/// instance; `check-config` reaches the server, and says so when it cannot.
#[test]
fn the_cli_and_check_config_work_on_postgres() {
    let up = users();
    let pg = Postgres::start();
    let a = on_postgres(&up, &pg);
    let path = a.config_path();
    let cfg = path.to_str().unwrap();
    let (sid, token) = a.create_session("alice", "alice-pw");
    assert_eq!(status(&a, &token), 200);
    let listed = run_cli(&["session", "list", "--json", "--config", cfg]);
    assert!(listed.status.success());
    let listed = String::from_utf8(listed.stdout).unwrap();
    assert_eq!(listed.lines().count(), 1, "{listed}");
    assert!(listed.contains("\"sub\":\"alice\""), "{listed}");
    let reseal = run_cli(&["session", "reseal", "--config", cfg]);
    assert!(reseal.status.success());
    let report: serde_json::Value = serde_json::from_slice(&reseal.stdout).unwrap();
    assert_eq!(report["total"], 1, "{report}");
    // 2,500 copies of the record under other sids: the list reads them in pages of 1,000,
    // each page a call with its own deadline, none missed or read twice.
    pg.sql(
        "INSERT INTO tessera_kv (key, value, expires_at) \
         SELECT 'tessera:session:copy-' || lpad(n::text, 5, '0'), value, expires_at \
         FROM tessera_kv, generate_series(1, 2500) AS n",
    );
    let listed = run_cli(&["session", "list", "--json", "--config", cfg]);
    let listed = String::from_utf8(listed.stdout).unwrap();
    let hashes: std::collections::BTreeSet<&str> = listed
        .lines()
        .map(|l| {
            l.split("\"sid_hash\":\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
        })
        .collect();
    assert_eq!((listed.lines().count(), hashes.len()), (2501, 2501));
    a.revoke(&sid);
    assert!(until_status(&a, &token, 401, Duration::from_secs(10)).is_some());

    let checked = run_cli(&["check-config", "--config", cfg]);
    assert!(
        checked.status.success(),
        "{}",
        String::from_utf8_lossy(&checked.stderr)
    );
    pg.crash();
    let checked = run_cli(&["check-config", "--config", cfg]);
    let said = String::from_utf8_lossy(&checked.stderr);
    assert!(!checked.status.success());
    assert!(said.contains("postgres"), "{said}");
}

/// A `tessera_kv` of another shape than tessera's (its value column altered to text, or made
/// so by another tool) is a store failure: 503, never forwarded, and the CLI exits 1 naming
/// it. The rows were read with accessors that panic on a type they do not expect: the
/// request's task died (the client saw its connection reset) and `session list` panicked.
#[test]
fn a_session_table_of_another_shape_is_a_store_failure() {
    let up = users();
    let pg = Postgres::start();
    let a = on_postgres(&up, &pg);
    let (_, token) = a.create_session("alice", "alice-pw");
    pg.sql(
        "ALTER TABLE tessera_kv ALTER COLUMN value TYPE text \
         USING convert_from(value, 'UTF8')",
    );
    // A fresh instance: nothing cached.
    let b = on_postgres(&up, &pg);
    assert_eq!(status(&b, &token), 503, "{}", b.log());
    let path = b.config_path();
    let listed = run_cli(&["session", "list", "--config", path.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&listed.stderr);
    assert_eq!(listed.status.code(), Some(1), "{said}");
    assert!(
        said.contains("postgres") && !said.contains("panicked"),
        "{said}"
    );
}

/// Sessions of `users` (passwords `USER-pw`) as tessera makes them, moved into an application's
/// own table `app.sessions (sid, record jsonb)`, tessera's tables dropped; the URL of a role
/// that may only `SELECT` it, and each user's `(sid, token)`.
fn applications_table(
    up: &TestUpstream,
    pg: &Postgres,
    users: &[&str],
) -> (String, Vec<(String, String)>) {
    let writer = on_postgres(up, pg);
    let made = (users.iter())
        .map(|u| writer.create_session(u, &format!("{u}-pw")))
        .collect();
    drop(writer);
    pg.sql(
        "CREATE SCHEMA app; \
         CREATE TABLE app.sessions AS \
           SELECT key AS sid, convert_from(value, 'UTF8')::jsonb AS record FROM tessera_kv; \
         DROP TABLE tessera_kv, tessera_kv_log, tessera_counters; \
         CREATE ROLE reader LOGIN; GRANT USAGE ON SCHEMA app TO reader; \
         GRANT SELECT ON app.sessions TO reader",
    );
    (pg.url().replace("tessera@", "reader@"), made)
}

/// Without `notify_channel` no change is announced, so the open responses of a session the
/// application deletes are ended by reading them again every 2 s: an event stream ends
/// (reported) within a few seconds of the `DELETE`.
#[test]
fn without_a_channel_an_open_response_of_a_deleted_session_ends() {
    let up = users();
    let pg = Postgres::start();
    let (url, made) = applications_table(&up, &pg, &["alice"]);
    let [(sid, token)] = made.try_into().unwrap();
    let up_url = up.url();
    let t = Tessera::start(move |port, _| {
        let query = "query = \"SELECT record FROM app.sessions WHERE sid = $1\"";
        config(port, &up_url, &url, &[("session", query)])
    });
    let mut events = EventStream::open(&t, &token);
    assert!(
        events.events_within(1, Duration::from_secs(5)),
        "the stream goes on"
    );
    pg.sql(&format!(
        "DELETE FROM app.sessions WHERE sid = 'tessera:session:{sid}'"
    ));
    let ended = events.ended_within(Duration::from_secs(20));
    println!("the stream ended {ended:?} after the DELETE");
    assert!(ended.is_some(), "{}", t.log());
}

/// Sessions in the application's own table (`session.query`), read by a role that may only
/// `SELECT` it: two instances serve a session and keep it cached (no read on warm requests);
/// the application's `DELETE` with `NOTIFY` on its channel is refused on both; an instance
/// without a channel keeps no cache and refuses a row deleted without a notice, or whose record
/// was set NULL, at once.
/// tessera creates nothing and refuses writes.
#[test]
fn sessions_in_the_applications_own_table_are_read_only() {
    let up = users();
    let pg = Postgres::start();
    up.stats.set_password("dave", "dave-pw");
    let (url, made) = applications_table(&up, &pg, &["alice", "bob", "carol", "dave"]);
    let query = (
        "session",
        "query = \"SELECT record FROM app.sessions WHERE sid = $1\"",
    );
    let channel = ("session", "notify_channel = \"app_sessions\"");
    let reader = |lines: &[(&'static str, &'static str)]| {
        let (url, up_url, lines) = (url.clone(), up.url(), lines.to_vec());
        Tessera::start(move |port, _| config(port, &up_url, &url, &lines))
    };
    let (a, b, uncached) = (
        reader(&[query, channel]),
        reader(&[query, channel]),
        reader(&[query]),
    );
    let [(alice_sid, alice), (bob_sid, bob), (_, carol), (dave_sid, dave)] =
        made.try_into().unwrap();
    for t in [&a, &b, &uncached] {
        assert_eq!(status(t, &alice), 200, "{}", t.log());
        assert_eq!(status(t, &bob), 200);
    }
    let reads = pg.calls("SELECT record FROM app.sessions");
    for t in [&a, &b, &a, &b] {
        assert_eq!(status(t, &alice), 200);
    }
    assert_eq!(
        pg.calls("SELECT record FROM app.sessions"),
        reads,
        "warm: no reads"
    );
    assert_eq!(status(&uncached, &alice), 200);
    assert!(
        pg.calls("SELECT record FROM app.sessions") > reads,
        "no cache: a read"
    );
    // An application that dates its records with PostgreSQL's epoch, a numeric with a fraction.
    let dated = |sign: &str| {
        let query = format!(
            "query = \"SELECT record || jsonb_build_object('expires_at', \
             extract(epoch FROM now() {sign} interval '1 hour')) FROM app.sessions WHERE sid = $1\""
        );
        let (url, up_url) = (url.clone(), up.url());
        Tessera::start(move |port, _| config(port, &up_url, &url, &[("session", &query)]))
    };
    let (later, over) = (dated("+"), dated("-"));
    assert_eq!(status(&later, &alice), 200, "{}", later.log());
    assert_eq!(status(&over, &alice), 401, "{}", over.log());
    drop((later, over));

    pg.sql(&format!(
        "BEGIN; DELETE FROM app.sessions WHERE sid = 'tessera:session:{alice_sid}'; \
         SELECT pg_notify('app_sessions', 'tessera:session:{alice_sid}'); COMMIT"
    ));
    for (name, t) in [("A", &a), ("B", &b), ("uncached", &uncached)] {
        let after = until_status(t, &alice, 401, Duration::from_secs(10));
        println!("{name} refused the session {after:?} after the application's DELETE");
        assert!(after.is_some(), "{name} serves a deleted session");
    }
    pg.sql(&format!(
        "DELETE FROM app.sessions WHERE sid = 'tessera:session:{bob_sid}'"
    ));
    assert_eq!(status(&uncached, &bob), 401, "without a channel, no cache");
    // An application that clears the record at logout instead of deleting the row.
    assert_eq!(status(&uncached, &dave), 200);
    pg.sql(&format!(
        "UPDATE app.sessions SET record = NULL WHERE sid = 'tessera:session:{dave_sid}'"
    ));
    assert_eq!(status(&uncached, &dave), 401, "a NULL record is no session");

    // The upstream refuses carol's stored password (no such user there): a 401, the row left to
    // the application, and no write tried (it would fail as read-only and warn).
    assert_eq!(status(&a, &carol), 401);
    let rows = pg.sql("SELECT count(*) FROM app.sessions");
    assert_eq!(rows, "2", "carol's row is the application's to delete");
    let log = a.log();
    assert!(
        log.contains("upstream rejected credentials; session kept: the store is read-only")
            && !log.contains("session store call failed"),
        "{log}"
    );

    // A query that refuses the key as data: PostgreSQL's message quotes the value (`invalid
    // input syntax for type uuid: "tessera:session:<sid>"`), which the log must not.
    let casting = (
        "session",
        "query = \"SELECT record FROM app.sessions WHERE sid = $1::text::uuid::text\"",
    );
    let strict = reader(&[casting]);
    assert_eq!(status(&strict, &dave), 503);
    let log = strict.log_when(|l| l.contains("session store call failed"));
    assert!(
        log.contains("invalid input syntax for type uuid (22P02)") && !log.contains(&dave_sid),
        "{log}"
    );

    let tables = pg.sql("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'tessera%'");
    assert_eq!(tables, "0", "tessera created nothing");
    let cfg = a.config_path();
    let revoke = run_cli(&[
        "session",
        "revoke",
        "--config",
        cfg.to_str().unwrap(),
        "--sid",
        &bob_sid,
    ]);
    let said = String::from_utf8_lossy(&revoke.stderr);
    assert!(
        !revoke.status.success() && said.contains("read-only"),
        "{said}"
    );
    let checked = run_cli(&["check-config", "--config", cfg.to_str().unwrap()]);
    assert!(
        checked.status.success(),
        "{}",
        String::from_utf8_lossy(&checked.stderr)
    );
    // check-config runs the query: a record column of the wrong type is named.
    let text = std::fs::read_to_string(&cfg).unwrap();
    let wrong = a.dir.path().join("wrong-column.toml");
    std::fs::write(&wrong, text.replace("SELECT record FROM", "SELECT 1 FROM")).unwrap();
    let checked = run_cli(&["check-config", "--config", wrong.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&checked.stderr);
    assert!(
        !checked.status.success() && said.contains("answers int4"),
        "{said}"
    );
    // A query that writes fails even for a role that may write: the connections are read-only.
    let writes = a.dir.path().join("writes.toml");
    let text = text.replace("reader@", "tessera@").replace(
        "SELECT record FROM app.sessions WHERE sid = $1",
        "UPDATE app.sessions SET record = record WHERE sid = $1 RETURNING record",
    );
    std::fs::write(&writes, text).unwrap();
    let checked = run_cli(&["check-config", "--config", writes.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&checked.stderr);
    assert!(
        !checked.status.success() && said.contains("read-only transaction"),
        "{said}"
    );
}

/// TLS to the server (`sslmode=verify-full`, the CA from `sslrootcert`): sessions work, every
/// tessera connection is encrypted (`pg_stat_ssl`), and a CA that did not sign the server's
/// certificate gives 503s, never a plain connection. A role that logs in by client certificate
/// (`cert` in pg_hba.conf) is served with `sslcert` + `sslkey`, and refused without them.
#[test]
fn tls_to_the_server_is_verified() {
    let pki = support::tls::Pki::new();
    let (cert, key) = pki.leaf("db", &["localhost"]);
    let pg = Postgres::start_tls(&cert, &key, &pki.ca());
    let up = users();
    let url = |ca: &std::path::Path| {
        format!(
            "postgres://tessera@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
            pg.port,
            ca.display()
        )
    };
    let a = on_store(&up, &url(&pki.ca()));
    let alice = login(&a, "alice", "alice-pw");
    assert_eq!(status(&a, &alice), 200);
    let plain = pg.sql(
        "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid)
         WHERE application_name LIKE 'tessera%' AND NOT ssl",
    );
    let encrypted = pg.sql(
        "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid)
         WHERE application_name LIKE 'tessera%' AND ssl",
    );
    assert_eq!(plain, "0");
    assert!(
        encrypted.parse::<u64>().unwrap() >= 2,
        "pool and listener: {encrypted}"
    );
    let other = support::tls::Pki::new();
    let b = on_store(&up, &url(&other.ca()));
    let (code, _) = curl(&["-H", &bearer(&alice), &b.url("/mail")]);
    assert_eq!(code, 503);
    let log = b.log_when(|l| l.contains("certificate"));
    assert!(log.contains("certificate"), "{log}");

    let (client_cert, client_key) = pki.leaf("certuser", &["certuser"]);
    let by_cert = format!(
        "postgres://certuser@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
        pg.port,
        pki.ca().display()
    );
    let with_cert = on_store(
        &up,
        &format!(
            "{by_cert}&sslcert={}&sslkey={}",
            client_cert.display(),
            client_key.display()
        ),
    );
    assert_eq!(status(&with_cert, &alice), 200, "{}", with_cert.log());
    let without = on_store(&up, &by_cert);
    assert_eq!(status(&without, &alice), 503);
    let why = "requires a valid client certificate";
    let log = without.log_when(|l| l.contains(why));
    assert!(log.contains(why), "{log}");
}

/// A `sslrootcert` file that cannot be read, or a scheme that is no store, is refused at start
/// naming the key.
#[test]
fn a_bad_postgres_url_is_refused_with_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.toml");
    for (store, says) in [
        (
            "postgres://u@127.0.0.1:1/db?sslmode=require&sslrootcert=/nonexistent/ca.pem",
            "sslrootcert",
        ),
        (
            "postgres://u@127.0.0.1:1/db?sslmode=require&sslcert=/c.pem",
            "go together",
        ),
        (
            "postgres://u@127.0.0.1:1/db?sslrootcert=/ca.pem",
            "need TLS",
        ),
        ("postgre://u@127.0.0.1:1/db", "postgres://"),
    ] {
        std::fs::write(&path, config(1, "http://127.0.0.1:9", store, &[])).unwrap();
        let out = run_cli(&["check-config", "--config", path.to_str().unwrap()]);
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{store}");
        assert!(
            said.contains("session.store") && said.contains(says),
            "{store}: {said}"
        );
    }
}
