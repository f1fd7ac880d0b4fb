//! The MySQL store against a real MariaDB started by each test: several tessera instances on
//! it, the change log polled (transactions committing out of id order included), a crashed
//! server, the CLI.

mod support;

use std::io::Write;
use std::process::Stdio;
use std::time::Duration;

use support::mysql::Mariadb;
use support::stores::{
    a_restricted_account_serves, hex, login, logout, on_store, on_store_with, status, until_status,
    users,
};
use support::{curl, free_port, sample, Tessera};

#[test]
fn login_on_one_use_on_another_logout_on_a_third_refused_everywhere() {
    shared_and_revoked_everywhere(&Mariadb::start());
}

/// The same over TLS (`ssl-mode=VERIFY_IDENTITY`, the server's CA, a client certificate) as an
/// account the server admits only over TLS with a client certificate (`REQUIRE X509`). Without
/// the client certificate, or without TLS, that account is refused, and a server certificate
/// from another CA is refused by tessera: a valid token gets 503, and the log says why.
#[test]
fn over_tls_with_a_client_certificate_a_logout_is_refused_everywhere() {
    let db = Mariadb::start_tls();
    shared_and_revoked_everywhere(&db);
    let up = users();
    let good = on_store(&up, &db.url());
    let token = login(&good, "bob", "bob-pw");
    let tls = db.tls.as_ref().unwrap();
    let no_client_certificate = format!(
        "mysql://x509@127.0.0.1:{}/tessera?ssl-mode=VERIFY_IDENTITY&ssl-ca={}",
        db.port,
        tls.pki.ca().display()
    );
    let plain = format!("mysql://x509@127.0.0.1:{}/tessera", db.port);
    let other = support::tls::ServerTls::new();
    let other_ca = db.url().replace(
        &tls.pki.ca().display().to_string(),
        &other.pki.ca().display().to_string(),
    );
    let denied = "Access denied for user 'x509'";
    for (url, why) in [
        (no_client_certificate, denied),
        (plain, denied),
        (other_ca, "invalid peer certificate"),
    ] {
        let t = on_store(&up, &url);
        assert_eq!(status(&t, &token), 503, "{url}: {}", t.log());
        let log = t.log();
        assert!(log.contains(why), "{log}");
    }
}

/// Once the tables exist, a user who may only read and write them serves (no `CREATE`), as
/// docs/stores.md tells to run it.
#[test]
fn a_user_without_create_serves_once_the_tables_exist() {
    let db = Mariadb::start();
    let up = users();
    login(&on_store(&up, &db.url()), "alice", "alice-pw");
    db.sql(
        "CREATE USER app_rw@'%'; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON tessera.* TO app_rw@'%'",
    );
    let url = db.url().replace("root@", "app_rw@");
    a_restricted_account_serves(&up, &url);
}

/// A change log whose rows tessera cannot read (another tool's table, its ids past i64) is a
/// store error of the poller, reported as the invalidation stream lost: the session cache
/// stops serving, and a logout on another instance is refused at once. mysql_async's typed
/// reads panicked there instead, which ended the stream and left the cache trusted: the
/// logged-out session was served until `session.cache_ttl_seconds`.
#[test]
fn a_change_log_tessera_cannot_read_turns_the_cache_off() {
    let db = Mariadb::start();
    db.sql(
        "CREATE TABLE tessera_kv_log (id BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY, \
           `key` VARBINARY(512) NOT NULL, at BIGINT NOT NULL, KEY tessera_kv_log_at (at)) \
         ENGINE=InnoDB AUTO_INCREMENT=9223372036854775900",
    );
    let up = users();
    let (a, b) = (on_store(&up, &db.url()), on_store(&up, &db.url()));
    let token = login(&a, "alice", "alice-pw");
    for _ in 0..3 {
        assert_eq!(status(&b, &token), 200, "{}", b.log());
    }
    assert_eq!(logout(&a, &token), 204);
    let refused = until_status(&b, &token, 401, Duration::from_secs(10));
    assert!(
        refused.is_some(),
        "B serves a logged-out session: {}",
        b.log()
    );
    assert!(
        b.log().contains("another shape than tessera"),
        "{}",
        b.log()
    );
}

