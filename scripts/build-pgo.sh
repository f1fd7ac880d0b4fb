#!/usr/bin/env bash
# Builds tessera with profile-guided optimization (PGO): the release binary the benchmarks in
# docs/benchmarks.md measure ("Profile-guided build"), at target/pgo/release/tessera.
#   scripts/build-pgo.sh            # then: target/pgo/release/tessera serve --config tessera.toml
# Why: with the same instructions per request as nginx, tessera spent more CPU cycles on them (user
# time per request, docs/benchmarks.md "Profile-guided build"); a profile of the real
# workload lets LLVM lay out and inline the hot path for it. It is the plain `cargo build --release`
# otherwise: same source, same Cargo profile, same behaviour.
# Steps: 1. an instrumented build (RUSTFLAGS=-Cprofile-generate, target/pgo-instr); 2. the training
# workload below against it, on loopback; 3. llvm-profdata merge; 4. the final build
# (RUSTFLAGS=-Cprofile-use, target/pgo). 13-18 minutes on 2 cores.
# Training workload (127.0.0.1, free ports, processes stopped by PID), every shape the benchmarks
# measure: an nginx origin with a 1 KiB JSON; a. one `tessera serve` (embedded store, one session,
# TLS and HTTP/3 on a test CA's certificate): wrk GET with the bearer token at c=1, 8 and 64, wrk
# POST of 16 KiB bodies, h2load over h2c and over TLS, wrk over TLS, 1,000 HTTP/3 uploads of
# 10 KiB (the example h3_bench, a plain release build), requests without a token (401); b. one
# `tessera serve` in the hyper-auth-proxy shape of `SHAPE=compat bench/ab.sh` (Redis, 1,000
# sessions, base64 cookies from bench/compat.lua) at c=1, 8 and 64. Each tessera is stopped with
# SIGTERM so that it exits normally and writes its profile.
# Needs: cargo, nginx, wrk, h2load (nghttp2-client), curl, openssl, redis-server, python3, and
# llvm-profdata of the LLVM major version rustc reports (`rustc -vV`); on Debian as root, missing
# ones are installed with apt-get (llvm-<major> from the configured sources).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

