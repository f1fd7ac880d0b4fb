#!/usr/bin/env bash
# The issue-4 benchmark suite, in one go on loopback.
#
#   bench/suite.sh                          # DURATION=5s REPS=3 (about 10 minutes)
#   DURATION=2s REPS=1 bench/suite.sh       # quick check of every piece
#   SECTIONS="matrix memory" bench/suite.sh # only some sections
#                                           # (matrix compat scaled algs close revocation affinity
#                                           # memory)
#   TESSERA_BIN=/path/to/tessera bench/suite.sh  # another binary (default target/release/tessera)
#   IDLE_POLL_NS=200000 bench/suite.sh      # the guest's idle polling for the run (bench/lib.sh)
#   PINNED_C1= bench/suite.sh               # without the pinned c=1 pass of the matrix (below)
#
# Processes (all on 127.0.0.1, free ports, stopped by PID on exit, as bench/run.sh does):
#   redis-server (no persistence); nginx "origin" (worker_processes 1) serving the 1 KiB JSON at
#   /1k plus stub_status on a separate port; nginx "proxy" (a second nginx process, worker_processes
#   1): plain reverse proxy to the origin with upstream keepalive 64, no auth (bench/run.sh's
#   server block, in its own process so the origin's `accepted` counter sees only upstream
#   connections); bench/reference/proxy.py (one worker) on Redis; tessera on Redis; tessera on the
#   embedded store. Every tessera: `[log] level = "warn"`, `access_log = false`, the HS512
#   `token.secret` plus `[[token.keys]]` rs1 (RS256) and ed1 (EdDSA) with `public_key = "file:..."`;
#   the warm ones (tessera-redis, tessera-embedded, tessera-busy, tessera-affinity): `[session]
#   cache_ttl_seconds = 3600` (WARM_TTL below says why).
#
# Sections:
#   matrix     targets direct, nginx-proxy, python-ref, tessera-redis, tessera-embedded, tessera-busy
#              (tessera-redis's config plus `[server] busy_poll_us = 50`, src/busy_poll.rs); GET /1k with
#              a bearer token rotating over SESSIONS (1,000) sessions (tokens.py's wrk Lua script,
#              the same script for every target, direct and nginx-proxy included);
#              wrk -t (1 if c<2 else 2) -c c -d DURATION --latency, c in 1 8 64, REPS repetitions
#              round-robin over the targets within each repetition; medians. Per run: Redis commands
#              (INFO commandstats delta, INFO itself excluded) and upstream connections opened (the
#              origin's stub_status `accepted` delta, minus the status request's own connection).
#              Sessions for tessera-embedded: `tessera session create` run EMBEDDED_SESSIONS times.
#              Then the pinned pass (unless PINNED_C1 is empty): the same targets at c=1 again, REPS
#              repetitions, with every process pinned to CPUs by `taskset` as PINNED_C1 says
#              (default "wrk=0,origin=1,proxy=0": wrk and the proxy under test, every thread of it,
#              share CPU 0, the nginx origin has CPU 1); unpinned again afterwards. Why: unpinned,
#              a c=1 run lands in one of two latency modes (where the scheduler puts the three
#              processes), for nginx-proxy as for tessera, and the median of five follows that
#              lottery (docs/benchmarks.md, "Method"); pinned, every run has the same layout.
#   compat     the shape a hyper-auth-proxy deployment switches over in (issue 39): tessera-compat
#              on the same Redis, database 1 (emptied afterwards), holding SESSIONS (1,000)
#              plaintext-legacy records
#              (bench/compat_sessions.py: key the sid, value {"credentials": "<base64 user:pass>"}),
#              `session.format = "hyper-auth-proxy"`, `token.sources = ["cookie-b64:Authorization",
#              "bearer"]`, `credentials.allow_plaintext_legacy = true`, against direct and
#              nginx-proxy; every target's requests rotate over the sessions' base64 cookies
#              (bench/compat.lua); wrk -t 1 at every c in 1 8 64, REPS repetitions round-robin,
#              medians, after 2 s at c=8 per target (every session touched). Headline: CPU per
#              request beside req/s, both against nginx-proxy.
#   scaled     the peers with one process per CPU, beside their one-process runs: nginx-proxy-mw
#              (the same proxy as nginx-proxy, `worker_processes` = the CPUs) and python-ref-mw
#              (bench/reference/proxy.py --workers = the CPUs, forked processes sharing the port),
#              against nginx-proxy, python-ref and tessera-redis (whose default is already one
#              serving thread per CPU); c in 8 64, REPS repetitions round-robin, medians; CPU per
#              request summed over every worker. Why: a careful team on this machine would run
#              one worker per core, so the matrix's one-worker peers alone would flatter tessera.
#   algs       c=8: tessera-redis (warm: default session and token caches) and tessera-cold
#              (`[session] cache_max_entries = 0`, `[token] cache_max_entries = 0`: every request
#              verifies, reads Redis, unseals), each with HS512, RS256 (kid rs1) and EdDSA (kid ed1)
#              tokens from tokens.py (1,000 sessions each); round-robin, REPS repetitions.
#              Covers "RS256/EdDSA vs HS512" and "cold vs warm".
#   close      `wrk -H "Connection: close"` (a new client connection per request): tessera-pool16
#              (`upstream.max_connections = 16`) at c=8 and c=64, nginx-proxy at c=8; upstream
#              connections opened (origin `accepted` delta) and the most upstream connections open at
#              once (tessera's sockets to the origin, sampled with `ss -tnp` every 50 ms); why
#              tessera-pool16 closed upstream connections and the exchanges it finished in the
#              background, per run (its metrics before the run and 0.5 s after it) and over the
#              whole section (close-closes.tsv; tessera-pool16 has [metrics] on for these).
#   revocation two tessera instances (tessera-redis = A, tessera-b = B) on one Redis;
#              bench/revocation.py, REVOCATION_TRIALS (1,000) trials, revoke = DEL in Redis.
#   affinity   the cost of `[upstream] affinity = "session"` (a pooled upstream connection only
#              carries requests with one upstream credential): tessera-redis (affinity "none") vs
#              tessera-affinity (same config plus `affinity = "session"`), default max_connections
#              (64), each with two session sets from tokens.py --distinct-users (session n = user
#              alice-n, so every session has its own injected `Authorization: Basic`): SESSIONS
#              (1,000; more users than pool slots, the worst case) and AFFINITY_FEW_SESSIONS (16;
#              fewer users than slots); c in 8 64, REPS repetitions round-robin, medians; upstream
#              connections opened per run (origin `accepted` delta, as in matrix). Every token once
#              through both instances and 1 s of wrk per (instance, set) first.
#   memory     a fresh tessera on Redis (session and token cache_max_entries = 120000,
#              cache_ttl_seconds = 3600 so nothing expires meanwhile); MEMORY_SESSIONS (100,000)
#              sessions made by tokens.py (MEMORY_TOKEN_CACHE sets the token cache size; 0 shows
#              what the session cache alone takes), each requested once (Python keep-alive clients, 4
#              processes, every answer must be 200), then VmRSS/VmHWM from /proc/PID/status; a
#              second pass counts Redis GETs (0 = every session was still cached).
#
# Output: bench/results/suite-<date>.json (object: matrix = list of {target, concurrency, rps,
# p50_ms, p99_ms, redis_cmds_per_req, upstream_conns, ...}, pinned, scaled (the same rows), algs,
# close, revocation, affinity =
# list of {affinity, sessions, concurrency, rps, ..., upstream_conns, vs_none}, memory, meta),
# suite-<date>.md (tables, targets met/missed, command, machine facts), SVG plots
# suite-<date>-{matrix,scaled,algs,close,affinity}-{rps,latency}.svg via bench/plot.py, raw wrk output in
# suite-<date>.raw.txt. Needs target/release/tessera (never built here; TESSERA_BIN picks another
# binary), redis-server, redis-cli, nginx (with stub_status), wrk, curl, openssl, ss, python3.
set -euo pipefail

