//! Request fields that carry an identity or a routing decision an upstream may trust from its
//! proxy (`X-Remote-User`, `X-Original-URL`, `True-Client-IP`, `X-HTTP-Method-Override`, ...),
//! which a client must not be able to set: removed from every request
//! (`upstream.strip_request_headers`). Names compare ASCII case-insensitively with `_` read as
//! `-` (CGI and WSGI servers read `X_Remote_User` as `X-Remote-User`); an entry ending in `*` is
//! a prefix. Must never: let a listed field through in another spelling.

/// The default `upstream.strip_request_headers`: identity fields set by authenticating proxies
/// (oauth2-proxy, Apache, nginx `auth_request`, Authelia, authentik, Pomerium, Cloudflare
/// Access, Google IAP, AWS ALB, Azure App Service, Tailscale), client-address and host fields
/// set by CDNs and balancers, URL rewrites some frameworks trust (IIS, Symfony), method
/// overrides (a `GET` allowed through a policy that a framework then runs as `DELETE`), and
/// `Proxy`, which CGI servers turn into `HTTP_PROXY` (httpoxy, CVE-2016-5385). The signed
/// assertions those proxies send beside (`Cf-Access-Jwt-Assertion`, `X-Amzn-Oidc-Data`,
/// `X-Pomerium-Jwt-Assertion`, `X-authentik-jwt`) are left: a client cannot forge them, and an
/// upstream that checks them would lose them.
pub const DEFAULT_STRIPPED: [&str; 42] = [
    "x-remote-user",
    "remote-user",
    "x-remote-group",
    "remote-groups",
    "remote-email",
    "remote-name",
    "x-auth-request-*",
    "x-auth-user",
    "x-webauth-user",
    "x-authentik-username",
    "x-authentik-groups",
    "x-authentik-entitlements",
    "x-authentik-email",
    "x-authentik-name",
    "x-authentik-uid",
    "x-pomerium-claim-*",
    "cf-access-authenticated-user-email",
    "x-goog-authenticated-user-*",
    "x-amzn-oidc-identity",
    "x-ms-client-principal*",
    "tailscale-user-*",
    "x-original-url",
    "x-rewrite-url",
    "x-original-uri",
    "x-original-host",
    "x-host",
    "x-http-host-override",
    "true-client-ip",
    "x-client-ip",
    "client-ip",
    "x-originating-ip",
    "x-remote-ip",
    "x-remote-addr",
    "cf-connecting-ip",
    "x-cluster-client-ip",
    "fastly-client-ip",
    "x-original-forwarded-for",
    "x-forwarded",
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
    "proxy",
];

/// The names of `upstream.strip_request_headers`, ready to match.
#[derive(Debug, Clone)]
pub struct Stripped {
    /// (lowercase name or prefix, whether it is a prefix).
    entries: Vec<(Box<[u8]>, bool)>,
    /// Which first bytes any entry starts with (`_` and `-` both), so most fields cost one
    /// lookup.
    first: [bool; 256],
}

impl Default for Stripped {
    /// None listed.
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            first: [false; 256],
        }
    }
}

impl Stripped {
    /// The list from `names` (lowercase; `*` at the end makes a prefix).
    pub fn new<S: AsRef<str>>(names: &[S]) -> Self {
        let mut this = Self::default();
        for name in names {
            let name = name.as_ref().to_ascii_lowercase().replace('_', "-");
            let (bytes, prefix) = match name.strip_suffix('*') {
                Some(p) => (p.as_bytes(), true),
                None => (name.as_bytes(), false),
            };
            if let Some(&b) = bytes.first() {
                this.first[usize::from(b)] = true;
                if b == b'-' {
                    this.first[usize::from(b'_')] = true;
                }
            }
            this.entries.push((bytes.into(), prefix));
        }
        this
    }

    /// Whether the field `name` (lowercase, as `http` keeps names) is listed.
    pub fn contains(&self, name: &str) -> bool {
        let name = name.as_bytes();
        let Some(&b) = name.first() else { return false };
        if !self.first[usize::from(b)] {
            return false;
        }
        self.entries.iter().any(|(entry, prefix)| {
            let fits = if *prefix {
                name.len() >= entry.len()
            } else {
                name.len() == entry.len()
            };
            fits && entry
                .iter()
                .zip(name)
                .all(|(e, n)| e == n || (*e == b'-' && *n == b'_'))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_names_match_in_any_spelling_and_prefixes_match_their_family() {
        let s = Stripped::new(&DEFAULT_STRIPPED);
        for name in [
            "x-remote-user",
            "x_remote_user",
            "remote-user",
            "x-auth-request-email",
            "x_auth_request_user",
            "x-original-url",
            "true-client-ip",
            "cf-connecting-ip",
            "x-http-method-override",
            "proxy",
            "client_ip",
            "x-authentik-username",
            "x-pomerium-claim-email",
            "x-ms-client-principal-name",
            "remote-groups",
        ] {
            assert!(s.contains(name), "{name}");
        }
        for name in [
            "x-remote-users",
            "x-remote",
            "authorization",
            "cookie",
            "content-type",
            "x-auth-request",
            "remote-user-agent",
            "proxy-status",
            "x-forwarded-by",
            "cf-access-jwt-assertion",
            "x-amzn-oidc-data",
            "x-pomerium-jwt-assertion",
            "x-authentik-jwt",
        ] {
            assert!(!s.contains(name), "{name}");
        }
        assert!(!Stripped::default().contains("x-remote-user"));
    }
}
