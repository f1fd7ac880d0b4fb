#!/usr/bin/env bash
# A/B benchmark: tessera binaries vs a plain nginx reverse proxy, one run, loopback; a code change
# is kept only with its number.
#   BINS="/tmp/tessera-base target/release/tessera" bench/ab.sh
#   BINS="/tmp/a /tmp/b" ENVS="TOKIO_WORKER_THREADS=1 -" CONC=8 DURATION=2s REPS=1 bench/ab.sh
# Env: BINS (space-separated, default target/release/tessera; relative paths from the current dir,
# else the repo root; labeled t0, t1, ...), CONC ("8 64"), DURATION (5s), REPS (3), WARMUP (2s, one
# unrecorded c=8 run per target), ENVS (aligned with BINS: NAME=VALUE[,NAME=VALUE] for that binary's
# `serve`, "-" for none), EXTRA_TOML (TOML for every tessera config: lines under a section it has,
# [server] [upstream] [token] [session] [credentials] [log], go there, replacing a same-named key;
# the rest is appended), TOMLS (aligned with BINS: section.key=VALUE[,section.key=VALUE] merged
# into that binary's config after EXTRA_TOML, "-" for none; VALUE is a TOML literal without spaces
# or commas, e.g. TOMLS="- server.busy_poll_us=50 log.level=\"info\""), HOGS (0: CPU-bound
# neighbours, `python3 -c "while True: pass"` at normal priority, running from before the warm-up to
# the end; each run then also reports the hogs' CPU share: what a target leaves to other work),
# IDLE_POLL_NS (the guest's cpuidle haltpoll polling for the run, ns: bench/lib.sh idle_poll_apply),
# WRK_HEADER (one more request header for every target's runs, e.g. "Connection: close": a new
# client connection per request), PIN (CPU affinity, `taskset` CPU lists: "wrk=0,origin=1,proxy=1";
# wrk: the load generator, origin: the nginx origin, proxy: every thread of nginx-proxy and of each
# tessera; a role left out runs where the scheduler puts it), SHAPE (tessera: the default below;
# compat: the shape a hyper-auth-proxy deployment switches over in: every tessera on one Redis
# holding 1,000 plaintext-legacy records (`session.format = "hyper-auth-proxy"`,
# `credentials.allow_plaintext_legacy = true`), `token.sources = ["cookie-b64:Authorization",
# "bearer"]`, and every target's requests rotating over the 1,000 sessions' base64 cookies
# (bench/compat.lua, bench/compat_sessions.py); wrk -t 1 at every c).
# Processes (127.0.0.1, free ports, stopped by PID on exit, the work dir with logs kept on failure):
# nginx origin (worker_processes 1, access_log off, keepalive_requests 1000000) with a 1 KiB JSON at
# /1k; nginx-proxy, a second nginx proxying to it (upstream keepalive 64, no auth); per binary, one
# `tessera serve` with its own embedded store, [log] level "warn", access_log false, token.secret
# from `keygen` and one session (`tessera session create`); it must answer 200 with 1024 bytes with
# the token and 401 without. Each rep, each c, round-robin over direct (the origin), nginx-proxy,
# t0, t1, ...:
# `wrk -t (1 if c<2 else 2) -c c -d DURATION --latency` (+ -H "Authorization: Bearer T" for tessera).
# Per run: req/s, p50, p99, non-2xx + socket errors (any: WARNING), the target's CPU (user+sys,
# /proc/PID/stat; nginx: its worker) per request, and of it the user-space part.
# Output: Markdown on stdout (medians per target and c: req/s, p50, p99, p50 added over direct,
# req/s vs nginx-proxy, CPU µs/req and its user part; then every run), also in bench/results/ab-<date>-<time>.md with the command line and the
# binaries' sha256, env and TOMLS config. Progress on stderr. Needs nginx, wrk, curl, python3.
set -euo pipefail

