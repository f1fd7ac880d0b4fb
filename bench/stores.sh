#!/usr/bin/env bash
# Revocation across instances on each shared store (issue 37: refused everywhere within 10 ms
# p99): per store, two tessera instances A and B on it, TRIALS sessions made by the CLI, and
# bench/revocation.py: warm both, log out on A, poll B on a keep-alive connection until 401.
# Stores: redis (one server, tracking), postgres (LISTEN/NOTIFY), mysql (MariaDB, the change log
# polled every 25 ms). Redis Cluster: bench/cluster.sh.
# Usage: bench/stores.sh     Env: STORES ("redis postgres mysql"), TRIALS (200), POLL_MS
# (`session.poll_interval_ms` for every instance: how often the MySQL change log is read;
# default the store's 25).
# Output: Markdown on stdout and bench/results/stores-<date>-<time>.md. Needs redis-server,
# postgresql, mariadb-server, nginx, curl, python3, cargo.
set -euo pipefail

STORES="${STORES:-redis postgres mysql}" TRIALS="${TRIALS:-200}" POLL_MS="${POLL_MS:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[stores %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
[[ -z $POLL_MS || $POLL_MS =~ ^[1-9][0-9]*$ ]] || die "POLL_MS must be a positive integer"
for t in nginx curl python3 cargo; do command -v "$t" >/dev/null || die "$t is not installed"; done
log "building tessera (release)"
(cd "$ROOT" && cargo build --release -q) || die "cargo build failed"
BIN="$ROOT/target/release/tessera"

work_dir stores
read -r P_ORIGIN P_ENGINE < <(free_ports 2)
write_1k "$WORK/1k.json"
nginx_start origin "$P_ORIGIN" "server { listen 127.0.0.1:$P_ORIGIN; keepalive_requests 1000000;
  location = /1k { default_type application/json; alias $WORK/1k.json; } }"
mkdir -p "$WORK/keys"
tessera_keys "$BIN"
: >"$WORK/results.tsv"
for store in $STORES; do
  read -r P_ENGINE P_A P_B < <(free_ports 3)
  case $store in
    redis)
      redis-server --port "$P_ENGINE" --bind 127.0.0.1 --save '' --appendonly no >"$WORK/redis.log" 2>&1 &
      PIDS+=("$!")
      wait_port "$P_ENGINE" redis-server "$!"
      URL="redis://127.0.0.1:$P_ENGINE/0" ;;
    postgres) pg_start "$P_ENGINE"; URL="$PG_URL" ;;
    mysql) mariadb_start "$P_ENGINE"; URL="$MYSQL_URL" ;;
    *) die "unknown store $store (redis, postgres, mysql)" ;;
  esac
  for t in A B; do
    port=P_$t
    tessera_toml_on "$WORK/$store-$t.toml" "${!port}" "http://127.0.0.1:$P_ORIGIN" "$URL"
    printf '[login]\ncookie_secure = false\nverify_path = "/1k"\n' >>"$WORK/$store-$t.toml"
    [[ -z $POLL_MS ]] ||
      sed -i "s/^\[session\]\$/[session]\npoll_interval_ms = $POLL_MS/" "$WORK/$store-$t.toml"
    "$BIN" serve --config "$WORK/$store-$t.toml" >"$WORK/$store-$t.log" 2>&1 &
    PIDS+=("$!")
    wait_port "${!port}" "tessera $store $t" "$!"
  done
  log "$store: $TRIALS sessions"
  for ((i = 0; i < TRIALS; i++)); do
    printf 'pw\n' | "$BIN" session create --config "$WORK/$store-A.toml" --user "u$i" --password-stdin
  done >"$WORK/$store-sessions.jsonl" || die "session create on $store failed"
  log "$store: revocation, $TRIALS trials"
  python3 "$ROOT/bench/revocation.py" --a "http://127.0.0.1:$P_A" --b "http://127.0.0.1:$P_B" \
    --sessions "$WORK/$store-sessions.jsonl" --trials "$TRIALS" --logout-path /auth/logout --path /1k \
    --out "$WORK/$store-revocation.json" >/dev/null || die "revocation.py on $store failed"
  label=$store
  [[ -z $POLL_MS || $store != mysql ]] || label+=" (poll_interval_ms = $POLL_MS)"
  printf '%s\t%s\n' "$label" "$WORK/$store-revocation.json" >>"$WORK/results.tsv"
done

mkdir -p "$ROOT/bench/results"
OUT="$ROOT/bench/results/stores-$(date +%Y-%m-%d-%H%M%S).md"
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
python3 - "$WORK/results.tsv" "$OUT" "$COMMIT" <<'PY'
import json, sys
rows, out, commit = sys.argv[1], sys.argv[2], sys.argv[3]
lines = [f"# Revocation across two instances per store (bench/stores.sh), commit {commit}", "",
         "Logout on A, then B polled on one keep-alive connection until 401 (bench/revocation.py).", "",
         "| store | trials | p50 ms | p99 ms | max ms | timeouts | errors | poll ms |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
for line in open(rows):
    store, path = line.rstrip("\n").split("\t")
    r = json.load(open(path))
    lines.append(f"| {store} | {r['completed']} | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} | "
                 f"{r['timeouts']} | {r['errors']} | {r['poll_ms_mean']} |")
text = "\n".join(lines) + "\n"
print(text)
open(out, "w").write(text)
PY
log "written $OUT"
KEEP_WORK=0