DURATION="${DURATION:-5s}"
REPS="${REPS:-3}"
ALL_SECTIONS="matrix compat scaled algs close revocation affinity memory"
SECTIONS="${SECTIONS:-$ALL_SECTIONS}"
SESSIONS="${SESSIONS:-1000}"
AFFINITY_FEW_SESSIONS="${AFFINITY_FEW_SESSIONS:-16}"
EMBEDDED_SESSIONS="${EMBEDDED_SESSIONS:-1000}"
REVOCATION_TRIALS="${REVOCATION_TRIALS:-1000}"
MEMORY_SESSIONS="${MEMORY_SESSIONS:-100000}"
MEMORY_TOKEN_CACHE="${MEMORY_TOKEN_CACHE:-120000}" # [token] cache_max_entries of tessera-mem
CONCURRENCIES=(1 8 64)
PINNED_C1="${PINNED_C1-wrk=0,origin=1,proxy=0}" # taskset CPU lists for the pinned c=1 pass
AFFINITY_CONCURRENCIES=(8 64)
SCALED_CONCURRENCIES=(8 64)
SCALED_TARGETS=(nginx-proxy nginx-proxy-mw python-ref python-ref-mw tessera-redis)
NCPU="$(nproc)"
TARGETS=(direct nginx-proxy python-ref tessera-redis tessera-embedded tessera-busy)
BUSY_POLL_US=50 # [server] busy_poll_us of tessera-busy
POOL_CAP=16

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BENCH="$ROOT/bench"
BIN="${TESSERA_BIN:-$ROOT/target/release/tessera}"
RESULTS_DIR="$BENCH/results"
START_EPOCH=$(date +%s)
LOAD_START="$(cut -d' ' -f1-3 /proc/loadavg)"

log() { printf '[suite %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
has_section() { [[ " $SECTIONS " == *" $1 "* ]]; }

[[ "$REPS" =~ ^[1-9][0-9]*$ ]] || die "REPS must be a positive integer, got '$REPS'"
[[ "$DURATION" =~ ^[0-9]+[smh]?$ ]] || die "DURATION must look like 5s, 1m, 30, got '$DURATION'"
pin_parse PINNED_C1 "$PINNED_C1" # PIN_OF: bench/lib.sh
[[ -z $PINNED_C1 || (-n ${PIN_OF[wrk]:-} && -n ${PIN_OF[origin]:-} && -n ${PIN_OF[proxy]:-}) ]] ||
  die "PINNED_C1 must pin wrk, origin and proxy, got '$PINNED_C1'"
for s in $SECTIONS; do
  [[ " $ALL_SECTIONS " == *" $s "* ]] || die "unknown section '$s'"
done
[[ "$AFFINITY_FEW_SESSIONS" =~ ^[1-9][0-9]*$ ]] ||
  die "AFFINITY_FEW_SESSIONS must be a positive integer, got '$AFFINITY_FEW_SESSIONS'"

# ---------------------------------------------------------------- prerequisites
for tool in redis-server redis-cli nginx wrk curl openssl ss pgrep python3 git; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is not installed"
done
nginx -V 2>&1 | grep -q with-http_stub_status_module || die "nginx lacks stub_status"
[[ -x "$BIN" ]] || die "$BIN not found: build it first with 'cargo build --release' (or set TESSERA_BIN)"
STALE=""
if [[ -n "$(find "$ROOT/src" "$ROOT/Cargo.toml" "$ROOT/Cargo.lock" -newer "$BIN" -print -quit 2>/dev/null)" ]]; then
  STALE="yes"
  log "WARNING: sources are newer than $BIN; the numbers are for the binary as built"
fi
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if ! git -C "$ROOT" diff --quiet HEAD -- src Cargo.toml Cargo.lock 2>/dev/null; then
  COMMIT="$COMMIT (src/Cargo files modified vs HEAD at start)"
fi
BIN_BUILT="$(date -u -r "$BIN" '+%Y-%m-%d %H:%M:%S UTC')"
BIN_SHA256="$(sha256sum "$BIN" | cut -c1-12)"
PY="$(python3 "$BENCH/_venv.py")" # bench/.venv (created on first use)

# ---------------------------------------------------------------- work dir, processes and ports
# WORK, PIDS, KEEP_WORK (cleared after a successful run) and the cleanup on exit: bench/lib.sh
work_dir tessera-suite
idle_poll_apply
IDLE="$(idle_state)" # for the report, as the run starts
mkdir -p "$WORK/tmp" "$WORK/tmp2" "$WORK/raw" "$WORK/keys" "$WORK/tok" "$WORK/emb"
chmod 700 "$WORK/keys" "$WORK/tok"
RAW="$WORK/raw"
RUNS="$WORK/runs.tsv"
: >"$RUNS"

read -r P_REDIS P_ORIGIN P_STATUS P_PROXY P_PYREF P_TR P_TE P_TCOLD P_TPOOL P_TB P_TMEM P_TAFF P_TBUSY \
  P_PROXY_MW P_PYREF_MW P_TAFF_METRICS P_TPOOL_METRICS P_TCOMPAT < <(free_ports 18)


declare -A PID_OF URL_OF CPU_PID_OF

# ---------------------------------------------------------------- redis
redis-server --port "$P_REDIS" --bind 127.0.0.1 --save '' --appendonly no --protected-mode no \
  >"$WORK/redis.log" 2>&1 &
PID_OF[redis]=$!
PIDS+=("$!")
wait_port "$P_REDIS" redis-server "$!"
REDIS="redis://127.0.0.1:$P_REDIS/0"
rcli() { redis-cli -p "$P_REDIS" "$@"; }

# ---------------------------------------------------------------- nginx: origin and plain proxy
python3 - "$WORK/1k.json" <<'PY'
import sys
s = '{"items":['
while len(s) < 1000:
    s += '"lorem-ipsum",'
s += '"end"]}'
body = s.ljust(1023) + "\n"
assert len(body.encode()) == 1024
open(sys.argv[1], "w").write(body)
PY

cat >"$WORK/origin.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK/origin.pid;
error_log $WORK/origin-error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_temp_path $WORK/tmp; proxy_temp_path $WORK/tmp; fastcgi_temp_path $WORK/tmp;
  uwsgi_temp_path $WORK/tmp; scgi_temp_path $WORK/tmp;

  # direct: the origin, upstream of every proxy.
  server {
    listen 127.0.0.1:$P_ORIGIN;
    keepalive_requests 1000000;
    location = /1k { default_type application/json; alias $WORK/1k.json; }
  }
  # stub_status of this process: 'accepted' counts every connection the origin accepted.
  server {
    listen 127.0.0.1:$P_STATUS;
    location = /status { stub_status; }
  }
}
EOF

