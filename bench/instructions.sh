#!/usr/bin/env bash
# User-space instructions per proxied request, counted by callgrind: a cost measure that does not
# move with the machine's load (req/s on this shared 2-core VM varies by 10-40% within an hour).
#
#   BINS="/tmp/tessera-old target/release/tessera" bench/instructions.sh
#   N=5000 C=8 bench/instructions.sh
#
# Env: BINS (default target/release/tessera), N requests measured (5000), C connections (8; with
# C = N, each request on a connection of its own, so the figure is a request and its connection),
# HELD connections for the memory measure (2000; 0 skips it), EXTRA_TOML (appended to every
# tessera config as is, e.g. EXTRA_TOML=$'[metrics]\nlisten = "127.0.0.1:0"'), SHAPE (tessera:
# as below; compat: the session in a Redis holding 1,000 hyper-auth-proxy records, read with
# `session.format = "hyper-auth-proxy"` and `credentials.allow_plaintext_legacy = true`, the token
# sent as the base64 `Authorization` cookie: `token.sources = ["cookie-b64:Authorization",
# "bearer"]`, see bench/ab.sh SHAPE=compat; needs redis-server), PROTO (h1: `h2load --h1` on the
# plain listener; h2c: `h2load -m1`, HTTP/2 with prior knowledge on the plain listener; h2: `h2load
# -m1` over TLS 1.3 to a `[tls]` listener and to nginx-proxy with `ssl http2`, one ECDSA P-256
# certificate for both).
# For each binary: an nginx origin (worker_processes 1, the 1 KiB JSON at /1k) and one
# `tessera serve` under `valgrind --tool=callgrind` (`[server] threads = 1`, embedded store,
# warn log, no access log, one session made with `tessera session create`), driven by
# `h2load --h1 -c C` with the bearer token. Two runs: 500 warm-up requests, then 500 + N; the
# difference of the two runs' total Ir (every thread, start-up and shutdown included in both) over
# N is the cost of one warm request in user space (kernel time is not counted: compare it with
# bench/ab.sh's CPU µs/req).
# Last, the same two runs of nginx as a plain keep-alive proxy (no auth, `master_process off`),
# the floor. Output: one line per target on stdout: label, Ir per request, the two totals.
# Then, with HELD > 0, memory per client connection: each target again, not under valgrind, holds
# HELD keep-alive connections, each after one answered request (a Python client), opened one by
# one (each answered before the next opens), then HELD more in a burst (all requests sent before
# any answer is read); for each, the growth of the process's VmRSS over HELD is printed as bytes
# per connection.
# Needs valgrind, nginx, h2load, curl, python3.
set -euo pipefail
PROTO="${PROTO:-h1}" SHAPE="${SHAPE:-tessera}" BINS="${BINS:-target/release/tessera}" N="${N:-5000}" C="${C:-8}" HELD="${HELD:-2000}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[instructions %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for t in valgrind nginx h2load curl python3; do command -v "$t" >/dev/null || die "$t is not installed"; done
[[ "$N" =~ ^[1-9][0-9]*$ && "$C" =~ ^[1-9][0-9]*$ ]] || die "N and C must be positive integers"
[[ "$HELD" =~ ^(0|[1-9][0-9]*)$ ]] || die "HELD must be a non-negative integer"
[[ $SHAPE == tessera || $SHAPE == compat ]] || die "SHAPE must be tessera or compat, got '$SHAPE'"
[[ $PROTO == h1 || $PROTO == h2c || $PROTO == h2 ]] || die "PROTO must be h1, h2c or h2, got '$PROTO'"
((HELD == 0)) || [[ $PROTO == h1 ]] || die "HELD > 0 needs PROTO=h1 (the held connections speak HTTP/1.1 in clear): set HELD=0"
[[ $SHAPE == tessera ]] || command -v redis-server >/dev/null || die "SHAPE=compat needs redis-server"
# The client and the target each hold HELD sockets (nginx-proxy also one per upstream connection).
if ((HELD > 0 && $(ulimit -n) < 4 * HELD + 256)); then
  ulimit -n $((4 * HELD + 256)) 2>/dev/null ||
    die "HELD=$HELD needs $((4 * HELD + 256)) open files, the limit is $(ulimit -n): lower HELD or raise it"
fi

work_dir tessera-ir # WORK, PIDS and the cleanup: bench/lib.sh
write_1k "$WORK/1k.json"
read -r P_ORIGIN P_T P_REDIS P_PLAIN < <(free_ports 4)
# The client's command line for PROTO, before -n; the URL's scheme.
case $PROTO in
  h1) CLIENT=(h2load --h1) SCHEME=http ;;
  h2c) CLIENT=(h2load -m1) SCHEME=http ;;
  h2) CLIENT=(h2load -m1) SCHEME=https ;;