/// A `tessera_kv` of another shape than tessera's (its value made nullable and cleared, as
/// another tool might) is a store failure: 503, never forwarded, and the CLI exits 1. Its rows
/// were read with mysql_async's typed reads, which panic on a NULL: the request's task died
/// (the client's connection reset) and `session list` panicked.
#[test]
fn a_session_table_of_another_shape_is_a_store_failure() {
    let db = Mariadb::start();
    let up = users();
    let a = on_store(&up, &db.url());
    let token = login(&a, "alice", "alice-pw");
    db.sql(
        "ALTER TABLE tessera_kv MODIFY `value` LONGBLOB NULL; UPDATE tessera_kv SET `value` = NULL",
    );
    let b = on_store(&up, &db.url());
    assert_eq!(status(&b, &token), 503, "{}", b.log());
    let listed = std::process::Command::new(support::bin())
        .args(["session", "list", "--config"])
        .arg(b.config_path())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&listed.stderr);
    assert_eq!(listed.status.code(), Some(1), "{said}");
    assert!(
        said.contains("another shape") && !said.contains("panicked"),
        "{said}"
    );
}

fn shared_and_revoked_everywhere(db: &Mariadb) {
    let up = users();
    let (a, b, c) = (
        on_store(&up, &db.url()),
        on_store(&up, &db.url()),
        on_store(&up, &db.url()),
    );
    let token = login(&a, "alice", "alice-pw");
    assert_eq!(db.sql("SELECT COUNT(*) FROM tessera_kv"), "1");
    // A successful login gives its counted attempt back in the background (two UPDATEs that
    // may land after the answer): wait for them, so that they are not taken for warm reads.
    let given_back = || db.sql("SELECT COALESCE(SUM(n), 0) FROM tessera_counters") == "0";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !given_back() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        given_back(),
        "the login's counted attempt was not given back"
    );
    let cold = db.statements();
    for t in [&a, &b, &c] {
        assert_eq!(status(t, &token), 200);
    }
    let statements = db.statements();
    assert!(statements >= cold + 2, "B and C read the session");
    for t in [&a, &b, &c, &a, &b, &c] {
        assert_eq!(status(t, &token), 200);
    }
    assert_eq!(
        db.statements(),
        statements,
        "warm requests ran no statement"
    );
    assert_eq!(logout(&c, &token), 204);
    assert_eq!(db.sql("SELECT COUNT(*) FROM tessera_kv"), "0");
    for (name, t) in [("A", &a), ("B", &b)] {
        let after = until_status(t, &token, 401, Duration::from_secs(10));
        println!("{name} refused the token {after:?} after the logout on C");
        assert!(after.is_some(), "{name} still serves a revoked session");
    }
}

/// A change whose transaction took a lower change-log id but commits after a higher one was
/// read (ids are handed out at insert, not at commit) is still seen: the poller asks for the
/// skipped id again until it appears.
#[test]
fn a_change_committed_out_of_id_order_is_not_missed() {
    let up = users();
    let db = Mariadb::start();
    let (a, b) = (on_store(&up, &db.url()), on_store(&up, &db.url()));
    let (alice, bob) = both_served(&a, &b);
    let held = Held::deletion(&db, "alice");
    // Meanwhile bob logs out: a higher id, committed first, read by B.
    assert_eq!(logout(&a, &bob), 204);
    assert!(until_status(&b, &bob, 401, Duration::from_secs(10)).is_some());
    assert_eq!(
        status(&b, &alice),
        200,
        "alice's deletion is not committed yet"
    );
    held.commit();
    let after = until_status(&b, &alice, 401, Duration::from_secs(10));
    println!("B refused alice {after:?} after the late commit");
    assert!(
        after.is_some(),
        "a change committed out of id order was missed"
    );
}

