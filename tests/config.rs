//! The configuration file as an operator writes it: defaults, bounds, and errors that name the
//! key and the fix (`tessera::Config::from_toml_with`, the parser `tessera serve` uses).

use std::time::Duration;

use tessera::config::resolve_secret;
use tessera::session::{SessionFormat, StoreSpec};
use tessera::token::keys::JwksSource;
use tessera::upstream::UpstreamConfig;
use tessera::Config;

const KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

fn env(name: &str) -> Option<String> {
    match name {
        "SECRET" => Some("s".repeat(64)),
        "KEY" => Some(KEY.into()),
        _ => None,
    }
}

fn minimal() -> String {
    "[upstream]\nurl = \"http://127.0.0.1:9\"\n[token]\nsecret = \"env:SECRET\"\n[credentials]\nkeys = { k1 = \"env:KEY\" }\n".into()
}

#[test]
fn minimal_config_gets_documented_defaults() {
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert_eq!(c.server.listen, Some("127.0.0.1:8080".parse().unwrap()));
    assert!(c.tls.is_none());
    assert_eq!(c.upstream.max_connections, 64);
    assert_eq!(c.token.sid_claim, "sid");
    assert_eq!(c.token.sources.len(), 3);
    assert_eq!(
        c.session.store,
        StoreSpec::Embedded("./tessera-sessions".into())
    );
    assert_eq!(c.session.format, SessionFormat::Tessera);
    assert_eq!(c.credentials.active, "k1");
    assert!(!c.credentials.allow_plaintext_legacy);
}

#[test]
fn server_threads_default_to_the_cpus_and_are_bounded() {
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert!(c.server.threads >= 1);
    let text = format!("{}[server]\nthreads = 3\n", minimal());
    assert_eq!(
        Config::from_toml_with(&text, env).unwrap().server.threads,
        3
    );
    let text = format!("{}[server]\nthreads = 0\n", minimal());
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(err.contains("server.threads"), "{err}");
}

#[test]
fn http2_streams_default_to_200_and_are_bounded() {
    let streams = |extra: &str| {
        Config::from_toml_with(&format!("{}[server]\n{extra}", minimal()), env)
            .map(|c| c.server.http2_max_concurrent_streams)
            .map_err(|e| e.to_string())
    };
    assert_eq!(streams(""), Ok(200));
    assert_eq!(streams("http2_max_concurrent_streams = 16\n"), Ok(16));
    for bad in ["0", "1001"] {
        let err = streams(&format!("http2_max_concurrent_streams = {bad}\n")).unwrap_err();
        assert!(
            err.contains("server.http2_max_concurrent_streams") && err.contains("1000"),
            "{bad}: {err}"
        );
    }
}

