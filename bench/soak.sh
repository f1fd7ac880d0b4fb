#!/usr/bin/env bash
# Soak test (issue 38; not part of the test command, about 3-10 min): REQUESTS (1,000,000) requests
# through the release tessera on Redis with rotating sessions, while Redis is restarted RESTARTS (2)
# times and the upstream closes idle keep-alive connections at random. It fails unless every
# request is answered 200 (with the right user's body) or 503 with Retry-After while Redis is
# down; never a 401 for a valid session, a transport error, a revoked session served, or a request
# at the upstream without its credential; and tessera's RSS and open files at the end are no
# higher than when the run was warm (10 %).
#   bench/soak.sh                       # builds target/release/tessera, writes results/soak-<date>.json
#   REQUESTS=100000 BIN=/tmp/tessera bench/soak.sh
# Processes (127.0.0.1, free ports, stopped on exit; logs kept in the work dir on failure):
# redis-server (RDB saved at each shutdown, so a restart keeps the sessions), the upstream and the
# load generator (bench/soak/, Go standard library only: `soak upstream`, `soak load`), one
# `tessera serve` with [login] (verify_path /check). USERS (64) workers, one user each: log in
# (POST /auth/login), ROTATE (2000) GETs, log out, check the old token gets 401, again.
# Needs redis-server, redis-cli, go, cargo.
set -euo pipefail
REQUESTS="${REQUESTS:-1000000}" RESTARTS="${RESTARTS:-2}" USERS="${USERS:-64}" ROTATE="${ROTATE:-2000}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[soak %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for c in redis-server redis-cli go cargo; do command -v "$c" >/dev/null || die "$c not found"; done

work_dir soak
# Redis runs daemonized (a restart outlives the command that made it): stopped by its pidfile.
redis_stop() { [[ -s "$WORK/redis.pid" ]] && stop_pid "$(cat "$WORK/redis.pid")"; return 0; }
trap 'rc=$?; redis_stop; (exit $rc); cleanup' EXIT
read -r REDIS_PORT UP_PORT PORT <<<"$(free_ports 3)"

if [[ -z ${BIN:-} ]]; then
  log "building target/release/tessera"
  (cd "$ROOT" && cargo build --release --quiet)
  BIN="$ROOT/target/release/tessera"
fi
(cd "$ROOT/bench/soak" && go build -o "$WORK/soak" .)

cat >"$WORK/redis-start.sh" <<SH
#!/bin/sh
exec redis-server --port $REDIS_PORT --bind 127.0.0.1 --dir $WORK --dbfilename soak.rdb \
  --save '' --appendonly no --daemonize yes --pidfile $WORK/redis.pid --logfile $WORK/redis.log
SH
cat >"$WORK/redis-restart.sh" <<SH
#!/bin/sh
# SAVE, then down for a second, then up again with the saved sessions.
set -e
redis-cli -p $REDIS_PORT shutdown save >/dev/null
while [ -e /proc/\$(cat $WORK/redis.pid 2>/dev/null || echo 0) ] && [ -s $WORK/redis.pid ]; do sleep 0.05; done
sleep 1
$WORK/redis-start.sh
until redis-cli -p $REDIS_PORT ping >/dev/null 2>&1; do sleep 0.05; done
SH
chmod +x "$WORK/redis-start.sh" "$WORK/redis-restart.sh"
"$WORK/redis-start.sh"
until redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; do sleep 0.05; done

"$WORK/soak" upstream -listen "127.0.0.1:$UP_PORT" >"$WORK/upstream.log" 2>&1 &
PIDS+=($!)
wait_port "$UP_PORT" upstream "$!"

mkdir -p "$WORK/keys"
tessera_keys "$BIN"
tessera_toml_on "$WORK/tessera.toml" "$PORT" "http://127.0.0.1:$UP_PORT" "redis://127.0.0.1:$REDIS_PORT/0"
printf '[login]\nverify_path = "/check"\ncookie_secure = false\n' >>"$WORK/tessera.toml"
"$BIN" serve --config "$WORK/tessera.toml" >"$WORK/tessera.log" 2>&1 &
TESSERA_PID=$!
PIDS+=("$TESSERA_PID")
wait_port "$PORT" tessera "$TESSERA_PID"

log "$REQUESTS requests, $USERS users, a new session every $ROTATE requests, $RESTARTS Redis restarts"
mkdir -p "$ROOT/bench/results"
out="$ROOT/bench/results/soak-$(date +%Y-%m-%d).json"
"$WORK/soak" load -url "http://127.0.0.1:$PORT" -users "$USERS" -requests "$REQUESTS" \
  -rotate "$ROTATE" -restarts "$RESTARTS" -restart "$WORK/redis-restart.sh" \
  -pid "$TESSERA_PID" -upstream "http://127.0.0.1:$UP_PORT" -store-port "$REDIS_PORT" >"$WORK/report.json"
cp "$WORK/report.json" "$out"
cat "$out"
log "passed; report in ${out#"$ROOT"/}"
KEEP_WORK=0
