//! CORS (`[cors]`): the Fetch standard's CORS protocol
//! (<https://fetch.spec.whatwg.org/#http-cors-protocol>) for web applications on other origins
//! that call the proxied API with a token. tessera answers a preflight itself, before
//! authentication (a browser sends a preflight without credentials), and marks the answers to
//! requests from an allowed origin, its own refusals included, so that a page can read a 401 and
//! renew its token. The upstream's own `Access-Control-*` fields are dropped
//! ([`UPSTREAM_FIELDS`]): one policy answers.
//! Hand-written: tower-http's `CorsLayer` wraps a tower `Service`, and the phases are none.
//! Must never: allow an origin not listed, allow credentials to every origin (`*`), or apply
//! to the session endpoints (`/login`, `/logout`, `/session`), which stay same-origin.

use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Response, StatusCode};

use crate::error::ProxyError;
use crate::upstream::ProxyBody;

/// The upstream's response fields that [`Cors`] replaces; with `[cors]` they are screened out.
pub const UPSTREAM_FIELDS: [HeaderName; 6] = [
    header::ACCESS_CONTROL_ALLOW_ORIGIN,
    header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
    header::ACCESS_CONTROL_ALLOW_METHODS,
    header::ACCESS_CONTROL_ALLOW_HEADERS,
    header::ACCESS_CONTROL_EXPOSE_HEADERS,
    header::ACCESS_CONTROL_MAX_AGE,
];

/// `cors.allow_origins`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origins {
    /// `["*"]`: every origin, answered `Access-Control-Allow-Origin: *` (never with
    /// credentials: browsers refuse that, and it would hand every site the user's cookie).
    Any,
    /// These origins, each `scheme://host[:port]` in lower case without the scheme's default
    /// port (as browsers serialize `Origin`).
    List(Vec<String>),
}

/// `cors.allow_headers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowHeaders {
    /// `["*"]`: the request fields a preflight names are allowed (the answer repeats them;
    /// a literal `*` would not cover `Authorization`).
    Mirror,
    /// These field names, as one `Access-Control-Allow-Headers` value.
    List(HeaderValue),
}

/// `[cors]`, validated: what a preflight answers and what an allowed origin's answers carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cors {
    /// Who may read answers.
    pub origins: Origins,
    /// `Access-Control-Allow-Methods` of a preflight: `cors.allow_methods`, comma-separated
    /// (default `GET, HEAD, POST, PUT, PATCH, DELETE`).
    pub allow_methods: HeaderValue,
    /// `Access-Control-Allow-Headers` of a preflight (default `Authorization, Content-Type`).
    pub allow_headers: AllowHeaders,
    /// `Access-Control-Expose-Headers` of an answer: `cors.expose_headers`; `None` when empty.
    pub expose_headers: Option<HeaderValue>,
    /// `Access-Control-Max-Age` of a preflight, seconds: `cors.max_age` (default 7200,
    /// Chromium's cap; Firefox keeps up to 86400).
    pub max_age: u32,
    /// `cors.allow_credentials`: `Access-Control-Allow-Credentials: true`, so a page may send
    /// cookies (`credentials: "include"`). A token in `Authorization` needs none.
    pub allow_credentials: bool,
}

impl Cors {
    /// The `Access-Control-Allow-Origin` value for a request with `fields`: `*` for any origin,
    /// on every answer (with or without `Origin`: a cache then holds one answer fit for all,
    /// as Fetch's "CORS protocol and HTTP caches" asks), else the request's own `Origin` when
    /// it is listed; `None` without `Origin` or for an origin not listed.
    pub fn allowed(&self, fields: &HeaderMap) -> Option<HeaderValue> {
        match &self.origins {
            Origins::Any => Some(HeaderValue::from_static("*")),
            Origins::List(list) => fields
                .get(header::ORIGIN)
                .filter(|origin| listed(origin.as_bytes(), list))
                .cloned(),
        }
    }

    /// The answer to a preflight with `fields` ([`is_preflight`]): 204 with the allowed
    /// methods, fields and how long a browser may keep them; [`Cors::mark`] adds the origin.
    /// Whether the method and fields asked for are among them is the browser's to judge, whose
    /// console then names the one refused.
    ///
    /// Errors: [`ProxyError::CorsOrigin`] (403) when the origin is not allowed.
    pub fn preflight(&self, fields: &HeaderMap) -> Result<Response<ProxyBody>, ProxyError> {
        if self.allowed(fields).is_none() {
            return Err(ProxyError::CorsOrigin);
        }
        let mut resp = Response::new(ProxyBody::empty());
        *resp.status_mut() = StatusCode::NO_CONTENT;
        let out = resp.headers_mut();
        out.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            self.allow_methods.clone(),
        );
        let allow_headers = match &self.allow_headers {
            AllowHeaders::List(list) => Some(list.clone()),
            AllowHeaders::Mirror => {
                out.append(
                    header::VARY,
                    HeaderValue::from_static("Access-Control-Request-Headers"),
                );
                fields
                    .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
                    .filter(|v| is_field_name_list(v.as_bytes()))
                    .cloned()
            }
        };
        if let Some(allow_headers) = allow_headers {
            out.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, allow_headers);
        }
        out.insert(header::ACCESS_CONTROL_MAX_AGE, self.max_age.into());
        Ok(resp)
    }

    /// Marks an answer (`out`, its fields besides the upstream's) to a request whose
    /// [`Cors::allowed`] was `allowed`: the origin, credentials and exposed fields when it is
    /// allowed; `Vary: Origin` whenever the answer depends on the origin (a listed one), so a
    /// cache never hands one origin's answer to another.
    pub fn mark(&self, allowed: Option<HeaderValue>, out: &mut HeaderMap) {
        if let Origins::List(_) = self.origins {
            out.append(header::VARY, HeaderValue::from_static("Origin"));
        }
        let Some(origin) = allowed else {
            return;
        };
        out.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        if self.allow_credentials {
            out.insert(
                header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
                HeaderValue::from_static("true"),
            );
        }
        if let Some(expose) = &self.expose_headers {
            out.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, expose.clone());
        }
    }
}

