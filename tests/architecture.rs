//! The shape of `src/`, checked as text: files small enough to read (at most 400 lines before
//! their test module) and no import cycle between top-level modules (a module reaches another
//! through `crate::name`; test modules are not counted). `lib.rs` and `main.rs` are the root and
//! may name any module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Most lines a source file may have before its `#[cfg(test)]` module.
const MAX_LINES: usize = 400;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, as (path relative to `src/`, text).
fn sources(dir: &Path, out: &mut Vec<(String, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path
                .strip_prefix(src())
                .unwrap()
                .to_string_lossy()
                .into_owned();
            out.push((rel, std::fs::read_to_string(&path).unwrap()));
        }
    }
}

/// The text before the file's test module.
fn before_tests(text: &str) -> &str {
    text.split("#[cfg(test)]").next().unwrap_or(text)
}

/// The top-level module a file belongs to (`upstream/pool.rs` -> `upstream`), `None` for the
/// root files.
fn top_module(rel: &str) -> Option<String> {
    let first = rel.split('/').next().unwrap();
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then(|| name.to_string())
}

/// The top-level modules `text` names through `crate::` (comment lines skipped): `crate::a`,
/// `crate::a::b`, and every name of a group `crate::{a, b::c}`.
fn named_modules(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let group = group.split('}').next().unwrap_or("");
                names.extend(group.split(',').map(|n| ident(n.trim())));
            } else {
                names.insert(ident(rest));
            }
        }
    }
    names
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The module graph: module -> the modules it names.
fn graph(files: &[(String, String)]) -> BTreeMap<String, BTreeSet<String>> {
    let modules: BTreeSet<String> = files.iter().filter_map(|(r, _)| top_module(r)).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (rel, text) in files {
        let Some(from) = top_module(rel) else {
            continue;
        };
        for to in named_modules(before_tests(text)) {
            if to != from && modules.contains(&to) {
                edges.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    edges
}

/// A cycle in `edges`, as the modules along it, if there is one.
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|start| visit(start, edges, &mut Vec::new(), &mut done))
}

#[test]
fn no_source_file_is_over_400_lines_before_its_tests() {
    let mut files = Vec::new();
    sources(&src(), &mut files);
    let mut problems = Vec::new();
    for (rel, text) in &files {
        let lines = before_tests(text).lines().count();
        if lines > MAX_LINES {
            problems.push(format!(
                "{rel}: {lines} lines before its tests (max {MAX_LINES})"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn no_two_top_level_modules_import_each_other() {
    let mut files = Vec::new();
    sources(&src(), &mut files);
    let edges = graph(&files);
    if let Some(cycle) = find_cycle(&edges) {
        panic!("import cycle: {}", cycle.join(" -> "));
    }
}

#[test]
fn the_checks_see_a_cycle_and_a_grouped_import() {
    let files = vec![
        (
            "a/mod.rs".to_string(),
            "use crate::{b::X, c};\n".to_string(),
        ),
        ("b.rs".to_string(), "// crate::a in a comment\n".to_string()),
        ("c.rs".to_string(), "fn f() { crate::a::g() }\n".to_string()),
        ("lib.rs".to_string(), "use crate::a;\n".to_string()),
        (
            "d.rs".to_string(),
            "#[cfg(test)]\nmod tests { use crate::a; }\n".to_string(),
        ),
    ];
    let edges = graph(&files);
    assert_eq!(
        edges["a"],
        BTreeSet::from(["b".to_string(), "c".to_string()])
    );
    assert!(!edges.contains_key("b"), "a comment is not an import");
    assert!(!edges.contains_key("d"), "a test module is not counted");
    let cycle = find_cycle(&edges).expect("a -> c -> a");
    assert_eq!(cycle.first(), cycle.last());
    assert!(cycle.contains(&"c".to_string()));
}