/// With ids handed out in steps (`auto_increment_increment = 3`, as on a three-node Galera or
/// Group Replication multi-primary cluster, here with one node writing), each change leaves the
/// two ids between as gaps. A burst of 600 changes (1,200 such gaps) neither flushes them out
/// nor loses a change committed late, out of id order, below the burst.
#[test]
fn with_ids_in_steps_a_burst_of_changes_keeps_a_late_commit() {
    let up = users();
    let db = Mariadb::start();
    db.sql("SET GLOBAL auto_increment_increment = 3");
    let metrics = free_port();
    let table = format!("[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n");
    let a = on_store(&up, &db.url());
    let b = on_store_with(&up, &db.url(), &[("tables", &table)]);
    let (alice, bob) = both_served(&a, &b);
    let held = Held::deletion(&db, "alice");
    db.sql(
        "INSERT INTO tessera_kv_log (`key`, at) \
         SELECT CONCAT('burst:', seq), UNIX_TIMESTAMP() FROM seq_1_to_600",
    );
    let ids = db.sql("SELECT MAX(id) - MIN(id) FROM tessera_kv_log WHERE `key` LIKE 'burst:%'");
    assert_eq!(ids, "1797", "ids in steps of 3");
    // B reads past the burst: bob's logout comes after it.
    assert_eq!(logout(&a, &bob), 204);
    assert!(until_status(&b, &bob, 401, Duration::from_secs(10)).is_some());
    // B serves alice from its cache (not committed yet), until the commit.
    let after = cached_until_commit(&b, metrics, &alice, held);
    println!("B refused alice {after:?} after the late commit");
    assert!(after.is_some(), "a late commit below the burst was missed");
}

/// alice and bob logged in on `a`: their tokens, each served by `a` and `b`.
fn both_served(a: &Tessera, b: &Tessera) -> (String, String) {
    let alice = login(a, "alice", "alice-pw");
    let bob = login(a, "bob", "bob-pw");
    for t in [a, b] {
        assert_eq!(status(t, &alice), 200);
        assert_eq!(status(t, &bob), 200);
    }
    (alice, bob)
}

/// Waits until `t` (its metrics on `metrics`) serves `token` from its cache (a 200 that read
/// nothing from the store), then commits `held`: how long until `t` refuses the token after
/// it, `None` after 10 s.
fn cached_until_commit(t: &Tessera, metrics: u16, token: &str, held: Held) -> Option<Duration> {
    let reads = || {
        let (_, text) = curl(&[&format!("http://127.0.0.1:{metrics}/metrics")]);
        sample(&text, "tessera_session_store_reads_total")
    };
    let cached = (0..500).any(|_| {
        let before = reads();
        status(t, token) == 200 && reads() == before
    });
    assert!(cached, "never served from the cache: {}", t.log());
    held.commit();
    until_status(t, token, 401, Duration::from_secs(10))
}

/// A transaction that deletes a user's session and logs it, held open until [`Held::commit`]:
/// its change-log id is taken now, its change seen by others only at the commit.
struct Held {
    client: std::process::Child,
    sql: std::process::ChildStdin,
}

impl Held {
    fn deletion(db: &Mariadb, user: &str) -> Self {
        let key = db.sql(&format!(
            "SELECT `key` FROM tessera_kv WHERE HEX(`value`) LIKE '%{}%'",
            hex(&format!("\"sub\":\"{user}\"")).to_uppercase()
        ));
        assert!(key.starts_with("tessera:session:"), "{key}");
        let mut client = db
            .client()
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let mut sql = client.stdin.take().unwrap();
        writeln!(
            sql,
            "BEGIN; DELETE FROM tessera_kv WHERE `key` = '{key}';\n\
             INSERT INTO tessera_kv_log (`key`, at) VALUES ('{key}', UNIX_TIMESTAMP());"
        )
        .unwrap();
        sql.flush().unwrap();
        let taken = (0..200).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            db.sql("SELECT COUNT(*) FROM information_schema.innodb_trx") == "1"
        });
        assert!(taken, "the held transaction did not start");
        std::thread::sleep(Duration::from_millis(100));
        Self { client, sql }
    }

    fn commit(mut self) {
        writeln!(self.sql, "COMMIT;").unwrap();
        drop(self.sql);
        assert!(self.client.wait().unwrap().success());
    }
}

