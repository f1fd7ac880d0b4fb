#!/usr/bin/env bash
# Field report 2 (issue 35, benchmark d): three requests one after another from a client RTT_MS
# away (two network namespaces joined by ../shared/tools/rtt-netns.sh's delay line), through
# tessera with full auth: a new TCP + TLS connection per request; one kept TLS connection; TLS
# resumed on each new connection, without and with TCP Fast Open; HTTP/3 on a new connection; and
# HTTP/3 resuming with 0-RTT. About 1 min. Needs root (namespaces), curl, openssl, nginx, cargo.
#   bench/rtt.sh                          # builds target/release/tessera and the example h3_bench
#   BIN=/tmp/tessera RTT_MS=90 REPS=5 bench/rtt.sh
# curl (HTTP/1.1) takes the TCP/TLS modes (`-w %{time_total}` summed; a new connection per request is three
# curl processes; resumption is one curl sending `Connection: close`, so it reconnects with the
# session it keeps); `h3_bench rtt` the HTTP/3 ones. tessera and the nginx origin run in the server
# namespace. Reported: medians in ms and in RTTs. Writes results/rtt-<date>.md.
set -euo pipefail
RTT_MS="${RTT_MS:-90}" REPS="${REPS:-5}" N=3
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NETNS="$ROOT/../shared/tools/rtt-netns.sh"
log() { printf '[rtt %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for c in curl openssl nginx cargo ip; do command -v "$c" >/dev/null || die "$c not found"; done
[[ -x $NETNS ]] || die "$NETNS not found"

work_dir rtt
NAME="tessera-rtt$$"
trap 'rc=$?; "$NETNS" down "$NAME" >/dev/null 2>&1 || true; (exit $rc); cleanup' EXIT
if [[ -z ${BIN:-} ]]; then
  log "building target/release/tessera"
  (cd "$ROOT" && cargo build --release --quiet)
  BIN="$ROOT/target/release/tessera"
fi
(cd "$ROOT" && cargo build --release --quiet --example h3_bench)
TOOL="$ROOT/target/release/examples/h3_bench"
"$NETNS" up "$RTT_MS" "$NAME" >/dev/null
S=(ip netns exec "$NAME-s") C=(ip netns exec "$NAME-c")
# TCP Fast Open: the kernel's client and server sides (3), tessera's `server.fastopen` on its
# listeners, as an operator sets them.
"${S[@]}" sysctl -q -w net.ipv4.tcp_fastopen=3
SERVER=10.77.0.2 PORT=8443 ORIGIN=18080 PLAIN=18081

test_ca "$WORK" DNS:localhost
write_1k "$WORK/1k.json"
mkdir -p "$WORK/origin-tmp"
cat >"$WORK/origin.conf" <<EOF
worker_processes 1; daemon off; pid $WORK/origin.pid; error_log $WORK/origin-error.log warn;
events { worker_connections 1024; }
http { access_log off; client_body_temp_path $WORK/origin-tmp; proxy_temp_path $WORK/origin-tmp;
  fastcgi_temp_path $WORK/origin-tmp; uwsgi_temp_path $WORK/origin-tmp; scgi_temp_path $WORK/origin-tmp;
  server { listen 127.0.0.1:$ORIGIN; location = /1k { default_type application/json; alias $WORK/1k.json; } } }
EOF
"${S[@]}" nginx -p "$WORK" -c "$WORK/origin.conf" >"$WORK/origin.out" 2>&1 &
PIDS+=($!)
mkdir -p "$WORK/keys"
tessera_keys "$BIN"
tessera_toml "$WORK/tessera.toml" "$PLAIN" "$ORIGIN" "$WORK/sessions"
sed -i 's/^\[server\]$/[server]\nfastopen = true/' "$WORK/tessera.toml"
printf '[tls]\nlisten = "%s:%s"\ncertificate = "file:%s"\nprivate_key = "file:%s"\n[http3]\n' \
  "$SERVER" "$PORT" "$WORK/cert.pem" "$WORK/key.pem" >>"$WORK/tessera.toml"
"${S[@]}" "$BIN" serve --config "$WORK/tessera.toml" >"$WORK/tessera.log" 2>&1 &
PIDS+=($!)
for ((i = 0; i < 100; i++)); do
  "${S[@]}" bash -c "exec 3<>/dev/tcp/$SERVER/$PORT" 2>/dev/null && break
  sleep 0.1
done
TOKEN="$(printf 'pw' | "$BIN" session create --config "$WORK/tessera.toml" --user alice --password-stdin |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')"
URL="https://localhost:$PORT/1k"
CURL=("${C[@]}" curl -s --http1.1 --cacert "$WORK/ca.pem" --resolve "localhost:$PORT:$SERVER"
  -H "Authorization: Bearer $TOKEN" -w '%{http_code} %{time_total}\n')
# total_ms: the sum of curl's time_total lines on stdin, in ms; dies on a non-200.
total_ms() { awk '$1 != 200 {bad = 1} {t += $2} END {if (bad || NR == 0) exit 1; printf "%.1f", t * 1000}'; }
# urls: N times `-o /dev/null URL` (curl binds each -o to one URL).
urls() { local i; for ((i = 0; i < N; i++)); do printf -- '-o /dev/null %s ' "$URL"; done; }

: >"$WORK/runs.tsv"
for ((rep = 1; rep <= REPS; rep++)); do
  # shellcheck disable=SC2046 # one URL per request
  {
    printf 'new-connection\t%s\n' "$(for ((i = 0; i < N; i++)); do "${CURL[@]}" -o /dev/null "$URL"; done | total_ms)"
    printf 'kept-connection\t%s\n' "$("${CURL[@]}" $(urls) | total_ms)"
    printf 'tls-resumed\t%s\n' "$("${CURL[@]}" -H 'Connection: close' $(urls) | total_ms)"
    printf 'tls-resumed-tfo\t%s\n' "$("${CURL[@]}" --tcp-fastopen -H 'Connection: close' $(urls) | total_ms)"
    h3="$("${C[@]}" "$TOOL" rtt "$SERVER:$PORT" "$WORK/ca.pem" "$N" /1k "$TOKEN")" || die "h3_bench rtt failed"
    python3 -c 'import json, sys
j = json.loads(sys.argv[1])
print("http3-fresh\t%s" % j["fresh_ms"])
print("http3-0rtt\t%s" % (j["zero_rtt_ms"] if j["zero_rtt_accepted"] else "nan"))' "$h3"
  } >>"$WORK/runs.tsv" || die "a run failed (logs in $WORK)"
  log "rep $rep done"
done

out="$ROOT/bench/results/rtt-$(date +%Y-%m-%d).md"
python3 - "$WORK/runs.tsv" "$(git -C "$ROOT" rev-parse --short HEAD)" "$REPS" "$RTT_MS" "$N" >"$out" <<'PY'
import math, statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
commit, reps, rtt, n = sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
modes = [("new-connection", "a new TCP + TLS connection per request"),
         ("kept-connection", "one kept TLS connection"),
         ("tls-resumed", "a new TCP connection per request, TLS resumed"),
         ("tls-resumed-tfo", "the same with TCP Fast Open"),
         ("http3-fresh", "HTTP/3, a new connection"),
         ("http3-0rtt", "HTTP/3, resumed with 0-RTT")]
med = {m: statistics.median(float(r[1]) for r in rows if r[0] == m) for m, _ in modes}
print(f"# {n} requests one after another from a client {rtt:.0f} ms away\n")
print(f"commit {commit}; {reps} repetitions, medians; client and server in two network namespaces "
      f"joined by a user-space delay line. `bench/rtt.sh`\n")
print(f"| mode | ms | RTTs | of a new connection per request |\n|---|---:|---:|---:|")
for m, name in modes:
    v = med[m]
    print(f"| {name} | {v:,.0f} | {v / rtt:.1f} | {v / med['new-connection'] * 100:.0f} % |")
print("\nEvery run (ms):\n\n| mode | ms |\n|---|---:|")
for r in rows:
    print(f"| {r[0]} | {r[1]} |")
PY
cat "$out"
log "report in ${out#"$ROOT"/}"
KEEP_WORK=0
