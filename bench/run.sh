#!/usr/bin/env bash
# First load measurement of tessera, in one go on loopback.
#
#   bench/run.sh                      # DURATION=10s REPS=3 (about 5 minutes)
#   DURATION=3s REPS=1 bench/run.sh   # quick smoke run
#
# Targets, each serving the same static 1 KiB JSON file (/1k):
#   direct       nginx itself
#   nginx-proxy  a second nginx server block, plain reverse proxy to `direct` with upstream
#                keepalive: the floor for "one proxy hop, no auth"
#   tessera      target/release/tessera (embedded session store, bearer token) in front of `direct`
#
# For each concurrency c in 1 8 64, every target is run REPS times, round-robin over the targets
# within each repetition, with `wrk -t $((c<2?1:2)) -c $c -d $DURATION --latency`. Reported: the
# median req/s, median p50 and median p99 of the repetitions. Before each wrk run curl checks that
# the target answers 200 with the 1 KiB body, and that tessera answers 401 without the token.
#
# Needs target/release/tessera (cargo build --release; this script never builds), nginx, wrk,
# curl and python3. nginx and wrk are installed with apt-get when missing (root only).
# Everything listens on 127.0.0.1 only; every process started here is stopped by PID on exit.
# Output: a Markdown table on stdout, and the same with the machine details in
# bench/results/first-load-<date>.md (raw wrk output beside it in first-load-<date>.raw.txt).
set -euo pipefail

DURATION="${DURATION:-10s}"
REPS="${REPS:-3}"
CONCURRENCIES=(1 8 64)
TARGETS=(direct nginx-proxy tessera)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/target/release/tessera"
RESULTS_DIR="$ROOT/bench/results"
START_EPOCH=$(date +%s)
LOAD_START="$(cut -d' ' -f1-3 /proc/loadavg)"

