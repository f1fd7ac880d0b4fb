#!/usr/bin/env bash
# Field report 5 re-run (issue 37, ../shared/docs/CONTEXT.md section 5): JWT verification plus one
# SQL lookup per request. One run, loopback, ratios within it:
#   ref        bench/reference/sql-lookup (actix-web + jsonwebtoken + sqlx, as the report built it):
#              verifies the bearer HS512 JWT and reads the token's sid row from PostgreSQL, answers
#              the row as JSON;
#   cold       tessera on the PostgreSQL store with its session cache off (session.cache_max_entries
#              = 0, token cache off): every request verifies the JWT, reads the session row, unseals
#              it and forwards to the nginx origin (1 KiB);
#   warm       the same tessera config with both caches on (defaults): no SQL per request.
# Usage: bench/sql.sh            Env: CONC ("8 64"), DURATION (5s), REPS (3), WARMUP (2s), BIN
# (a tessera binary, e.g. target/pgo/release/tessera; default: target/release/tessera, built).
# Processes (127.0.0.1, free ports, stopped by PID on exit): a PostgreSQL 15 cluster (initdb, trust,
# fsync off), the nginx origin, the reference, two tessera (cold, warm). wrk -t2 with one token.
# Output: Markdown on stdout and in bench/results/sql-<date>-<time>.md (medians of req/s, p50 and
# CPU per request of the target and of PostgreSQL, per target and c; ratios to ref). Needs postgresql, nginx, wrk, curl, python3, cargo.
set -euo pipefail

CONC="${CONC:-8 64}" DURATION="${DURATION:-5s}" REPS="${REPS:-3}" WARMUP="${WARMUP:-2s}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[sql %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for t in nginx wrk curl python3 cargo; do command -v "$t" >/dev/null || die "$t is not installed"; done

if [[ -z ${BIN:-} ]]; then
  log "building tessera (release)"
  (cd "$ROOT" && cargo build --release -q) || die "cargo build failed"
  BIN="$ROOT/target/release/tessera"
fi
[[ -x $BIN ]] || die "BIN=$BIN is not an executable"
log "building the reference (release)"
(cd "$ROOT/bench/reference/sql-lookup" && CARGO_TARGET_DIR="$ROOT/target/bench-reference" cargo build --release -q) ||
  die "reference build failed"
REF="$ROOT/target/bench-reference/release/sql-lookup"

work_dir sql
read -r P_PG P_ORIGIN P_REF P_COLD P_WARM < <(free_ports 5)
pg_start "$P_PG"
DB="$PG_URL"

write_1k "$WORK/1k.json"
nginx_start origin "$P_ORIGIN" "server { listen 127.0.0.1:$P_ORIGIN; keepalive_requests 1000000;
  location = /1k { default_type application/json; alias $WORK/1k.json; } }"
PID_ORIGIN=$NGINX_PID

mkdir -p "$WORK/keys"
tessera_keys "$BIN"
tessera_toml_on "$WORK/cold.toml" "$P_COLD" "http://127.0.0.1:$P_ORIGIN" "$DB"
tessera_toml_on "$WORK/warm.toml" "$P_WARM" "http://127.0.0.1:$P_ORIGIN" "$DB"
sed -i 's/^\[session\]$/[session]\ncache_max_entries = 0/; s/^\[token\]$/[token]\ncache_max_entries = 0/' "$WORK/cold.toml"
session="$(printf 'bench-password\n' | "$BIN" session create --config "$WORK/warm.toml" --user alice --password-stdin)" ||
  die "session create failed"
TOKEN="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["token"])' "$session")"
SID="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["sid"])' "$session")"
"${PSQL[@]}" -c "CREATE TABLE users (sid text PRIMARY KEY, name text NOT NULL, email text NOT NULL);
  INSERT INTO users VALUES ('$SID', 'alice', 'alice@example.com');" >/dev/null || die "users table"

declare -A PID_OF URL_OF
for t in cold warm; do
  port=P_${t^^}
  "$BIN" serve --config "$WORK/$t.toml" >"$WORK/$t.log" 2>&1 &
  PID_OF[$t]=$! PIDS+=("$!")
  wait_port "${!port}" "tessera $t" "${PID_OF[$t]}"
  URL_OF[$t]="http://127.0.0.1:${!port}/1k"
done
"$REF" "$P_REF" "$DB" "$WORK/keys/jwt.secret" >"$WORK/ref.log" 2>&1 &
PID_OF[ref]=$! PIDS+=("$!")
wait_port "$P_REF" reference "${PID_OF[ref]}"
URL_OF[ref]="http://127.0.0.1:$P_REF/1k"
TARGETS=(ref cold warm)
for t in "${TARGETS[@]}"; do
  got="$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $TOKEN" "${URL_OF[$t]}")"
  [[ $got == 200 ]] || die "$t answered $got with the token"
  got="$(curl -s -o /dev/null -w '%{http_code}' "${URL_OF[$t]}")"
  [[ $got == 401 ]] || die "$t answered $got without a token"