esac
if [[ $PROTO == h2 ]]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 7 -subj /CN=localhost \
    -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout "$WORK/key.pem" -out "$WORK/cert.pem" 2>/dev/null
fi
nginx_start origin "$P_ORIGIN" "  server { listen 127.0.0.1:$P_ORIGIN; keepalive_requests 1000000;
    location = /1k { default_type application/json; alias $WORK/1k.json; } }" $((2 * HELD + 1024))

# one REQUESTS COMMAND...: total Ir of COMMAND under callgrind serving 500 + REQUESTS requests
# on port P_T.
one() {
  local n=$1 vp total=0 f t
  shift
  rm -f "$WORK"/cg.out.*
  valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.out.%p" "$@" >"$WORK/vg.log" 2>&1 &
  vp=$!
  wait_port "$P_T" "$1 under callgrind" "$vp"
  for k in warm run; do
    local count=500
    [[ $k == run ]] && count=$n
    ((count > 0)) || continue
    "${CLIENT[@]}" -n "$count" -c "$C" -H "$AUTH" "$SCHEME://127.0.0.1:$P_T/1k" \
      >"$WORK/h2load.out" 2>&1 || die "h2load failed: $(cat "$WORK/h2load.out")"
    grep -q "^status codes: $count 2xx" "$WORK/h2load.out" || die "not all 2xx: $(grep '^status' "$WORK/h2load.out")"
  done
  kill -TERM "$vp" && wait "$vp" 2>/dev/null || true
  for f in "$WORK"/cg.out.*; do
    t="$(sed -n 's/^summary: *//p' "$f" | head -1)"
    total=$((total + ${t:-0}))
  done
  echo "$total"
}

# held LABEL COMMAND...: COMMAND (listening on P_T) holds HELD connections opened one by one, then
# HELD more opened in a burst, one request answered on each; prints "LABEL: " and its VmRSS growth
# per connection for each. Any failure ends the script (the
# process is in PIDS, so the cleanup stops it).
held() {
  local label=$1 p
  shift
  "$@" >"$WORK/held.log" 2>&1 &
  p=$!
  PIDS+=("$p")
  wait_port "$P_T" "$label" "$p"
  printf '%s: ' "$label"
  python3 - "$p" "$P_T" "$HELD" "$AUTH" <<'PY' || die "$label: held-connection run failed (log: $WORK/held.log)"
import socket, sys, time
pid, port, n, auth = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def rss_kib():
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
request = f"GET /1k HTTP/1.1\r\nHost: bench\r\n{auth}\r\n\r\n".encode()
warm = socket.create_connection(("127.0.0.1", port))  # first request: caches and pool warm
warm.sendall(request)
warm.recv(65536)
time.sleep(0.2)
before = rss_kib()
def answered(s):
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        if not chunk:
            sys.exit("connection closed before the answer")
        got += chunk
    if not got.startswith(b"HTTP/1.1 200"):
        sys.exit(f"not 200: {got[:40]!r}")
# One by one: each connection is answered before the next opens (connections that went idle over
# time); then a burst: all send before any answer is read (their requests in flight at once).
held, out = [], []
for mode in ("one by one", "burst"):
    before = rss_kib()
    batch = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(request)
        if mode == "one by one":
            answered(s)
        batch.append(s)
    for s in batch if mode == "burst" else []:
        answered(s)
    held += batch
    time.sleep(0.5)
    after = rss_kib()
    out.append(f"{mode}: VmRSS {before} -> {after} KiB, {(after - before) * 1024 // n} bytes per held connection")
print("; ".join(out))
PY
  kill -TERM "$p" && wait "$p" 2>/dev/null || true
}

