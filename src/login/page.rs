//! The answers of the session endpoints: the login page (one small HTML form, no script), JSON
//! bodies, redirects to a same-origin `rd` only, cookies (`__Host-`, `HttpOnly`, `Secure`,
//! `SameSite`). Must never: redirect off the origin, or put unescaped text in the page.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};

use crate::upstream::ProxyBody;

use super::{Login, Refusal, MAX_RD_BYTES};

/// `rd` accepted only as a same-origin absolute path: starts with one `/`, no `//` or `/\`
/// authority trick, no backslash, control character or whitespace, also after one more round of
/// percent-decoding (`/%09/evil`, `/%2F/evil`). Returns the value to put in `Location`.
pub fn safe_redirect(rd: &str) -> Option<&str> {
    pub(super) fn no_authority(b: &[u8]) -> bool {
        b.first() == Some(&b'/')
            && !matches!(b.get(1), Some(b'/') | Some(b'\\'))
            && !b.iter().any(|&c| c == b'\\' || c.is_ascii_control())
    }
    let raw = rd.as_bytes();
    if rd.len() > MAX_RD_BYTES || !no_authority(raw) || raw.iter().any(|&c| c == b' ' || c >= 0x80)
    {
        return None;
    }
    let decoded = percent_decode(rd)?;
    no_authority(decoded.as_bytes()).then_some(rd)
}

pub(super) fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

pub(super) fn html_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

pub(super) fn json(status: StatusCode, body: Vec<u8>) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

pub(super) fn json_error(status: StatusCode, message: &str) -> Response<ProxyBody> {
    json(
        status,
        serde_json::to_vec(&serde_json::json!({ "error": message })).expect("serializes"),
    )
}

pub(super) fn redirect(location: &str, cookie: Option<HeaderValue>) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::empty());
    *r.status_mut() = StatusCode::SEE_OTHER;
    let h = r.headers_mut();
    h.insert(
        header::LOCATION,
        HeaderValue::from_str(location).expect("validated redirect target"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(c) = cookie {
        h.append(header::SET_COOKIE, c);
    }
    r
}

/// Characters of a CSRF token: 18 random bytes in base64url without padding.
const CSRF_CHARS: usize = 24;

/// How a session endpoint answers a request: with the login page (a form post), keeping the
/// CSRF token the browser's cookie holds so that a form open in another tab stays good, or
/// with JSON.
#[derive(Clone, Copy)]
pub(super) struct Shape<'a> {
    /// A form post (`application/x-www-form-urlencoded`): answered with pages and redirects.
    pub(super) form: bool,
    /// The CSRF cookie's value the request carried, if any.
    pub(super) csrf: Option<&'a str>,
}

impl<'a> Shape<'a> {
    /// The shape `parts` asks for; `csrf_cookie` names the CSRF cookie.
    pub(super) fn of(parts: &'a http::request::Parts, csrf_cookie: &'a str) -> Self {
        Self {
            form: super::request::content_type_is(parts, "application/x-www-form-urlencoded"),
            csrf: super::request::cookie_value(&parts.headers, csrf_cookie),
        }
    }
}

impl Login {
    /// Shapes a refusal: JSON for API clients, the login page again for form posts.
    pub(super) fn refuse(
        &self,
        r: Refusal,
        shape: Shape<'_>,
        rd: Option<&str>,
    ) -> (Response<ProxyBody>, Option<String>) {
        let status = r.status();
        let mut resp = if shape.form {
            self.page(status, rd.unwrap_or("/"), Some(r.message(true)), shape.csrf)
        } else {
            json_error(status, r.message(false))
        };
        r.add_fields(resp.headers_mut());
        (resp, Some(r.to_string()))
    }

    /// The login page: a plain HTML form, no script, no external asset; a CSRF token in a
    /// hidden field and a cookie (double submit): `held`, the one the browser's cookie holds,
    /// when it is one of ours (so a form open in another tab stays good), else a fresh one.
    pub(super) fn page(
        &self,
        status: StatusCode,
        rd: &str,
        error: Option<&str>,
        held: Option<&str>,
    ) -> Response<ProxyBody> {
        let held = held.filter(|t| {
            t.len() == CSRF_CHARS
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
        });
        let csrf = held.map_or_else(
            || {
                let mut raw = [0u8; 18];
                getrandom::getrandom(&mut raw).expect("OS random source");
                URL_SAFE_NO_PAD.encode(raw)
            },
            str::to_owned,
        );
        let title = html_escape(&self.cfg.page_title);
        let error = error.map_or_else(String::new, |e| {
            format!(
                "<p class=\"error\" role=\"alert\" id=\"error\">{}</p>\n",
                html_escape(e)
            )
        });
        let html = format!(
            include_str!("login_page.html"),
            title = title,
            error = error,
            action = html_escape(&format!("{}/login", self.cfg.path_prefix)),
            csrf = csrf,
            rd = html_escape(rd),
        );
        let mut resp = Response::new(ProxyBody::full(html));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static("default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
        );
        h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
        h.insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
        h.insert(
            header::REFERRER_POLICY,
            HeaderValue::from_static("same-origin"),
        );
        h.append(
            header::SET_COOKIE,
            self.cookie(&self.csrf_cookie, &csrf, None),
        );
        resp
    }

    pub(super) fn cookie(&self, name: &str, value: &str, max_age: Option<u64>) -> HeaderValue {
        let mut c = format!(
            "{name}={value}; Path=/; HttpOnly; SameSite={}",
            self.cfg.cookie_same_site.as_str()
        );
        if let Some(age) = max_age {
            c.push_str(&format!("; Max-Age={age}"));
        }
        if self.cfg.cookie_secure {
            c.push_str("; Secure");
        }
        let mut v = HeaderValue::from_str(&c).expect("token and names are header-safe");
        v.set_sensitive(true);
        v
    }

    pub(super) fn token_cookie(&self, jwt: &str, max_age: u64) -> HeaderValue {
        self.cookie(&self.cfg.cookie_name, jwt, Some(max_age))
    }

    /// `Set-Cookie` that deletes the token cookie (Max-Age=0).
    pub fn clear_token_cookie(&self) -> HeaderValue {
        self.clear_cookie(&self.cfg.cookie_name)
    }

    pub(super) fn clear_cookie(&self, name: &str) -> HeaderValue {
        self.cookie(name, "", Some(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects_only_to_same_origin_paths() {
        for good in ["/", "/x", "/mail/inbox?id=3#top", "/a%20b"] {
            assert_eq!(safe_redirect(good), Some(good), "{good}");
        }
        for bad in [
            "//evil",
            "/\\evil",
            "/%09/evil",
            "https:evil",
            "https://evil",
            "evil",
            "",
            "/%2F/evil",
            "/%5Cevil",
            "/\t/evil",
            " /x",
            "/x\ny",
            "/%2f%2fevil",
        ] {
            assert_eq!(safe_redirect(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn html_is_escaped() {
        assert_eq!(
            html_escape("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }
}