cat >"$WORK/proxy.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK/proxy.pid;
error_log $WORK/proxy-error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_temp_path $WORK/tmp2; proxy_temp_path $WORK/tmp2; fastcgi_temp_path $WORK/tmp2;
  uwsgi_temp_path $WORK/tmp2; scgi_temp_path $WORK/tmp2;

  # nginx-proxy: plain reverse proxy to the origin, pooled keep-alive upstream connections, no auth.
  upstream direct_pool {
    server 127.0.0.1:$P_ORIGIN;
    keepalive 64;
    keepalive_requests 1000000;
  }
  server {
    listen 127.0.0.1:$P_PROXY;
    keepalive_requests 1000000;
    location / {
      proxy_pass http://direct_pool;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
EOF

log "starting nginx origin (:$P_ORIGIN, status :$P_STATUS) and nginx proxy (:$P_PROXY) in $WORK"
nginx -e "$WORK/origin-error.log" -p "$WORK" -c "$WORK/origin.conf" >"$WORK/origin.out" 2>&1 &
PID_OF[origin]=$!
PIDS+=("$!")
wait_port "$P_ORIGIN" "nginx origin" "$!"
wait_port "$P_STATUS" "nginx origin" "$!"
nginx -e "$WORK/proxy-error.log" -p "$WORK" -c "$WORK/proxy.conf" >"$WORK/proxy.out" 2>&1 &
PID_OF[nginx-proxy]=$!
PIDS+=("$!")
wait_port "$P_PROXY" "nginx proxy" "$!"
STATUS_URL="http://127.0.0.1:$P_STATUS/status"
# The worker (not the master) serves, holds the sockets and burns the CPU.
worker_of() { # master pid [count] -> its first worker's pid (every one of count workers, one line each)
  local i w n="${2:-1}"
  for ((i = 0; i < 100; i++)); do
    w="$(pgrep -P "$1" || true)"
    (($(grep -c . <<<"$w") >= n)) && echo "$w" | head -"$n" && return 0
    sleep 0.05
  done
  die "fewer than $n workers under master $1"
}
WORKER_OF_ORIGIN="$(worker_of "${PID_OF[origin]}")"
WORKER_OF_PROXY="$(worker_of "${PID_OF[nginx-proxy]}")"
URL_OF[direct]="http://127.0.0.1:$P_ORIGIN/1k"
URL_OF[nginx-proxy]="http://127.0.0.1:$P_PROXY/1k"
CPU_PID_OF[direct]="$WORKER_OF_ORIGIN"
CPU_PID_OF[nginx-proxy]="$WORKER_OF_PROXY"

# ---------------------------------------------------------------- keys (throwaway, files 0600)
umask 077
KEYS="$("$BIN" keygen)"
sed -n 's/^TESSERA_JWT_SECRET=//p' <<<"$KEYS" >"$WORK/keys/jwt.secret"
sed -n 's/^TESSERA_CRED_KEY=//p' <<<"$KEYS" >"$WORK/keys/cred.key"
[[ $(wc -c <"$WORK/keys/jwt.secret") -ge 65 ]] || die "tessera keygen gave no usable TESSERA_JWT_SECRET"
[[ -s "$WORK/keys/cred.key" ]] || die "tessera keygen gave no TESSERA_CRED_KEY"
openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$WORK/keys/rs256.pem" 2>/dev/null
openssl pkey -in "$WORK/keys/rs256.pem" -pubout -out "$WORK/keys/rs256.pub.pem"
openssl genpkey -algorithm ed25519 -out "$WORK/keys/ed25519.pem"
openssl pkey -in "$WORK/keys/ed25519.pem" -pubout -out "$WORK/keys/ed25519.pub.pem"
umask 022
export BENCH_PASSWORD="bench-password"

# ---------------------------------------------------------------- tessera instances
write_conf() { # name port store [session extra] [token extra] [upstream extra] [server extra] [credentials extra]
  local name=$1 port=$2 store=$3 sess=${4:-} tok=${5:-} up=${6:-} srv=${7:-} cred=${8:-}
  cat >"$WORK/$name.toml" <<EOF
[server]
listen = "127.0.0.1:$port"
$srv

[upstream]
url = "http://127.0.0.1:$P_ORIGIN"
$up

[token]
secret = "file:$WORK/keys/jwt.secret"
$tok

[session]
store = "$store"
$sess

[credentials]
keys = { k1 = "file:$WORK/keys/cred.key" }
$cred

[log]
level = "warn"
access_log = false

[[token.keys]]
kid = "rs1"
alg = "RS256"
public_key = "file:$WORK/keys/rs256.pub.pem"

[[token.keys]]
kid = "ed1"
alg = "EdDSA"
public_key = "file:$WORK/keys/ed25519.pub.pem"
EOF
}

start_tessera() { # name port
  local name=$1 port=$2
  "$BIN" serve --config "$WORK/$name.toml" >"$WORK/$name.log" 2>&1 &
  PID_OF[$name]=$!
  PIDS+=("$!")
  wait_port "$port" "$name" "$!"
  URL_OF[$name]="http://127.0.0.1:$port/1k"
  CPU_PID_OF[$name]="${PID_OF[$name]}"
  log "started $name (:$port, pid ${PID_OF[$name]})"
}

stop_named() { # name
  stop_pid "${PID_OF[$1]}"
  wait "${PID_OF[$1]}" 2>/dev/null || true
}

# The warm instances keep a cache entry for WARM_TTL s, longer than a run: with the default
# [session] cache_ttl_seconds (300 s, counted from when the entry was made; the bound on how stale
# an entry can be if an invalidation were ever missed), a matrix longer than 5 minutes has
# tessera read every session once more, one GET per session per 300 s, which is a cold read, not
# the warm path this suite measures (seen: 999 GETs over 1000 sessions in a 6-minute matrix).
WARM_TTL="cache_ttl_seconds = 3600"
write_conf tessera-redis "$P_TR" "$REDIS" "$WARM_TTL"
write_conf tessera-embedded "$P_TE" "embedded:$WORK/emb/sessions" "$WARM_TTL"
write_conf tessera-cold "$P_TCOLD" "$REDIS" "cache_max_entries = 0" "cache_max_entries = 0"
# Its metrics say why upstream connections closed (scraped around each run; with [metrics] it
# also counts each request by status and duration).
write_conf tessera-pool16 "$P_TPOOL" "$REDIS" "" "" "max_connections = $POOL_CAP" "
[metrics]
listen = \"127.0.0.1:$P_TPOOL_METRICS\""
write_conf tessera-b "$P_TB" "$REDIS"
write_conf tessera-mem "$P_TMEM" "$REDIS" "cache_max_entries = 120000
cache_ttl_seconds = 3600" "cache_max_entries = $MEMORY_TOKEN_CACHE"
INSTANCES=(tessera-redis tessera-embedded tessera-cold tessera-pool16 tessera-b tessera-mem)
if has_section compat; then
  write_conf tessera-compat "$P_TCOMPAT" "redis://127.0.0.1:$P_REDIS/1" "format = \"hyper-auth-proxy\"
$WARM_TTL" "sources = [\"cookie-b64:Authorization\", \"bearer\"]" "" "" "allow_plaintext_legacy = true"
  INSTANCES+=(tessera-compat)
fi
# Only when the section runs: a binary older than server.busy_poll_us or upstream.affinity
# refuses the key.
if has_section matrix; then
  write_conf tessera-busy "$P_TBUSY" "$REDIS" "$WARM_TTL" "" "" "busy_poll_us = $BUSY_POLL_US"
  INSTANCES+=(tessera-busy)
fi
if has_section affinity; then
  # Its metrics count the waits for a user's own connection at the cap (scraped around each run;
  # with [metrics] it also counts each request by status and duration, which tessera-redis,
  # its "none" comparison, does not).
  write_conf tessera-affinity "$P_TAFF" "$REDIS" "$WARM_TTL" "" 'affinity = "session"' "
[metrics]
listen = \"127.0.0.1:$P_TAFF_METRICS\""
  INSTANCES+=(tessera-affinity)
fi
for name in "${INSTANCES[@]}"; do
  "$BIN" check-config --config "$WORK/$name.toml" >"$WORK/$name.check" 2>&1 ||
    die "$name config refused: $(cat "$WORK/$name.check")"
done

start_tessera tessera-redis "$P_TR"

# ---------------------------------------------------------------- sessions and tokens
mk_tokens() { # out-stem count [tokens.py args...]
  local stem=$1 count=$2
  shift 2
  "$PY" "$BENCH/tokens.py" --count "$count" --redis "$REDIS" --cred-key "file:$WORK/keys/cred.key" \
    --user alice --password-env BENCH_PASSWORD --out "$WORK/tok/$stem.jsonl" \
    --lua "$WORK/tok/$stem.lua" "$@" >&2
}
# Distinct upstream credentials among the sessions of a tokens.py jsonl: each Redis record's sealed
# `credentials` opened with the credential key (as tessera does: AES-256-GCM, the sid as AAD).
distinct_credentials() { # jsonl
  "$PY" - "$1" "$REDIS" "$WORK/keys/cred.key" <<'PY'
import base64, json, sys
import redis
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
path, url, keyfile = sys.argv[1:4]
aead = AESGCM(base64.b64decode(open(keyfile).read().strip()))
sids = [json.loads(line)["sid"] for line in open(path) if line.strip()]
records = redis.Redis.from_url(url).mget(["tessera:session:" + sid for sid in sids])
creds = set()
for sid, record in zip(sids, records):
    blob = json.loads(record)["credentials"].split(".", 2)[2]
    blob = base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4))
    creds.add(aead.decrypt(blob[:12], blob[12:], sid.encode()))
print(len(creds))
PY
}
first_token() { python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["token"])' "$1"; }

log "tokens.py: $SESSIONS sessions each for HS512, RS256 (kid rs1), EdDSA (kid ed1)"
mk_tokens hs512 "$SESSIONS" --jwt-secret "file:$WORK/keys/jwt.secret"
if has_section algs; then
  mk_tokens rs256 "$SESSIONS" --alg RS256 --kid rs1 --jwt-key "file:$WORK/keys/rs256.pem"
  mk_tokens eddsa "$SESSIONS" --alg EdDSA --kid ed1 --jwt-key "file:$WORK/keys/ed25519.pem"
fi
TOK_HS512="$(first_token "$WORK/tok/hs512.jsonl")"

check_target() { # target url token (empty: no auth)
  local target=$1 url=$2 token=$3 got
  if [[ -n $token ]]; then
    got="$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$url" || true)"
    [[ $got == 401 ]] || die "$target answered $got without a token, expected 401"
    got="$(curl -s -o /dev/null -w '%{http_code} %{size_download}' --max-time 5 \
      -H "Authorization: Bearer $token" "$url" || true)"
  else
    got="$(curl -s -o /dev/null -w '%{http_code} %{size_download}' --max-time 5 "$url" || true)"
  fi
  [[ $got == "200 1024" ]] || die "$target ($url) answered '$got', expected '200 1024'"
}

