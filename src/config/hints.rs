//! The fix a wrong-typed value's error message suggests, by key.

/// The fix for serde's message about `key` (serde's wording: "invalid type: string \"5s\",
/// expected u64", "unknown field `x`, expected one of ..."), in one sentence.
pub(super) fn type_fix(key: &str, message: &str) -> String {
    // The keys that are arrays of tables (`Vec` of a struct in the `Raw*` types).
    const ARRAYS_OF_TABLES: [&str; 2] = ["token.keys", "tls.sni"];
    let expected = message.rsplit("expected ").next().unwrap_or("");
    let unit = [
        ("_ms", " of milliseconds"),
        ("_us", " of microseconds"),
        ("_seconds", " of seconds"),
        ("_bytes", " of bytes"),
    ]
    .into_iter()
    .find(|(suffix, _)| key.ends_with(suffix))
    .map_or("", |(_, unit)| unit);
    // An entry of an array of tables (`token.keys[0]`) is written `[[token.keys]]`.
    let entry_of = key
        .strip_suffix(']')
        .and_then(|k| k.rsplit_once('['))
        .map(|(array, _)| array);
    if message.starts_with("unknown field") {
        "is unknown here; check its spelling and its table against the keys listed below \
         and the configuration reference in docs/configuration.md"
            .to_string()
    } else if ["u8", "u16", "u32", "u64", "usize"].contains(&expected) {
        // No range: the type's is not the key's, whose own bounds are checked after this.
        format!("must be a whole number{unit}, without quotes")
    } else if ARRAYS_OF_TABLES.contains(&key) {
        format!(
            "must be an array of tables: one `[[{key}]]` block per entry, with its keys below it"
        )
    } else if let (true, Some(array)) = (expected.starts_with("struct "), entry_of) {
        format!("must be a table: a `[[{array}]]` block with its keys below it")
    } else if expected.starts_with("struct ") {
        format!("must be a table: a `[{key}]` line with its keys below it")
    } else if expected == "a map" {
        format!(
            "must be a table: a `[{key}]` line with `name = \"value\"` lines below it, or \
             `{{ name = \"value\" }}`"
        )
    } else if expected == "a boolean" {
        "must be true or false, without quotes".to_string()
    } else if expected == "a string" {
        "must be a quoted string".to_string()
    } else if expected == "a sequence" && message.starts_with("invalid type: map") {
        "must be an array, not a table, e.g. [\"a\", \"b\"]".to_string()
    } else if expected == "a sequence" {
        "must be an array, e.g. [\"a\", \"b\"]".to_string()
    } else {
        "has the wrong type; see the configuration reference in docs/configuration.md".to_string()
    }
}
