#!/usr/bin/env bash
# Three tessera instances on a Redis Cluster (issue 37, benchmark b). One run, loopback:
#   - req/s of instance A at CONC clients (wrk -t2, one token), and the Redis commands the run
#     cost per request on every node (INFO commandstats; the tracking heartbeat's PING and
#     CLUSTER SLOTS counted apart);
#   - revocation across instances: bench/revocation.py, logout on A, B polled until 401, TRIALS
#     trials;
#   - a primary killed (kill -9 of the one owning a live session L and a session R revoked just
#     before): B polled back to back with L and R on two keep-alive connections for KILL_WATCH
#     seconds; the longest run of 503s for L and any 200 for R (stale service) are reported.
# Usage: bench/cluster.sh    Env: CONC (8), DURATION (5s), TRIALS (200), KILL_WATCH (10).
# Processes (127.0.0.1, free ports, stopped by PID on exit): six redis-server (three primaries,
# three replicas, node timeout 2 s, a password), the nginx origin, three tessera (release).
# Output: Markdown on stdout and bench/results/cluster-<date>-<time>.md. Needs redis-server,
# redis-cli, nginx, wrk, curl, python3, cargo.
set -euo pipefail

CONC="${CONC:-8}" DURATION="${DURATION:-5s}" TRIALS="${TRIALS:-200}" KILL_WATCH="${KILL_WATCH:-10}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[cluster %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for t in redis-server redis-cli nginx wrk curl python3 cargo; do
  command -v "$t" >/dev/null || die "$t is not installed"
done
log "building tessera (release)"
(cd "$ROOT" && cargo build --release -q) || die "cargo build failed"
BIN="$ROOT/target/release/tessera" PASS=bench-cluster-pass

work_dir cluster
read -r -a NODES < <(free_ports 6)
# Each node's cluster bus gets a free port of its own (the default, port + 10000, may be taken).
read -r -a BUSES < <(free_ports 6)
read -r P_ORIGIN P_A P_B P_C < <(free_ports 4)
declare -A PID_OF
for i in "${!NODES[@]}"; do
  p=${NODES[$i]}
  mkdir -p "$WORK/redis-$p"
  redis-server --port "$p" --cluster-port "${BUSES[$i]}" --bind 127.0.0.1 --cluster-enabled yes --cluster-node-timeout 2000 \
    --cluster-config-file "$WORK/redis-$p/nodes.conf" --dir "$WORK/redis-$p" --requirepass "$PASS" \
    --masterauth "$PASS" --repl-diskless-sync-delay 0 --save '' --appendonly no >"$WORK/redis-$p.log" 2>&1 &
  PID_OF[$p]=$! PIDS+=("$!")
  wait_port "$p" "redis-server $p" "${PID_OF[$p]}"
done
rcli() { local p=$1; shift; redis-cli -p "$p" --no-auth-warning -a "$PASS" "$@"; }
redis-cli --no-auth-warning -a "$PASS" --cluster create $(printf '127.0.0.1:%s ' "${NODES[@]}") \
  --cluster-replicas 1 --cluster-yes >"$WORK/create.log" 2>&1 || die "cluster create: $(tail -3 "$WORK/create.log")"
for _ in $(seq 600); do
  ok=1
  for p in "${NODES[@]}"; do rcli "$p" CLUSTER INFO | grep -q 'cluster_state:ok' || ok=0; done
  for p in "${NODES[@]}"; do
    if rcli "$p" ROLE | head -1 | grep -q master; then
      rcli "$p" INFO replication | grep -q 'connected_slaves:1' || ok=0
    fi
  done
  ((ok)) && break
  sleep 0.05
done
((ok)) || die "cluster not ready"
STORE="redis+cluster://:$PASS@127.0.0.1:${NODES[0]},127.0.0.1:${NODES[1]}"

write_1k "$WORK/1k.json"
nginx_start origin "$P_ORIGIN" "server { listen 127.0.0.1:$P_ORIGIN; keepalive_requests 1000000;
  location = /1k { default_type application/json; alias $WORK/1k.json; } }"
