//! The Redis store on a Redis Cluster (`redis+cluster://`) started by each test: three primaries
//! and three replicas with a password. Several tessera instances, invalidation from every shard,
//! FLUSHALL, `CLUSTER FAILOVER`, `kill -9` and `SIGSTOP` of the primary owning a session.

mod support;

use std::time::{Duration, Instant};

use support::cluster::Cluster;
use support::stores::{
    login, logout, on_store, session_key, status, through_failover, two_warm, until_status, users,
};

#[test]
fn login_on_one_use_on_another_logout_on_a_third_refused_everywhere() {
    shared_and_revoked_everywhere(&Cluster::start());
}

/// The same with every node on TLS only (`rediss+cluster://`, client certificates required):
/// commands, the shard map and one tracking connection per primary, all over TLS.
#[test]
fn over_tls_a_logout_on_one_instance_is_refused_everywhere() {
    let c = Cluster::start_tls();
    assert!(c.url().starts_with("rediss+cluster://"));
    shared_and_revoked_everywhere(&c);
}

fn shared_and_revoked_everywhere(c: &Cluster) {
    let up = users();
    let (a, b, t3) = (
        on_store(&up, &c.url()),
        on_store(&up, &c.url()),
        on_store(&up, &c.url()),
    );
    // Sessions land on several shards; each instance must hear every shard. Six random sids
    // all fall on one of three shards once in 243 runs: more logins until two shards hold some.
    let mut tokens: Vec<String> = Vec::new();
    let mut owners = std::collections::HashSet::new();
    for i in 0..30 {
        let user = if i % 2 == 0 { "alice" } else { "bob" };
        tokens.push(login(&a, user, &format!("{user}-pw")));
        if tokens.len() >= 6 {
            let keys = c.session_keys();
            assert_eq!(keys.len(), tokens.len());
            owners = keys.iter().map(|k| c.owner_of(k)).collect();
            if owners.len() >= 2 {
                break;
            }
        }
    }
    assert!(
        owners.len() >= 2,
        "all {} sessions on one shard",
        tokens.len()
    );
    for t in [&a, &b, &t3] {
        for token in &tokens {
            assert_eq!(status(t, token), 200);
        }
    }
    let gets = c.gets();
    for t in [&a, &b, &t3] {
        for token in &tokens {
            assert_eq!(status(t, token), 200);
        }
    }
    assert_eq!(c.gets(), gets, "warm requests read no session");
    for token in &tokens {
        assert_eq!(logout(&t3, token), 204);
    }
    assert!(c.session_keys().is_empty());
    for (name, t) in [("A", &a), ("B", &b)] {
        for token in &tokens {
            let after = until_status(t, token, 401, Duration::from_secs(10));
            assert!(after.is_some(), "{name} serves a revoked session");
        }
    }
}

/// FLUSHALL on every primary: the null invalidation flushes every instance's cache.
#[test]
fn flushall_refuses_every_session_everywhere() {
    let up = users();
    let c = Cluster::start();
    let (a, b) = (on_store(&up, &c.url()), on_store(&up, &c.url()));
    let alice = login(&a, "alice", "alice-pw");
    for t in [&a, &b] {
        assert_eq!(status(t, &alice), 200);
    }
    for p in c.primaries() {
        c.cli(p, &["FLUSHALL"]);
    }
    for t in [&a, &b] {
        assert!(until_status(t, &alice, 401, Duration::from_secs(10)).is_some());
    }
}