SHAPE="${SHAPE:-tessera}" CONC="${CONC:-8 64}" DURATION="${DURATION:-5s}" REPS="${REPS:-3}" WARMUP="${WARMUP:-2s}" HOGS="${HOGS:-0}"
BINS="${BINS:-target/release/tessera}" ENVS="${ENVS:-}" EXTRA_TOML="${EXTRA_TOML:-}" TOMLS="${TOMLS:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { printf '[ab %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

[[ "$REPS" =~ ^[1-9][0-9]*$ ]] || die "REPS must be a positive integer, got '$REPS'"
[[ "$HOGS" =~ ^(0|[1-9][0-9]*)$ ]] || die "HOGS must be a whole number, got '$HOGS'"
[[ $SHAPE == tessera || $SHAPE == compat ]] || die "SHAPE must be tessera or compat, got '$SHAPE'"
[[ $SHAPE == tessera ]] || command -v redis-server >/dev/null || die "SHAPE=compat needs redis-server"
for d in "$DURATION" "$WARMUP"; do [[ "$d" =~ ^[0-9]+[smh]?$ ]] || die "bad duration '$d'"; done
read -r -a CONCS <<<"$CONC"
((${#CONCS[@]})) || die "CONC is empty"
for c in "${CONCS[@]}"; do [[ "$c" =~ ^[1-9][0-9]*$ ]] || die "bad concurrency '$c' in CONC"; done
pin_parse PIN "${PIN:-}" # PIN_OF: bench/lib.sh
pin() { # role pid...: every thread of each pid onto the role's CPUs (PIN), if the role is pinned
  local role=$1
  shift
  [[ -z ${PIN_OF[$role]:-} ]] || pin_to "${PIN_OF[$role]}" "$@"
}
for t in nginx wrk curl python3 sha256sum pgrep; do command -v "$t" >/dev/null || die "$t is not installed"; done

read -r -a BIN_ARGS <<<"$BINS"
read -r -a ENV_ARGS <<<"$ENVS"
read -r -a TOML_ARGS <<<"$TOMLS"
((${#BIN_ARGS[@]})) || die "BINS is empty"
((${#ENV_ARGS[@]} == 0 || ${#ENV_ARGS[@]} == ${#BIN_ARGS[@]})) ||
  die "ENVS has ${#ENV_ARGS[@]} entries for ${#BIN_ARGS[@]} binaries (use - for none)"
((${#TOML_ARGS[@]} == 0 || ${#TOML_ARGS[@]} == ${#BIN_ARGS[@]})) ||
  die "TOMLS has ${#TOML_ARGS[@]} entries for ${#BIN_ARGS[@]} binaries (use - for none)"
BIN_PATHS=() BIN_HASHES=() BIN_ENVS=() BIN_TOMLS=() LABELS=()
for i in "${!BIN_ARGS[@]}"; do
  b="${BIN_ARGS[$i]}" e="${ENV_ARGS[$i]:--}" o="${TOML_ARGS[$i]:--}"
  [[ $b != /* && ! -e $b && -e "$ROOT/$b" ]] && b="$ROOT/$b"
  [[ -f $b && -x $b ]] || die "${BIN_ARGS[$i]} is not an executable file (build it first)"
  b="$(cd "$(dirname "$b")" && pwd)/$(basename "$b")"
  [[ $e == - || $e =~ ^[A-Za-z_][A-Za-z0-9_]*=[^,]*(,[A-Za-z_][A-Za-z0-9_]*=[^,]*)*$ ]] ||
    die "ENVS entry '$e' is not NAME=VALUE[,NAME=VALUE...] or -"
  [[ $o == - || $o =~ ^[a-z_]+\.[a-z_]+=[^,]+(,[a-z_]+\.[a-z_]+=[^,]+)*$ ]] ||
    die "TOMLS entry '$o' is not section.key=VALUE[,section.key=VALUE...] or -"
  [[ $b != "$ROOT/target/"* || -z "$(find "$ROOT/src" "$ROOT/Cargo.toml" "$ROOT/Cargo.lock" -newer "$b" \
    -print -quit 2>/dev/null)" ]] || log "WARNING: sources are newer than $b; the numbers are for it as built"
  BIN_PATHS+=("$b") BIN_ENVS+=("$e") BIN_TOMLS+=("$o") LABELS+=("t$i") BIN_HASHES+=("$(sha256sum "$b" | cut -c1-12)")
  log "t$i = $b (sha256 ${BIN_HASHES[$i]}$([[ $e == - ]] || echo ", env $e")$([[ $o == - ]] || echo ", $o"))"
done
TARGETS=(direct nginx-proxy "${LABELS[@]}")

# ---------------------------------------------------------------- processes and cleanup
work_dir tessera-ab # WORK, PIDS, KEEP_WORK (cleared after a successful run) and the cleanup: bench/lib.sh
idle_poll_apply     # IDLE_POLL_NS, put back on exit: bench/lib.sh
IDLE="$(idle_state)" # for the report, as the run starts
mkdir -p "$WORK/raw" "$WORK/keys" && chmod 700 "$WORK/keys"
RAW="$WORK/raw"
: >"$WORK/runs.tsv"
read -r -a PORTS < <(free_ports "$((3 + ${#LABELS[@]}))")
P_ORIGIN=${PORTS[0]} P_PROXY=${PORTS[1]} P_REDIS=${PORTS[-1]}

declare -A PID_OF URL_OF CPU_PID_OF AUTH_OF # AUTH_OF: the header a tessera target needs

# ---------------------------------------------------------------- nginx: origin and plain proxy
write_1k "$WORK/1k.json"
log "starting nginx origin (:$P_ORIGIN) and nginx-proxy (:$P_PROXY) in $WORK"
nginx_start origin "$P_ORIGIN" "  server { listen 127.0.0.1:$P_ORIGIN; keepalive_requests 1000000;
    location = /1k { default_type application/json; alias $WORK/1k.json; } }"
PID_OF[origin]=$NGINX_PID
nginx_start proxy "$P_PROXY" "  upstream origin_pool {
    server 127.0.0.1:$P_ORIGIN; keepalive 64; keepalive_requests 1000000; }
  server { listen 127.0.0.1:$P_PROXY; keepalive_requests 1000000;
    location / { proxy_pass http://origin_pool; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
PID_OF[proxy]=$NGINX_PID
for t in direct:origin nginx-proxy:proxy; do # the worker, not the master, serves and burns the CPU
  for ((i = 0; i < 100; i++)); do
    CPU_PID_OF[${t%:*}]="$(pgrep -P "${PID_OF[${t#*:}]}" | head -1 || true)"
    [[ -n ${CPU_PID_OF[${t%:*}]} ]] && break || sleep 0.05
  done
  [[ -n ${CPU_PID_OF[${t%:*}]} ]] || die "no worker under the nginx ${t#*:} master"
done
pin origin "${PID_OF[origin]}" "${CPU_PID_OF[direct]}"
pin proxy "${PID_OF[proxy]}" "${CPU_PID_OF[nginx-proxy]}"
PID_OF[direct]="${PID_OF[origin]}" URL_OF[direct]="http://127.0.0.1:$P_ORIGIN/1k" AUTH_OF[direct]=""
PID_OF[nginx-proxy]="${PID_OF[proxy]}" URL_OF[nginx-proxy]="http://127.0.0.1:$P_PROXY/1k"
AUTH_OF[nginx-proxy]=""

# ---------------------------------------------------------------- tessera instances
tessera_keys "${BIN_PATHS[0]}"
if [[ $SHAPE == compat ]]; then # one Redis with the sessions every tessera reads (see the header)
  compat_redis "$P_REDIS"
  USER_EXTRA_TOML="$EXTRA_TOML" EXTRA_TOML="[token]
sources = [\"cookie-b64:Authorization\", \"bearer\"]
[session]
store = \"redis://127.0.0.1:$P_REDIS/\"
format = \"hyper-auth-proxy\"
[credentials]
allow_plaintext_legacy = true
$EXTRA_TOML"
  log "redis-server (:$P_REDIS) holds 1000 hyper-auth-proxy sessions"
fi
merge_toml() { # file: EXTRA_TOML into it (see the header)
  python3 - "$1" <<'PY'
import os, re, sys
hdr = lambda l: (m := re.match(r"\s*\[([^\[\]]+)\]\s*(#.*)?$", l)) and m.group(1).strip()
key = lambda l: (m := re.match(r"\s*([\w.\"-]+)\s*=", l)) and m.group(1)
base = open(sys.argv[1]).read().splitlines()
secs, add, tail, sec = {hdr(l) for l in base} - {None}, {}, [], None
for l in os.environ["EXTRA_TOML"].splitlines():
    if l.lstrip().startswith("["):
        sec = hdr(l) or "[["  # an array of tables goes to the end
    if sec is None or sec in secs:
        add.setdefault(sec, []).extend([] if hdr(l) else [l])
    else:
        tail.append(l)
out, sec = [], None
for l in base + [None]:
    if l is None or hdr(l):
        out += add.pop(sec, [])
        sec = l and hdr(l)
    if l is not None and (hdr(l) or key(l) not in {key(x) for x in add.get(sec, [])} - {None}):
        out.append(l)
open(sys.argv[1], "w").write("\n".join(out + tail) + "\n")
PY
}
for i in "${!LABELS[@]}"; do
  t="${LABELS[$i]}" port="${PORTS[$((2 + i))]}"
  mkdir -p "$WORK/emb-$t"
  tessera_toml "$WORK/$t.toml" "$port" "$P_ORIGIN" "$WORK/emb-$t"
  [[ -z $EXTRA_TOML ]] || EXTRA_TOML="$EXTRA_TOML" merge_toml "$WORK/$t.toml"
  if [[ ${BIN_TOMLS[$i]} != - ]]; then # section.key=VALUE,... as "[section]\nkey = VALUE" lines
    EXTRA_TOML="$(tr , '\n' <<<"${BIN_TOMLS[$i]}" | sed -E 's/^([a-z_]+)\.([a-z_]+)=(.*)$/[\1]\n\2 = \3/')" \
      merge_toml "$WORK/$t.toml"
  fi
  "${BIN_PATHS[$i]}" check-config --config "$WORK/$t.toml" >"$WORK/$t.check" 2>&1 ||
    die "$t config refused: $(cat "$WORK/$t.check")"
  env_args=()
  [[ ${BIN_ENVS[$i]} == - ]] || IFS=, read -r -a env_args <<<"${BIN_ENVS[$i]}"
  env ${env_args[@]+"${env_args[@]}"} "${BIN_PATHS[$i]}" serve --config "$WORK/$t.toml" \
    >"$WORK/$t.log" 2>&1 &
  PID_OF[$t]=$! CPU_PID_OF[$t]=$! URL_OF[$t]="http://127.0.0.1:$port/1k" && PIDS+=("$!")
  wait_port "$port" "$t" "$!"
  pin proxy "${PID_OF[$t]}"
  if [[ $SHAPE == compat ]]; then
    AUTH_OF[$t]="Cookie: Authorization=$(head -1 "$COMPAT_TOKENS")"
  else
    (umask 077 && printf '%s\n' bench-password | "${BIN_PATHS[$i]}" session create --config "$WORK/$t.toml" \
      --user alice --password-stdin >"$WORK/$t.session" 2>"$WORK/$t.session.err") ||
      die "$t session create failed: $(cat "$WORK/$t.session.err")"
    token="$(sed -n 's/.*"token" *: *"\([^"]*\)".*/\1/p' "$WORK/$t.session" | head -1)"
    [[ -n $token ]] || die "no token in $t's session create output: $(cat "$WORK/$t.session")"
    AUTH_OF[$t]="Authorization: Bearer $token"
  fi
  log "started $t (:$port, pid ${PID_OF[$t]}) and made its session"
done

check_target() { # target: 200 with 1024 bytes (with the token), 401 without it (tessera)
  local t=$1 got url="${URL_OF[$1]}" auth=()
  if [[ -n ${AUTH_OF[$t]} ]]; then
    got="$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$url" || true)"
    [[ $got == 401 ]] || die "$t answered $got without a token, expected 401"
    auth=(-H "${AUTH_OF[$t]}")
  fi
  got="$(curl -s -o /dev/null -w '%{http_code} %{size_download}' --max-time 5 ${auth[@]+"${auth[@]}"} "$url" ||
    true)"
  [[ $got == "200 1024" ]] || die "$t ($url) answered '$got', expected '200 1024'"
}
cpu_ticks() { awk '{print $14, $15}' "/proc/$1/stat"; } # user, system: clock ticks
wrk_run() { # target c duration out
  local t=$1 c=$2 auth=() name threads=$(($2 < 2 ? 1 : 2))
  if [[ $SHAPE == compat ]]; then # the cookies of bench/compat.lua, for every target
    auth=(-s "$ROOT/bench/compat.lua") threads=1
  elif [[ -n ${AUTH_OF[$t]} ]]; then
    auth=(-H "${AUTH_OF[$t]}")
  fi
  [[ -z ${WRK_HEADER:-} ]] || auth+=(-H "$WRK_HEADER")
  ${PIN_OF[wrk]:+taskset -c "${PIN_OF[wrk]}"} wrk -t "$threads" -c "$c" -d "$3" --latency \
    ${auth[@]+"${auth[@]}"} "${URL_OF[$t]}" >"$4" 2>&1 &
  PIDS+=("$!")
  wait "$!" || die "wrk failed for $t c=$c: $(cat "$4")"
  for name in origin proxy "${LABELS[@]}"; do
    kill -0 "${PID_OF[$name]}" 2>/dev/null || die "$name (pid ${PID_OF[$name]}) died during a run on $t"
  done
}

for t in "${TARGETS[@]}"; do check_target "$t"; done
HOG_PIDS=()
for ((i = 0; i < HOGS; i++)); do
  python3 -c 'while True: pass' &
  HOG_PIDS+=("$!") PIDS+=("$!")
done
((HOGS == 0)) || log "started $HOGS CPU hog(s): ${HOG_PIDS[*]}"
hog_ticks() { # user+sys clock ticks of every hog, summed (0 without hogs)
  local p sum=0 u s
  for p in ${HOG_PIDS[@]+"${HOG_PIDS[@]}"}; do
    read -r u s < <(cpu_ticks "$p") || die "CPU hog $p is gone"
    sum=$((sum + u + s))
  done
  echo "$sum"
}
log "warm-up: $WARMUP at c=8 per target (not recorded)"
for t in "${TARGETS[@]}"; do wrk_run "$t" 8 "$WARMUP" "$RAW/warmup-$t.txt"; done
log "runs: ${#TARGETS[@]} targets x c in (${CONCS[*]}) x $REPS reps x $DURATION"
for ((rep = 1; rep <= REPS; rep++)); do
  for c in "${CONCS[@]}"; do
    for t in "${TARGETS[@]}"; do
      id="$t-c$c-r$rep"
      log "rep $rep/$REPS c=$c $t"
      read -r user0 sys0 < <(cpu_ticks "${CPU_PID_OF[$t]}")
      hog0=$(hog_ticks) # alone on its line, so that set -e sees hog_ticks fail
      ns0=$(date +%s%N)
      wrk_run "$t" "$c" "$DURATION" "$RAW/$id.txt"
      hog1=$(hog_ticks)
      ns1=$(date +%s%N)
      read -r user1 sys1 < <(cpu_ticks "${CPU_PID_OF[$t]}")
      ! grep -Eq 'Non-2xx|Socket errors' "$RAW/$id.txt" ||
        log "WARNING: $id: $(grep -E 'Non-2xx|Socket errors' "$RAW/$id.txt" | tr -s ' \n' ' ')"
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$rep" "$c" "$t" "$id" "$((user1 - user0))" "$((sys1 - sys0))" \
        "$((hog1 - hog0))" "$((ns1 - ns0))" >>"$WORK/runs.tsv"
    done
  done
done

# ---------------------------------------------------------------- report
for i in "${!LABELS[@]}"; do
  printf '%s\t%s\t%s\t%s\t%s\n' "${LABELS[$i]}" "${BIN_PATHS[$i]}" "${BIN_HASHES[$i]}" "${BIN_ENVS[$i]}" \
    "${BIN_TOMLS[$i]}"
done >"$WORK/bins.tsv"
CMD="BINS=\"$BINS\" SHAPE=$SHAPE CONC=\"$CONC\" DURATION=$DURATION REPS=$REPS WARMUP=$WARMUP"
[[ -n ${IDLE_POLL_NS:-} ]] && CMD+=" IDLE_POLL_NS=$IDLE_POLL_NS"
[[ -z ${WRK_HEADER:-} ]] || CMD+=" WRK_HEADER=$(printf '%q' "$WRK_HEADER")"
[[ -z ${PIN:-} ]] || CMD+=" PIN=$PIN"
((HOGS == 0)) || CMD+=" HOGS=$HOGS"
[[ -z $ENVS ]] || CMD+=" ENVS=\"$ENVS\""
[[ -z $TOMLS ]] || CMD+=" TOMLS=$(printf '%q' "$TOMLS")"
EXTRA_TOML="${USER_EXTRA_TOML-$EXTRA_TOML}" # as given, without the compat shape's lines
[[ -z $EXTRA_TOML ]] || CMD+=" EXTRA_TOML=$(printf '%q' "$EXTRA_TOML")"
mkdir -p "$ROOT/bench/results"
export CMD="$CMD bench/ab.sh" OUT="$ROOT/bench/results/ab-$(date +%Y-%m-%d-%H%M%S).md" CONC HOGS SHAPE
export CLK_TCK="$(getconf CLK_TCK)" COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
MACHINE="nproc $(nproc), $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1), $IDLE, load"
export MACHINE="$MACHINE $(cut -d' ' -f1-3 /proc/loadavg), $(nginx -v 2>&1 | sed 's/^nginx version: //'), \
$(wrk -v 2>&1 | head -1 | cut -d' ' -f1-2)"
python3 - "$WORK" <<'PY'
import os, re, statistics, sys, time
work, env = sys.argv[1], os.environ
UNIT, LAT = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6, "h": 3600e6}, r"\s+([0-9.]+)(us|ms|s|m|h)\s*$"
def parse(path):  # one wrk --latency output
    t = open(path).read()
    g = [re.search(p, t, re.M) for p in (r"^Requests/sec:\s+([0-9.]+)", r"^\s+50%" + LAT, r"^\s+99%" + LAT,
                                          r"^\s+(\d+) requests in", r"Non-2xx or 3xx responses:\s+(\d+)",
                                          r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")]
    if not all(g[:4]):
        sys.exit(f"cannot parse wrk output {path}:\n{t}")
    r = dict(rps=float(g[0][1]), p50=float(g[1][1]) * UNIT[g[1][2]], p99=float(g[2][1]) * UNIT[g[2][2]],
             reqs=int(g[3][1]), non2xx=int(g[4][1]) if g[4] else 0, sock=sum(map(int, g[5].groups())) if g[5] else 0)
    r["warn"] = f"WARNING: non-2xx {r['non2xx']}, {g[5][0] if g[5] else 'no socket errors'}" \
        if r["non2xx"] or r["sock"] else ""
    return r
bins = [l.rstrip("\n").split("\t") for l in open(f"{work}/bins.tsv")]
runs = []
for line in open(f"{work}/runs.tsv"):
    rep, c, t, rid, user, system, hog, ns = line.split()
    r = parse(f"{work}/raw/{rid}.txt")
    per_req = lambda ticks: int(ticks) / int(env["CLK_TCK"]) * 1e6 / r["reqs"] if r["reqs"] else None
    r.update(rep=rep, c=int(c), t=t, cpu=per_req(int(user) + int(system)), user=per_req(user),
             hog=int(hog) / int(env["CLK_TCK"]) / (int(ns) / 1e9) * 100)
    runs.append(r)
ms, f1 = lambda us: f"{us / 1000:.3f} ms", lambda x: "" if x is None else f"{x:.1f}"
hogs = int(env["HOGS"])  # with hogs, one more column: their CPU share, % of one core (all hogs)
hog_h, hog_a = (" hogs' CPU % |", "---:|") if hogs else ("", "")
hog_v = lambda x: f" {x:.0f} |" if hogs else ""
med = lambda rs, k: statistics.median(v) if (v := [r[k] for r in rs if r[k] is not None]) else None
md = [f"# tessera A/B vs nginx-proxy, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", "", f"- command: `{env['CMD']}`",
      f"- commit: {env['COMMIT']}", f"- machine: {env['MACHINE']}",
      f"- shape: {env['SHAPE']}" + (" (1,000 hyper-auth-proxy sessions in Redis, base64 JWT cookies rotated by "
                                    "bench/compat.lua for every target)" if env["SHAPE"] == "compat" else ""), "", "| label | binary | sha256 | env | config |",
      "|---|---|---|---|---|", "| direct | the nginx origin itself, no proxy | | | |",
      "| nginx-proxy | nginx, upstream keepalive 64, no auth | | | |"]
code = lambda v: "" if v == "-" else f"`{v}`"
md += [f"| {b[0]} | `{b[1]}` | {b[2]} | {code(b[3])} | {code(b[4])} |" for b in bins]
md += ["", "## Medians per target and c", "", "| target | c | req/s | p50 | p99 | p50 added (minus direct) | "
       f"req/s vs nginx-proxy | CPU µs/req | of it user |{hog_h} runs | warnings |",
       f"|---|---:|---:|---:|---:|---:|---:|---:|---:|{hog_a}---:|---|"]
for c in [int(x) for x in env["CONC"].split()]:
    base = med([r for r in runs if r["c"] == c and r["t"] == "nginx-proxy"], "rps")
    direct = med([r for r in runs if r["c"] == c and r["t"] == "direct"], "p50")
    for t in ["direct", "nginx-proxy"] + [b[0] for b in bins]:
        rs = [r for r in runs if r["c"] == c and r["t"] == t]
        bad = sum(1 for r in rs if r["warn"])
        added = "" if t == "direct" else f"{med(rs, 'p50') - direct:+.0f} µs"
        md.append(f"| {t} | {c} | {med(rs, 'rps'):,.0f} | {ms(med(rs, 'p50'))} | {ms(med(rs, 'p99'))} | {added} | "
                  f"{med(rs, 'rps') / base:.3f} | {f1(med(rs, 'cpu'))} | {f1(med(rs, 'user'))} |"
                  f"{hog_v(med(rs, 'hog'))} {len(rs)} | "
                  f"{'WARNING: %d run(s) with errors' % bad if bad else ''} |")
md += ["", "## Every run", "", "| rep | c | target | req/s | p50 | p99 | requests | CPU µs/req | of it user |"
       f"{hog_h} non-2xx | socket errors | note |", f"|---:|---:|---|---:|---:|---:|---:|---:|---:|{hog_a}---:|---:|---|"]
md += [f"| {r['rep']} | {r['c']} | {r['t']} | {r['rps']:,.0f} | {ms(r['p50'])} | {ms(r['p99'])} | {r['reqs']} | "
       f"{f1(r['cpu'])} | {f1(r['user'])} |{hog_v(r['hog'])} {r['non2xx']} | {r['sock']} | {r['warn'] or ''} |"
       for r in runs]
md += ["", "CPU: user+sys time of the target process (nginx-proxy: its worker; direct: the origin's) during the run "
       "(/proc/PID/stat) per request wrk completed, and its user-space part (the rest is the kernel's: "
       "system calls, loopback TCP); every process shares the machine."]
if hogs:
    md += ["", f"Hogs: {hogs} CPU-bound `python3` process(es) at normal priority ran throughout; their CPU "
           "share is their user+sys time during the run over its wall time, % of one core, summed."]
md += [""]
open(env["OUT"], "w").write("\n".join(md))
print("\n".join(md), end="")
PY

KEEP_WORK=0
log "report: $OUT"