# ---------------------------------------------------------------- one measured wrk run
SAMPLER_PID=""
sample_upstream() { # pid out: most sockets of pid established to the origin, every 50 ms
  local pid=$1 out=$2 max=0 n
  while :; do
    n=$(ss -tnpH state established dst "127.0.0.1:$P_ORIGIN" 2>/dev/null | grep -c "pid=$pid," || true)
    ((n > max)) && max=$n && echo "$max" >"$out"
    sleep 0.05
  done
}

measure() { # section target c rep lua [wrk args...]
  local section=$1 target=$2 c=$3 rep=$4 lua=$5
  shift 5
  local id="$section-$target-c$c-r$rep" threads=${WRK_THREADS:-$((c < 2 ? 1 : 2))} url
  url="${URL_OF[$target]}"
  local sample_pid="${SAMPLE_PID:-}" cpu_pids
  read -ra cpu_pids <<<"${CPU_PID_OF[$target]}" # one pid, or every worker's
  rcli info commandstats >"$RAW/$id.redis0"
  cpu_ticks "${cpu_pids[@]}" >"$RAW/$id.cpu0"
  curl -s --max-time 5 "$STATUS_URL" >"$RAW/$id.nginx0"
  if [[ -n $sample_pid ]]; then
    echo 0 >"$RAW/$id.maxopen"
    sample_upstream "$sample_pid" "$RAW/$id.maxopen" &
    SAMPLER_PID=$!
    PIDS+=("$SAMPLER_PID")
  fi
  ${WRK_CPUS:+taskset -c "$WRK_CPUS"} wrk -t "$threads" -c "$c" -d "$DURATION" --latency -s "$lua" "$@" \
    "$url" >"$RAW/$id.txt" 2>&1 &
  local wrk_pid=$!
  PIDS+=("$wrk_pid")
  wait "$wrk_pid" || die "wrk failed for $id: $(cat "$RAW/$id.txt")"
  if [[ -n $sample_pid ]]; then
    stop_pid "$SAMPLER_PID"
    wait "$SAMPLER_PID" 2>/dev/null || true
  fi
  cpu_ticks "${cpu_pids[@]}" >"$RAW/$id.cpu1"
  curl -s --max-time 5 "$STATUS_URL" >"$RAW/$id.nginx1"
  rcli info commandstats >"$RAW/$id.redis1"
  printf '%s\t%s\t%s\t%s\t%s\n' "$section" "$target" "$c" "$rep" "$id" >>"$RUNS"
  local name
  for name in "${!PID_OF[@]}"; do
    [[ -n ${PID_OF[$name]} ]] || continue
    kill -0 "${PID_OF[$name]}" 2>/dev/null || die "$name (pid ${PID_OF[$name]}) died during $id"
  done
}

cpu_ticks() { # pid... -> user + system CPU time in clock ticks (fields 14, 15 of /proc/PID/stat), summed
  local p files=()
  for p in "$@"; do files+=("/proc/$p/stat"); done
  awk '{s += $14 + $15} END {print s}' "${files[@]}"
}
export CLK_TCK="$(getconf CLK_TCK)"

proc_mem() { # pid -> "VmRSS_kB VmHWM_kB"
  awk '/^VmRSS:/ {r=$2} /^VmHWM:/ {h=$2} END {print r, h}' "/proc/$1/status"
}

# Every token of FILE (jsonl or plain) requested once on PORT, by PROCS keep-alive clients; dies
# unless every answer is 200. Prints "requests seconds".
warm_tokens() { # file port procs
  python3 - "$1" "$2" "$3" <<'PY'
import http.client, json, multiprocessing, sys, time
path, port, procs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tokens = []
for line in open(path):
    line = line.strip()
    if line:
        tokens.append(json.loads(line)["token"] if line.startswith("{") else line)

def run(part):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    bad = 0
    for t in part:
        conn.request("GET", "/1k", headers={"Authorization": "Bearer " + t})
        r = conn.getresponse()
        r.read()
        bad += r.status != 200
    return bad

start = time.perf_counter()
with multiprocessing.Pool(procs) as pool:
    bad = sum(pool.map(run, [tokens[i::procs] for i in range(procs)]))
if bad:
    sys.exit(f"{bad} of {len(tokens)} answers from port {port} were not 200")
print(len(tokens), round(time.perf_counter() - start, 1))
PY
}