done

# CPU clock ticks (user + system, /proc/PID/stat) of the PIDs given, summed; PostgreSQL's are the
# postmaster and every backend it started.
ticks() { local p sum=0; for p in "$@"; do sum=$((sum + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done; echo "$sum"; }
pg_pids() { echo "$PID_PG" $(pgrep -P "$PID_PG"); }
log "warm-up: $WARMUP at c=8 per target"
for t in "${TARGETS[@]}"; do
  wrk -t2 -c8 -d "$WARMUP" -H "Authorization: Bearer $TOKEN" "${URL_OF[$t]}" >/dev/null
done
: >"$WORK/runs.tsv"
for ((rep = 1; rep <= REPS; rep++)); do
  for c in $CONC; do
    for t in "${TARGETS[@]}"; do
      log "rep $rep/$REPS c=$c $t"
      out="$WORK/$t-c$c-r$rep.txt"
      own0=$(ticks "${PID_OF[$t]}") pg0=$(ticks $(pg_pids))
      wrk -t2 -c "$c" -d "$DURATION" --latency -H "Authorization: Bearer $TOKEN" "${URL_OF[$t]}" >"$out" 2>&1
      own1=$(ticks "${PID_OF[$t]}") pg1=$(ticks $(pg_pids))
      ! grep -Eq 'Non-2xx|Socket errors' "$out" || log "WARNING: $t c=$c: $(grep -E 'Non-2xx|Socket errors' "$out" | tr -s ' \n' ' ')"
      rps="$(awk '/^Requests\/sec/ {print $2}' "$out")"
      p50="$(awk '$1 == "50%" {print $2}' "$out")"
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$c" "$rep" "$rps" "$p50" "$((own1 - own0))" \
        "$((pg1 - pg0))" "$(awk '/requests in/ {print $1}' "$out")" >>"$WORK/runs.tsv"
      for name in origin "${TARGETS[@]}"; do
        pid=${PID_OF[$name]:-$PID_ORIGIN}
        kill -0 "$pid" 2>/dev/null || die "$name died during a run"
      done
    done
  done
done

mkdir -p "$ROOT/bench/results"
OUT="$ROOT/bench/results/sql-$(date +%Y-%m-%d-%H%M%S).md"
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
python3 - "$WORK/runs.tsv" "$OUT" "$COMMIT" "$CONC" "$DURATION" "$REPS" "${BIN#"$ROOT"/}" <<'PY'
import os, statistics, sys
from collections import defaultdict
runs, out, commit, conc, duration, reps, binary = sys.argv[1:]
rps, p50, own, pg = defaultdict(list), defaultdict(list), defaultdict(list), defaultdict(list)
tck = int(os.sysconf("SC_CLK_TCK"))
def us(s):
    for unit, f in (("us", 1), ("ms", 1e3), ("s", 1e6)):
        if s.endswith(unit):
            return float(s[:-len(unit)]) * f
    return float(s)
for line in open(runs):
    t, c, rep, r, p, own_t, pg_t, n = line.rstrip("\n").split("\t")
    rps[(t, c)].append(float(r)); p50[(t, c)].append(us(p))
    own[(t, c)].append(int(own_t) * 1e6 / tck / int(n)); pg[(t, c)].append(int(pg_t) * 1e6 / tck / int(n))
lines = [f"# JWT + SQL lookup per request (bench/sql.sh), commit {commit}", "", f"tessera binary: {binary}", "",
         f"wrk -t2, {duration} per run, {reps} reps, medians; one token; PostgreSQL on loopback; "
         "the same 2 cores for everything.", "",
         "CPU µs/req: the target's process, and PostgreSQL's (postmaster and backends), "
         "user + system from /proc/PID/stat over the run, per request wrk completed.", "",
         "| target | c | req/s | p50 µs | req/s vs ref | CPU µs/req: target | PostgreSQL | sum vs ref |",
         "|---|---|---|---|---|---|---|---|"]
for c in conc.split():
    m = lambda d, t: statistics.median(d[(t, c)])
    ref, ref_cpu = m(rps, "ref"), m(own, "ref") + m(pg, "ref")
    for t in ("ref", "cold", "warm"):
        r, cpu = m(rps, t), m(own, t) + m(pg, t)
        lines.append(f"| {t} | {c} | {r:,.0f} | {m(p50, t):,.0f} | {r / ref:.2f}x | {m(own, t):.1f} | "
                     f"{m(pg, t):.1f} | {cpu / ref_cpu:.2f}x |")
lines += ["", "Every run (target, c, rep, req/s, p50, target ticks, PostgreSQL ticks, requests):", "", "```"]
lines += [l.rstrip("\n") for l in open(runs)] + ["```", ""]
text = "\n".join(lines)
print(text)
open(out, "w").write(text)
PY
log "written $OUT"
KEEP_WORK=0
