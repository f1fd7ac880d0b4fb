//! `[cors]` -> [`Cors`], and the origin syntax it shares with `websocket.allowed_origins`.

use http::header::{HeaderName, HeaderValue};

use super::raw::RawCors;
use super::ConfigError;
use crate::cors::{AllowHeaders, Cors, Origins};

/// An origin as written in the config (`scheme://host[:port]`, http or https) in the form
/// browsers send in `Origin`: lower case, no trailing `/`, no default port.
///
/// Errors: `key` named, when `text` is no such origin.
pub(super) fn origin(key: &str, text: &str) -> Result<String, ConfigError> {
    let origin = text.trim_end_matches('/').to_ascii_lowercase();
    let origin = match origin.strip_suffix(":443") {
        Some(o) if origin.starts_with("https://") => o.to_string(),
        _ => match origin.strip_suffix(":80") {
            Some(o) if origin.starts_with("http://") => o.to_string(),
            _ => origin,
        },
    };
    let ok = origin.parse::<http::Uri>().is_ok_and(|u| {
        matches!(u.scheme_str(), Some("http" | "https"))
            && u.authority().is_some_and(|a| !a.as_str().contains('@'))
            && u.path_and_query().is_none_or(|pq| pq.as_str() == "/")
    });
    if !ok {
        return Err(ConfigError::new(
            key,
            format!("`{text}` is not an origin; write scheme://host[:port], e.g. \"https://mail.example.com\""),
        ));
    }
    Ok(origin)
}

/// `[cors]`, present: `allow_origins` is required; `"*"` stands alone and not with
/// `allow_credentials`.
pub(super) fn validate_cors(c: RawCors) -> Result<Cors, ConfigError> {
    let Some(listed) = c.allow_origins.filter(|l| !l.is_empty()) else {
        return Err(ConfigError::new(
            "cors.allow_origins",
            "missing: list the origins whose pages may call tessera, e.g. \
             [\"https://app.example.com\"], or remove [cors]",
        ));
    };
    let allow_credentials = c.allow_credentials.unwrap_or(false);
    let origins = if listed.iter().any(|o| o == "*") {
        if listed.len() > 1 {
            return Err(ConfigError::new(
                "cors.allow_origins",
                "\"*\" allows every origin: list it alone, or list origins without it",
            ));
        }
        if allow_credentials {
            return Err(ConfigError::new(
                "cors.allow_credentials",
                "true with cors.allow_origins = [\"*\"] would let every site send the user's \
                 cookies; list the origins, or set it false",
            ));
        }
        Origins::Any
    } else {
        let mut list = Vec::new();
        for (i, text) in listed.iter().enumerate() {
            list.push(origin(&format!("cors.allow_origins[{i}]"), text)?);
        }
        Origins::List(list)
    };
    let methods = allow_methods(c.allow_methods, allow_credentials)?;
    let allow_headers = match c.allow_headers.as_deref() {
        Some([]) => {
            return Err(ConfigError::new(
                "cors.allow_headers",
                "is empty: a preflight asking for Authorization would be refused; list the \
                 fields pages send, or leave it out for Authorization, Content-Type",
            ))
        }
        Some([star]) if star == "*" => AllowHeaders::Mirror,
        Some(names) => AllowHeaders::List(names_value("cors.allow_headers", names)?),
        None => AllowHeaders::List(HeaderValue::from_static("Authorization, Content-Type")),
    };
    let expose = c.expose_headers.unwrap_or_default();
    let expose_star = expose.len() == 1 && expose[0] == "*" && !allow_credentials;
    Ok(Cors {
        origins,
        allow_methods: list_value(&methods),
        allow_headers,
        expose_headers: match (expose.is_empty(), expose_star) {
            (true, _) => None,
            (false, true) => Some(HeaderValue::from_static("*")),
            (false, false) => Some(names_value("cors.expose_headers", &expose)?),
        },
        max_age: c.max_age.unwrap_or(7200),
        allow_credentials,
    })
}

/// `cors.allow_methods` (default `GET, HEAD, POST, PUT, PATCH, DELETE`): method names, the six
/// a browser upper-cases (DELETE, GET, HEAD, OPTIONS, POST, PUT) upper-cased here too, as its
/// comparison is case-sensitive; or `["*"]` alone without credentials.
///
/// Errors: an empty list, a name that is no method, `*` among others or with credentials.
fn allow_methods(
    listed: Option<Vec<String>>,
    credentials: bool,
) -> Result<Vec<String>, ConfigError> {
    let default = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"];
    let mut methods = listed.unwrap_or_else(|| default.map(String::from).to_vec());
    if methods.is_empty() {
        return Err(ConfigError::new(
            "cors.allow_methods",
            "is empty: list the methods pages may use, or leave it out for GET, HEAD, POST, PUT, \
             PATCH, DELETE",
        ));
    }
    let star_alone = methods.len() == 1 && methods[0] == "*" && !credentials;
    for (i, m) in methods.iter_mut().enumerate() {
        let upper = m.to_ascii_uppercase();
        if ["DELETE", "GET", "HEAD", "OPTIONS", "POST", "PUT"].contains(&upper.as_str()) {
            *m = upper;
        } else if !(star_alone || (m != "*" && http::Method::from_bytes(m.as_bytes()).is_ok())) {
            return Err(ConfigError::new(
                &format!("cors.allow_methods[{i}]"),
                format!(
                    "`{m}` is not a method name (\"*\" only alone, and not with \
                     cors.allow_credentials); write e.g. \"PUT\""
                ),
            ));
        }
    }
    Ok(methods)
}