/// A change whose transaction is still open when an instance starts polling, with a higher id
/// already committed (the log's end above it), is seen when it commits: polling starts with the
/// recent missing ids as gaps.
#[test]
fn a_change_still_open_when_polling_starts_is_not_missed() {
    let up = users();
    let db = Mariadb::start();
    let a = on_store(&up, &db.url());
    let alice = login(&a, "alice", "alice-pw");
    let bob = login(&a, "bob", "bob-pw");
    let held = Held::deletion(&db, "alice");
    assert_eq!(logout(&a, &bob), 204);
    // B starts polling now, at bob's id; alice's is below it, not committed.
    let metrics = free_port();
    let table = format!("[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n");
    let b = on_store_with(&up, &db.url(), &[("tables", &table)]);
    // B serves alice from its cache, until the commit.
    let after = cached_until_commit(&b, metrics, &alice, held);
    println!("B refused alice {after:?} after the commit");
    assert!(
        after.is_some(),
        "a change open when polling started was missed"
    );
}

/// A crashed server (SIGKILL): 503 with nothing forwarded until it is back, then the same token
/// is served again; the CLI lists sessions on it.
#[test]
fn a_crashed_server_gives_503_then_service_again() {
    let up = users();
    let mut db = Mariadb::start();
    let a = on_store(&up, &db.url());
    let alice = login(&a, "alice", "alice-pw");
    assert_eq!(status(&a, &alice), 200);
    db.kill();
    let unavailable = until_status(&a, &alice, 503, Duration::from_secs(10));
    println!("503 {unavailable:?} after the crash");
    assert!(unavailable.is_some(), "{}", a.log());
    // Until the poller sees the loss (within a poll) the cached session is still served; from
    // the first 503 on, the cache is off and nothing is forwarded.
    let forwarded = up.stats.requests.load(std::sync::atomic::Ordering::SeqCst);
    for _ in 0..5 {
        assert_eq!(status(&a, &alice), 503);
    }
    assert_eq!(
        up.stats.requests.load(std::sync::atomic::Ordering::SeqCst),
        forwarded,
        "forwarded while the store was down"
    );
    db.start_again();
    let served = until_status(&a, &alice, 200, Duration::from_secs(15));
    println!("served {served:?} after the restart");
    assert!(served.is_some(), "{}", a.log());
    let list = || {
        let out = std::process::Command::new(support::bin())
            .args(["session", "list", "--json", "--config"])
            .arg(a.config_path())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let listed = list();
    assert!(listed.contains("\"sub\":\"alice\""), "{listed}");
    // 2,500 copies of the record under other sids, each followed by one whose key is not
    // UTF-8 (another tool's, named by no token): listed in pages of 1,000 (each a call with
    // its own deadline) going by the keys as stored, none missed or read twice.
    db.sql(
        "INSERT INTO tessera_kv (`key`, `value`, expires_at) \
         SELECT CONCAT('tessera:session:copy-', LPAD(seq, 5, '0'), suffix), `value`, expires_at \
         FROM tessera_kv, seq_1_to_2500, (SELECT '' AS suffix UNION SELECT X'FF') AS s",
    );
    let listed = list();
    let hashes: std::collections::BTreeSet<&str> = listed
        .lines()
        .filter_map(|l| l.split("\"sid_hash\":\"").nth(1)?.split('"').next())
        .collect();
    assert_eq!((listed.lines().count(), hashes.len()), (2501, 2501));
}