/// `CLUSTER FAILOVER` on the replica of the primary owning alice's session: both instances
/// follow, a logout after it is refused on the other, bob's session goes on.
#[test]
fn a_cluster_failover_keeps_revocations_and_sessions() {
    let up = users();
    let c = Cluster::start();
    let (a, b, alice, bob) = two_warm(&up, &c.url());
    let key = session_key(&alice);
    let owner = c.owner_of(&key);
    let replica = c.replica_of(owner);
    // A manual failover that Redis lets time out (seen here about one time in four: the
    // replica never takes over, no error) is asked for again.
    let failed_over = (0..3).any(|_| {
        assert_eq!(c.cli(replica, &["CLUSTER", "FAILOVER"]), "OK");
        let deadline = Instant::now() + Duration::from_secs(6);
        while Instant::now() < deadline {
            if c.owner_of(&key) == replica {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    });
    assert!(failed_over, "no failover: {}", c.cli(replica, &["ROLE"]));
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut code = logout(&a, &alice);
    while code != 204 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        code = logout(&a, &alice);
    }
    assert_eq!(code, 204, "{}", a.log());
    let after = until_status(&b, &alice, 401, Duration::from_secs(10));
    println!("B refused alice {after:?} after the logout on A");
    assert!(after.is_some(), "B serves a revoked session: {}", b.log());
    assert!(until_status(&b, &bob, 200, Duration::from_secs(10)).is_some());
}

/// A revocation acknowledged just before `kill -9` of the primary owning it is on its replica
/// (WAIT), so the replica promoted in its place cannot bring it back; until then requests get
/// 503 or 200 for live sessions, never 200 for the revoked one, never 401 for a live one.
#[test]
fn a_revocation_survives_kill_9_of_the_owning_primary() {
    let up = users();
    let mut c = Cluster::start();
    let (a, b, alice, bob) = two_warm(&up, &c.url());
    let owner = c.owner_of(&session_key(&alice));
    c.wait_replicated(&session_key(&bob));
    assert_eq!(logout(&a, &alice), 204);
    c.kill(owner);
    let killed = Instant::now();
    // Until bob is served with the replica promoted (three primaries again).
    let (served, unavailable) = through_failover(&b, &bob, &alice, || c.primaries().len() == 3);
    println!(
        "bob served {:?} after the kill; 503s for about {unavailable:?}",
        killed.elapsed()
    );
    assert!(served, "{}", b.log());
    c.wait_ok();
    for t in [&a, &b] {
        assert!(until_status(t, &alice, 401, Duration::from_secs(10)).is_some());
        assert_eq!(status(t, &bob), 200);
    }
}

/// A stopped primary (SIGSTOP: its sockets stay open): the heartbeat trips within about
/// 1 s + the store timeout, the cache is bypassed, and requests needing that shard get 503
/// instead of being served from a cache nobody can invalidate; once its replica took over, they
/// are served again.
#[test]
fn a_stopped_primary_trips_the_heartbeat() {
    let up = users();
    let c = Cluster::start();
    let a = on_store(&up, &c.url());
    let alice = login(&a, "alice", "alice-pw");
    let owner = c.owner_of(&session_key(&alice));
    c.wait_replicated(&session_key(&alice));
    assert_eq!(status(&a, &alice), 200);
    c.signal(owner, rustix::process::Signal::STOP);
    let unavailable = until_status(&a, &alice, 503, Duration::from_secs(15));
    println!("503 {unavailable:?} after SIGSTOP");
    let served = until_status(&a, &alice, 200, Duration::from_secs(20));
    println!("served {served:?} after that");
    c.signal(owner, rustix::process::Signal::CONT);
    assert!(unavailable.is_some(), "{}", a.log());
    assert!(served.is_some(), "{}", a.log());
    assert!(a.log().contains("invalidation stream lost"), "{}", a.log());
}

/// alice's slot migrating to another primary while she logs out (`SETSLOT IMPORTING/MIGRATING`,
/// the logout in the middle, then `SETSLOT NODE` to finish): B refuses her at once, during the
/// move and after it (a changed shard map), and bob's session goes on.
#[test]
fn a_slot_migrated_while_revoking_keeps_the_revocation() {
    let up = users();
    let c = Cluster::start();
    let (a, b, alice, bob) = two_warm(&up, &c.url());
    let key = session_key(&alice);
    let src = c.owner_of(&key);
    let dst = c.primaries().into_iter().find(|&p| p != src).unwrap();
    let slot = c.cli(src, &["CLUSTER", "KEYSLOT", &key]);
    let (src_id, dst_id) = (
        c.cli(src, &["CLUSTER", "MYID"]),
        c.cli(dst, &["CLUSTER", "MYID"]),
    );
    assert_eq!(
        c.cli(dst, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &src_id]),
        "OK"
    );
    assert_eq!(
        c.cli(src, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &dst_id]),
        "OK"
    );
    // Mid-migration: the key is still on the source, which answers for it.
    assert_eq!(logout(&a, &alice), 204, "{}", a.log());
    for port in [src, dst] {
        let keys = c.cli(port, &["CLUSTER", "GETKEYSINSLOT", &slot, "10"]);
        assert!(
            !keys.contains(&key),
            "{port} still has alice's session: {keys}"
        );
    }
    let during = until_status(&b, &alice, 401, Duration::from_secs(10));
    println!("B refused alice {during:?} after the logout, mid-migration");
    assert!(during.is_some(), "B serves a session revoked mid-migration");
    for p in c.primaries() {
        c.cli(p, &["CLUSTER", "SETSLOT", &slot, "NODE", &dst_id]);
    }
    assert_eq!(c.owner_of(&key), dst);
    for t in [&a, &b] {
        let after = until_status(t, &alice, 401, Duration::from_secs(10));
        assert!(
            after.is_some(),
            "a revoked session served after the migration"
        );
        assert!(until_status(t, &bob, 200, Duration::from_secs(10)).is_some());
    }
}
