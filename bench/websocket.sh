#!/usr/bin/env bash
# WebSocket tunnel load: round trips through tessera vs the echo server directly vs nginx as a
# WebSocket proxy, one run, loopback.
#   bench/websocket.sh
#   BINS="/tmp/tessera-old target/release/tessera" CONC="1 8" SIZES=64 DURATION=3 REPS=1 bench/websocket.sh
# Env: BINS (space-separated tessera binaries, default target/release/tessera; labeled t0, t1, ...),
# CONC ("1 8 64": WebSockets open at once), SIZES ("64 16384": bytes per message), DURATION (5,
# seconds recorded per run), WARMUP (1, seconds per run not recorded), REPS (3), WS_BENCH (the load
# tool, default: built from examples/ws_bench.rs with `cargo build --release --example ws_bench`),
# IDLE_POLL_NS (the guest's cpuidle haltpoll polling for the run, ns: bench/lib.sh idle_poll_apply).
# Processes (127.0.0.1, free ports, stopped by PID on exit, the work dir kept on failure):
# `ws_bench echo` (tokio-tungstenite, one thread: every message sent back); nginx-proxy (one worker,
# proxying the upgrade to the echo server: `proxy_http_version 1.1` and `Upgrade`/`Connection`
# set, the nginx documentation's WebSocket recipe); per binary one `tessera serve` (embedded store,
# log level warn, no access log, upstream.max_connections 256, websocket.max_connections 128, all
# of them for one user) with one session (`tessera session create`), every handshake carrying its
# token as a bearer.
# Each rep, size and c, round-robin over direct, nginx-proxy, t0, t1, ...: `ws_bench load` opens c
# WebSockets, and each sends a binary message and waits for its echo, again and again, for WARMUP +
# DURATION seconds (one client thread). Per run: round trips/s, round-trip p50/p99, and the proxy's
# CPU (user+sys from /proc/PID/stat; nginx: its worker) per round trip.
# Output: Markdown on stdout (medians per target, size and c; vs direct and vs nginx-proxy), also in
# bench/results/websocket-<date>-<time>.md with the command line. Progress on stderr. Needs nginx,
# curl, python3, cargo.
set -euo pipefail

CONC="${CONC:-1 8 64}" SIZES="${SIZES:-64 16384}" DURATION="${DURATION:-5}" WARMUP="${WARMUP:-1}"
REPS="${REPS:-3}" BINS="${BINS:-target/release/tessera}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[websocket %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for tool in nginx curl python3; do command -v "$tool" >/dev/null || die "$tool is not installed"; done

if [[ -z ${WS_BENCH:-} ]]; then
  log "building examples/ws_bench.rs"
  (cd "$ROOT" && cargo build --release --quiet --example ws_bench) || die "cannot build ws_bench"
  WS_BENCH="$ROOT/target/release/examples/ws_bench"
