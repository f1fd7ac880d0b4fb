#!/usr/bin/env bash
# Runs every fuzz target under fuzz/fuzz_targets for a bounded time (docs/testing.md): the
# README's test command runs it with FUZZ_SECONDS=20 per target; a longer hunt is
# `FUZZ_SECONDS=600 scripts/fuzz.sh path`. Needs the nightly toolchain (libFuzzer's
# instrumentation) and cargo-fuzz, installed here from crates.io when missing.
# An input that fails is left in fuzz/artifacts/<target>/ and ends the run with an error: copy
# it to fuzz/regressions/<target>/ so tests/fuzz.rs replays it in every `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${FUZZ_SECONDS:-20}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --version 0.13.2 --locked
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
targets=("$@")
((${#targets[@]})) || mapfile -t targets < <(cargo +nightly fuzz list)
# 16 codegen units (cargo-fuzz's own advice for faster builds) spread the instrumented build of
# tessera over both cores; build and run must pass the same flags or the run builds again.
flags=(--codegen-units 16)
cargo +nightly fuzz build "${flags[@]}" 2>&1 | tail -n 3
for t in "${targets[@]}"; do
  # A scratch copy of the corpus: what a run adds is not committed (minimize it with
  # `cargo fuzz cmin` first when it is worth keeping).
  work=$(mktemp -d)
  cp -r "corpus/$t/." "$work/"
  echo "fuzz: $t for ${seconds}s"
  log=$(mktemp)
  status=0
  cargo +nightly fuzz run "${flags[@]}" "$t" "$work" -- -max_total_time="$seconds" -print_final_stats=1 \
    >"$log" 2>&1 || status=$?
  grep -E '^(stat::number_of_executed_units|SUMMARY|artifact_prefix|Test unit written)' "$log" || true
  rm -rf "$work"
  if ((status != 0)) || compgen -G "artifacts/$t/*" >/dev/null; then
    tail -n 40 "$log" >&2
    echo "fuzz: $t failed (exit $status); failing inputs are in fuzz/artifacts/$t" >&2
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
done
