//! The fuzz targets' inputs replayed on every test run: each file of `fuzz/corpus/<target>/`
//! (the minimized corpus `cargo fuzz` grew, committed) and `fuzz/regressions/<target>/` (inputs
//! that once failed) goes through the same check the target runs (`fuzz/src/lib.rs`). So a
//! change that breaks an input the fuzzer once covered fails here, on stable, without a fuzzer.

#[path = "../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod harness;

use std::path::Path;

/// Runs `check` over every input of `target`; fails when there are fewer than `at_least`
/// (about 90% of the committed corpus: a missing or emptied corpus must not pass as a replay)
/// or when the target has regressions committed and none is found.
fn replay(target: &str, at_least: usize, check: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut inputs = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        for entry in entries {
            let path = entry.expect("a readable corpus directory").path();
            if path.is_file() {
                inputs.push(path);
            }
        }
    }
    inputs.sort();
    let regressions = root.join("regressions").join(target);
    assert!(
        !matches!(target, "fast_path" | "upstream" | "token")
            || inputs.iter().any(|p| p.starts_with(&regressions)),
        "{target}: the inputs under fuzz/regressions/{target} are gone"
    );
    assert!(
        inputs.len() >= at_least,
        "{target}: {} inputs under fuzz/corpus and fuzz/regressions, expected at least {at_least}",
        inputs.len()
    );
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
    replay("fast_path", 1800, harness::fast_path);
}

#[test]
fn upstream_corpus_agrees_with_hyper() {
    replay("upstream", 1600, harness::upstream);
}

#[test]
fn frame_edges_corpus_agrees_with_tungstenite() {
    replay("frame_edges", 130, harness::frame_edges);
}

#[test]
fn token_corpus_is_accepted_only_as_the_rfcs_and_config_allow() {
    replay("token", 1150, harness::token);
}