/// Whether `origin` (an `Origin` value) is one of `list` (lowercase `scheme://host[:port]`,
/// default ports removed, as the config keeps them), ASCII case ignored.
pub fn listed(origin: &[u8], list: &[String]) -> bool {
    list.iter()
        .any(|o| o.as_bytes().eq_ignore_ascii_case(origin))
}

/// Whether a request is a CORS preflight: `OPTIONS` with `Origin` and
/// `Access-Control-Request-Method` (Fetch, "CORS-preflight request").
pub fn is_preflight(method: &Method, fields: &HeaderMap) -> bool {
    method == Method::OPTIONS
        && fields.contains_key(header::ORIGIN)
        && fields.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
}

/// Whether `v` is a comma-separated list of field names (tokens, RFC 9110 section 5.1), as an
/// `Access-Control-Request-Headers` value must be before it is repeated in an answer.
fn is_field_name_list(v: &[u8]) -> bool {
    v.split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .all(|name| HeaderName::from_bytes(name).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cors(origins: Origins, allow_headers: AllowHeaders) -> Cors {
        Cors {
            origins,
            allow_methods: HeaderValue::from_static("GET, PUT"),
            allow_headers,
            expose_headers: Some(HeaderValue::from_static("ETag")),
            max_age: 600,
            allow_credentials: true,
        }
    }

    fn fields(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(n, v)| (HeaderName::from_static(n), HeaderValue::from_static(v)))
            .collect()
    }

    fn listed() -> Cors {
        let list = HeaderValue::from_static("Authorization, Content-Type");
        cors(
            Origins::List(vec!["https://app.example".into()]),
            AllowHeaders::List(list),
        )
    }

    #[test]
    fn a_listed_origin_is_answered_with_its_own_spelling_and_no_other_is() {
        let c = listed();
        let allowed = c.allowed(&fields(&[("origin", "https://APP.example")]));
        assert_eq!(allowed.unwrap(), "https://APP.example");
        for other in ["https://app.example.evil", "http://app.example", "null"] {
            let f = HeaderMap::from_iter([(header::ORIGIN, HeaderValue::from_static(other))]);
            assert_eq!(c.allowed(&f), None, "{other}");
        }
        assert_eq!(c.allowed(&HeaderMap::new()), None);
    }

    #[test]
    fn a_preflight_gets_the_lists_and_a_foreign_one_403() {
        let c = listed();
        let asked = fields(&[
            ("origin", "https://app.example"),
            ("access-control-request-method", "PUT"),
        ]);
        assert!(is_preflight(&Method::OPTIONS, &asked));
        assert!(!is_preflight(&Method::GET, &asked));
        let resp = c.preflight(&asked).unwrap();
        assert_eq!(resp.status(), 204);
        let h = resp.headers();
        assert_eq!(h["access-control-allow-methods"], "GET, PUT");
        assert_eq!(
            h["access-control-allow-headers"],
            "Authorization, Content-Type"
        );
        assert_eq!(h["access-control-max-age"], "600");
        let foreign = fields(&[
            ("origin", "https://evil.example"),
            ("access-control-request-method", "PUT"),
        ]);
        let Err(e) = c.preflight(&foreign) else {
            panic!("a foreign origin's preflight was answered");
        };
        assert_eq!(e.status(), StatusCode::FORBIDDEN);
    }

    #[test]
    fn mirrored_fields_are_repeated_only_when_they_are_field_names() {
        let c = cors(Origins::Any, AllowHeaders::Mirror);
        let mut asked = fields(&[
            ("origin", "https://a.example"),
            ("access-control-request-method", "GET"),
            ("access-control-request-headers", "authorization,x-trace"),
        ]);
        let resp = c.preflight(&asked).unwrap();
        let h = resp.headers();
        assert_eq!(h["access-control-allow-headers"], "authorization,x-trace");
        assert_eq!(h["vary"], "Access-Control-Request-Headers");
        asked.insert(
            header::ACCESS_CONTROL_REQUEST_HEADERS,
            HeaderValue::from_static("a b, c"),
        );
        let resp = c.preflight(&asked).unwrap();
        assert!(!resp
            .headers()
            .contains_key(header::ACCESS_CONTROL_ALLOW_HEADERS));
    }

    #[test]
    fn an_allowed_answer_is_marked_and_every_answer_varies_by_origin() {
        let c = listed();
        let mut out = HeaderMap::new();
        c.mark(None, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out["vary"], "Origin");
        let mut out = HeaderMap::new();
        c.mark(
            Some(HeaderValue::from_static("https://app.example")),
            &mut out,
        );
        assert_eq!(out["access-control-allow-origin"], "https://app.example");
        assert_eq!(out["access-control-allow-credentials"], "true");
        assert_eq!(out["access-control-expose-headers"], "ETag");
        let any = Cors {
            allow_credentials: false,
            ..cors(Origins::Any, AllowHeaders::Mirror)
        };
        let mut out = HeaderMap::new();
        any.mark(any.allowed(&HeaderMap::new()), &mut out);
        assert_eq!(out["access-control-allow-origin"], "*");
        assert!(!out.contains_key(header::VARY));
        assert!(!out.contains_key(header::ACCESS_CONTROL_ALLOW_CREDENTIALS));
    }
}
