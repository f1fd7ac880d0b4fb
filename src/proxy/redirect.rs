//! Redirects that point at the client's side (nginx's `proxy_redirect default`): a `Location`,
//! `Content-Location` or `Refresh` URL that names the upstream's own address (scheme, host, port
//! and base path, as `upstream.url` has them), or the client's host with the upstream hop's
//! scheme (`http`, where the client came over https through a trusted proxy), is rewritten to the
//! scheme and authority the client used. Cyrus answers `/.well-known/jmap` with `301 Location:
//! http://HOST/jmap`, which behind TLS must send the client to https. Any other URL, and any
//! relative one, passes as it is.

use http::header::{self, HeaderName, HeaderValue};
use http::Response;

use crate::screen::Screened;
use crate::upstream::ProxyBody;

use super::{Proxy, RequestCtx};

/// `url` with a leading `from` (ASCII case aside, as schemes and hosts compare) replaced by `to`;
/// `from` ends in `/`, and `url` equal to `from` without it counts too. `None` otherwise.
fn repoint(url: &str, from: &str, to: &str) -> Option<String> {
    let head = url.get(..from.len());
    if head.is_some_and(|h| h.eq_ignore_ascii_case(from)) {
        return Some(format!("{to}{}", &url[from.len()..]));
    }
    let bare = &from[..from.len() - 1];
    url.eq_ignore_ascii_case(bare).then(|| to.to_owned())
}

/// A field value with its URL repointed (`Refresh` carries it after `url=`); `None` when nothing
/// changed.
fn repoint_value(name: &HeaderName, value: &str, rules: &[(String, String)]) -> Option<String> {
    let (prefix, url) = if name == header::REFRESH {
        let at = value.to_ascii_lowercase().find("url=")? + 4;
        value.split_at(at)
    } else {
        ("", value)
    };
    let url = url.trim_start();
    rules
        .iter()
        .find_map(|(from, to)| repoint(url, from, to))
        .map(|url| format!("{prefix}{url}"))
}

/// The answer of a plain listener that only redirects (`server.redirect_to_https`): 308 (the
/// method and body kept, RFC 9110 section 15.4.9) to the same host and target on https at
/// `port` (left out when 443).
pub(super) fn to_https(host: &HeaderValue, target: &str, port: u16) -> Response<ProxyBody> {
    let host = host.to_str().unwrap_or_default();
    // The port goes; an IPv6 literal keeps its brackets.
    let name = match host.rfind(':') {
        Some(at) if !host[at..].contains(']') => &host[..at],
        _ => host,
    };
    let location = match port {
        443 => format!("https://{name}{target}"),
        p => format!("https://{name}:{p}{target}"),
    };
    let mut resp = Response::new(ProxyBody::empty());
    *resp.status_mut() = http::StatusCode::PERMANENT_REDIRECT;
    if let Ok(v) = HeaderValue::from_str(&location) {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    resp
}

impl Proxy {
    /// Repoints the redirect fields of an upstream answer ([module docs](self)). Reads nothing
    /// of a response without such a field.
    pub(super) fn point_redirects(
        &self,
        resp: &mut Response<ProxyBody>,
        screened: &Screened,
        ctx: &RequestCtx<'_>,
    ) {
        // Recorded as the head was read: no scan here.
        if !resp
            .body_mut()
            .fields_mut()
            .is_some_and(|f| f.may_redirect())
        {
            return;
        }
        // An HTTP/1.0 request may name no host; `http:///x` is no URL of the client's side.
        let Some(host) = screened.host.to_str().ok().filter(|h| !h.is_empty()) else {
            return;
        };
        let proto = ctx.peer().proto;
        let client = format!("{proto}://{host}/");
        let upstream = self.upstream_host.to_str().unwrap_or_default();
        let mut rules = vec![(
            format!("{}://{upstream}{}/", self.upstream_scheme, self.base_path),
            client.clone(),
        )];
        // Only ever towards https: an https upstream's `https://HOST/` sent to a plain client
        // stays as it is (rewritten to http it would loop, or downgrade).
        if proto != "http" && self.upstream_scheme == "http" {
            rules.push((format!("http://{host}/"), client));
        }
        crate::upstream::materialize(resp);
        for name in [header::LOCATION, header::CONTENT_LOCATION, header::REFRESH] {
            let values: Vec<HeaderValue> = resp.headers().get_all(&name).iter().cloned().collect();
            let mut changed = false;
            let repointed: Vec<HeaderValue> = values
                .iter()
                .map(|v| {
                    let new = v
                        .to_str()
                        .ok()
                        .and_then(|s| repoint_value(&name, s, &rules));
                    changed |= new.is_some();
                    new.and_then(|n| HeaderValue::from_str(&n).ok())
                        .unwrap_or_else(|| v.clone())
                })
                .collect();
            if changed {
                resp.headers_mut().remove(&name);
                for v in repointed {
                    resp.headers_mut().append(&name, v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Vec<(String, String)> {
        vec![
            (
                "http://up:8008/base/".into(),
                "https://mail.example/".into(),
            ),
            (
                "http://mail.example/".into(),
                "https://mail.example/".into(),
            ),
        ]
    }

    #[test]
    fn the_https_redirect_keeps_host_and_target_and_drops_the_plain_port() {
        let at = |host: &str, port| {
            let resp = to_https(&HeaderValue::from_str(host).unwrap(), "/a?b=1", port);
            assert_eq!(resp.status(), 308);
            resp.headers()[header::LOCATION]
                .to_str()
                .unwrap()
                .to_owned()
        };
        assert_eq!(at("mail.example:8080", 443), "https://mail.example/a?b=1");
        assert_eq!(at("mail.example", 8443), "https://mail.example:8443/a?b=1");
        assert_eq!(at("[::1]:8080", 8443), "https://[::1]:8443/a?b=1");
        assert_eq!(at("[::1]", 443), "https://[::1]/a?b=1");
    }

    #[test]
    fn urls_naming_the_upstream_or_the_upstream_scheme_go_to_the_client_side() {
        let r = rules();
        let loc = |v: &str| repoint_value(&header::LOCATION, v, &r);
        assert_eq!(
            loc("http://up:8008/base/jmap").as_deref(),
            Some("https://mail.example/jmap")
        );
        assert_eq!(
            loc("HTTP://UP:8008/base/x?y=1").as_deref(),
            Some("https://mail.example/x?y=1")
        );
        assert_eq!(
            loc("http://up:8008/base").as_deref(),
            Some("https://mail.example/")
        );
        assert_eq!(
            loc("http://mail.example/jmap").as_deref(),
            Some("https://mail.example/jmap")
        );
        let refresh = repoint_value(&header::REFRESH, "5; url=http://up:8008/base/r", &r);
        assert_eq!(refresh.as_deref(), Some("5; url=https://mail.example/r"));
    }

    #[test]
    fn other_and_relative_urls_pass_as_they_are() {
        let r = rules();
        for url in [
            "/jmap",
            "https://elsewhere.example/",
            "http://up:8008/other/",
            "http://up:80080/base/",
            "http://mail.example.evil/",
        ] {
            assert_eq!(repoint_value(&header::LOCATION, url, &r), None, "{url}");
        }
        assert_eq!(repoint_value(&header::REFRESH, "5", &r), None);
    }
}
