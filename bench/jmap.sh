#!/usr/bin/env bash
# JMAP through tessera against Cyrus directly (issue 36): `Mailbox/get` POSTs to Cyrus's JMAP API,
# with `Authorization: Bearer` through tessera, and with `Authorization: Basic` straight to Cyrus
# and through nginx as a plain proxy (the floor for one proxy hop), round-robin in one run. About
# 3 min.
#   bench/jmap.sh                          # builds target/release/tessera
#   BIN=/tmp/tessera CONC="1 8" REPS=5 DURATION=5s bench/jmap.sh
# Processes (127.0.0.1, free ports, stopped on exit): a private Cyrus 3.6 (scripts/cyrus.sh,
# maxchild 32), one `tessera serve` (embedded store, [login] checked at /jmap/,
# upstream.max_connections 8) and nginx-proxy (one worker, keepalive 8). Per repetition and c: `wrk -t1 -c c -d DURATION` on
# each target. Reported: medians of req/s and p50 per target and c, the proxies' req/s over
# direct, the upstream connections tessera opened, and the Cyrus httpd children alive at the
# end. Writes results/jmap-<date>.md. Needs wrk, curl, cargo; runs as root (Cyrus).
set -euo pipefail
CONC="${CONC:-1 8}" REPS="${REPS:-5}" DURATION="${DURATION:-5s}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[jmap %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for c in wrk curl cargo; do command -v "$c" >/dev/null || die "$c not found"; done

work_dir jmap
cyrus_stop() { "$ROOT/scripts/cyrus.sh" stop "$WORK/cyrus" >/dev/null 2>&1 || true; }
trap 'rc=$?; cyrus_stop; (exit $rc); cleanup' EXIT
if [[ -z ${BIN:-} ]]; then
  log "building target/release/tessera"
  (cd "$ROOT" && cargo build --release --quiet)
  BIN="$ROOT/target/release/tessera"
fi
read -r PORT METRICS NGINX <<<"$(free_ports 3)"
# maxchild 32: the direct clients (8), nginx's idle connections (8) and tessera's (8) together, so
# no target waits on a connection Cyrus accepted and does not serve.
HTTP_PORT="$(CYRUS_MAXCHILD=32 "$ROOT/scripts/cyrus.sh" start "$WORK/cyrus" | sed -n 's/^HTTP_PORT=//p')"
[[ -n $HTTP_PORT ]] || die "Cyrus did not start"

