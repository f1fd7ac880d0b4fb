#!/usr/bin/env bash
# End-to-end check of the Python bench pieces (no Rust involved), about 20 s:
#   bench/smoke.sh
# Starts redis-server and nginx (/1k: 1 KiB JSON; /echo: the Authorization, Cookie and
# X-Forwarded-* headers it received) on free loopback ports, and two reference proxies A and B
# (bench/reference/proxy.py) sharing the Redis. Then:
#   - bench/tokens.py makes sessions (jsonl for revocation, plain + wrk Lua for wrk);
#   - curl: no token / bad token -> 401; bearer and cookie `tessera` -> 200 with the 1024-byte
#     body; /echo shows the injected `Basic base64(user:password)`, no client token or token
#     cookie, other cookies kept; a session deleted in Redis -> 401;
#   - wrk -s <lua> for 2 s through A: no non-2xx answer;
#   - bench/revocation.py over 50 trials (A, B): JSON with p50/p99/max;
#   - bench/plot.py on a small results JSON: two SVG files.
# Every process started here is stopped by PID on exit; the work dir is removed on success.
set -euo pipefail

BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { printf '[smoke %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

PIDS=()
WORK=""
OK=0
cleanup() {
  local rc=$? pid i
  trap - EXIT INT TERM
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    pid=${PIDS[$i]}
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [[ -n "$WORK" ]]; then
    if [[ $OK -eq 1 ]]; then rm -rf "$WORK"; else log "logs kept in $WORK"; fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for tool in redis-server redis-cli nginx wrk curl python3; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done
PY="$(python3 "$BENCH/_venv.py")" # creates bench/.venv on first use

WORK="$(mktemp -d /tmp/tessera-smoke.XXXXXX)"
chmod 711 "$WORK"
mkdir -p "$WORK/tmp"
read -r P_REDIS P_NGINX P_A P_B < <(free_ports 4)


redis-server --port "$P_REDIS" --bind 127.0.0.1 --save '' --appendonly no \
  --protected-mode no >"$WORK/redis.log" 2>&1 &
PIDS+=($!)
wait_port "$P_REDIS" redis-server $!
REDIS="redis://127.0.0.1:$P_REDIS/0"

python3 - "$WORK/1k.json" <<'PY'
import sys
s = '{"items":['
while len(s) < 1000:
    s += '"lorem-ipsum",'
s += '"end"]}'
open(sys.argv[1], "w").write(s.ljust(1023) + "\n")
PY
cat >"$WORK/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK/nginx.pid;
error_log $WORK/error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $WORK/tmp; proxy_temp_path $WORK/tmp; fastcgi_temp_path $WORK/tmp;
  uwsgi_temp_path $WORK/tmp; scgi_temp_path $WORK/tmp;
  keepalive_requests 1000000;
  server {
    listen 127.0.0.1:$P_NGINX;
    location /echo {
      default_type application/json;
      return 200 '{"authorization":"\$http_authorization","cookie":"\$http_cookie","xff":"\$http_x_forwarded_for","xfh":"\$http_x_forwarded_host","xfp":"\$http_x_forwarded_proto","host":"\$http_host","connection":"\$http_connection","uri":"\$request_uri"}';
    }
    location = /1k { default_type application/json; alias $WORK/1k.json; }
  }
}
EOF
nginx -e "$WORK/error.log" -p "$WORK" -c "$WORK/nginx.conf" >"$WORK/nginx.out" 2>&1 &
PIDS+=($!)
wait_port "$P_NGINX" nginx $!

# Throwaway secrets for this run only, passed by environment (never on a command line).
export SMOKE_JWT_SECRET SMOKE_CRED_KEY SMOKE_PASSWORD
SMOKE_JWT_SECRET="$(python3 -c 'import secrets; print(secrets.token_urlsafe(64))')"
SMOKE_CRED_KEY="$(python3 -c 'import base64, os; print(base64.b64encode(os.urandom(32)).decode())')"
SMOKE_PASSWORD="smoke-pass:with colon"

for port in "$P_A" "$P_B"; do
  "$PY" "$BENCH/reference/proxy.py" --listen "127.0.0.1:$port" --upstream "http://127.0.0.1:$P_NGINX" \
    --redis "$REDIS" --jwt-secret env:SMOKE_JWT_SECRET --cred-key env:SMOKE_CRED_KEY \
    >"$WORK/proxy-$port.log" 2>&1 &
  PIDS+=($!)
  wait_port "$port" "proxy.py" $!
done
A="http://127.0.0.1:$P_A"
B="http://127.0.0.1:$P_B"

mk_tokens() { # count out format [lua]
  "$PY" "$BENCH/tokens.py" --count "$1" --redis "$REDIS" --jwt-secret env:SMOKE_JWT_SECRET \
    --cred-key env:SMOKE_CRED_KEY --user alice --password-env SMOKE_PASSWORD --ttl 600 \
    --out "$2" --format "$3" ${4:+--lua "$4"}
}
mk_tokens 60 "$WORK/rev.tokens.jsonl" jsonl
mk_tokens 200 "$WORK/wrk.tokens" plain "$WORK/wrk-rotate.lua"
[[ $(redis-cli -p "$P_REDIS" dbsize) == 260 ]] || die "expected 260 sessions in Redis"
TOKEN="$(sed -n 1p "$WORK/wrk.tokens")"
SID="$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["sid"])' "$WORK/rev.tokens.jsonl")"
TOKEN_R="$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["token"])' "$WORK/rev.tokens.jsonl")"

expect() { # want got what; want is a glob pattern (e.g. "401 *": any body length)
  # shellcheck disable=SC2053 # unquoted on purpose: a pattern
  [[ $2 == $1 ]] || die "$3: got '$2', want '$1'"
  log "ok: $3 -> $2"
}
code() { curl -s -o /dev/null -w '%{http_code} %{size_download}' --max-time 5 "$@"; }
expect "401 *" "$(code "$A/1k")" "no token"
expect "401 *" "$(code -H "Authorization: Bearer ${TOKEN}x" "$A/1k")" "tampered token"
expect "200 1024" "$(code -H "Authorization: Bearer $TOKEN" "$A/1k")" "bearer on A"
expect "200 1024" "$(code -H "Authorization: Bearer $TOKEN" "$B/1k")" "bearer on B"
expect "200 1024" "$(code -b "tessera=$TOKEN" "$A/1k")" "cookie tessera"

ECHO="$(curl -s --max-time 5 -H "Authorization: Bearer $TOKEN" -b "a=1; tessera=$TOKEN; b=2" \
  -H 'X-Forwarded-For: 6.6.6.6' "$A/echo?q=1")"
python3 - "$ECHO" <<'PY' || die "echo check failed"
import base64, json, os, sys
e = json.loads(sys.argv[1])
want = "Basic " + base64.b64encode(("alice:" + os.environ["SMOKE_PASSWORD"]).encode()).decode()
assert e["authorization"] == want, "upstream did not get the Basic credential"
assert e["cookie"] == "a=1; b=2", f"cookie forwarded as {e['cookie']!r}"
assert e["xff"] == "127.0.0.1", f"X-Forwarded-For {e['xff']!r}"
assert e["xfp"] == "http" and e["xfh"].startswith("127.0.0.1:"), e
assert e["uri"] == "/echo?q=1", e["uri"]
print("[smoke] ok: upstream saw Basic alice:<password>, cookie 'a=1; b=2', XFF 127.0.0.1",
      file=sys.stderr)
PY

redis-cli -p "$P_REDIS" del "tessera:session:$SID" >/dev/null
expect "401 *" "$(code -H "Authorization: Bearer $TOKEN_R" "$B/1k")" "deleted session on B"
sed -i 1d "$WORK/rev.tokens.jsonl" # that pair is spent

log "wrk 2 s through A rotating over 200 tokens"
wrk -t2 -c8 -d2s -s "$WORK/wrk-rotate.lua" "$A/1k" >"$WORK/wrk.txt" 2>&1 &
PIDS+=($!)
wait $! || die "wrk failed: $(cat "$WORK/wrk.txt")"
grep -q 'Non-2xx' "$WORK/wrk.txt" && die "wrk saw non-2xx answers: $(cat "$WORK/wrk.txt")"
log "ok: wrk $(grep -E 'requests in|Requests/sec' "$WORK/wrk.txt" | tr -s ' ' | tr '\n' ' ')"

log "revocation.py, 50 trials"
"$PY" "$BENCH/revocation.py" --a "$A" --b "$B" --redis "$REDIS" --sessions "$WORK/rev.tokens.jsonl" \
  --trials 50 --out "$WORK/revocation.json" >/dev/null
python3 - "$WORK/revocation.json" <<'PY' || die "revocation result check failed"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 50 and r["timeouts"] == 0 and r["errors"] == 0, r
print(f"[smoke] ok: revocation p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, max {r['max_ms']} ms "
      f"(poll {r['poll_ms_mean']} ms)", file=sys.stderr)
PY

cat >"$WORK/results.json" <<'EOF'
[{"target": "nginx-proxy", "concurrency": 1, "rps": 18000, "p50_ms": 0.05, "p99_ms": 0.1},
 {"target": "python-ref", "concurrency": 1, "rps": 3000, "p50_ms": 0.3, "p99_ms": 0.6},
 {"target": "nginx-proxy", "concurrency": 8, "rps": 32000, "p50_ms": 0.25, "p99_ms": 0.5},
 {"target": "python-ref", "concurrency": 8, "rps": 4000, "p50_ms": 2.0, "p99_ms": 4.0}]
EOF
"$PY" "$BENCH/plot.py" "$WORK/results.json" --out-dir "$WORK/plots" >/dev/null
for f in results-rps.svg results-latency.svg; do
  grep -q '<svg' "$WORK/plots/$f" || die "plot $f missing"
done
log "ok: plot.py wrote results-rps.svg and results-latency.svg"

[[ -s "$WORK/error.log" ]] && die "nginx error.log not empty: $(cat "$WORK/error.log")"
grep -vq 'listening on' "$WORK"/proxy-*.log && die "proxy logged errors: $(cat "$WORK"/proxy-*.log)"
OK=1
log "all checks passed"