# bench/reference/proxy.py with WORKERS processes (one: it serves itself; more: the forked
# workers serve, and their CPU is counted).
start_pyref() { # name port workers
  local name=$1 port=$2 workers=$3
  log "$name (bench/reference/proxy.py, $workers worker(s)) on Redis"
  "$PY" "$BENCH/reference/proxy.py" --listen "127.0.0.1:$port" --upstream "http://127.0.0.1:$P_ORIGIN" \
    --redis "$REDIS" --jwt-secret "file:$WORK/keys/jwt.secret" --cred-key "file:$WORK/keys/cred.key" \
    --workers "$workers" >>"$WORK/$name.log" 2>&1 &
  PID_OF[$name]=$!
  PIDS+=("$!")
  wait_port "$port" "$name" "$!"
  URL_OF[$name]="http://127.0.0.1:$port/1k"
  if ((workers > 1)); then
    CPU_PID_OF[$name]="$(worker_of "${PID_OF[$name]}" "$workers" | tr '\n' ' ')"
    read -ra workers_pids <<<"${CPU_PID_OF[$name]}"
    PIDS+=("${workers_pids[@]}") # stopped by the cleanup too, should the master be killed
  else
    CPU_PID_OF[$name]="${PID_OF[$name]}"
  fi
}

# TOKEN_FN TARGET / LUA_FN TARGET print the target's token (empty: none) and its wrk script.
warm_up() { # section token_fn lua_fn target...: each checked, then 2 s of wrk at c=8 (not recorded)
  local section=$1 token_fn=$2 lua_fn=$3 target
  shift 3
  for target in "$@"; do
    check_target "$target" "${URL_OF[$target]}" "$("$token_fn" "$target")"
    wrk -t 2 -c 8 -d 2s -s "$("$lua_fn" "$target")" "${URL_OF[$target]}" >"$RAW/warmup-$section-$target.txt" 2>&1 ||
      die "warm-up wrk failed for $target"
  done
}

measure_all() { # section token_fn lua_fn "c..." target...: REPS round-robin repetitions, recorded
  local section=$1 token_fn=$2 lua_fn=$3 concs rep c target
  read -ra concs <<<"$4"
  shift 4
  log "$section: $# targets x c in (${concs[*]}) x $REPS reps x $DURATION"
  for ((rep = 1; rep <= REPS; rep++)); do
    for c in "${concs[@]}"; do
      for target in "$@"; do
        check_target "$target" "${URL_OF[$target]}" "$("$token_fn" "$target")"
        log "$section rep $rep/$REPS c=$c $target"
        measure "$section" "$target" "$c" "$rep" "$("$lua_fn" "$target")"
      done
    done
  done
}

SECTION_TIMES=""
section_done() { SECTION_TIMES+="$1=$(($(date +%s) - $2)) "; }

# ---------------------------------------------------------------- section: matrix
if has_section matrix; then
  t0=$(date +%s)
  start_pyref python-ref "$P_PYREF" 1

  start_tessera tessera-embedded "$P_TE"
  start_tessera tessera-busy "$P_TBUSY"
  log "tessera session create x $EMBEDDED_SESSIONS (embedded store)"
  emb_t0=$(date +%s.%N)
  for ((n = 0; n < EMBEDDED_SESSIONS; n++)); do
    printf '%s\n' "$BENCH_PASSWORD" |
      "$BIN" session create --config "$WORK/tessera-embedded.toml" --user alice --password-stdin
  done >"$WORK/tok/emb.jsonl" 2>"$WORK/emb-create.err" || die "session create failed: $(tail -3 "$WORK/emb-create.err")"
  EMB_CREATE_S="$(python3 -c "import sys; print(round($(date +%s.%N) - $emb_t0, 1))")"
  [[ $(grep -c '"token"' "$WORK/tok/emb.jsonl") -eq $EMBEDDED_SESSIONS ]] || die "session create wrote too few tokens"
  sed "s|$WORK/tok/hs512.jsonl|$WORK/tok/emb.jsonl|" "$WORK/tok/hs512.lua" >"$WORK/tok/emb.lua"
  grep -q "emb.jsonl" "$WORK/tok/emb.lua" || die "could not write the embedded wrk script"
  log "made $EMBEDDED_SESSIONS embedded sessions in $EMB_CREATE_S s"
  TOK_EMB="$(first_token "$WORK/tok/emb.jsonl")"

  lua_of() { [[ $1 == tessera-embedded ]] && echo "$WORK/tok/emb.lua" || echo "$WORK/tok/hs512.lua"; }
  token_of() {
    case $1 in
      direct | nginx-proxy) echo "" ;;
      tessera-embedded) echo "$TOK_EMB" ;;
      *) echo "$TOK_HS512" ;;
    esac
  }
  # Warm-up (not recorded): 2 s of wrk at c=8 per target (pools open), then every session once
  # through each tessera (caches filled).
  log "warm-up: 2 s at c=8 per target, every token once per tessera"
  warm_up matrix token_of lua_of "${TARGETS[@]}"
  warm_tokens "$WORK/tok/hs512.jsonl" "$P_TR" 2 >/dev/null || die "warm-up of tessera-redis failed"
  warm_tokens "$WORK/tok/hs512.jsonl" "$P_TBUSY" 2 >/dev/null || die "warm-up of tessera-busy failed"
  warm_tokens "$WORK/tok/emb.jsonl" "$P_TE" 2 >/dev/null || die "warm-up of tessera-embedded failed"
  measure_all matrix token_of lua_of "${CONCURRENCIES[*]}" "${TARGETS[@]}"
  if [[ -n $PINNED_C1 ]]; then
    proxies=("${PID_OF[nginx-proxy]}" "$WORKER_OF_PROXY" "${PID_OF[python-ref]}" "${PID_OF[tessera-redis]}"
      "${PID_OF[tessera-embedded]}" "${PID_OF[tessera-busy]}")
    pin_to "${PIN_OF[origin]}" "${PID_OF[origin]}" "$WORKER_OF_ORIGIN"
    pin_to "${PIN_OF[proxy]}" "${proxies[@]}"
    log "pinned pass: c=1, ${#TARGETS[@]} targets x $REPS reps x $DURATION, taskset $PINNED_C1"
    for ((rep = 1; rep <= REPS; rep++)); do
      for target in "${TARGETS[@]}"; do
        check_target "$target" "${URL_OF[$target]}" "$(token_of "$target")"
        log "pinned rep $rep/$REPS c=1 $target"
        WRK_CPUS="${PIN_OF[wrk]}" measure pinned "$target" 1 "$rep" "$(lua_of "$target")"
      done
    done
    pin_to "0-$(($(nproc) - 1))" "${PID_OF[origin]}" "$WORKER_OF_ORIGIN" "${proxies[@]}"
  fi
  for name in python-ref tessera-redis tessera-embedded tessera-busy redis; do
    echo "$name $(proc_mem "${PID_OF[$name]}")"
  done >"$WORK/matrix-mem.txt"
  echo "nginx-proxy-worker $(proc_mem "$WORKER_OF_PROXY")" >>"$WORK/matrix-mem.txt"
  echo "origin-worker $(proc_mem "$WORKER_OF_ORIGIN")" >>"$WORK/matrix-mem.txt"
  stop_named python-ref
  stop_named tessera-embedded
  stop_named tessera-busy
  PID_OF[python-ref]="" PID_OF[tessera-embedded]="" PID_OF[tessera-busy]=""
  section_done matrix "$t0"