fi
read -r -a BIN_LIST <<<"$BINS"
BIN_PATHS=() LABELS=()
for i in "${!BIN_LIST[@]}"; do
  b="${BIN_LIST[$i]}"
  [[ $b == /* || -e $b ]] || b="$ROOT/$b"
  [[ -x $b ]] || die "$b is not an executable tessera"
  BIN_PATHS+=("$(cd "$(dirname "$b")" && pwd)/$(basename "$b")") LABELS+=("t$i")
done

work_dir tessera-ws
idle_poll_apply # IDLE_POLL_NS, put back on exit: bench/lib.sh
IDLE="$(idle_state)" # for the report, as the run starts
mkdir -p "$WORK/keys" "$WORK/raw"
read -r -a PORTS <<<"$(free_ports $((2 + ${#LABELS[@]})))"
P_ECHO=${PORTS[0]} P_PROXY=${PORTS[1]}
declare -A URL_OF CPU_PID_OF TOKEN_OF

"$WS_BENCH" echo "$P_ECHO" >"$WORK/echo.log" 2>&1 &
PIDS+=("$!") && wait_port "$P_ECHO" "ws_bench echo" "$!"
URL_OF[direct]="ws://127.0.0.1:$P_ECHO/ws" TOKEN_OF[direct]="" CPU_PID_OF[direct]=""

nginx_start proxy "$P_PROXY" "  server { listen 127.0.0.1:$P_PROXY;
    location / { proxy_pass http://127.0.0.1:$P_ECHO; proxy_http_version 1.1;
      proxy_set_header Upgrade \$http_upgrade; proxy_set_header Connection \"upgrade\";
      proxy_read_timeout 1h; } }"
PROXY_MASTER=$NGINX_PID
for ((i = 0; i < 100; i++)); do # the worker, not the master, does the copying
  CPU_PID_OF[nginx-proxy]="$(pgrep -P "$PROXY_MASTER" | head -1 || true)"
  [[ -n ${CPU_PID_OF[nginx-proxy]} ]] && break || sleep 0.05
done
[[ -n ${CPU_PID_OF[nginx-proxy]} ]] || die "no worker under the nginx-proxy master"
URL_OF[nginx-proxy]="ws://127.0.0.1:$P_PROXY/ws" TOKEN_OF[nginx-proxy]=""

tessera_keys "${BIN_PATHS[0]}"
for i in "${!LABELS[@]}"; do
  t="${LABELS[$i]}" port="${PORTS[$((2 + i))]}"
  mkdir -p "$WORK/emb-$t"
  tessera_toml "$WORK/$t.toml" "$port" "$P_ECHO" "$WORK/emb-$t"
  # Room for c=64 tunnels: each holds an upstream connection, and tunnels stay below the cap.
  sed -i 's/^url = .*/&\nmax_connections = 256/' "$WORK/$t.toml"
  printf '[websocket]\nmax_connections = 128\nmax_connections_per_user = 128\n' >>"$WORK/$t.toml"
  # A build from before websocket.max_connections_per_user has no per-user cap to lift.
  "${BIN_PATHS[$i]}" check-config --config "$WORK/$t.toml" >/dev/null 2>&1 ||
    sed -i '/^max_connections_per_user/d' "$WORK/$t.toml"
  "${BIN_PATHS[$i]}" serve --config "$WORK/$t.toml" >"$WORK/$t.log" 2>&1 &
  CPU_PID_OF[$t]=$! URL_OF[$t]="ws://127.0.0.1:$port/ws" && PIDS+=("$!")
  wait_port "$port" "$t" "$!"
  (umask 077 && printf '%s\n' bench-password | "${BIN_PATHS[$i]}" session create --config "$WORK/$t.toml" \
    --user alice --password-stdin >"$WORK/$t.session" 2>"$WORK/$t.session.err") ||
    die "$t session create failed: $(cat "$WORK/$t.session.err")"
  TOKEN_OF[$t]="$(sed -n 's/.*"token" *: *"\([^"]*\)".*/\1/p' "$WORK/$t.session" | head -1)"
  [[ -n ${TOKEN_OF[$t]} ]] || die "no token in $t's session create output"
  log "started $t (:$port, pid ${CPU_PID_OF[$t]})"
done
TARGETS=(direct nginx-proxy "${LABELS[@]}")

load() { # target c bytes seconds warmup -> one JSON line
  local t=$1 auth=()
  [[ -z ${TOKEN_OF[$t]} ]] || auth=("authorization: Bearer ${TOKEN_OF[$t]}")
  "$WS_BENCH" load "${URL_OF[$t]}" "$2" "$4" "$3" "$5" ${auth[@]+"${auth[@]}"}
}
cpu_ticks() { [[ -z $1 ]] && echo "0 0" || awk '{print $14, $15}' "/proc/$1/stat"; }
for t in "${TARGETS[@]}"; do # every target answers, and tessera refuses a handshake without a token
  load "$t" 1 64 1 0 >/dev/null || die "$t: no echo through it (logs in $WORK)"
done
for t in "${LABELS[@]}"; do
  got="$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 -H 'Connection: Upgrade' -H 'Upgrade: websocket' \
    -H 'Sec-WebSocket-Version: 13' -H 'Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==' \
    "http://${URL_OF[$t]#ws://}" || true)"
  [[ $got == 401 ]] || die "$t answered $got to a handshake without a token, expected 401"
done

read -r -a CONCS <<<"$CONC" && read -r -a SIZE_LIST <<<"$SIZES"
log "runs: ${#TARGETS[@]} targets x sizes (${SIZE_LIST[*]}) x c (${CONCS[*]}) x $REPS reps x (${WARMUP}+${DURATION}) s"
for ((rep = 1; rep <= REPS; rep++)); do
  for size in "${SIZE_LIST[@]}"; do
    for c in "${CONCS[@]}"; do
      for t in "${TARGETS[@]}"; do
        log "rep $rep/$REPS size=$size c=$c $t"
        read -r u0 s0 < <(cpu_ticks "${CPU_PID_OF[$t]}")
        line="$(load "$t" "$c" "$size" "$DURATION" "$WARMUP")" || log "WARNING: $t size=$size c=$c: errors: $line"
        read -r u1 s1 < <(cpu_ticks "${CPU_PID_OF[$t]}")
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$rep" "$size" "$c" "$t" "$((u1 - u0 + s1 - s0))" "$line" >>"$WORK/runs.tsv"
      done
    done
  done
done

mkdir -p "$ROOT/bench/results"
export OUT="$ROOT/bench/results/websocket-$(date +%Y-%m-%d-%H%M%S).md" CLK_TCK="$(getconf CLK_TCK)"
CMD="BINS=\"$BINS\" CONC=\"$CONC\" SIZES=\"$SIZES\" DURATION=$DURATION WARMUP=$WARMUP REPS=$REPS"
[[ -z ${IDLE_POLL_NS:-} ]] || CMD+=" IDLE_POLL_NS=$IDLE_POLL_NS"
export CMD="$CMD bench/websocket.sh"
export COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
export MACHINE="nproc $(nproc), $IDLE, load $(cut -d' ' -f1-3 /proc/loadavg), $(nginx -v 2>&1 | sed 's/^nginx version: //')"
export LABEL_LIST="${LABELS[*]}" BIN_PATH_LIST="${BIN_PATHS[*]}" WARMUP DURATION
python3 - "$WORK/runs.tsv" <<'PY'
import json, os, statistics, sys, time
env = os.environ
runs = []
for line in open(sys.argv[1]):
    rep, size, c, t, ticks, js = line.rstrip("\n").split("\t", 5)
    r = json.loads(js) if js.startswith("{") else {"per_sec": 0, "p50_us": 0, "p99_us": 0, "round_trips": 0, "errors": 1}
    trips = r["round_trips"]
    # The CPU counter spans warm-up + run, the count the run only: scale the count to the span.
    span = (int(env["WARMUP"]) + int(env["DURATION"])) / int(env["DURATION"])
    cpu = int(ticks) / int(env["CLK_TCK"]) * 1e6 / (trips * span) if trips and t != "direct" else None
    runs.append(dict(rep=int(rep), size=int(size), c=int(c), t=t, cpu=cpu, **r))
med = lambda rs, k: statistics.median(v) if (v := [r[k] for r in rs if r[k] is not None]) else None
f1 = lambda x: "" if x is None else f"{x:.1f}"
labels = env["LABEL_LIST"].split()
md = [f"# WebSocket round trips through tessera, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", "",
      f"- command: `{env['CMD']}`", f"- commit: {env['COMMIT']}", f"- machine: {env['MACHINE']}", ""]
md += [f"- {l}: `{p}`" for l, p in zip(labels, env["BIN_PATH_LIST"].split())]
md += ["", "## Medians per target, message size and c", "",
       "| bytes | c | target | round trips/s | p50 | p99 | vs direct | vs nginx-proxy | added p50 | proxy CPU µs/round trip | errors |",
       "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
for size in sorted({r["size"] for r in runs}):
    for c in sorted({r["c"] for r in runs}):
        sel = lambda t: [r for r in runs if r["size"] == size and r["c"] == c and r["t"] == t]
        d, n = med(sel("direct"), "per_sec"), med(sel("nginx-proxy"), "per_sec")
        dp50 = med(sel("direct"), "p50_us")
        for t in ["direct", "nginx-proxy"] + labels:
            rs = sel(t)
            rate, p50, p99, cpu = med(rs, "per_sec"), med(rs, "p50_us"), med(rs, "p99_us"), med(rs, "cpu")
            md.append(f"| {size} | {c} | {t} | {rate:,.0f} | {p50:.0f} µs | {p99:.0f} µs | {rate / d:.2f}x | "
                      f"{rate / n:.2f}x | {'' if t == 'direct' else f'+{p50 - dp50:.0f} µs'} | "
                      f"{f1(cpu)} | {sum(r['errors'] for r in rs)} |")
md += ["", "## Every run", "", "| rep | bytes | c | target | round trips/s | p50 | p99 | max | CPU µs/round trip | errors |",
       "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
md += [f"| {r['rep']} | {r['size']} | {r['c']} | {r['t']} | {r['per_sec']:,.0f} | {r['p50_us']} µs | {r['p99_us']} µs | "
       f"{r.get('max_us', 0)} µs | {f1(r['cpu'])} | {r['errors']} |"
       for r in runs]
md += ["", "A round trip: one binary message of `bytes` from the client and its echo back, on one of c "
       "WebSockets; each WebSocket waits for its echo before sending again. CPU: user+sys of the proxy "
       "process (nginx: its worker) during warm-up and run, over the round trips of both (the warm-up's "
       "count taken at the run's rate). Every process shares the machine's cores.", ""]
text = "\n".join(md)
open(env["OUT"], "w").write(text)
print(text)
print(f"written to {env['OUT']}", file=sys.stderr)
PY
KEEP_WORK=0