nginx_start nginx-proxy "$NGINX" "  upstream cyrus { server 127.0.0.1:$HTTP_PORT; keepalive 8; }
  server { listen 127.0.0.1:$NGINX; location / { proxy_pass http://cyrus;
    proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
mkdir -p "$WORK/keys"
tessera_keys "$BIN"
tessera_toml_on "$WORK/tessera.toml" "$PORT" "http://127.0.0.1:$HTTP_PORT/" "embedded:$WORK/sessions" \
  "max_connections = 8"
printf '[login]\nverify_path = "/jmap/"\ncookie_secure = false\n[metrics]\nlisten = "127.0.0.1:%s"\n' \
  "$METRICS" >>"$WORK/tessera.toml"
"$BIN" serve --config "$WORK/tessera.toml" >"$WORK/tessera.log" 2>&1 &
PIDS+=($!)
wait_port "$PORT" tessera "$!"
TOKEN="$(curl -s -H 'Content-Type: application/json' -d '{"username":"alice","password":"alice-secret-1"}' \
  "http://127.0.0.1:$PORT/auth/login" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')"
BASIC="$(printf 'alice:alice-secret-1' | base64)"

cat >"$WORK/post.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"using":["urn:ietf:params:jmap:core","urn:ietf:params:jmap:mail"],"methodCalls":[["Mailbox/get",{"accountId":"alice"},"m"]]}'
LUA
TARGETS=(direct nginx-proxy tessera)
declare -A URL=([direct]="http://127.0.0.1:$HTTP_PORT/jmap/" [nginx-proxy]="http://127.0.0.1:$NGINX/jmap/"
  [tessera]="http://127.0.0.1:$PORT/jmap/")
declare -A AUTH=([direct]="Basic $BASIC" [nginx-proxy]="Basic $BASIC" [tessera]="Bearer $TOKEN")
for t in "${TARGETS[@]}"; do
  code="$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: ${AUTH[$t]}" -H 'Content-Type: application/json' \
    -d @<(sed -n "s/^wrk.body = '\(.*\)'$/\1/p" "$WORK/post.lua") "${URL[$t]}")"
  [[ $code == 200 ]] || die "$t answered $code to Mailbox/get"
done

: >"$WORK/runs.tsv"
for ((rep = 1; rep <= REPS; rep++)); do
  for c in $CONC; do
    for t in "${TARGETS[@]}"; do
      out="$(wrk -t1 -c "$c" -d "$DURATION" --latency -s "$WORK/post.lua" -H "Authorization: ${AUTH[$t]}" "${URL[$t]}")"
      grep -q 'Non-2xx' <<<"$out" && die "$t c=$c: non-2xx answers: $out"
      rps="$(awk '/^Requests\/sec/ {print $2}' <<<"$out")"
      p50="$(awk '$1 == "50%" {print $2}' <<<"$out")"
      printf '%s\t%s\t%s\t%s\n' "$t" "$c" "$rps" "$p50" >>"$WORK/runs.tsv"
      log "rep $rep c=$c $t: $rps req/s, p50 $p50"
    done
  done
done
opened="$(curl -s "http://127.0.0.1:$METRICS/metrics" | awk '/^tessera_upstream_connections_opened_total / {print $2}')"
children="$(pgrep -f "$WORK/cyrus/imapd.conf" | xargs -r ps -o comm= -p | grep -c '^httpd' || true)"

out="$ROOT/bench/results/jmap-$(date +%Y-%m-%d).md"
python3 - "$WORK/runs.tsv" "$opened" "$children" "$(git -C "$ROOT" rev-parse --short HEAD)" "$DURATION" "$REPS" >"$out" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]


def us(text):
    """wrk's latency (`850.00us`, `1.23ms`, `2.00s`) in µs."""
    for unit, factor in (("us", 1), ("ms", 1e3), ("s", 1e6)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    raise ValueError(text)


opened, children, commit, duration, reps = sys.argv[2:7]
print(f"# JMAP Mailbox/get through tessera vs Cyrus directly\n\ncommit {commit}; wrk -t1, {duration} per run, "
      f"{reps} repetitions round-robin, medians. `bench/jmap.sh`\n")
targets = ("direct", "nginx-proxy", "tessera")
print("| clients | " + " | ".join(f"{t} req/s" for t in targets) + " | nginx-proxy / direct | tessera / direct | "
      + " | ".join(f"p50 {t}" for t in targets) + " |")
print("|---:|" + "---:|" * 5 + "---|" * 3)
for c in sorted({r[1] for r in rows}, key=int):
    med = {t: statistics.median(float(r[2]) for r in rows if r[0] == t and r[1] == c) for t in targets}
    p50 = {t: statistics.median(us(r[3]) for r in rows if r[0] == t and r[1] == c) for t in targets}
    print(f"| {c} | " + " | ".join(f"{med[t]:,.0f}" for t in targets)
          + f" | {med['nginx-proxy'] / med['direct']:.2f}x | {med['tessera'] / med['direct']:.2f}x | "
          + " | ".join(f"{p50[t]:,.0f} µs" for t in targets) + " |")
print(f"\nUpstream connections tessera opened in all: {opened}; Cyrus httpd children alive at the end: {children}.")
print("\nEvery run:\n\n| target | clients | req/s | p50 |\n|---|---:|---:|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |")
PY
cat "$out"
log "report in ${out#"$ROOT"/}"
KEEP_WORK=0