fi

# ---------------------------------------------------------------- section: compat
if has_section compat; then
  t0=$(date +%s)
  export COMPAT_TOKENS="$WORK/tok/compat-tokens" # read by bench/compat.lua
  python3 "$BENCH/compat_sessions.py" "$P_REDIS" "$WORK/keys/jwt.secret" "$SESSIONS" "$COMPAT_TOKENS" 1 ||
    die "could not write the compat sessions"
  # Started for this section only: with the hyper-auth-proxy format its key prefix is empty, so
  # it would be told of every other section's Redis writes.
  start_tessera tessera-compat "$P_TCOMPAT"
  TOK_COMPAT="$(head -1 "$COMPAT_TOKENS" | base64 -d)" # the cookie's JWT, as a bearer token
  compat_token() { [[ $1 == tessera-compat ]] && echo "$TOK_COMPAT" || echo ""; }
  compat_lua() { echo "$BENCH/compat.lua"; }
  log "warm-up: 2 s at c=8 per target (every session of tessera-compat touched)"
  warm_up compat compat_token compat_lua direct nginx-proxy tessera-compat
  WRK_THREADS=1 measure_all compat compat_token compat_lua "${CONCURRENCIES[*]}" \
    direct nginx-proxy tessera-compat
  stop_named tessera-compat
  PID_OF[tessera-compat]=""
  rcli -n 1 flushdb >/dev/null # the memory section reports Redis's memory: only its sessions
  section_done compat "$t0"
fi

# ---------------------------------------------------------------- section: scaled
if has_section scaled; then
  t0=$(date +%s)
  sed -e "s/^worker_processes 1;/worker_processes $NCPU;/" -e "s|$WORK/proxy.pid|$WORK/proxy-mw.pid|" \
    -e "s|listen 127.0.0.1:$P_PROXY;|listen 127.0.0.1:$P_PROXY_MW;|" -e "s|$WORK/tmp2|$WORK/tmp3|g" \
    -e "s|$WORK/proxy-error.log|$WORK/proxy-mw-error.log|" "$WORK/proxy.conf" >"$WORK/proxy-mw.conf"
  if ! grep -q "worker_processes $NCPU;" "$WORK/proxy-mw.conf" || ! grep -q ":$P_PROXY_MW;" "$WORK/proxy-mw.conf"; then
    die "could not write proxy-mw.conf"
  fi
  mkdir -p "$WORK/tmp3"
  nginx -e "$WORK/proxy-mw-error.log" -p "$WORK" -c "$WORK/proxy-mw.conf" >"$WORK/proxy-mw.out" 2>&1 &
  PID_OF[nginx-proxy-mw]=$!
  PIDS+=("$!")
  wait_port "$P_PROXY_MW" "nginx proxy ($NCPU workers)" "$!"
  URL_OF[nginx-proxy-mw]="http://127.0.0.1:$P_PROXY_MW/1k"
  CPU_PID_OF[nginx-proxy-mw]="$(worker_of "${PID_OF[nginx-proxy-mw]}" "$NCPU" | tr '\n' ' ')"
  read -ra workers_pids <<<"${CPU_PID_OF[nginx-proxy-mw]}"
  PIDS+=("${workers_pids[@]}")
  start_pyref python-ref "$P_PYREF" 1
  start_pyref python-ref-mw "$P_PYREF_MW" "$NCPU"
  scaled_token() { [[ $1 == nginx-proxy* ]] && echo "" || echo "$TOK_HS512"; }
  scaled_lua() { echo "$WORK/tok/hs512.lua"; }
  log "warm-up: 2 s at c=8 per target, every token once through tessera-redis"
  warm_up scaled scaled_token scaled_lua "${SCALED_TARGETS[@]}"
  warm_tokens "$WORK/tok/hs512.jsonl" "$P_TR" 2 >/dev/null || die "warm-up of tessera-redis failed"
  measure_all scaled scaled_token scaled_lua "${SCALED_CONCURRENCIES[*]}" "${SCALED_TARGETS[@]}"
  stop_named python-ref
  stop_named python-ref-mw
  stop_named nginx-proxy-mw
  PID_OF[python-ref]="" PID_OF[python-ref-mw]="" PID_OF[nginx-proxy-mw]=""
  section_done scaled "$t0"
fi

# ---------------------------------------------------------------- section: algs (+ cold vs warm)
if has_section algs; then
  t0=$(date +%s)
  start_tessera tessera-cold "$P_TCOLD"
  for alg in hs512 rs256 eddsa; do
    tok="$(first_token "$WORK/tok/$alg.jsonl")"
    check_target "tessera-redis" "${URL_OF[tessera-redis]}" "$tok"
    check_target "tessera-cold" "${URL_OF[tessera-cold]}" "$tok"
    # every token once through tessera-redis: its token and session caches hold all of them
    warm_tokens "$WORK/tok/$alg.jsonl" "$P_TR" 2 >/dev/null || die "warm-up with $alg tokens failed"
    wrk -t 2 -c 8 -d 1s -s "$WORK/tok/$alg.lua" "${URL_OF[tessera-cold]}" >"$RAW/warmup-$alg.txt" 2>&1 ||
      die "warm-up wrk failed for $alg"
  done
  log "algs: (tessera-redis warm, tessera-cold) x (HS512 RS256 EdDSA) x $REPS reps x $DURATION at c=8"
  for ((rep = 1; rep <= REPS; rep++)); do
    for alg in hs512 rs256 eddsa; do
      for target in tessera-redis tessera-cold; do
        log "algs rep $rep/$REPS $alg $target"
        measure "algs_$alg" "$target" 8 "$rep" "$WORK/tok/$alg.lua"
      done
    done
  done
  stop_named tessera-cold
  PID_OF[tessera-cold]=""
  section_done algs "$t0"
fi

# ---------------------------------------------------------------- section: close
# pool_closes: tessera-pool16's upstream connections closed so far by reason, then its exchanges
# drained and drain-failed so far: "upstream expired evicted abandoned error tunnel drained
# drain_failed" (tessera_upstream_connections_closed_total{reason}, ..._exchanges_drained_total,
# ..._exchanges_drain_failed_total).
POOL_CLOSE_KEYS="upstream expired evicted abandoned error tunnel drained drain_failed"
pool_closes() {
  curl -s --max-time 5 "http://127.0.0.1:$P_TPOOL_METRICS/metrics" | awk -v keys="$POOL_CLOSE_KEYS" '
    $1 ~ /^tessera_upstream_connections_closed_total[{]reason="/ { split($1, a, "\""); v[a[2]] = $2 }
    $1 == "tessera_upstream_exchanges_drained_total" { v["drained"] = $2 }
    $1 == "tessera_upstream_exchanges_drain_failed_total" { v["drain_failed"] = $2 }
    END {
      n = split(keys, k, " ")
      for (i = 1; i <= n; i++) {
        if (v[k[i]] == "") exit 1
        printf "%s%s", v[k[i]], (i < n ? " " : "\n")
      }
    }' || die "no closed-connection counters in tessera-pool16's metrics"
}