#[test]
fn metrics_are_off_by_default_and_need_their_own_address() {
    assert!(Config::from_toml_with(&minimal(), env)
        .unwrap()
        .metrics
        .is_none());
    let with = |body: &str| Config::from_toml_with(&format!("{}[metrics]\n{body}", minimal()), env);
    assert_eq!(
        with("listen = \"127.0.0.1:9464\"\n")
            .unwrap()
            .metrics
            .unwrap()
            .listen
            .to_string(),
        "127.0.0.1:9464"
    );
    for (body, says) in [
        ("", "missing"),
        ("listen = \"9464\"\n", "not IP:PORT"),
        (
            "listen = \"127.0.0.1:8080\"\n",
            "same address as server.listen",
        ),
    ] {
        let err = with(body).unwrap_err().to_string();
        assert!(
            err.contains("metrics.listen") && err.contains(says),
            "{body:?}: {err}"
        );
    }
    let err = with("listen = \"127.0.0.1:9464\"\nport = 1\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("port"), "unknown key: {err}");
}

#[test]
fn jwks_urls_and_their_ca_file_are_checked_at_load() {
    let with = |token: &str| {
        Config::from_toml_with(
            &format!("[upstream]\nurl = \"http://127.0.0.1:9\"\n[token]\n{token}\n[credentials]\nkeys = {{ k1 = \"env:KEY\" }}\n"),
            env,
        )
    };
    let not_pem = std::env::temp_dir().join(format!("tessera-not-pem-{}", std::process::id()));
    std::fs::write(&not_pem, "not a certificate\n").unwrap();
    let not_pem = not_pem.display().to_string();
    for (token, key, says) in [
        ("jwks = \"ftp://idp/jwks.json\"", "token.jwks", "is none of"),
        ("jwks = \"https:///jwks.json\"", "token.jwks", "jwks.json"),
        (
            "jwks = \"https://u:p@idp/jwks.json\"",
            "token.jwks",
            "user:password",
        ),
        (
            "secret = \"env:SECRET\"\njwks_ca = \"file:/etc/hosts\"",
            "token.jwks_ca",
            "only used with an \"https://\"",
        ),
        (
            "jwks = \"http://127.0.0.1:9/j\"\njwks_ca = \"file:/etc/hosts\"",
            "token.jwks_ca",
            "only used with an \"https://\"",
        ),
        (
            "jwks = \"https://idp/j\"\njwks_ca = \"/etc/ca.pem\"",
            "token.jwks_ca",
            "is not \"file:PATH\"",
        ),
        (
            "jwks = \"https://idp/j\"\njwks_ca = \"file:/nonexistent/ca.pem\"",
            "token.jwks_ca",
            "cannot read CA certificates",
        ),
        (
            &format!("jwks = \"https://idp/j\"\njwks_ca = \"file:{not_pem}\""),
            "token.jwks_ca",
            "holds no usable CA certificate",
        ),
    ] {
        let err = with(token).unwrap_err().to_string();
        assert!(err.contains(key) && err.contains(says), "{token}: {err}");
    }
    let c = with("jwks = \"http://127.0.0.1:9/jwks.json\"").unwrap();
    assert!(matches!(
        c.token.jwks.unwrap().source,
        JwksSource::Url(_, None)
    ));
    std::fs::remove_file(&not_pem).unwrap();
}

#[test]
fn websocket_defaults_limits_and_origins() {
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert_eq!(
        c.websocket.max_connections, 32,
        "half of upstream.max_connections"
    );
    assert_eq!(c.websocket.max_connections_per_user, 8, "a quarter of them");
    assert_eq!(c.websocket.idle_timeout, Some(Duration::from_secs(600)));
    assert!(c.websocket.allowed_origins.is_empty());
    let with =
        |lines: &str| Config::from_toml_with(&format!("{}[websocket]\n{lines}\n", minimal()), env);
    let c = with("max_connections = 0\nidle_timeout_ms = 0\nallowed_origins = [\"https://Mail.Example.com:443/\", \"http://127.0.0.1:8080\"]").unwrap();
    assert_eq!(c.websocket.max_connections, 0);
    assert_eq!(c.websocket.idle_timeout, None);
    assert_eq!(
        c.websocket.allowed_origins,
        ["https://mail.example.com", "http://127.0.0.1:8080"]
    );
    let err = with("max_connections = 64").unwrap_err().to_string();
    assert!(
        err.contains("websocket.max_connections") && err.contains("below 64"),
        "{err}"
    );
    for bad in [
        "mail.example.com",
        "https://mail.example.com/inbox",
        "ftp://a",
        "https://u@a",
    ] {
        let err = with(&format!("allowed_origins = [\"https://ok\", \"{bad}\"]"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("websocket.allowed_origins[1]") && err.contains("scheme://host[:port]"),
            "{bad}: {err}"
        );
    }
    for per_user in ["0", "33"] {
        let err = with(&format!("max_connections_per_user = {per_user}"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("websocket.max_connections_per_user") && err.contains("(32)"),
            "{err}"
        );
    }
    let err = with("max_conections = 1").unwrap_err().to_string();
    assert!(err.contains("max_conections"), "unknown key: {err}");
}

#[test]
fn trusted_proxies_are_addresses_or_cidr_blocks_and_none_by_default() {
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert!(c.server.trusted_proxies.is_empty());
    let text = format!(
        "{}[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"::1\", \"192.0.2.7\"]\n",
        minimal()
    );
    let nets = Config::from_toml_with(&text, env)
        .unwrap()
        .server
        .trusted_proxies;
    let shown: Vec<String> = nets.iter().map(ToString::to_string).collect();
    assert_eq!(shown, ["10.0.0.0/8", "::1/128", "192.0.2.7/32"]);
    for (bad, says) in [
        ("10.0.0.0/33", "e.g. \"10.0.0.0/8\""),
        ("lb.internal", "e.g. \"10.0.0.0/8\""),
        ("", "e.g. \"10.0.0.0/8\""),
        ("::ffff:10.0.0.0/104", "write it as IPv4"),
    ] {
        let text = format!(
            "{}[server]\ntrusted_proxies = [\"127.0.0.1\", \"{bad}\"]\n",
            minimal()
        );
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(err.contains("server.trusted_proxies[1]"), "{bad}: {err}");
        assert!(err.contains(says), "{bad}: {err}");
    }
}

#[test]
fn the_proxy_protocol_is_off_by_default_and_needs_trusted_proxies() {
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert!(!c.server.proxy_protocol);
    let on = format!("{}[server]\nproxy_protocol = true\n", minimal());
    let err = Config::from_toml_with(&on, env).unwrap_err().to_string();
    assert!(err.contains("server.proxy_protocol"), "{err}");
    assert!(err.contains("needs server.trusted_proxies"), "{err}");
    let trusted = format!("{on}trusted_proxies = [\"10.0.0.0/8\"]\n");
    assert!(
        Config::from_toml_with(&trusted, env)
            .unwrap()
            .server
            .proxy_protocol
    );
}

#[test]
fn response_headers_are_none_by_default_and_never_framing_fields() {
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert!(c.server.response_headers.is_empty());
    let set = |table: &str| {
        let text = format!("{}[server]\nresponse_headers = {{ {table} }}\n", minimal());
        Config::from_toml_with(&text, env).map_err(|e| e.to_string())
    };
    let ok = set(r#""Strict-Transport-Security" = "max-age=63072000""#).unwrap();
    let (name, value) = &ok.server.response_headers[0];
    assert_eq!(
        (name.as_str(), value.to_str().unwrap()),
        ("strict-transport-security", "max-age=63072000")
    );
    for (table, says) in [
        (r#""Content-Length" = "0""#, "tessera sets itself"),
        (r#""Connection" = "close""#, "tessera sets itself"),
        (r#""bad name" = "x""#, "not a valid field name"),
        ("\"X-A\" = \"a\\u0007b\"", "visible ASCII"),
        (r#""X-A" = "a ""#, "no space at its start or end"),
        (r#""Set-Cookie" = "a=b""#, "leave it out"),
        (r#""X-A" = "a", "x-a" = "b""#, "named twice"),
    ] {
        let err = set(table).unwrap_err();
        assert!(err.contains("server.response_headers."), "{table}: {err}");
        assert!(err.contains(says), "{table}: {err}");
    }
}

#[test]
fn private_responses_are_unmarked_by_default_and_off_under_a_set_cache_control() {
    use tessera::screen::PrivateResponses;
    let with = |server: &str| {
        let text = format!("{}[server]\n{server}\n", minimal());
        Config::from_toml_with(&text, env).map(|c| c.server.private_responses)
    };
    assert_eq!(with("").unwrap(), PrivateResponses::Unmarked);
    assert_eq!(
        with("private_responses = \"always\"").unwrap(),
        PrivateResponses::Always
    );
    let replaced = "response_headers = { \"Cache-Control\" = \"no-store\" }";
    assert_eq!(with(replaced).unwrap(), PrivateResponses::Off);
    for bad in [
        "private_responses = \"yes\"".to_string(),
        format!("private_responses = \"yes\"\n{replaced}"),
    ] {
        let err = with(&bad).unwrap_err().to_string();
        assert!(
            err.contains("server.private_responses") && err.contains("\"unmarked\""),
            "{err}"
        );
    }
}

#[test]
fn a_request_id_header_must_be_a_field_name() {
    let text = minimal().replace(
        "[upstream]\n",
        "[upstream]\nrequest_id_header = \"X Request\"\n",
    );
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(err.contains("upstream.request_id_header"), "{err}");
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert!(c.upstream.request_id_header.is_none());
    let own = minimal().replace(
        "[upstream]\n",
        "[upstream]\nrequest_id_header = \"Authorization\"\n",
    );
    let err = Config::from_toml_with(&own, env).unwrap_err().to_string();
    assert!(err.contains("tessera sets or reads itself"), "{err}");
    let both = format!(
        "{}[server]\nresponse_headers = {{ \"X-Request-Id\" = \"x\" }}\n",
        minimal().replace(
            "[upstream]\n",
            "[upstream]\nrequest_id_header = \"X-Request-Id\"\n"
        )
    );
    let err = Config::from_toml_with(&both, env).unwrap_err().to_string();
    assert!(err.contains("also in server.response_headers"), "{err}");
}

#[test]
fn busy_polling_is_off_by_default_and_bounded() {
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert_eq!(c.server.busy_poll, Duration::ZERO);
    let text = format!("{}[server]\nbusy_poll_us = 50\n", minimal());
    assert_eq!(
        Config::from_toml_with(&text, env).unwrap().server.busy_poll,
        Duration::from_micros(50)
    );
    let text = format!("{}[server]\nbusy_poll_us = 1000\n", minimal());
    assert!(Config::from_toml_with(&text, env).is_ok());
    let text = format!("{}[server]\nbusy_poll_us = 1001\n", minimal());
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(err.contains("server.busy_poll_us"), "{err}");
}

#[test]
fn change_log_poll_defaults_to_25_ms_and_is_bounded() {
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert_eq!(c.session.poll_interval, Duration::from_millis(25));
    let text = format!("{}[session]\npoll_interval_ms = 5\n", minimal());
    assert_eq!(
        Config::from_toml_with(&text, env)
            .unwrap()
            .session
            .poll_interval,
        Duration::from_millis(5)
    );
    for bad in [0, 1001] {
        let text = format!("{}[session]\npoll_interval_ms = {bad}\n", minimal());
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(err.contains("session.poll_interval_ms"), "{err}");
    }
}

#[test]
fn send_timeout_defaults_to_a_minute_and_is_never_zero() {
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert_eq!(c.server.send_timeout, Duration::from_secs(60));
    let text = format!("{}[server]\nsend_timeout_ms = 1500\n", minimal());
    assert_eq!(
        Config::from_toml_with(&text, env)
            .unwrap()
            .server
            .send_timeout,
        Duration::from_millis(1500)
    );
    let text = format!("{}[server]\nsend_timeout_ms = 0\n", minimal());
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(
        err.contains("server.send_timeout_ms") && err.contains("greater than 0"),
        "{err}"
    );
}

/// The `[upstream]` table of [`minimal`] with `lines` added, or the error's text.
fn upstream_with(lines: &str) -> Result<UpstreamConfig, String> {
    let text = minimal().replace("[token]", &format!("{lines}\n[token]"));
    Config::from_toml_with(&text, env)
        .map(|c| c.upstream)
        .map_err(|e| e.to_string())
}

/// Each `(lines, key, says)`: `[upstream]` with `lines` is refused, naming `key` and saying
/// `says`.
fn rejected(cases: &[(&str, &str, &str)]) {
    for (lines, key, says) in cases {
        let err = upstream_with(lines)
            .err()
            .unwrap_or_else(|| panic!("{lines}: accepted"));
        assert!(err.contains(key) && err.contains(says), "{lines}: {err}");
    }
}

#[test]
fn upstream_affinity_is_none_or_session() {
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert_eq!(c.upstream.affinity, tessera::upstream::Affinity::None);
    let with = |lines: &str| upstream_with(lines).map(|u| u.affinity);
    let session = |ms| tessera::upstream::Affinity::Session {
        wait: Duration::from_millis(ms),
        stale: tessera::upstream::AFFINITY_STALE,
    };
    assert_eq!(with("affinity = \"session\""), Ok(session(5)));
    assert_eq!(
        with("affinity = \"session\"\naffinity_wait_ms = 0"),
        Ok(session(0))
    );
    assert_eq!(
        with("affinity = \"session\"\naffinity_wait_ms = 1000"),
        Ok(session(1000))
    );
    rejected(&[
        ("affinity = \"user\"", "upstream.affinity", "\"session\""),
        (
            "affinity = \"session\"\naffinity_wait_ms = 1001",
            "upstream.affinity_wait_ms",
            "1000",
        ),
        (
            "affinity_wait_ms = 5",
            "upstream.affinity_wait_ms",
            "affinity = \"session\"",
        ),
    ]);
}

#[test]
fn upstream_drain_settings_default_bound_and_turn_off() {
    use tessera::upstream::Drain;
    let with = |lines: &str| upstream_with(lines).map(|u| u.drain);
    let drain = |ms, max_bytes| Drain {
        wait: Duration::from_millis(ms),
        max_bytes,
    };
    assert_eq!(with(""), Ok(drain(250, 65_536)));
    assert_eq!(with("drain_wait_ms = 0"), Ok(drain(0, 65_536)));
    assert_eq!(
        with("drain_wait_ms = 10000\ndrain_max_bytes = 16777216"),
        Ok(drain(10_000, 16_777_216))
    );
    assert_eq!(with("drain_max_bytes = 0"), Ok(drain(250, 0)));
    rejected(&[
        ("drain_wait_ms = 10001", "upstream.drain_wait_ms", "10000"),
        (
            "drain_max_bytes = 16777217",
            "upstream.drain_max_bytes",
            "16 MiB",
        ),
        (
            "drain_wait_ms = 0\ndrain_max_bytes = 100",
            "upstream.drain_max_bytes",
            "remove it or set drain_wait_ms above 0",
        ),
    ]);
}

#[test]
fn session_cache_is_bounded_by_entries_and_bytes() {
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert_eq!(c.session.cache.max_entries, 100_000);
    assert_eq!(c.session.cache.max_bytes, 64 << 20);
    assert!(c.token.cache_hmac, "HS* tokens are cached by default");
    let text = format!("{}[session]\ncache_max_bytes = 1048576\n", minimal());
    let c = Config::from_toml_with(&text, env).unwrap();
    assert_eq!(c.session.cache.max_bytes, 1 << 20);
    let text = format!("{}[session]\ncache_max_bytes = 65535\n", minimal());
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(err.contains("session.cache_max_bytes"), "{err}");
}

#[test]
fn unknown_key_is_named() {
    let text = format!("{}\n[server]\nlisen = \"x\"\n", minimal());
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(
        err.starts_with("config key `server.lisen`: is unknown here; check its spelling"),
        "{err}"
    );
    // toml's own message follows, with the line and the keys this table has.
    assert!(err.contains("line 9") && err.contains("`listen`"), "{err}");
}

#[test]
fn token_leeway_is_at_most_five_minutes() {
    let with = |v: &str| {
        let text = minimal().replace("[token]\n", &format!("[token]\nleeway_seconds = {v}\n"));
        Config::from_toml_with(&text, env).map_err(|e| e.to_string())
    };
    assert_eq!(with("300").unwrap().token.leeway_seconds, 300);
    let err = with("5000").unwrap_err();
    assert!(
        err.contains("token.leeway_seconds") && err.contains("300"),
        "{err}"
    );
}

/// An error never quotes the offending line: a misspelt key may hold a literal secret.
#[test]
fn an_error_does_not_quote_a_literal_secret() {
    let text = minimal().replace("keys = {", "key = { k0 = \"s3cret-key\" }\nkeys = {");
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(
        err.contains("credentials.key") && err.contains("line 6"),
        "{err}"
    );
    assert!(!err.contains("s3cret"), "{err}");
    let err = Config::from_toml_with("secret = \"s3cret\" x", env)
        .unwrap_err()
        .to_string();
    assert!(err.contains("line 1") && !err.contains("s3cret"), "{err}");
    // A secret where a table or an array belongs: serde's message would quote the value.
    let text = minimal().replace("keys = {", "keys = \"s3cret-key\"\nold = {");
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(
        err.contains("credentials.keys") && err.contains("a string"),
        "{err}"
    );
    assert!(!err.contains("s3cret"), "{err}");
    let text = format!(
        "{}[tls]\nsession_ticket_keys = \"s3cret-ticket-key\"\n",
        minimal()
    );
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(err.contains("tls.session_ticket_keys"), "{err}");
    assert!(!err.contains("s3cret"), "{err}");
}

/// A value of the wrong type is led by its dotted key and the fix, then toml's line.
#[test]
fn wrong_typed_values_name_the_key_and_the_fix() {
    let cases = [
        (
            "[upstream]\nidle_timeout_ms = -1\n",
            "config key `upstream.idle_timeout_ms`: must be a whole number of milliseconds, \
             without quotes\n",
        ),
        (
            "[upstream]\ndrain_wait_ms = \"250ms\"\n",
            "config key `upstream.drain_wait_ms`: must be a whole number of milliseconds",
        ),
        (
            "[login]\nmax_failures_per_ip = 5000000000\n",
            "config key `login.max_failures_per_ip`: must be a whole number, without \
             quotes\n",
        ),
        (
            "[upstream]\npreserve_host = \"yes\"\n",
            "config key `upstream.preserve_host`: must be true or false, without quotes",
        ),
        (
            "[server]\nlisten = 8080\n",
            "config key `server.listen`: must be a quoted string",
        ),
        (
            "[token]\nalgorithms = \"HS256\"\n",
            "config key `token.algorithms`: must be an array",
        ),
        (
            "[[token.keys]]\nkid = \"a\"\nalg = 5\n",
            "config key `token.keys[0].alg`: must be a quoted string",
        ),
        (
            "log = 5\n",
            "config key `log`: must be a table: a `[log]` line with its keys below it",
        ),
        (
            "[token]\nkeys = [5]\n",
            "config key `token.keys[0]`: must be a table: a `[[token.keys]]` block with its \
             keys below it",
        ),
        (
            "[token.keys]\nkid = \"a\"\n",
            "config key `token.keys`: must be an array of tables: one `[[token.keys]]` \
             block per entry, with its keys below it",
        ),
        (
            "[token]\nkeys = \"a\"\n",
            "config key `token.keys`: must be an array of tables: one `[[token.keys]]`",
        ),
        (
            "[server.trusted_proxies]\na = 1\n",
            "config key `server.trusted_proxies`: must be an array, not a table, e.g. \
             [\"a\", \"b\"]",
        ),
        (
            "[credentials]\nkeys = 5\n",
            "config key `credentials.keys`: must be a table: a `[credentials.keys]` line \
             with `name = \"value\"` lines below it, or `{ name = \"value\" }`",
        ),
        (
            "[server]\nbusy_poll_us = true\n",
            "config key `server.busy_poll_us`: must be a whole number of microseconds",
        ),
    ];
    for (text, want) in cases {
        // Types are checked before any value is validated, so the rest may be missing.
        let err = Config::from_toml_with(text, env).unwrap_err().to_string();
        assert!(err.starts_with(want), "{text}\n{err}");
        assert!(err.contains("\nline "), "{err}");
    }
    // A syntax error has no key to name: toml's message alone.
    let err = Config::from_toml_with("[upstream\n", env)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("line 1, column "), "{err}");
}

#[test]
fn missing_env_secret_names_key_and_variable() {
    let text = minimal().replace("env:SECRET", "env:NOPE");
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(
        err.contains("token.secret") && err.contains("NOPE"),
        "{err}"
    );
}

#[test]
fn short_hmac_secret_rejected() {
    let text = minimal().replace("env:SECRET", "tooshort");
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(err.contains("token.secret") && err.contains("64"), "{err}");
}

#[test]
fn bad_sealing_key_length_rejected() {
    let text = minimal().replace("env:KEY", "AAAA");
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(
        err.contains("credentials.keys.k1") && err.contains("32"),
        "{err}"
    );
}

#[test]
fn active_must_name_a_key() {
    let text = format!("{}active = \"k2\"\n", minimal());
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(err.contains("credentials.active"), "{err}");
}

#[test]
fn bad_store_and_scheme_rejected() {
    let text = format!("{}[session]\nstore = \"memcached://x\"\n", minimal());
    assert!(Config::from_toml_with(&text, env)
        .unwrap_err()
        .to_string()
        .contains("session.store"));
    let text = minimal().replace("http://127.0.0.1:9", "ftp://x");
    assert!(Config::from_toml_with(&text, env)
        .unwrap_err()
        .to_string()
        .contains("upstream.url"));
}

/// A password in a URL is never echoed by the error that refuses the URL.
#[test]
fn urls_with_passwords_are_refused_without_echoing_them() {
    let text = minimal().replace("http://127.0.0.1:9", "http://svc:s3cret@127.0.0.1:9");
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(
        err.contains("upstream.url") && err.contains("user:password@"),
        "{err}"
    );
    assert!(!err.contains("s3cret"), "{err}");
    let typo = "redis-sentinel://:s3cret@10.0.0.1:26379/m";
    let text = format!("{}[session]\nstore = \"{typo}\"\n", minimal());
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(
        err.contains("session.store") && err.contains("redis-sentinel://***@10.0.0.1"),
        "{err}"
    );
    assert!(!err.contains("s3cret"), "{err}");
}

/// `login.path_prefix` is visible ASCII (a request path carries nothing else, and the prefix
/// goes into `Location`); `session.ttl_seconds` stays within ten years (a valid Redis `EX`).
#[test]
fn a_login_prefix_and_a_session_ttl_the_stores_cannot_take_are_refused() {
    // The second is DEL, written as TOML's escape.
    for prefix in ["/connexi\u{f3}n", "/a\\u007fb", "/a b"] {
        let text = format!(
            "{}[login]\nverify_path = \"/x\"\npath_prefix = \"{prefix}\"\n",
            minimal()
        );
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(err.contains("login.path_prefix"), "{prefix:?}: {err}");
    }
    let text = format!(
        "{}[session]\nttl_seconds = 9223372036854775807\n",
        minimal()
    );
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(err.contains("session.ttl_seconds"), "{err}");
    let text = format!("{}[session]\nttl_seconds = 315360000\n", minimal());
    assert!(Config::from_toml_with(&text, env).is_ok());
}

/// A key that would do nothing in this configuration is refused, naming what it needs: left in
/// place, it reads as if it applied (a typo'd or removed companion key).
#[test]
fn keys_that_would_do_nothing_are_refused() {
    for (table, lines, key, says) in [
        (
            "session",
            "format = \"hyper-auth-proxy\"\nkey_prefix = \"app:\"",
            "session.key_prefix",
            "bare sid",
        ),
        (
            "token",
            "jwks_refresh_seconds = 60",
            "token.jwks_refresh_seconds",
            "only used with token.jwks",
        ),
        (
            "jmap",
            "session_path = \"/jmap/\"",
            "jmap.session_path",
            "only used with jmap.session_urls",
        ),
        (
            "websocket",
            "max_connections = 0\nmax_connections_per_user = 2",
            "websocket.max_connections_per_user",
            "max_connections is 0",
        ),
    ] {
        // Into minimal()'s own [token], or a table of its own.
        let text = match table {
            "token" => minimal().replace("[token]\n", &format!("[token]\n{lines}\n")),
            _ => format!("{}[{table}]\n{lines}\n", minimal()),
        };
        let err = Config::from_toml_with(&text, env)
            .err()
            .unwrap_or_else(|| panic!("{lines}: accepted"))
            .to_string();
        assert!(err.contains(key) && err.contains(says), "{lines}: {err}");
    }
}

/// A log level that is no level (`warning`, which the filter would take for a target and so
/// log nothing) is refused, naming the key.
#[test]
fn a_log_level_that_is_no_level_is_refused() {
    let text = format!("{}[log]\nlevel = \"warning\"\n", minimal());
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(
        err.contains("log.level") && err.contains("`warning`"),
        "{err}"
    );
}

#[test]
fn file_secret_trailing_newline_removed() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s");
    std::fs::write(&p, format!("{}\n", "x".repeat(64))).unwrap();
    let v = resolve_secret("k", &format!("file:{}", p.display()), &env).unwrap();
    assert_eq!(v.len(), 64);
}

#[test]
fn upstream_max_idle_connections_defaults_to_a_quarter_and_is_bounded() {
    let with = |lines: &str| upstream_with(lines).map(|u| u.max_idle_connections);
    assert_eq!(with(""), Ok(16));
    assert_eq!(with("max_connections = 6"), Ok(2));
    assert_eq!(with("max_connections = 1"), Ok(1));
    assert_eq!(with("max_idle_connections = 0"), Ok(0));
    assert_eq!(with("max_connections = 8\nmax_idle_connections = 8"), Ok(8));
    rejected(&[(
        "max_connections = 8\nmax_idle_connections = 9",
        "upstream.max_idle_connections",
        "between 0 and upstream.max_connections (8)",
    )]);
}

/// `examples/cyrus/tessera.toml` loads as it is (with its secrets in the environment), and keeps
/// the pool below the `maxchild` of the `cyrus.conf` beside it.
#[test]
fn the_cyrus_example_loads_and_stays_below_maxchild() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/cyrus");
    let text = std::fs::read_to_string(format!("{dir}/tessera.toml")).unwrap();
    let secrets = |name: &str| match name {
        "TESSERA_JWT_SECRET" => env("SECRET"),
        "TESSERA_CRED_KEY" => env("KEY"),
        _ => None,
    };
    let c = Config::from_toml_with(&text, secrets).unwrap_or_else(|e| panic!("{e}"));
    let cyrus = std::fs::read_to_string(format!("{dir}/cyrus.conf")).unwrap();
    let maxchild: usize = cyrus
        .split_whitespace()
        .find_map(|w| w.strip_prefix("maxchild="))
        .and_then(|n| n.parse().ok())
        .expect("maxchild in cyrus.conf");
    assert!(c.upstream.max_connections < maxchild);
    assert!(c.upstream.max_idle_connections < c.upstream.max_connections);
    assert_eq!(c.login.expect("[login]").verify_path.as_str(), "/jmap/");
}

#[test]
fn jmap_mode_is_off_unless_absolute_and_its_path_is_checked() {
    let with = |extra: &str| {
        Config::from_toml_with(&format!("{}{extra}", minimal()), env)
            .map(|c| c.jmap)
            .map_err(|e| e.to_string())
    };
    assert_eq!(with(""), Ok(None));
    assert_eq!(with("[jmap]\nsession_urls = \"as_sent\"\n"), Ok(None));
    let on = with("[jmap]\nsession_urls = \"absolute\"\n")
        .unwrap()
        .unwrap();
    assert_eq!(on.session_path, "/jmap/");
    let other = with("[jmap]\nsession_urls = \"absolute\"\nsession_path = \"/api/session\"\n");
    assert_eq!(other.unwrap().unwrap().session_path, "/api/session");
    for (extra, key) in [
        ("[jmap]\nsession_urls = \"relative\"\n", "jmap.session_urls"),
        (
            "[jmap]\nsession_urls = \"absolute\"\nsession_path = \"jmap\"\n",
            "jmap.session_path",
        ),
    ] {
        let err = with(extra).unwrap_err();
        assert!(err.contains(key), "{extra}: {err}");
    }
}

#[test]
fn upstream_probe_timeout_is_off_by_default_and_bounded() {
    let with = |lines: &str| upstream_with(lines).map(|u| u.probe_timeout);
    assert_eq!(with(""), Ok(None));
    assert_eq!(with("probe_timeout_ms = 0"), Ok(None));
    assert_eq!(
        with("probe_timeout_ms = 500"),
        Ok(Some(Duration::from_millis(500)))
    );
    rejected(&[(
        "probe_timeout_ms = 10001",
        "upstream.probe_timeout_ms",
        "over 10000",
    )]);
}

#[test]
fn a_session_query_is_read_only_on_postgres_and_names_its_mistakes() {
    let pg = "[session]\nstore = \"postgres://app@db/app\"\n";
    let query = "query = \"SELECT record FROM app.sessions WHERE sid = $1\"\n";
    let text = format!(
        "{}{pg}{query}notify_channel = \"app_sessions\"\n",
        minimal()
    );
    let c = Config::from_toml_with(&text, env).unwrap();
    let StoreSpec::Postgres(_, Some(q)) = c.session.store else {
        panic!("{:?}", c.session.store)
    };
    assert_eq!(q.channel.as_deref(), Some("app_sessions"));
    for (text, key, why) in [
        (
            format!("{}[session]\nstore = \"redis://r/0\"\n{query}", minimal()),
            "session.query",
            "PostgreSQL only",
        ),
        (
            format!("{}{pg}notify_channel = \"c\"\n", minimal()),
            "session.notify_channel",
            "goes with session.query",
        ),
        (
            format!(
                "{}{pg}{query}notify_channel = \"x; DROP TABLE t\"\n",
                minimal()
            ),
            "session.notify_channel",
            "not a plain identifier",
        ),
        (
            format!("{}{pg}query = \"SELECT record FROM s\"\n", minimal()),
            "session.query",
            "$1",
        ),
        (
            format!(
                "{}{pg}{query}[login]\nverify_path = \"/check\"\n",
                minimal()
            ),
            "login",
            "read-only",
        ),
    ] {
        let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
        assert!(err.contains(key) && err.contains(why), "{err}");
    }
}

#[test]
fn log_format_is_text_or_json() {
    use tessera::telemetry::LogFormat;
    let c = Config::from_toml_with(&minimal(), env).unwrap();
    assert_eq!(c.log.format, LogFormat::Text);
    let json = format!("{}[log]\nformat = \"json\"\n", minimal());
    assert_eq!(
        Config::from_toml_with(&json, env).unwrap().log.format,
        LogFormat::Json
    );
    let bad = format!("{}[log]\nformat = \"logfmt\"\n", minimal());
    let err = Config::from_toml_with(&bad, env).unwrap_err().to_string();
    assert!(
        err.contains("log.format") && err.contains("\"json\""),
        "{err}"
    );
}

#[test]
fn encoded_slashes_under_takes_whole_plain_path_prefixes() {
    let load = |v: &str| {
        let text = format!(
            "{}[server]\nallow_encoded_slashes_under = [{v}]\n",
            minimal()
        );
        Config::from_toml_with(&text, env).map_err(|e| e.to_string())
    };
    let c = load("\"/jmap/download/\"").unwrap();
    assert_eq!(c.server.allow_encoded_slashes_under, ["/jmap/download/"]);
    assert!(minimal_config()
        .server
        .allow_encoded_slashes_under
        .is_empty());
    for bad in [
        "\"/jmap/download\"",
        "\"jmap/\"",
        "\"/a%2F/\"",
        "\"/a/../b/\"",
        "\"/a\\\\b/\"",
    ] {
        let err = load(bad).unwrap_err();
        assert!(
            err.contains("server.allow_encoded_slashes_under"),
            "{bad}: {err}"
        );
    }
}

fn minimal_config() -> Config {
    Config::from_toml_with(&minimal(), env).unwrap()
}

/// `[cors]` is read from the file, and a CORS field also in `server.response_headers` is
/// refused by name (two grants would make browsers refuse both).
#[test]
fn cors_is_read_and_not_doubled_by_response_headers() {
    let cors = "[cors]\nallow_origins = [\"https://app.example\"]\n";
    let c = Config::from_toml_with(&format!("{}{cors}", minimal()), env).unwrap();
    assert!(c.cors.is_some());
    assert!(Config::from_toml_with(&minimal(), env)
        .unwrap()
        .cors
        .is_none());
    let text = format!(
        "{}[server]\nresponse_headers = {{ \"Access-Control-Allow-Origin\" = \"*\" }}\n{cors}",
        minimal()
    );
    let err = Config::from_toml_with(&text, env).unwrap_err().to_string();
    assert!(
        err.contains("server.response_headers.\"access-control-allow-origin\"")
            && err.contains("[cors]"),
        "{err}"
    );
    let unknown = format!(
        "{}[cors]\nallow_origin = [\"https://app.example\"]\n",
        minimal()
    );
    let err = Config::from_toml_with(&unknown, env)
        .unwrap_err()
        .to_string();
    assert!(err.contains("cors.allow_origin"), "{err}");
}