mkdir -p "$WORK/keys"
tessera_keys "$BIN"
for t in A B C; do
  port=P_$t
  tessera_toml_on "$WORK/$t.toml" "${!port}" "http://127.0.0.1:$P_ORIGIN" "$STORE"
  printf '[login]\ncookie_secure = false\nverify_path = "/1k"\n' >>"$WORK/$t.toml"
  "$BIN" serve --config "$WORK/$t.toml" >"$WORK/$t.log" 2>&1 &
  PID_OF[$t]=$! PIDS+=("$!")
  wait_port "${!port}" "tessera $t" "${PID_OF[$t]}"
done
log "creating $((TRIALS + 3)) sessions"
for ((i = 0; i < TRIALS + 3; i++)); do
  printf 'pw\n' | "$BIN" session create --config "$WORK/A.toml" --user "u$i" --password-stdin
done >"$WORK/sessions.jsonl" || die "session create failed"
token_n() { sed -n "$1p" "$WORK/sessions.jsonl" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])'; }
key_n() { sed -n "$1p" "$WORK/sessions.jsonl" | python3 -c 'import json,sys; print("tessera:session:" + json.load(sys.stdin)["sid"])'; }

# commandstats calls summed over the live nodes, per command, as JSON
calls() {
  local p
  for p in "${NODES[@]}"; do
    kill -0 "${PID_OF[$p]}" 2>/dev/null && rcli "$p" INFO commandstats
  done | python3 -c '
import json, re, sys
calls = {}
for line in sys.stdin:
    m = re.match(r"cmdstat_([^:]+):calls=(\d+)", line)
    if m:
        calls[m.group(1)] = calls.get(m.group(1), 0) + int(m.group(2))
print(json.dumps(calls))'
}
TOKEN="$(token_n 1)"
for t in A B C; do
  port=P_$t
  got="$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $TOKEN" "http://127.0.0.1:${!port}/1k")"
  [[ $got == 200 ]] || die "$t answered $got"
done
log "load: wrk -c$CONC $DURATION on A"
wrk -t2 -c "$CONC" -d 1s -H "Authorization: Bearer $TOKEN" "http://127.0.0.1:$P_A/1k" >/dev/null
calls >"$WORK/calls0.json"
wrk -t2 -c "$CONC" -d "$DURATION" --latency -H "Authorization: Bearer $TOKEN" "http://127.0.0.1:$P_A/1k" >"$WORK/wrk.txt"
calls >"$WORK/calls1.json"
RPS="$(awk '/^Requests\/sec/ {print $2}' "$WORK/wrk.txt")"
REQS="$(awk '/requests in/ {print $1}' "$WORK/wrk.txt")"
P50="$(awk '$1 == "50%" {print $2}' "$WORK/wrk.txt")"

log "revocation: $TRIALS trials, logout on A, B polled"
sed -n "4,$((TRIALS + 3))p" "$WORK/sessions.jsonl" >"$WORK/trials.jsonl"
python3 "$ROOT/bench/revocation.py" --a "http://127.0.0.1:$P_A" --b "http://127.0.0.1:$P_B" \
  --sessions "$WORK/trials.jsonl" --trials "$TRIALS" --logout-path /auth/logout --path /1k \
  --out "$WORK/revocation.json" >/dev/null || die "revocation.py failed"

log "kill -9 of the primary owning session L; R revoked just before"
L="$(token_n 2)" R="$(token_n 3)"
slot="$(rcli "${NODES[0]}" CLUSTER KEYSLOT "$(key_n 2)")"
OWNER="$(rcli "${NODES[0]}" CLUSTER NODES | python3 -c '
import sys
slot = int(sys.argv[1])
for line in sys.stdin:
    f = line.split()
    if "master" not in f[2]:
        continue
    for r in f[8:]:
        a, _, b = r.partition("-")
        if a.isdigit() and int(a) <= slot <= int(b or a):
            print(f[1].split("@")[0].rsplit(":", 1)[1])' "$slot")"
[[ -n $OWNER ]] || die "no owner for slot $slot"
for t in A B; do
  port=P_$t
  for k in "$L" "$R"; do curl -s -o /dev/null -H "Authorization: Bearer $k" "http://127.0.0.1:${!port}/1k"; done