# close_delta C REP BEFORE AFTER: "C REP" and each AFTER - BEFORE field, tab-separated.
close_delta() {
  local line="$1"$'\t'"$2" i
  local -a b a
  read -ra b <<<"$3"
  read -ra a <<<"$4"
  for i in "${!a[@]}"; do line+=$'\t'"$((a[i] - b[i]))"; done
  printf '%s\n' "$line"
}

if has_section close; then
  t0=$(date +%s)
  start_tessera tessera-pool16 "$P_TPOOL"
  check_target tessera-pool16 "${URL_OF[tessera-pool16]}" "$TOK_HS512"
  closes_start="$(pool_closes)"
  echo "c rep $POOL_CLOSE_KEYS" | tr ' ' '\t' >"$WORK/close-closes.tsv"
  log "close: wrk -H 'Connection: close'; tessera-pool16 (max_connections = $POOL_CAP) c=8, c=64; nginx-proxy c=8"
  for ((rep = 1; rep <= REPS; rep++)); do
    for cell in "tessera-pool16 8" "nginx-proxy 8" "tessera-pool16 64"; do
      read -r target c <<<"$cell"
      log "close rep $rep/$REPS c=$c $target"
      # Whose sockets to the origin are counted: tessera's, or the nginx proxy's worker.
      owner="${PID_OF[$target]}"
      [[ $target == nginx-proxy ]] && owner="$(pgrep -P "$owner" | head -1)"
      if [[ $target == tessera-pool16 ]]; then
        closes_before="$(pool_closes)"
      fi
      SAMPLE_PID="$owner" measure close "$target" "$c" "$rep" "$WORK/tok/hs512.lua" \
        -H "Connection: close"
      if [[ $target == tessera-pool16 ]]; then
        # Exchanges left at wrk's end finish or close within DRAIN_WAIT (250 ms).
        sleep 0.5
        # Assigned first: a failed scrape stops the suite (set -e) instead of writing a short line.
        closes_after="$(pool_closes)"
        close_delta "$c" "$rep" "$closes_before" "$closes_after" >>"$WORK/close-closes.tsv"
      fi
    done
  done
  # The whole section: the runs, the first fill and the time between runs.
  closes_after="$(pool_closes)"
  close_delta all all "$closes_start" "$closes_after" >>"$WORK/close-closes.tsv"
  echo "tessera-pool16 $(proc_mem "${PID_OF[tessera-pool16]}")" >"$WORK/close-mem.txt"
  stop_named tessera-pool16
  PID_OF[tessera-pool16]=""
  section_done close "$t0"
fi

# ---------------------------------------------------------------- section: revocation
if has_section revocation; then
  t0=$(date +%s)
  start_tessera tessera-b "$P_TB"
  mk_tokens rev "$REVOCATION_TRIALS" --jwt-secret "file:$WORK/keys/jwt.secret"
  log "revocation: $REVOCATION_TRIALS trials, A = tessera-redis, B = tessera-b, DEL in Redis"
  "$PY" "$BENCH/revocation.py" --a "http://127.0.0.1:$P_TR" --b "http://127.0.0.1:$P_TB" \
    --redis "$REDIS" --sessions "$WORK/tok/rev.jsonl" --trials "$REVOCATION_TRIALS" \
    --out "$WORK/revocation.json" >/dev/null || die "revocation.py failed"
  stop_named tessera-b
  PID_OF[tessera-b]=""
  section_done revocation "$t0"
fi

# ---------------------------------------------------------------- section: affinity
# affinity_waits: tessera-affinity's handovers and expired waits for a user's own connection so
# far (tessera_upstream_affinity_{handovers,waits_expired}_total), as "handovers expired".
affinity_waits() {
  curl -s --max-time 5 "http://127.0.0.1:$P_TAFF_METRICS/metrics" | awk '
    $1 == "tessera_upstream_affinity_handovers_total" { h = $2 }
    $1 == "tessera_upstream_affinity_waits_expired_total" { e = $2 }
    END { if (h == "" || e == "") exit 1; print h, e }' ||
    die "no affinity wait counters in tessera-affinity's metrics"
}

if has_section affinity; then
  t0=$(date +%s)
  start_tessera tessera-affinity "$P_TAFF"
  declare -A PORT_OF=([tessera-redis]="$P_TR" [tessera-affinity]="$P_TAFF")
  declare -A COUNT_OF=([many]="$SESSIONS" [few]="$AFFINITY_FEW_SESSIONS")
  log "affinity: tokens.py --distinct-users, $SESSIONS and $AFFINITY_FEW_SESSIONS sessions"
  for group in many few; do
    mk_tokens "aff-$group" "${COUNT_OF[$group]}" --jwt-secret "file:$WORK/keys/jwt.secret" --distinct-users
    # The measurement means nothing unless each session injects its own credential.
    n="$(distinct_credentials "$WORK/tok/aff-$group.jsonl")" || die "could not read the $group sessions back"
    [[ $n == "${COUNT_OF[$group]}" ]] ||
      die "$group set: $n distinct credentials among ${COUNT_OF[$group]} sessions"
  done
  # Warm-up (not recorded): every token once through each instance (caches filled), then 1 s of
  # wrk at c=64 per (instance, set) (pools open).
  log "affinity warm-up: every token once per instance, 1 s at c=64 per (instance, set)"
  for target in tessera-redis tessera-affinity; do
    check_target "$target" "${URL_OF[$target]}" "$(first_token "$WORK/tok/aff-few.jsonl")"
    for group in many few; do
      warm_tokens "$WORK/tok/aff-$group.jsonl" "${PORT_OF[$target]}" 2 >/dev/null ||
        die "affinity warm-up of $target ($group) failed"
      wrk -t 2 -c 64 -d 1s -s "$WORK/tok/aff-$group.lua" "${URL_OF[$target]}" \
        >"$RAW/warmup-affinity-$target-$group.txt" 2>&1 || die "warm-up wrk failed for $target ($group)"
    done
  done
  log "affinity: (tessera-redis none, tessera-affinity session) x ($SESSIONS, $AFFINITY_FEW_SESSIONS" \
    "sessions) x c in (${AFFINITY_CONCURRENCIES[*]}) x $REPS reps x $DURATION"
  for ((rep = 1; rep <= REPS; rep++)); do
    for c in "${AFFINITY_CONCURRENCIES[@]}"; do
      for group in many few; do
        for target in tessera-redis tessera-affinity; do
          log "affinity rep $rep/$REPS c=$c ${COUNT_OF[$group]} sessions $target"
          if [[ $target == tessera-affinity ]]; then before="$(affinity_waits)"; fi
          measure "affinity_$group" "$target" "$c" "$rep" "$WORK/tok/aff-$group.lua"
          if [[ $target == tessera-affinity ]]; then
            after="$(affinity_waits)"
            read -r h0 e0 <<<"$before"
            read -r h1 e1 <<<"$after"
            printf 'affinity_%s\t%s\t%s\t%s\t%s\n' "$group" "$c" "$rep" "$((h1 - h0))" "$((e1 - e0))" \
              >>"$WORK/affinity-waits.tsv"
          fi
        done
      done
    done
  done
  echo "tessera-affinity $(proc_mem "${PID_OF[tessera-affinity]}")" >"$WORK/affinity-mem.txt"
  stop_named tessera-affinity
  PID_OF[tessera-affinity]=""
  section_done affinity "$t0"
fi