log() { printf '[pgo %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"

LLVM_MAJOR="$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')"
[[ -n $LLVM_MAJOR ]] || die "rustc -vV reports no LLVM version"
profdata_ok() { "$1" --version 2>/dev/null | grep -q "LLVM version $LLVM_MAJOR\."; }
find_profdata() {
  local c
  for c in "llvm-profdata-$LLVM_MAJOR" llvm-profdata \
    "$(rustc --print sysroot)/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin/llvm-profdata"; do
    c="$(command -v "$c" || true)"
    [[ -n $c ]] && profdata_ok "$c" && { echo "$c"; return 0; }
  done
  return 1
}
need=()
command -v nginx >/dev/null || need+=(nginx)
command -v wrk >/dev/null || need+=(wrk)
command -v h2load >/dev/null || need+=(nghttp2-client)
command -v curl >/dev/null || need+=(curl)
command -v openssl >/dev/null || need+=(openssl)
command -v redis-server >/dev/null || need+=(redis-server)
PROFDATA="$(find_profdata || true)"
[[ -n $PROFDATA ]] || need+=("llvm-$LLVM_MAJOR")
if ((${#need[@]})); then
  [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null ||
    die "missing: ${need[*]} (install them; llvm-profdata must be from LLVM $LLVM_MAJOR, like rustc)"
  log "installing ${need[*]}"
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
    die "apt-get install ${need[*]} failed (llvm-$LLVM_MAJOR may need the apt.llvm.org source)"
  PROFDATA="$(find_profdata || true)"
  [[ -n $PROFDATA ]] || die "no llvm-profdata of LLVM $LLVM_MAJOR after installing llvm-$LLVM_MAJOR"
fi
log "rustc's LLVM is $LLVM_MAJOR; llvm-profdata: $PROFDATA"

work_dir tessera-pgo # WORK, PIDS and the cleanup: bench/lib.sh
mkdir -p "$WORK/keys" "$WORK/emb" && chmod 700 "$WORK/keys"
# A fixed path, so that a second run rebuilds only what changed.
PROFILES="$ROOT/target/pgo-instr/profiles"
rm -rf "$PROFILES" && mkdir -p "$PROFILES"

# ---------------------------------------------------------------- 1. instrumented build
log "instrumented build (target/pgo-instr)"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$PROFILES" CARGO_TARGET_DIR="$ROOT/target/pgo-instr" \
  cargo build --release --locked --quiet
BIN="$ROOT/target/pgo-instr/release/tessera"

log "the HTTP/3 client: example h3_bench (plain release build)"
cargo build --release --locked --quiet --example h3_bench
H3_CLIENT="$ROOT/target/release/examples/h3_bench"

# ---------------------------------------------------------------- 2. training workload
read -r P_ORIGIN P_TESSERA P_TLS P_COMPAT P_REDIS < <(free_ports 5)
write_1k "$WORK/1k.json"
nginx_start origin "$P_ORIGIN" "  server { listen 127.0.0.1:$P_ORIGIN; keepalive_requests 1000000; client_max_body_size 1m;
    location = /1k { default_type application/json; alias $WORK/1k.json; }
    location = /upload { return 200 \"stored\\n\"; } }"

tessera_keys "$BIN"
tessera_toml "$WORK/tessera.toml" "$P_TESSERA" "$P_ORIGIN" "$WORK/emb"
test_ca "$WORK" DNS:localhost,IP:127.0.0.1
printf '[tls]\nlisten = "127.0.0.1:%s"\ncertificate = "file:%s"\nprivate_key = "file:%s"\n[http3]\nmax_concurrent_streams = 1000\n' \
  "$P_TLS" "$WORK/cert.pem" "$WORK/key.pem" >>"$WORK/tessera.toml"
"$BIN" serve --config "$WORK/tessera.toml" >"$WORK/tessera.log" 2>&1 &
TESSERA_PID=$!
PIDS+=("$TESSERA_PID")
wait_port "$P_TESSERA" tessera "$TESSERA_PID"
TOKEN="$(printf '%s\n' pgo-password | "$BIN" session create --config "$WORK/tessera.toml" --user alice \
  --password-stdin | sed -n 's/.*"token" *: *"\([^"]*\)".*/\1/p' | head -1)"
[[ -n $TOKEN ]] || die "session create printed no token"
URL="http://127.0.0.1:$P_TESSERA"
got="$(curl -s -o /dev/null -w '%{http_code} %{size_download}' -H "Authorization: Bearer $TOKEN" "$URL/1k")"
[[ $got == "200 1024" ]] || die "tessera answered '$got' with the token, expected '200 1024'"

printf 'wrk.method = "POST"\nwrk.body = string.rep("x", 16384)\nwrk.headers["Content-Type"] = "application/octet-stream"\n' \
  >"$WORK/post.lua"
run() { # step command...: runs it, output in $WORK/step.out (the token is not logged)
  local step=$1 && shift
  log "training: $step"
  "$@" >"$WORK/$step.out" 2>&1 || die "training step $step failed (see $WORK/$step.out)"
}
ok() { ! grep -qE "Non-2xx|Socket errors" "$WORK/$1.out" || die "training step $1 had errors: $(cat "$WORK/$1.out")"; }
for c in 1 8 64; do
  run "get-c$c" wrk -t "$((c < 2 ? 1 : 2))" -c "$c" -d 4s -H "Authorization: Bearer $TOKEN" "$URL/1k"
  ok "get-c$c"
done
run post-16k wrk -t 2 -c 8 -d 2s -s "$WORK/post.lua" -H "Authorization: Bearer $TOKEN" "$URL/upload"
ok post-16k
run h2c h2load -n 40000 -c 8 -m 8 -H "authorization: Bearer $TOKEN" "$URL/1k"
grep -q "40000 succeeded" "$WORK/h2c.out" || die "h2load: not every request succeeded: $(cat "$WORK/h2c.out")"
TLS_URL="https://127.0.0.1:$P_TLS"
run h2-tls h2load -n 40000 -c 8 -m 1 -H "authorization: Bearer $TOKEN" "$TLS_URL/1k"
grep -q "40000 succeeded" "$WORK/h2-tls.out" || die "h2load over TLS: not every request succeeded"
run h1-tls wrk -t 1 -c 8 -d 2s -H "Authorization: Bearer $TOKEN" "$TLS_URL/1k"
ok h1-tls
run h3 "$H3_CLIENT" h3 "$P_TLS" "$WORK/ca.pem" 1000 10240 /upload "$TOKEN"
run no-token wrk -t 1 -c 8 -d 1s "$URL/1k"
grep -q "Non-2xx" "$WORK/no-token.out" || die "requests without a token were not refused: is the token check off?"

log "stopping tessera (SIGTERM) so that it writes its profile"
kill -TERM "$TESSERA_PID"
rc=0 && wait "$TESSERA_PID" || rc=$?
((rc == 0)) || die "tessera exited with $rc on SIGTERM (no profile written)"
compgen -G "$PROFILES/*.profraw" >/dev/null || die "no .profraw written in $PROFILES"

# b. the hyper-auth-proxy shape (bench/ab.sh SHAPE=compat)
compat_redis "$P_REDIS"
tessera_toml_on "$WORK/compat.toml" "$P_COMPAT" "http://127.0.0.1:$P_ORIGIN" "redis://127.0.0.1:$P_REDIS/"
python3 - "$WORK/compat.toml" <<'PY2'
import sys
p = sys.argv[1]
s = open(p).read()
s = s.replace("[token]\n", '[token]\nsources = ["cookie-b64:Authorization", "bearer"]\n')
s = s.replace("[session]\n", '[session]\nformat = "hyper-auth-proxy"\n')
s = s.replace("[credentials]\n", "[credentials]\nallow_plaintext_legacy = true\n")
open(p, "w").write(s)
PY2
"$BIN" serve --config "$WORK/compat.toml" >"$WORK/compat.log" 2>&1 &
TESSERA_PID=$!
PIDS+=("$TESSERA_PID")
wait_port "$P_COMPAT" "tessera (compat)" "$TESSERA_PID"
for c in 1 8 64; do
  run "compat-c$c" wrk -t 1 -c "$c" -d 3s -s "$ROOT/bench/compat.lua" "http://127.0.0.1:$P_COMPAT/1k"
  ok "compat-c$c"
done
log "stopping the compat tessera (SIGTERM)"
kill -TERM "$TESSERA_PID"
rc=0 && wait "$TESSERA_PID" || rc=$?
((rc == 0)) || die "the compat tessera exited with $rc on SIGTERM (no profile written)"

# ---------------------------------------------------------------- 3. merge, 4. final build
"$PROFDATA" merge -o "$WORK/tessera.profdata" "$PROFILES"
log "final build with the profile (target/pgo)"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$WORK/tessera.profdata" CARGO_TARGET_DIR="$ROOT/target/pgo" \
  cargo build --release --locked --quiet
"$ROOT/target/pgo/release/tessera" check-config --config "$WORK/tessera.toml" >"$WORK/check.out" 2>&1 ||
  die "the PGO build refused the training config: $(cat "$WORK/check.out")"
KEEP_WORK=0
log "built $ROOT/target/pgo/release/tessera"
