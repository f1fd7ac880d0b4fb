#!/usr/bin/env bash
# TLS at the edge (issue 35, benchmarks a and b): tessera with full auth terminating TLS vs nginx
# as a TLS-terminating plain proxy (no auth), the same certificate (ECDSA P-256) and the same
# origin, round-robin in one run. About 5 min.
#   bench/tls.sh                                   # builds target/release/tessera
#   BIN=/tmp/tessera CONC="1 8 64" REPS=3 DURATION=5s bench/tls.sh
# Processes (127.0.0.1, free ports, stopped on exit): the origin (nginx, one worker, 1 KiB JSON),
# nginx-tls (a second nginx, one worker: TLS 1.2/1.3, HTTP/2, session cache and tickets,
# keepalive 64 to the origin), and one `tessera serve` ([tls], embedded store, a session).
# a. keep-alive over TLS: HTTP/1.1 with `wrk -t1 -c C`, HTTP/2 with `h2load -t1 -c C -m1`, each
#    DURATION; req/s, and the proxy's CPU per request (user + system from /proc/PID/stat over
#    the run, divided by the requests).
# b. a new TLS connection each time, no request: `openssl s_time -new` (full handshakes) and
#    `-reuse` (resumed), DURATION each; connections/s, and the proxy's CPU per handshake.
# Machine defaults (no idle-poll change). Writes results/tls-<date>.md. Needs wrk, h2load
# (nghttp2-client), openssl, curl, cargo.
set -euo pipefail
CONC="${CONC:-1 8 64}" REPS="${REPS:-3}" DURATION="${DURATION:-5s}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[tls %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for c in wrk h2load openssl curl cargo nginx; do command -v "$c" >/dev/null || die "$c not found"; done
secs="${DURATION%s}"

work_dir tls
if [[ -z ${BIN:-} ]]; then
  log "building target/release/tessera"
  (cd "$ROOT" && cargo build --release --quiet)
  BIN="$ROOT/target/release/tessera"
fi
read -r ORIGIN NGINX PORT PLAIN <<<"$(free_ports 4)"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 7 -subj /CN=localhost \
  -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout "$WORK/key.pem" -out "$WORK/cert.pem" 2>/dev/null
write_1k "$WORK/1k.json"
nginx_start origin "$ORIGIN" "  server { listen 127.0.0.1:$ORIGIN; keepalive_requests 1000000;
    location = /1k { default_type application/json; alias $WORK/1k.json; } }"
