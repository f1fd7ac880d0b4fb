//! The fuzz targets' inputs replayed on every test run: each file of `fuzz/corpus/<target>/`
//! (the minimized corpus `cargo fuzz` grew, committed) and `fuzz/regressions/<target>/` (inputs
//! that once failed) goes through the same check the target runs (`fuzz/src/lib.rs`). So a
//! change that breaks an input the fuzzer once covered fails here, on stable, without a fuzzer.

#[path = "../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod harness;

use std::path::Path;

/// Runs `check` over every input of `target`; fails when the corpus has fewer than `corpus`
/// inputs (about 90% of the committed one: a missing or emptied corpus must not pass as a
/// replay) or `fuzz/regressions/<target>/` fewer than `regressions`.
fn replay(target: &str, corpus: usize, regressions: usize, check: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut inputs = Vec::new();
    for (dir, at_least) in [("corpus", corpus), ("regressions", regressions)] {
        let mut found: Vec<_> = std::fs::read_dir(root.join(dir).join(target))
            .map(|entries| {
                entries
                    .map(|e| e.expect("a readable corpus directory").path())
                    .filter(|p| p.is_file())
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            found.len() >= at_least,
            "{target}: {} inputs under fuzz/{dir}/{target}, expected at least {at_least}",
            found.len()
        );
        found.sort();
        inputs.append(&mut found);
    }
    for path in &inputs {
        let data = std::fs::read(path).expect("a readable input");
        if let Err(panic) = std::panic::catch_unwind(|| check(&data)) {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("{target}: {} fails: {why}", path.display());
        }
    }
    eprintln!("{target}: {} inputs replayed", inputs.len());
}

#[test]
fn fast_path_corpus_agrees_with_hyper() {
    replay("fast_path", 1800, 1, harness::fast_path);
}

#[test]
fn upstream_corpus_agrees_with_hyper() {
    replay("upstream", 1600, 1, harness::upstream);
}

#[test]
fn frame_edges_corpus_agrees_with_tungstenite() {
    replay("frame_edges", 130, 0, harness::frame_edges);
}

#[test]
fn token_corpus_is_accepted_only_as_the_rfcs_and_config_allow() {
    replay("token", 1150, 1, harness::token);
}

#[test]
fn path_corpus_never_resolves_outside_the_base_path() {
    replay("path", 410, 1, harness::path);
}