/// Field names as one comma-separated value.
///
/// Errors: `key[i]` named for an entry that is no field name (or a lone `*` among others).
fn names_value(key: &str, names: &[String]) -> Result<HeaderValue, ConfigError> {
    for (i, name) in names.iter().enumerate() {
        if name == "*" || HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(ConfigError::new(
                &format!("{key}[{i}]"),
                format!(
                    "`{name}` is not a header field name; write e.g. \"Content-Type\" (\"*\" \
                     only alone, and in expose_headers not with allow_credentials)"
                ),
            ));
        }
    }
    Ok(list_value(names))
}

/// Tokens (checked) joined by `, `, which is a valid field value.
fn list_value(items: &[String]) -> HeaderValue {
    HeaderValue::from_str(&items.join(", ")).expect("tokens make a field value")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(origins: &[&str]) -> RawCors {
        RawCors {
            allow_origins: Some(origins.iter().map(|s| s.to_string()).collect()),
            ..RawCors::default()
        }
    }

    #[test]
    fn origins_are_kept_as_browsers_send_them_and_defaults_fill_the_rest() {
        let c = validate_cors(raw(&["HTTPS://App.Example:443/", "http://localhost:8080"])).unwrap();
        assert_eq!(
            c.origins,
            Origins::List(vec![
                "https://app.example".into(),
                "http://localhost:8080".into()
            ])
        );
        assert_eq!(c.allow_methods, "GET, HEAD, POST, PUT, PATCH, DELETE");
        assert_eq!(
            c.allow_headers,
            AllowHeaders::List(HeaderValue::from_static("Authorization, Content-Type"))
        );
        assert_eq!((c.max_age, c.allow_credentials), (7200, false));
        assert_eq!(c.expose_headers, None);
    }

    #[test]
    fn a_wrong_cors_table_names_its_key() {
        let cases = [
            (RawCors::default(), "cors.allow_origins"),
            (raw(&["https://a.example/path"]), "cors.allow_origins[0]"),
            (raw(&["*", "https://a.example"]), "cors.allow_origins"),
            (
                RawCors {
                    allow_credentials: Some(true),
                    ..raw(&["*"])
                },
                "cors.allow_credentials",
            ),
            (
                RawCors {
                    allow_methods: Some(vec!["GET".into(), "P UT".into()]),
                    ..raw(&["https://a.example"])
                },
                "cors.allow_methods[1]",
            ),
            (
                RawCors {
                    allow_headers: Some(vec![]),
                    ..raw(&["https://a.example"])
                },
                "cors.allow_headers",
            ),
            (
                RawCors {
                    allow_methods: Some(vec![]),
                    ..raw(&["https://a.example"])
                },
                "cors.allow_methods",
            ),
            (
                RawCors {
                    allow_methods: Some(vec!["*".into()]),
                    allow_credentials: Some(true),
                    ..raw(&["https://a.example"])
                },
                "cors.allow_methods[0]",
            ),
            (
                RawCors {
                    allow_headers: Some(vec!["Authorization".into(), "*".into()]),
                    ..raw(&["https://a.example"])
                },
                "cors.allow_headers[1]",
            ),
            (
                RawCors {
                    expose_headers: Some(vec!["ETag:".into()]),
                    ..raw(&["https://a.example"])
                },
                "cors.expose_headers[0]",
            ),
        ];
        for (c, key) in cases {
            let e = validate_cors(c).unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
    }

    #[test]
    fn a_lone_star_mirrors_the_fields_asked_for() {
        let c = validate_cors(RawCors {
            allow_headers: Some(vec!["*".into()]),
            ..raw(&["*"])
        })
        .unwrap();
        assert_eq!(c.allow_headers, AllowHeaders::Mirror);
        assert_eq!(c.origins, Origins::Any);
    }

    /// Browsers upper-case six method names and compare case-sensitively: those are kept in
    /// upper case, any other as written.
    #[test]
    fn the_methods_browsers_normalize_are_upper_cased() {
        let c = validate_cors(RawCors {
            allow_methods: Some(vec!["put".into(), "delete".into(), "PROPFIND".into()]),
            expose_headers: Some(vec!["*".into()]),
            ..raw(&["https://a.example"])
        })
        .unwrap();
        assert_eq!(c.allow_methods, "PUT, DELETE, PROPFIND");
        assert_eq!(c.expose_headers.unwrap(), "*");
    }
}