# ---------------------------------------------------------------- section: memory
if has_section memory; then
  t0=$(date +%s)
  start_tessera tessera-mem "$P_TMEM"
  read -r MEM_RSS0 MEM_HWM0 < <(proc_mem "${PID_OF[tessera-mem]}")
  log "memory: tokens.py $MEMORY_SESSIONS sessions"
  mem_t0=$(date +%s)
  "$PY" "$BENCH/tokens.py" --count "$MEMORY_SESSIONS" --redis "$REDIS" \
    --cred-key "file:$WORK/keys/cred.key" --jwt-secret "file:$WORK/keys/jwt.secret" \
    --user alice --password-env BENCH_PASSWORD --out "$WORK/tok/mem.tokens" --format plain >&2
  MEM_CREATE_S=$(($(date +%s) - mem_t0))
  warm_pass() { warm_tokens "$WORK/tok/mem.tokens" "$P_TMEM" 4; }
  log "memory: pass 1, every session once"
  gets0=$(rcli info commandstats | sed -n 's/^cmdstat_get:calls=\([0-9]*\),.*/\1/p')
  read -r MEM_REQ1 MEM_T1 < <(warm_pass) || die "memory pass 1 failed"
  gets1=$(rcli info commandstats | sed -n 's/^cmdstat_get:calls=\([0-9]*\),.*/\1/p')
  sleep 1
  read -r MEM_RSS1 MEM_HWM1 < <(proc_mem "${PID_OF[tessera-mem]}")
  log "memory: pass 2 (cached sessions need no Redis GET)"
  read -r MEM_REQ2 MEM_T2 < <(warm_pass) || die "memory pass 2 failed"
  gets2=$(rcli info commandstats | sed -n 's/^cmdstat_get:calls=\([0-9]*\),.*/\1/p')
  read -r MEM_RSS2 MEM_HWM2 < <(proc_mem "${PID_OF[tessera-mem]}")
  REDIS_USED="$(rcli info memory | sed -n 's/^used_memory:\([0-9]*\).*/\1/p')"
  cat >"$WORK/memory.json" <<EOF
{"sessions": $MEMORY_SESSIONS, "create_s": $MEM_CREATE_S, "session_cache_max_entries": 120000,
 "token_cache_max_entries": $MEMORY_TOKEN_CACHE,
 "start": {"vmrss_kib": $MEM_RSS0, "vmhwm_kib": $MEM_HWM0},
 "after_pass1": {"vmrss_kib": $MEM_RSS1, "vmhwm_kib": $MEM_HWM1, "requests": $MEM_REQ1, "seconds": $MEM_T1, "redis_gets": $((${gets1:-0} - ${gets0:-0}))},
 "after_pass2": {"vmrss_kib": $MEM_RSS2, "vmhwm_kib": $MEM_HWM2, "requests": $MEM_REQ2, "seconds": $MEM_T2, "redis_gets": $((${gets2:-0} - ${gets1:-0}))},
 "redis_used_memory_bytes": ${REDIS_USED:-0}}
EOF
  stop_named tessera-mem
  PID_OF[tessera-mem]=""
  section_done memory "$t0"
fi

# ---------------------------------------------------------------- report
mkdir -p "$RESULTS_DIR"
STAMP="$(date +%Y-%m-%d)"
[[ -e "$RESULTS_DIR/suite-$STAMP.json" ]] && STAMP="$STAMP-$(date +%H%M%S)"
RAWOUT="$RESULTS_DIR/suite-$STAMP.raw.txt"
shopt -s nullglob
raw_files=("$RAW"/*.txt)
shopt -u nullglob
if ((${#raw_files[@]})); then
  for f in "${raw_files[@]}"; do
    printf '===== %s\n' "$(basename "$f" .txt)"
    cat "$f"
  done >"$RAWOUT"
else
  RAWOUT="" # no wrk run (e.g. SECTIONS=memory)
fi

export DURATION REPS SECTIONS SESSIONS EMBEDDED_SESSIONS REVOCATION_TRIALS MEMORY_SESSIONS POOL_CAP
export MEMORY_TOKEN_CACHE AFFINITY_FEW_SESSIONS BUSY_POLL_US
export COMMIT STALE BIN_BUILT BIN_SHA256 SECTION_TIMES STAMP BIN
export EMB_CREATE_S="${EMB_CREATE_S:-}"
BENCH_CMD="DURATION=$DURATION REPS=$REPS"
[[ $SECTIONS != "$ALL_SECTIONS" ]] && BENCH_CMD+=" SECTIONS=\"$SECTIONS\""
[[ $SESSIONS != 1000 ]] && BENCH_CMD+=" SESSIONS=$SESSIONS"
[[ $AFFINITY_FEW_SESSIONS != 16 ]] && BENCH_CMD+=" AFFINITY_FEW_SESSIONS=$AFFINITY_FEW_SESSIONS"
[[ $MEMORY_TOKEN_CACHE != 120000 ]] && BENCH_CMD+=" MEMORY_TOKEN_CACHE=$MEMORY_TOKEN_CACHE"
[[ -n ${TESSERA_BIN:-} ]] && BENCH_CMD+=" TESSERA_BIN=$TESSERA_BIN"
[[ -n ${IDLE_POLL_NS:-} ]] && BENCH_CMD+=" IDLE_POLL_NS=$IDLE_POLL_NS"
[[ $PINNED_C1 != wrk=0,origin=1,proxy=0 ]] && BENCH_CMD+=" PINNED_C1=$PINNED_C1"
export PINNED_C1
export BENCH_CMD+=" bench/suite.sh"
export NPROC="$(nproc)"
export IDLE
export KERNEL="$(uname -sr)"
export CPU="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
export MEM_TOTAL="$(awk '/^MemTotal:/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
export NGINX_V="$(nginx -v 2>&1 | sed 's/^nginx version: //')"
export WRK_V="$(wrk -v 2>&1 | head -1 | sed 's/ Copyright.*//')"
export REDIS_V="$(redis-server --version | sed 's/ sha=.*//')"
export PY_V="$("$PY" --version 2>&1)"
export TESSERA_V="$("$BIN" --version 2>/dev/null || echo unknown)"
export LOAD_START
export LOAD_END="$(cut -d' ' -f1-3 /proc/loadavg)"
export ELAPSED=$(($(date +%s) - START_EPOCH))
export WHEN="$(date -u '+%Y-%m-%d %H:%M:%S UTC')"
LOGS=""
for f in "$WORK"/*.log; do
  LOGS+="$(basename "$f"):$(grep -c . "$f" || true) "
done
export LOGS

"$PY" "$BENCH/suite_report.py" --work "$WORK" --json "$RESULTS_DIR/suite-$STAMP.json" \
  --md "$RESULTS_DIR/suite-$STAMP.md" --raw-name "$([[ -n $RAWOUT ]] && basename "$RAWOUT")"
for section in matrix scaled algs close affinity; do
  if "$PY" -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get(sys.argv[2]) else 1)' \
    "$RESULTS_DIR/suite-$STAMP.json" "$section"; then
    "$PY" "$BENCH/plot.py" "$RESULTS_DIR/suite-$STAMP.json" --section "$section" \
      --out-dir "$RESULTS_DIR" --title "$section" >&2
  fi
done

KEEP_WORK=0
log "results: $RESULTS_DIR/suite-$STAMP.{json,md}${RAWOUT:+ (raw wrk output: $RAWOUT)}"
log "took $(($(date +%s) - START_EPOCH)) s"
