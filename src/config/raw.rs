//! The configuration file's shape as written: every field optional, unknown keys rejected
//! (`deny_unknown_fields`); `config`'s validators turn each table into its domain's settings.

use std::collections::BTreeMap;

use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) server: Option<RawServer>,
    pub(super) upstream: Option<RawUpstream>,
    pub(super) token: Option<RawToken>,
    pub(super) session: Option<RawSession>,
    pub(super) credentials: Option<RawCredentials>,
    pub(super) login: Option<RawLogin>,
    pub(super) log: Option<RawLog>,
    pub(super) metrics: Option<RawMetrics>,
    pub(super) websocket: Option<RawWebSocket>,
    pub(super) jmap: Option<RawJmap>,
    pub(super) cors: Option<RawCors>,
    pub(super) tls: Option<RawTls>,
    pub(super) http3: Option<RawHttp3>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHttp3 {
    pub(super) listen: Option<String>,
    pub(super) early_data: Option<bool>,
    pub(super) alt_svc_max_age: Option<u64>,
    pub(super) max_concurrent_streams: Option<u32>,
    pub(super) idle_timeout_ms: Option<u64>,
    pub(super) threads: Option<usize>,
    pub(super) retry: Option<String>,
    pub(super) host_key: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    pub(super) listen: Option<String>,
    pub(super) certificate: Option<String>,
    pub(super) private_key: Option<String>,
    pub(super) min_version: Option<String>,
    pub(super) session_tickets: Option<bool>,
    pub(super) session_ticket_keys: Option<Vec<String>>,
    pub(super) sni: Option<Vec<RawSni>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSni {
    pub(super) server_names: Option<Vec<String>>,
    pub(super) certificate: Option<String>,
    pub(super) private_key: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawJmap {
    pub(super) session_urls: Option<String>,
    pub(super) session_path: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCors {
    pub(super) allow_origins: Option<Vec<String>>,
    pub(super) allow_methods: Option<Vec<String>>,
    pub(super) allow_headers: Option<Vec<String>>,
    pub(super) expose_headers: Option<Vec<String>>,
    pub(super) max_age: Option<u32>,
    pub(super) allow_credentials: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWebSocket {
    pub(super) max_connections: Option<usize>,
    pub(super) max_connections_per_user: Option<usize>,
    pub(super) idle_timeout_ms: Option<u64>,
    pub(super) allowed_origins: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) listen: Option<String>,
    pub(super) redirect_to_https: Option<bool>,
    pub(super) fastopen: Option<bool>,
    pub(super) max_header_bytes: Option<usize>,
    pub(super) max_uri_bytes: Option<usize>,
    pub(super) max_body_bytes: Option<u64>,
    pub(super) header_read_timeout_ms: Option<u64>,
    pub(super) send_timeout_ms: Option<u64>,
    pub(super) shutdown_delay_ms: Option<u64>,
    pub(super) shutdown_timeout_ms: Option<u64>,
    pub(super) http2_max_concurrent_streams: Option<u32>,
    pub(super) threads: Option<usize>,
    pub(super) busy_poll_us: Option<u64>,
    pub(super) trusted_proxies: Option<Vec<String>>,
    pub(super) proxy_protocol: Option<bool>,
    pub(super) response_headers: Option<std::collections::BTreeMap<String, String>>,
    pub(super) private_responses: Option<String>,
    pub(super) allow_encoded_slashes: Option<bool>,
    pub(super) allow_encoded_slashes_under: Option<Vec<String>>,
    pub(super) client_body_timeout_ms: Option<u64>,
    pub(super) max_connections: Option<usize>,
    pub(super) max_connections_per_ip: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    pub(super) url: Option<String>,
    pub(super) ca: Option<String>,
    pub(super) server_name: Option<String>,
    pub(super) client_certificate: Option<String>,
    pub(super) client_private_key: Option<String>,
    pub(super) max_connections: Option<usize>,
    pub(super) max_connections_per_user: Option<usize>,
    pub(super) max_event_streams: Option<usize>,
    pub(super) max_idle_connections: Option<usize>,
    pub(super) probe_timeout_ms: Option<u64>,
    pub(super) connect_timeout_ms: Option<u64>,
    pub(super) response_header_timeout_ms: Option<u64>,
    pub(super) idle_timeout_ms: Option<u64>,
    pub(super) preserve_host: Option<bool>,
    pub(super) request_id_header: Option<String>,
    pub(super) strip_request_headers: Option<Vec<String>>,
    pub(super) strip_response_headers: Option<Vec<String>>,
    pub(super) affinity: Option<String>,
    pub(super) affinity_wait_ms: Option<u64>,
    pub(super) drain_wait_ms: Option<u64>,
    pub(super) drain_max_bytes: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawToken {
    pub(super) algorithms: Option<Vec<String>>,
    pub(super) secret: Option<String>,
    pub(super) keys: Option<Vec<RawKey>>,
    pub(super) active_kid: Option<String>,
    pub(super) jwks: Option<String>,
    pub(super) jwks_ca: Option<String>,
    pub(super) jwks_refresh_seconds: Option<u64>,
    pub(super) jwks_min_refresh_seconds: Option<u64>,
    pub(super) cache_max_entries: Option<u64>,
    pub(super) cache_hmac: Option<bool>,
    pub(super) sources: Option<Vec<String>>,
    pub(super) sid_claim: Option<String>,
    pub(super) leeway_seconds: Option<u64>,
    pub(super) issuer: Option<String>,
    pub(super) audience: Option<String>,
    pub(super) max_token_bytes: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKey {
    pub(super) kid: Option<String>,
    pub(super) alg: Option<String>,
    pub(super) secret: Option<String>,
    pub(super) public_key: Option<String>,
    pub(super) private_key: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLogin {
    pub(super) enabled: Option<bool>,
    pub(super) path_prefix: Option<String>,
    pub(super) verify_path: Option<String>,
    pub(super) cookie_name: Option<String>,
    pub(super) cookie_secure: Option<bool>,
    pub(super) cookie_same_site: Option<String>,
    pub(super) token_ttl_seconds: Option<u64>,
    pub(super) max_failures_per_ip: Option<u32>,
    pub(super) max_failures_per_user: Option<u32>,
    pub(super) failure_window_seconds: Option<u64>,
    pub(super) device_cookie_max_age_seconds: Option<u64>,
    pub(super) page_title: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSession {
    pub(super) store: Option<String>,
    pub(super) format: Option<String>,
    pub(super) key_prefix: Option<String>,
    pub(super) ttl_seconds: Option<u64>,
    pub(super) timeout_ms: Option<u64>,
    pub(super) poll_interval_ms: Option<u64>,
    pub(super) cache_max_entries: Option<u64>,
    pub(super) cache_max_bytes: Option<u64>,
    pub(super) cache_ttl_seconds: Option<u64>,
    pub(super) negative_cache_ms: Option<u64>,
    pub(super) query: Option<String>,
    pub(super) notify_channel: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCredentials {
    pub(super) keys: Option<BTreeMap<String, String>>,
    pub(super) active: Option<String>,
    pub(super) allow_plaintext_legacy: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetrics {
    pub(super) listen: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    pub(super) level: Option<String>,
    pub(super) access_log: Option<bool>,
    pub(super) format: Option<String>,
}
