//! `Cache-Control: private` on proxied answers (`server.private_responses`). The upstream saw
//! `Authorization`, so it may count on a shared cache not storing its answer (RFC 9111 section
//! 3.5); a cache or CDN in front of tessera saw a cookie, or a bearer token it does not treat as
//! RFC 9111 says (nginx's `proxy_cache` ignores `Authorization`; CDNs store `.pdf` by its
//! extension), and could serve one user's answer to anyone. Must never: remove or change the
//! upstream's own directives (`private` is added as a field line of its own).

/// Which proxied answers get `Cache-Control: private` (`server.private_responses`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PrivateResponses {
    /// Those whose `Cache-Control` says nothing of shared caches: no `public`, `s-maxage`,
    /// `private` or `no-store` (`"unmarked"`, the default).
    #[default]
    Unmarked,
    /// Every one not already `private` or `no-store`, `public` ones too (`"always"`).
    Always,
    /// None: the upstream's fields pass as they are (`"off"`).
    Off,
}

impl PrivateResponses {
    /// The setting named `name` (`"unmarked"`, `"always"`, `"off"`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "unmarked" => Some(Self::Unmarked),
            "always" => Some(Self::Always),
            "off" => Some(Self::Off),
            _ => None,
        }
    }

    /// Whether an answer whose `Cache-Control` field lines are `values` gets `private` added.
    /// Directive names compare ASCII case-insensitively; `private="Set-Cookie"` keeps only the
    /// fields it names from shared caches (RFC 9111 section 5.2.2.7), so it counts as no
    /// `private`.
    pub fn wants_private<'a>(self, values: impl Iterator<Item = &'a [u8]>) -> bool {
        if self == Self::Off {
            return false;
        }
        for value in values {
            for directive in value.split(|&b| b == b',') {
                let (name, argument) = match directive.iter().position(|&b| b == b'=') {
                    Some(at) => (&directive[..at], true),
                    None => (directive, false),
                };
                let is = |n: &str| name.trim_ascii().eq_ignore_ascii_case(n.as_bytes());
                if is("no-store") || (is("private") && !argument) {
                    return false;
                }
                if self == Self::Unmarked && (is("public") || is("s-maxage")) {
                    return false;
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::PrivateResponses::{self, *};

    fn wants(mode: PrivateResponses, lines: &[&str]) -> bool {
        mode.wants_private(lines.iter().map(|l| l.as_bytes()))
    }

    #[test]
    fn unmarked_answers_are_made_private() {
        for lines in [
            &[][..],
            &["max-age=3600"],
            &["no-cache"],
            &["private=\"Set-Cookie\""],
        ] {
            assert!(wants(Unmarked, lines), "{lines:?}");
            assert!(wants(Always, lines), "{lines:?}");
            assert!(!wants(Off, lines), "{lines:?}");
        }
    }

    #[test]
    fn answers_saying_who_may_store_them_are_left_alone() {
        for lines in [
            &["Private, max-age=604800, immutable"][..],
            &["must-revalidate, no-cache, NO-STORE"],
            &["max-age=60", "private"],
        ] {
            assert!(!wants(Unmarked, lines), "{lines:?}");
            assert!(!wants(Always, lines), "{lines:?}");
        }
        for lines in [&["public, max-age=86400"][..], &["s-maxage = 60"]] {
            assert!(!wants(Unmarked, lines), "{lines:?}");
            assert!(wants(Always, lines), "{lines:?}");
        }
    }
}