nginx_start nginx-tls "$NGINX" "  upstream origin { server 127.0.0.1:$ORIGIN; keepalive 64; }
  server { listen 127.0.0.1:$NGINX ssl http2; keepalive_requests 1000000;
    ssl_certificate $WORK/cert.pem; ssl_certificate_key $WORK/key.pem;
    ssl_protocols TLSv1.2 TLSv1.3; ssl_session_cache shared:tls:10m; ssl_session_tickets on;
    location / { proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
NGINX_TLS_PID=$NGINX_PID
mkdir -p "$WORK/keys"
tessera_keys "$BIN"
tessera_toml "$WORK/tessera.toml" "$PLAIN" "$ORIGIN" "$WORK/sessions"
printf '[tls]\nlisten = "127.0.0.1:%s"\ncertificate = "file:%s"\nprivate_key = "file:%s"\n' \
  "$PORT" "$WORK/cert.pem" "$WORK/key.pem" >>"$WORK/tessera.toml"
"$BIN" serve --config "$WORK/tessera.toml" >"$WORK/tessera.log" 2>&1 &
TESSERA_PID=$!
PIDS+=("$TESSERA_PID")
wait_port "$PORT" tessera "$TESSERA_PID"
TOKEN="$(printf 'pw' | "$BIN" session create --config "$WORK/tessera.toml" --user alice --password-stdin |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')"

TARGETS=(nginx-tls tessera)
declare -A PORT_OF=([nginx-tls]=$NGINX [tessera]=$PORT) PID_OF=([nginx-tls]=$NGINX_TLS_PID [tessera]=$TESSERA_PID)
declare -A AUTH=([nginx-tls]="X-None: 1" [tessera]="Authorization: Bearer $TOKEN")
for t in "${TARGETS[@]}"; do
  for v in --http1.1 --http2; do
    code="$(curl -s -o /dev/null -w '%{http_code}' "$v" --cacert "$WORK/cert.pem" -H "${AUTH[$t]}" \
      "https://localhost:${PORT_OF[$t]}/1k")"
    [[ $code == 200 ]] || die "$t $v answered $code"
  done
done
cipher() { openssl s_client -connect "127.0.0.1:$1" </dev/null 2>/dev/null | awk '/^New,/ {print $2, $5}'; }
CIPHERS="nginx-tls: $(cipher "$NGINX"); tessera: $(cipher "$PORT")"
log "negotiated (OpenSSL client): $CIPHERS"

# cpu_ticks PID: the process's user + system clock ticks so far (all its threads and children).
cpu_ticks() {
  local t=0 pid
  for pid in $(pgrep -P "$1") "$1"; do
    t=$((t + $(awk '{print $14 + $15}' "/proc/$pid/stat")))
  done
  echo "$t"
}
TICK_US=$((1000000 / $(getconf CLK_TCK)))
# record KIND TARGET C COUNT TICKS_BEFORE: one row of runs.tsv (count/s and CPU µs per unit).
record() {
  local after
  after="$(cpu_ticks "${PID_OF[$2]}")"
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$(((after - $5) * TICK_US))" >>"$WORK/runs.tsv"
}

: >"$WORK/runs.tsv"
for ((rep = 1; rep <= REPS; rep++)); do
  for c in $CONC; do
    for t in "${TARGETS[@]}"; do
      url="https://127.0.0.1:${PORT_OF[$t]}/1k"
      before="$(cpu_ticks "${PID_OF[$t]}")"
      out="$(wrk -t1 -c "$c" -d "$DURATION" -H "${AUTH[$t]}" "$url")"
      grep -q 'Non-2xx' <<<"$out" && die "$t h1 c=$c: non-2xx answers: $out"
      n="$(awk '/requests in/ {print $1}' <<<"$out")"
      record h1 "$t" "$c" "$n" "$before"
      before="$(cpu_ticks "${PID_OF[$t]}")"
      out="$(h2load -t1 -c "$c" -m1 -D "$secs" -H "${AUTH[$t]}" "$url" 2>&1)"
      n="$(awk '/^status codes:/ {gsub(",", "", $3); print $3}' <<<"$out")"
      [[ -n $n && $n -gt 0 ]] || die "$t h2 c=$c: no 2xx answers: $out"
      record h2 "$t" "$c" "$n" "$before"
      log "rep $rep c=$c $t done"
    done
  done
  for t in "${TARGETS[@]}"; do
    for mode in new reuse; do
      before="$(cpu_ticks "${PID_OF[$t]}")"
      out="$(openssl s_time -connect "127.0.0.1:${PORT_OF[$t]}" "-$mode" -time "$secs" 2>&1)"
      n="$(awk '/connections in [0-9.]+s/ {print $1; exit}' <<<"$out")"
      [[ -n $n ]] || die "$t s_time -$mode: $out"
      record "handshake-$mode" "$t" 1 "$n" "$before"
      log "rep $rep s_time -$mode $t: $n connections"
    done
  done
done

out="$ROOT/bench/results/tls-$(date +%Y-%m-%d).md"
python3 - "$WORK/runs.tsv" "$(git -C "$ROOT" rev-parse --short HEAD)" "$secs" "$REPS" "$CIPHERS" \
  "$(idle_state)" >"$out" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
commit, secs, reps, ciphers, idle = sys.argv[2:7]
secs = float(secs)


def med(kind, target, c, what):
    runs = [r for r in rows if r[0] == kind and r[1] == target and r[2] == c]
    if what == "rate":
        return statistics.median(int(r[3]) / secs for r in runs)
    return statistics.median(int(r[4]) / max(int(r[3]), 1) for r in runs)


print(f"# TLS at the edge: tessera (full auth) vs nginx as a TLS-terminating plain proxy\n")
print(f"commit {commit}; {reps} repetitions round-robin, {secs:.0f} s each, medians; machine "
      f"defaults ({idle}); negotiated with an OpenSSL client: {ciphers}. `bench/tls.sh`\n")
print("## a. Keep-alive over TLS (1 KiB JSON)\n")
print("| protocol | clients | nginx-tls req/s | tessera req/s | tessera / nginx | "
      "CPU µs/req nginx | CPU µs/req tessera | CPU ratio |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for kind, name in (("h1", "HTTP/1.1 (wrk)"), ("h2", "HTTP/2 (h2load -m1)")):
    for c in sorted({r[2] for r in rows if r[0] == kind}, key=int):
        n, t = med(kind, "nginx-tls", c, "rate"), med(kind, "tessera", c, "rate")
        cn, ct = med(kind, "nginx-tls", c, "cpu"), med(kind, "tessera", c, "cpu")
        print(f"| {name} | {c} | {n:,.0f} | {t:,.0f} | {t / n:.2f}x | {cn:.1f} | {ct:.1f} | {ct / cn:.2f}x |")
print("\n## b. A new TLS connection each time (openssl s_time, one at a time, no request)\n")
print("| handshake | nginx-tls conn/s | tessera conn/s | tessera / nginx | CPU µs/conn nginx | "
      "CPU µs/conn tessera | CPU ratio |")
print("|---|---:|---:|---:|---:|---:|---:|")
for mode, name in (("new", "full"), ("reuse", "resumed")):
    kind = f"handshake-{mode}"
    n, t = med(kind, "nginx-tls", "1", "rate"), med(kind, "tessera", "1", "rate")
    cn, ct = med(kind, "nginx-tls", "1", "cpu"), med(kind, "tessera", "1", "cpu")
    print(f"| {name} | {n:,.0f} | {t:,.0f} | {t / n:.2f}x | {cn:.0f} | {ct:.0f} | {ct / cn:.2f}x |")
print("\nEvery run (count, CPU µs of the proxy in the run):\n\n| kind | target | clients | count | CPU µs |\n"
      "|---|---|---:|---:|---:|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} |")
PY
cat "$out"
log "report in ${out#"$ROOT"/}"
KEEP_WORK=0