done
got="$(curl -s -o /dev/null -w '%{http_code}' -X POST -H "Authorization: Bearer $R" "http://127.0.0.1:$P_A/auth/logout")"
[[ $got == 204 ]] || die "logout of R answered $got"
python3 - "$P_B" "$L" "$R" "$KILL_WATCH" "${PID_OF[$OWNER]}" >"$WORK/kill.json" <<'PY'
import http.client, json, os, signal, sys, time
port, live, revoked, watch, pid = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
conns = {t: http.client.HTTPConnection("127.0.0.1", port, timeout=10) for t in (live, revoked)}
def status(token):
    c = conns[token]
    try:
        c.request("GET", "/1k", headers={"Authorization": f"Bearer {token}"})
        r = c.getresponse(); r.read(); return r.status
    except (OSError, http.client.HTTPException):
        c.close(); return 0
os.kill(pid, signal.SIGKILL)
t0 = time.perf_counter()
longest = run_start = None
stale, codes, first_503 = 0, {}, None
while time.perf_counter() - t0 < watch:
    now = time.perf_counter()
    s = status(live)
    codes[s] = codes.get(s, 0) + 1
    if s == 503:
        first_503 = first_503 if first_503 is not None else now - t0
        run_start = run_start if run_start is not None else now
    elif run_start is not None:
        longest = max(longest or 0, now - run_start); run_start = None
    if status(revoked) == 200:
        stale += 1
if run_start is not None:
    longest = max(longest or 0, time.perf_counter() - run_start)
print(json.dumps({"live_codes": codes, "first_503_s": first_503, "longest_503_s": longest,
                  "revoked_served_200": stale}))
PY

mkdir -p "$ROOT/bench/results"
OUT="$ROOT/bench/results/cluster-$(date +%Y-%m-%d-%H%M%S).md"
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
python3 - "$WORK/revocation.json" "$WORK/kill.json" "$OUT" "$WORK/calls0.json" "$WORK/calls1.json" <<PY
import json, sys
rev, kill = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
c0, c1 = json.load(open(sys.argv[4])), json.load(open(sys.argv[5]))
delta = {k: v - c0.get(k, 0) for k, v in c1.items() if v - c0.get(k, 0)}
# The tracking heartbeat (PING, CLUSTER SLOTS), this script's probes (redis-cli's AUTH, INFO) and
# the replicas' own acknowledgements (REPLCONF ACK).
apart = ("ping", "cluster|slots", "auth", "info", "replconf")
other = {k: v for k, v in delta.items() if k not in apart}
lines = [
    "# Three tessera on a Redis Cluster (bench/cluster.sh), commit $COMMIT", "",
    "Three primaries, three replicas, node timeout 2 s; loopback; the same 2 cores for everything.", "",
    "| measure | value |", "|---|---|",
    f"| req/s on A, wrk -t2 -c$CONC $DURATION, one token | $RPS (p50 $P50) |",
    f"| Redis commands per warm request on every node, heartbeat and probes apart | {sum(other.values()) / $REQS:.4f} ({other or 'none'} over $REQS requests) |",
    f"| heartbeat, probes and replication over the run | { {k: v for k, v in delta.items() if k in apart} } |",
    f"| revocation, logout on A until B answers 401: p50 / p99 / max ms | {rev['p50_ms']} / {rev['p99_ms']} / {rev['max_ms']} ({rev['completed']} of {rev['trials']}, timeouts {rev['timeouts']}, poll {rev['poll_ms_mean']} ms) |",
    f"| kill -9 of the owning primary: first 503, longest run of 503s (s) | {kill['first_503_s']:.3f} / {kill['longest_503_s']:.2f} |",
    f"| answers for the live session over $KILL_WATCH s | {kill['live_codes']} |",
    f"| 200s for the session revoked before the kill (stale service) | {kill['revoked_served_200']} |",
]
text = "\n".join(lines) + "\n"
print(text)
open(sys.argv[3], "w").write(text)
PY
log "written $OUT"
KEEP_WORK=0