log() { printf '[bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

[[ "$REPS" =~ ^[1-9][0-9]*$ ]] || die "REPS must be a positive integer, got '$REPS'"
[[ "$DURATION" =~ ^[0-9]+[smh]?$ ]] || die "DURATION must look like 10s, 1m, 30, got '$DURATION'"

# ---------------------------------------------------------------- processes and cleanup
PIDS=()
WORK=""
KEEP_WORK=1 # cleared after a successful run

stop_pid() {
  local pid=$1 i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.05
  done
  kill -KILL "$pid" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local i
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    stop_pid "${PIDS[$i]}"
  done
  # Reap them (they are our children) so no zombie outlives the script.
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    wait "${PIDS[$i]}" 2>/dev/null || true
  done
  if [[ -n "$WORK" && -d "$WORK" ]]; then
    if [[ $KEEP_WORK -eq 1 ]]; then
      log "run failed (exit $rc): logs kept in $WORK (nginx: error.log, tessera: tessera.log, wrk: raw/)"
    else
      rm -rf "$WORK"
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- prerequisites
need_apt=()
command -v nginx >/dev/null 2>&1 || need_apt+=(nginx)
command -v wrk >/dev/null 2>&1 || need_apt+=(wrk)
if ((${#need_apt[@]})); then
  [[ $(id -u) -eq 0 ]] || die "missing ${need_apt[*]}: run as root or apt-get install ${need_apt[*]}"
  log "installing ${need_apt[*]} with apt-get"
  # Keep the package's postinst from starting a system nginx on port 80.
  added_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    added_policy=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >&2
  [[ $added_policy -eq 1 ]] && rm -f /usr/sbin/policy-rc.d
fi
for tool in curl python3 nginx wrk git; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is not installed"
done
[[ -x "$BIN" ]] || die "$BIN not found: build it first with 'cargo build --release'"
STALE=""
if [[ -n "$(find "$ROOT/src" "$ROOT/Cargo.toml" "$ROOT/Cargo.lock" -newer "$BIN" -print -quit 2>/dev/null)" ]]; then
  STALE="yes"
  log "WARNING: sources are newer than $BIN; the numbers are for the binary as built"
fi
# Recorded now, at the start: the tree may move while the run goes on.
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if ! git -C "$ROOT" diff --quiet HEAD -- src Cargo.toml Cargo.lock 2>/dev/null; then
  COMMIT="$COMMIT (src/Cargo files modified vs HEAD at start)"
fi
BIN_BUILT="$(date -u -r "$BIN" '+%Y-%m-%d %H:%M:%S UTC')"

# ---------------------------------------------------------------- work dir and ports
WORK="$(mktemp -d /tmp/tessera-bench.XXXXXX)"
# nginx workers run as nobody when started as root: let them traverse to 1k.json.
chmod 711 "$WORK"
mkdir -p "$WORK/tmp" "$WORK/raw" "$WORK/sessions"

# Three distinct free loopback ports: all bound at once, then released.
read -r P_DIRECT P_PROXY P_TESSERA < <(free_ports 3)


# ---------------------------------------------------------------- nginx (direct + plain proxy)
# The same 1 KiB JSON body as tests/support/mod.rs one_kib_json().
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

cat >"$WORK/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK/nginx.pid;
error_log $WORK/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/tmp; proxy_temp_path $WORK/tmp; fastcgi_temp_path $WORK/tmp;
  uwsgi_temp_path $WORK/tmp; scgi_temp_path $WORK/tmp;

  # direct: the origin, also tessera's upstream.
  server {
    listen 127.0.0.1:$P_DIRECT;
    keepalive_requests 1000000;
    location = /1k { default_type application/json; alias $WORK/1k.json; }
  }

  # nginx-proxy: plain reverse proxy to direct, pooled keep-alive upstream connections, no auth.
  upstream direct_pool {
    server 127.0.0.1:$P_DIRECT;
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

log "starting nginx (direct :$P_DIRECT, nginx-proxy :$P_PROXY) in $WORK"
nginx -e "$WORK/error.log" -p "$WORK" -c "$WORK/nginx.conf" >"$WORK/nginx.out" 2>&1 &
NGINX_PID=$!
PIDS+=("$NGINX_PID")
wait_port "$P_DIRECT" nginx "$NGINX_PID"
wait_port "$P_PROXY" nginx "$NGINX_PID"

# ---------------------------------------------------------------- tessera
KEYS="$("$BIN" keygen)"
JWT_SECRET="$(sed -n 's/^TESSERA_JWT_SECRET=//p' <<<"$KEYS")"
CRED_KEY="$(sed -n 's/^TESSERA_CRED_KEY=//p' <<<"$KEYS")"
[[ ${#JWT_SECRET} -ge 64 ]] || die "tessera keygen gave no usable TESSERA_JWT_SECRET"
[[ -n "$CRED_KEY" ]] || die "tessera keygen gave no TESSERA_CRED_KEY"

touch "$WORK/tessera.toml" && chmod 600 "$WORK/tessera.toml" # holds the secrets
cat >"$WORK/tessera.toml" <<EOF
[server]
listen = "127.0.0.1:$P_TESSERA"
[upstream]
url = "http://127.0.0.1:$P_DIRECT"
[token]
secret = "$JWT_SECRET"
[session]
store = "embedded:$WORK/sessions"
[credentials]
keys = { k1 = "$CRED_KEY" }
[log]
level = "warn"
access_log = false
EOF

log "starting tessera (:$P_TESSERA)"
"$BIN" serve --config "$WORK/tessera.toml" >"$WORK/tessera.log" 2>&1 &
TESSERA_PID=$!
PIDS+=("$TESSERA_PID")
wait_port "$P_TESSERA" tessera "$TESSERA_PID"

SESSION_JSON="$(printf 'bench-password\n' | "$BIN" session create --config "$WORK/tessera.toml" --user alice --password-stdin)"
TOKEN="$(python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["token"])' <<<"$SESSION_JSON")"
[[ -n "$TOKEN" ]] || die "session create printed no token: $SESSION_JSON"

# ---------------------------------------------------------------- checks and runs
url_of() {
  case $1 in
    direct) echo "http://127.0.0.1:$P_DIRECT/1k" ;;
    nginx-proxy) echo "http://127.0.0.1:$P_PROXY/1k" ;;
    tessera) echo "http://127.0.0.1:$P_TESSERA/1k" ;;
  esac
}

check_target() { # target url
  local target=$1 url=$2 got
  if [[ $target == tessera ]]; then
    got="$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$url" || true)"
    [[ $got == 401 ]] || die "tessera answered $got without a token, expected 401 (auth not enforced?)"
    got="$(curl -s -o /dev/null -w '%{http_code} %{size_download}' --max-time 5 -H "Authorization: Bearer $TOKEN" "$url" || true)"
  else
    got="$(curl -s -o /dev/null -w '%{http_code} %{size_download}' --max-time 5 "$url" || true)"
  fi
  [[ $got == "200 1024" ]] || die "$target ($url) answered '$got', expected '200 1024' (status, body bytes)"
}

log "plan: ${#TARGETS[@]} targets x c in (${CONCURRENCIES[*]}) x $REPS reps x $DURATION"
for ((rep = 1; rep <= REPS; rep++)); do
  for c in "${CONCURRENCIES[@]}"; do
    for target in "${TARGETS[@]}"; do
      url="$(url_of "$target")"
      check_target "$target" "$url"
      threads=$((c < 2 ? 1 : 2))
      args=(-t "$threads" -c "$c" -d "$DURATION" --latency)
      [[ $target == tessera ]] && args+=(-H "Authorization: Bearer $TOKEN")
      out="$WORK/raw/$target-c$c-r$rep.txt"
      log "rep $rep/$REPS c=$c $target"
      wrk "${args[@]}" "$url" >"$out" 2>&1 &
      WRK_PID=$!
      PIDS+=("$WRK_PID")
      wait "$WRK_PID" || die "wrk failed for $target c=$c rep $rep: $(cat "$out")"
      kill -0 "$NGINX_PID" 2>/dev/null || die "nginx died during the run"
      kill -0 "$TESSERA_PID" 2>/dev/null || die "tessera died during the run"
    done
  done
done

# ---------------------------------------------------------------- report
mkdir -p "$RESULTS_DIR"
STAMP="$(date +%Y-%m-%d)"
RESULT="$RESULTS_DIR/first-load-$STAMP.md"
[[ -e "$RESULT" ]] && STAMP="$STAMP-$(date +%H%M%S)" && RESULT="$RESULTS_DIR/first-load-$STAMP.md"
RAW="$RESULTS_DIR/first-load-$STAMP.raw.txt"

ELAPSED=$(($(date +%s) - START_EPOCH))

export REPS DURATION COMMIT ELAPSED STALE BIN_BUILT
export BENCH_CMD="DURATION=$DURATION REPS=$REPS bench/run.sh"
export NPROC="$(nproc)"
export KERNEL="$(uname -sr)"
export CPU="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
export NGINX_V="$(nginx -v 2>&1 | sed 's/^nginx version: //')"
export WRK_V="$(wrk -v 2>&1 | head -1 | sed 's/ Copyright.*//')"
export TESSERA_V="$("$BIN" --version 2>/dev/null || echo unknown)"
export LOAD="$LOAD_START at start, $(cut -d' ' -f1-3 /proc/loadavg) at end"
export WHEN="$(date -u '+%Y-%m-%d %H:%M:%S UTC')"

for f in "$WORK"/raw/*.txt; do
  printf '===== %s\n' "$(basename "$f" .txt)"
  cat "$f"
done >"$RAW"

python3 - "$WORK/raw" "$RESULT" "$(basename "$RAW")" "$WORK/tessera.log" "$WORK/error.log" <<'PY'
import os, re, statistics, sys

raw_dir, result_path, raw_name, tessera_log, nginx_log = sys.argv[1:6]
reps = int(os.environ["REPS"])
targets = ["direct", "nginx-proxy", "tessera"]
concs = [1, 8, 64]
UNIT = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6, "h": 3600e6}

def to_us(text):
    m = re.fullmatch(r"([0-9.]+)(us|ms|s|m|h)", text)
    if not m:
        raise SystemExit(f"cannot parse latency {text!r}")
    return float(m.group(1)) * UNIT[m.group(2)]

def parse(path):
    t = open(path).read()
    rps = re.search(r"^Requests/sec:\s+([0-9.]+)", t, re.M)
    p50 = re.search(r"^\s+50%\s+(\S+)", t, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", t, re.M)
    reqs = re.search(r"^\s+(\d+) requests in", t, re.M)
    if not (rps and p50 and p99 and reqs):
        raise SystemExit(f"cannot parse wrk output {path}:\n{t}")
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", t)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", t)
    return {
        "rps": float(rps.group(1)),
        "p50": to_us(p50.group(1)),
        "p99": to_us(p99.group(1)),
        "requests": int(reqs.group(1)),
        "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "sockerr": sum(int(x) for x in sock.groups()) if sock else 0,
        "sockerr_text": sock.group(0) if sock else "",
    }

runs = {(t, c): [parse(os.path.join(raw_dir, f"{t}-c{c}-r{r}.txt")) for r in range(1, reps + 1)]
        for c in concs for t in targets}
med = {k: {f: statistics.median(r[f] for r in v) for f in ("rps", "p50", "p99")} for k, v in runs.items()}

def us(x):
    return f"{x:.0f} µs" if x < 10000 else f"{x / 1000:.1f} ms"

lines = ["| target | c | req/s | p50 | p99 | ratio req/s vs nginx-proxy |",
         "|---|---:|---:|---:|---:|---:|"]
for c in concs:
    for t in targets:
        m = med[(t, c)]
        ratio = m["rps"] / med[("nginx-proxy", c)]["rps"]
        lines.append(f"| {t} | {c} | {m['rps']:,.0f} | {us(m['p50'])} | {us(m['p99'])} | {ratio:.2f} |")
added_direct = med[("tessera", 1)]["p50"] - med[("direct", 1)]["p50"]
added_proxy = med[("tessera", 1)]["p50"] - med[("nginx-proxy", 1)]["p50"]
lines.append("")
lines.append(f"Added p50 at c=1, tessera minus direct: **{added_direct:+.0f} µs** "
             f"(tessera minus nginx-proxy: {added_proxy:+.0f} µs).")

bad = [(k, r) for k, v in runs.items() for r in v if r["non2xx"] or r["sockerr"]]
total_non2xx = sum(r["non2xx"] for v in runs.values() for r in v)
total_sock = sum(r["sockerr"] for v in runs.values() for r in v)
if bad:
    lines.append("")
    lines.append(f"**WARNING: {total_non2xx} non-2xx/3xx responses and {total_sock} socket errors:**")
    for (t, c), r in bad:
        lines.append(f"- {t} c={c}: non-2xx {r['non2xx']}, {r['sockerr_text'] or 'no socket errors'}")
else:
    lines.append(f"Non-2xx/3xx responses: 0 and socket errors: 0 in every run "
                 f"({len(concs) * len(targets) * reps} wrk runs).")
table = "\n".join(lines)
print(table)

def count_lines(path):
    try:
        return sum(1 for l in open(path) if l.strip())
    except OSError:
        return 0

env = os.environ
detail = ["| target | c | " + " | ".join(f"rep {r} req/s, p50, p99" for r in range(1, reps + 1)) + " |",
          "|---|---:|" + "---:|" * reps]
for c in concs:
    for t in targets:
        cells = [f"{r['rps']:,.0f}, {us(r['p50'])}, {us(r['p99'])}" for r in runs[(t, c)]]
        detail.append(f"| {t} | {c} | " + " | ".join(cells) + " |")

stale = ("\n**Warning:** files under src/ or Cargo.* were newer than target/release/tessera at run "
         "time; the numbers are for the binary as built.\n") if env.get("STALE") else ""
doc = f"""# First load measurement: tessera vs nginx, loopback

- when: {env['WHEN']} (run took {int(env['ELAPSED']) // 60} min {int(env['ELAPSED']) % 60} s)
- command: `{env['BENCH_CMD']}`
- commit at start: {env['COMMIT']}; tessera binary: target/release/tessera ({env['TESSERA_V']}, built {env['BIN_BUILT']})
- machine: nproc {env['NPROC']}, {env['CPU'] or 'cpu model unknown'}, kernel {env['KERNEL']}; load average (1/5/15 min): {env['LOAD']}
- nginx {env['NGINX_V']} (`worker_processes 1`, `access_log off`, `keepalive_requests 1000000`), {env['WRK_V']}
{stale}
Setup: all on 127.0.0.1. `direct` = nginx serving a static 1 KiB JSON file at /1k;
`nginx-proxy` = a second nginx server block proxying to `direct` (`upstream {{ keepalive 64; }}`,
`proxy_http_version 1.1`, `proxy_set_header Connection ""`), no auth; `tessera` = `tessera serve`
(embedded SQLite session store, `[log] level = "warn"`, `access_log = false`, default upstream pool
of 64) proxying to `direct`, requests carry `Authorization: Bearer <token>` of one session made with
`tessera session create`. Before each run curl checked 200 + 1024-byte body on every target and 401
from tessera without the token. Load: `wrk -t (1 if c<2 else 2) -c c -d {env['DURATION']} --latency`
(keep-alive), {reps} repetitions per cell, round-robin over the targets within each repetition;
the table shows medians. wrk, nginx and tessera share the same {env['NPROC']} cores.

## Medians

{table}

## Every run

{chr(10).join(detail)}

Non-empty lines in tessera's log (level warn): {count_lines(tessera_log)}; in nginx's error.log: {count_lines(nginx_log)}.
Raw wrk output: `{raw_name}`.
"""
open(result_path, "w").write(doc)
PY

KEEP_WORK=0
log "results: $RESULT (raw wrk output: $RAW)"
log "took $(($(date +%s) - START_EPOCH)) s"
