#!/usr/bin/env bash
# Field report 4 (issue 35, benchmark c): 1,000 uploads of 10 KiB over one QUIC connection, one
# after another and all in flight, through tessera's HTTP/3 (full auth, to an nginx origin) and to
# a bare quinn server (QUIC alone, no HTTP, no proxy), round-robin in one run. About 1 min.
#   bench/http3.sh                         # builds target/release/tessera and the example h3_bench
#   BIN=/tmp/tessera REPS=5 STREAMS=1000 BYTES=10240 bench/http3.sh
#   HTTP3_TOML="threads = 2" bench/http3.sh  # more lines for tessera's [http3]
# Processes (127.0.0.1, free ports, stopped on exit): the origin (nginx, one worker, answering
# POST /up), one `tessera serve` ([tls] + [http3], max_concurrent_streams 1000, embedded store),
# `h3_bench raw-server` (examples/h3_bench.rs: quinn reading every stream to its end). The client is
# `h3_bench` too (quinn + h3, one thread). Reported: medians of the time for all uploads, each
# mode, and tessera over raw; and the CPU time (user + system, /proc/PID/stat) each server
# process spent per upload over a repetition's two modes, which does not depend on how the
# client, the servers and nginx share the cores. Writes results/http3-<date>.md. Needs openssl, nginx, cargo.
set -euo pipefail
REPS="${REPS:-5}" STREAMS="${STREAMS:-1000}" BYTES="${BYTES:-10240}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[http3 %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for c in openssl nginx cargo curl; do command -v "$c" >/dev/null || die "$c not found"; done

work_dir http3
if [[ -z ${BIN:-} ]]; then
  log "building target/release/tessera"
  (cd "$ROOT" && cargo build --release --quiet)
  BIN="$ROOT/target/release/tessera"
fi
log "building the example h3_bench"
(cd "$ROOT" && cargo build --release --quiet --example h3_bench)
TOOL="$ROOT/target/release/examples/h3_bench"
read -r ORIGIN PORT PLAIN RAW <<<"$(free_ports 4)"
test_ca "$WORK" DNS:localhost,IP:127.0.0.1
nginx_start origin "$ORIGIN" "  server { listen 127.0.0.1:$ORIGIN; keepalive_requests 1000000;
    location = /up { client_max_body_size 1m; return 200 ok; } }"
mkdir -p "$WORK/keys"
tessera_keys "$BIN"
tessera_toml "$WORK/tessera.toml" "$PLAIN" "$ORIGIN" "$WORK/sessions"
printf '[tls]\nlisten = "127.0.0.1:%s"\ncertificate = "file:%s"\nprivate_key = "file:%s"\n[http3]\nmax_concurrent_streams = 1000\n%s\n' \
  "$PORT" "$WORK/cert.pem" "$WORK/key.pem" "${HTTP3_TOML:-}" >>"$WORK/tessera.toml"
"$BIN" serve --config "$WORK/tessera.toml" >"$WORK/tessera.log" 2>&1 &
PIDS+=($!)
PID_TESSERA=$!
wait_port "$PORT" tessera "$!"
"$TOOL" raw-server "$RAW" "$WORK/cert.pem" "$WORK/key.pem" >"$WORK/raw.log" 2>&1 &
PIDS+=($!)
PID_RAW=$!
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; } # user + system, clock ticks
CLK_TCK="$(getconf CLK_TCK)"
sleep 0.3
TOKEN="$(printf 'pw' | "$BIN" session create --config "$WORK/tessera.toml" --user alice --password-stdin |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')"

: >"$WORK/runs.tsv"
for ((rep = 1; rep <= REPS; rep++)); do
  t0="$(ticks "$PID_RAW")"
  raw="$("$TOOL" raw "$RAW" "$WORK/ca.pem" "$STREAMS" "$BYTES")" || die "raw run failed"
  raw="${raw%\}}, \"cpu_us_per_upload\": $(( ($(ticks "$PID_RAW") - t0) * 1000000 / CLK_TCK / (2 * STREAMS) ))}"
  t0="$(ticks "$PID_TESSERA")"
  h3="$("$TOOL" h3 "$PORT" "$WORK/ca.pem" "$STREAMS" "$BYTES" /up "$TOKEN")" || die "h3 run failed: $(tail -5 "$WORK/tessera.log")"
  h3="${h3%\}}, \"cpu_us_per_upload\": $(( ($(ticks "$PID_TESSERA") - t0) * 1000000 / CLK_TCK / (2 * STREAMS) ))}"
  printf 'raw\t%s\ntessera\t%s\n' "$raw" "$h3" >>"$WORK/runs.tsv"
  log "rep $rep: raw $raw, tessera $h3"
done

out="$ROOT/bench/results/http3-$(date +%Y-%m-%d).md"
python3 - "$WORK/runs.tsv" "$(git -C "$ROOT" rev-parse --short HEAD)" "$REPS" "$STREAMS" "$BYTES" >"$out" <<'PY'
import json, statistics, sys
rows = [l.split("\t", 1) for l in open(sys.argv[1]).read().splitlines()]
commit, reps, streams, size = sys.argv[2:6]
med = {(t, k): statistics.median(json.loads(j)[k] for n, j in rows if n == t)
       for t in ("raw", "tessera") for k in ("sequential_ms", "in_flight_ms", "cpu_us_per_upload")}
print(f"# HTTP/3: {streams} uploads of {int(size) // 1024} KiB over one QUIC connection\n")
print(f"commit {commit}; {reps} repetitions round-robin, medians. `bench/http3.sh`\n")
print("| | one after another | all in flight | server CPU per upload |\n|---|---:|---:|---:|")
for t, name in (("raw", "quinn alone (no HTTP, no proxy)"), ("tessera", "through tessera (HTTP/3, full auth, to nginx)")):
    print(f"| {name} | {med[(t, 'sequential_ms')]:,.0f} ms | {med[(t, 'in_flight_ms')]:,.0f} ms | "
          f"{med[(t, 'cpu_us_per_upload')]:,.0f} µs |")
print(f"| tessera / raw | {med[('tessera', 'sequential_ms')] / med[('raw', 'sequential_ms')]:.2f}x | "
      f"{med[('tessera', 'in_flight_ms')] / med[('raw', 'in_flight_ms')]:.2f}x | "
      f"{med[('tessera', 'cpu_us_per_upload')] / med[('raw', 'cpu_us_per_upload')]:.2f}x |")
print("\nEvery run:\n\n| target | result |\n|---|---|")
for n, j in rows:
    print(f"| {n} | {j} |")
PY
cat "$out"
log "report in ${out#"$ROOT"/}"
KEEP_WORK=0