read -r -a BIN_ARGS <<<"$BINS"
mkdir -p "$WORK/keys" && chmod 700 "$WORK/keys"
b0="${BIN_ARGS[0]}"
[[ $b0 != /* && ! -e $b0 && -e "$ROOT/$b0" ]] && b0="$ROOT/$b0"
tessera_keys "$b0" # one key pair for every binary: bench/lib.sh
STORE_LINES="" TOKEN_LINES="" CRED_LINES=""
if [[ $SHAPE == compat ]]; then
  compat_redis "$P_REDIS"
  AUTH="Cookie: Authorization=$(head -1 "$COMPAT_TOKENS")"
  STORE_LINES=$'format = "hyper-auth-proxy"'
  TOKEN_LINES=$'sources = ["cookie-b64:Authorization", "bearer"]'
  CRED_LINES=$'allow_plaintext_legacy = true'
fi
for i in "${!BIN_ARGS[@]}"; do
  b="${BIN_ARGS[$i]}"
  [[ $b != /* && ! -e $b && -e "$ROOT/$b" ]] && b="$ROOT/$b"
  [[ -x $b ]] || die "$b is not an executable file (build it first)"
  mkdir -p "$WORK/t$i" && chmod 700 "$WORK/t$i"
  store="embedded:$WORK/t$i/sessions"
  [[ $SHAPE == tessera ]] || store="redis://127.0.0.1:$P_REDIS/"
  cat >"$WORK/t$i/t.toml" <<EOF
[server]
listen = "127.0.0.1:$P_T"
threads = 1
[upstream]
url = "http://127.0.0.1:$P_ORIGIN"
[token]
secret = "file:$WORK/keys/jwt.secret"
$TOKEN_LINES
[session]
store = "$store"
$STORE_LINES
[credentials]
keys = { k1 = "file:$WORK/keys/cred.key" }
$CRED_LINES
[log]
level = "warn"
access_log = false
EOF
  if [[ $PROTO == h2 ]]; then # TLS on P_T, the plain listener beside it
    sed -i "s/^listen = \"127.0.0.1:$P_T\"/listen = \"127.0.0.1:$P_PLAIN\"/" "$WORK/t$i/t.toml"
    printf '[tls]\nlisten = "127.0.0.1:%s"\ncertificate = "file:%s"\nprivate_key = "file:%s"\n' \
      "$P_T" "$WORK/cert.pem" "$WORK/key.pem" >>"$WORK/t$i/t.toml"
  fi
  [[ -z ${EXTRA_TOML:-} ]] || printf '%s\n' "$EXTRA_TOML" >>"$WORK/t$i/t.toml"
  if [[ $SHAPE == tessera ]]; then
    token="$(printf '%s\n' bench-password | "$b" session create --config "$WORK/t$i/t.toml" --user alice \
      --password-stdin | sed -n 's/.*"token" *: *"\([^"]*\)".*/\1/p' | head -1)"
    [[ -n $token ]] || die "no token from $b session create"
    AUTH="Authorization: Bearer $token"
  fi
  log "t$i = $b: two callgrind runs (500, then 500 + $N requests, c=$C)"
  a="$(one 0 "$b" serve --config "$WORK/t$i/t.toml")"
  z="$(one "$N" "$b" serve --config "$WORK/t$i/t.toml")"
  printf 't%s %s: %d Ir per request (totals %d and %d)\n' "$i" "$b" $(((z - a) / N)) "$a" "$z"
  if ((HELD > 0)); then
    log "t$i = $b: $HELD held connections"
    held "t$i $b" "$b" serve --config "$WORK/t$i/t.toml"
  fi
done

# The floor for reference: nginx as a plain keep-alive proxy (no auth), one process
# (`master_process off`), the same port, requests and client; the token header is sent and ignored.
mkdir -p "$WORK/tmp"
NGINX_LISTEN="" NGINX_TLS=""
[[ $PROTO == h2c ]] && NGINX_LISTEN=" http2"
[[ $PROTO == h2 ]] && NGINX_LISTEN=" ssl http2" NGINX_TLS="
    ssl_certificate $WORK/cert.pem; ssl_certificate_key $WORK/key.pem; ssl_protocols TLSv1.3;"
cat >"$WORK/proxy.conf" <<EOF
master_process off; daemon off; pid $WORK/proxy.pid; error_log $WORK/proxy-error.log warn;
events { worker_connections $((2 * C + 1024)); }
http { access_log off; client_body_temp_path $WORK/tmp; proxy_temp_path $WORK/tmp;
  fastcgi_temp_path $WORK/tmp; uwsgi_temp_path $WORK/tmp; scgi_temp_path $WORK/tmp;
  upstream origin_pool { server 127.0.0.1:$P_ORIGIN; keepalive 64; keepalive_requests 1000000; }
  server { listen 127.0.0.1:$P_T$NGINX_LISTEN; keepalive_requests 1000000;$NGINX_TLS
    location / { proxy_pass http://origin_pool; proxy_http_version 1.1; proxy_set_header Connection ""; } } }
EOF
log "nginx-proxy: two callgrind runs (500, then 500 + $N requests, c=$C)"
a="$(one 0 nginx -e "$WORK/proxy-error.log" -p "$WORK" -c "$WORK/proxy.conf")"
z="$(one "$N" nginx -e "$WORK/proxy-error.log" -p "$WORK" -c "$WORK/proxy.conf")"
printf 'nginx-proxy: %d Ir per request (totals %d and %d)\n' $(((z - a) / N)) "$a" "$z"
if ((HELD > 0)); then
  log "nginx-proxy: $HELD held connections"
  sed -i "s/worker_connections $((2 * C + 1024))/worker_connections $((4 * HELD + 2 * C + 1024))/" "$WORK/proxy.conf"
  held nginx-proxy nginx -e "$WORK/proxy-error.log" -p "$WORK" -c "$WORK/proxy.conf"
fi
KEEP_WORK=0
