# shellcheck shell=bash
# Shared helpers of the bench scripts (sourced; the caller defines log() and die()).

# free_ports N: prints N distinct free loopback TCP ports, all bound at once, then released. They
# are picked below the kernel's ephemeral range (net.ipv4.ip_local_port_range), in the upper half
# of [10000, range start) (the tests' free_port, tests/support/mod.rs, takes the lower half): a
# port from the ephemeral range can be taken meanwhile as the source port of one of the many
# outgoing connections a run opens (seen: a listener started 12 minutes into bench/suite.sh found
# its port in use). When the range starts below 12000, or 2000 tries found too few free ports
# there, the kernel picks (from the ephemeral range, with a warning on stderr).
free_ports() {
  python3 -c '
import random, socket, sys
n, lo = int(sys.argv[1]), int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
below = list(range(10000 + (lo - 10000) // 2, lo)) if lo >= 12000 else []
random.shuffle(below)
socks = []
for port in below[:2000]:
    if len(socks) == n:
        break
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        socks.append(s)
    except OSError:
        s.close()
if len(socks) < n:
    print(f"free_ports: {n - len(socks)} port(s) from the ephemeral range", file=sys.stderr)
while len(socks) < n:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

# wait_port PORT WHAT PID: waits up to 15 s until PORT accepts connections; dies if PID exits first.
wait_port() {
  local port=$1 what=$2 pid=$3 i
  for ((i = 0; i < 300; i++)); do
    kill -0 "$pid" 2>/dev/null || die "$what exited before listening on $port (logs in $WORK)"
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
    sleep 0.05
  done
  die "$what did not listen on $port within 15 s"
}

# work_dir PREFIX: makes WORK (/tmp/PREFIX.XXXXXX, mode 711 so that nginx workers running as
# nobody reach files in it) and sets traps so that on exit every PID in PIDS is stopped (stop_pid,
# last started first) and WORK is removed, or kept with a message when the script fails or has
# not cleared KEEP_WORK (set KEEP_WORK=0 once a run succeeded). The caller defines log().
PIDS=() WORK="" KEEP_WORK=1
stop_pid() { # pid: TERM, then KILL after 5 s
  local pid=$1 i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.05; done
  kill -KILL "$pid" 2>/dev/null || true
}
cleanup() {
  local rc=$? i
  trap - EXIT INT TERM HUP
  idle_poll_restore
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do stop_pid "${PIDS[$i]}"; done
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do wait "${PIDS[$i]}" 2>/dev/null || true; done
  if [[ -n "$WORK" && -d "$WORK" ]]; then
    if ((rc || KEEP_WORK)); then log "run failed (exit $rc): logs kept in $WORK"; else rm -rf "$WORK"; fi
  fi
  exit "$rc"
}
work_dir() {
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  trap 'exit 129' HUP
  WORK="$(mktemp -d "/tmp/$1.XXXXXX")"
  chmod 711 "$WORK"
}

# The guest's idle polling. On a VM an idle vCPU that halts costs microseconds to wake, and at c=1
# every hop of a request (load generator, proxy, origin) wakes one: the Linux cpuidle "haltpoll"
# governor (Documentation/virt/guest-halt-polling.rst) polls up to guest_halt_poll_ns (ns) before it
# halts. It is system-wide, so it changes every target of a run alike; the CPU a vCPU spends
# polling is idle time, in no process's CPU time. idle_state prints the setting for a report's
# machine line; idle_poll_apply sets IDLE_POLL_NS (ns, 0..4294967295; unset: left as the machine
# has it) for the run, holding a lock so that two runs cannot interleave their settings, and
# cleanup puts the old value back (not after SIGKILL: then write the old value back by hand).
HALTPOLL_NS=/sys/module/haltpoll/parameters/guest_halt_poll_ns
IDLE_POLL_LOCK=/run/tessera-bench-idle-poll.lock
IDLE_POLL_OLD=""
idle_governor() {
  local dir=/sys/devices/system/cpu/cpuidle
  cat "$dir/current_governor_ro" 2>/dev/null || cat "$dir/current_governor" 2>/dev/null || echo none
}
idle_state() {
  local driver governor
  driver="$(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none)"
  governor="$(idle_governor)"
  printf 'cpuidle driver %s, governor %s' "$driver" "$governor"
  if [[ $governor == haltpoll && -r $HALTPOLL_NS ]]; then
    printf ', guest_halt_poll_ns %s' "$(cat "$HALTPOLL_NS")"
  fi
  printf '\n'
}
idle_poll_apply() {
  [[ -n ${IDLE_POLL_NS:-} ]] || return 0
  if ! [[ $IDLE_POLL_NS =~ ^[0-9]{1,10}$ ]] || ((10#$IDLE_POLL_NS > 4294967295)); then
    die "IDLE_POLL_NS must be a whole number of ns from 0 to 4294967295, got '$IDLE_POLL_NS'"
  fi
  [[ "$(idle_governor)" == haltpoll && -w $HALTPOLL_NS ]] ||
    die "IDLE_POLL_NS needs the cpuidle haltpoll governor and a writable $HALTPOLL_NS (root); here: $(idle_state)"
  command -v flock >/dev/null || die "IDLE_POLL_NS needs flock (util-linux)"
  # /run: root's, like the parameter. Children inherit fd 9; idle_poll_restore unlocks it.
  exec 9>>"$IDLE_POLL_LOCK" || die "cannot open $IDLE_POLL_LOCK"
  flock -n 9 || die "another run holds $IDLE_POLL_LOCK (fuser -v $IDLE_POLL_LOCK shows it) and sets guest_halt_poll_ns"
  IDLE_POLL_OLD="$(cat "$HALTPOLL_NS")"
  echo "$((10#$IDLE_POLL_NS))" >"$HALTPOLL_NS" || die "could not write $IDLE_POLL_NS to $HALTPOLL_NS"
  log "guest_halt_poll_ns set to $((10#$IDLE_POLL_NS)) for this run (was $IDLE_POLL_OLD; put back on exit)"
}
idle_poll_restore() {
  [[ -n $IDLE_POLL_OLD ]] || return 0
  echo "$IDLE_POLL_OLD" >"$HALTPOLL_NS" || log "WARNING: could not put guest_halt_poll_ns back to $IDLE_POLL_OLD"
  IDLE_POLL_OLD=""
  flock -u 9 2>/dev/null || true
  exec 9>&-
}

# nginx_start NAME PORT HTTP-BLOCK [WORKER_CONNECTIONS]: writes $WORK/NAME.conf (one worker, no
# daemon, access log off, temp paths in $WORK/NAME-tmp, worker_connections 8192 unless given) with
# HTTP-BLOCK inside `http { }`, starts nginx with it, waits until PORT listens, and adds the
# master's PID to PIDS and sets NGINX_PID to it. Logs: $WORK/NAME-error.log, $WORK/NAME.out.
nginx_start() {
  local name=$1 port=$2 tmp="$WORK/$1-tmp"
  mkdir -p "$tmp"
  cat >"$WORK/$name.conf" <<EOF
worker_processes 1; daemon off; pid $WORK/$name.pid; error_log $WORK/$name-error.log warn;
events { worker_connections ${4:-8192}; }
http {
  access_log off;
  client_body_temp_path $tmp; proxy_temp_path $tmp; fastcgi_temp_path $tmp;
  uwsgi_temp_path $tmp; scgi_temp_path $tmp;
$3
}
EOF
  nginx -e "$WORK/$name-error.log" -p "$WORK" -c "$WORK/$name.conf" >"$WORK/$name.out" 2>&1 &
  NGINX_PID=$!
  PIDS+=("$NGINX_PID")
  wait_port "$port" "nginx $name" "$NGINX_PID"
}

# write_1k FILE: the 1 KiB JSON body every bench origin serves (the body of bench/suite.sh).
write_1k() {
  python3 -c 'import sys; open(sys.argv[1], "w").write(("{\"items\":[" + "\"lorem-ipsum\"," * 71 + "\"end\"]}")
.ljust(1023) + "\n")' "$1"
  [[ $(wc -c <"$1") -eq 1024 ]] || die "$1 is not 1024 bytes"
}

# tessera_keys BIN: a JWT secret and a sealing key from `BIN keygen`, in $WORK/keys/jwt.secret and
# $WORK/keys/cred.key (mode 600; $WORK/keys must exist).
tessera_keys() {
  local keys
  keys="$("$1" keygen)" || die "$1 keygen failed"
  (umask 077 && sed -n 's/^TESSERA_JWT_SECRET=//p' <<<"$keys" >"$WORK/keys/jwt.secret" &&
    sed -n 's/^TESSERA_CRED_KEY=//p' <<<"$keys" >"$WORK/keys/cred.key")
  [[ $(wc -c <"$WORK/keys/jwt.secret") -ge 65 && -s "$WORK/keys/cred.key" ]] || die "keygen gave no usable keys"
}

# compat_redis PORT: the hyper-auth-proxy shape's store (bench/ab.sh SHAPE=compat): a
# redis-server on 127.0.0.1:PORT (no persistence, PID in PIDS) holding 1,000 sessions written by
# bench/compat_sessions.py with $WORK/keys/jwt.secret (tessera_keys first); exports
# COMPAT_TOKENS, their base64 cookies one per line (read by bench/compat.lua).
compat_redis() {
  redis-server --port "$1" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" \
    >"$WORK/redis.log" 2>&1 &
  PIDS+=("$!")
  wait_port "$1" redis-server "$!"
  export COMPAT_TOKENS="$WORK/compat-tokens"
  python3 "$ROOT/bench/compat_sessions.py" "$1" "$WORK/keys/jwt.secret" 1000 "$COMPAT_TOKENS" ||
    die "could not write the compat sessions"
}

# tessera_toml FILE PORT ORIGIN_PORT STORE_DIR: a bench config: listen on 127.0.0.1:PORT, the
# origin on 127.0.0.1:ORIGIN_PORT, the embedded store in STORE_DIR, the keys of tessera_keys,
# log level warn, no access log.
tessera_toml() {
  tessera_toml_on "$1" "$2" "http://127.0.0.1:$3" "embedded:$4/sessions"
}

# tessera_toml_on FILE PORT UPSTREAM_URL STORE [UPSTREAM_LINES]: the same config with any upstream
# URL and store (`redis://...`), and more `[upstream]` lines; the caller may append tables after it.
tessera_toml_on() {
  cat >"$1" <<TOML
[server]
listen = "127.0.0.1:$2"
[upstream]
url = "$3"
${5:-}
[token]
secret = "file:$WORK/keys/jwt.secret"
[session]
store = "$4"
[credentials]
keys = { k1 = "file:$WORK/keys/cred.key" }
[log]
level = "warn"
access_log = false
TOML
}

# pin_parse NAME SPEC: SPEC ("wrk=0,origin=1,proxy=0": taskset CPU lists for wrk, the nginx
# origin and every thread of the proxy under test) into PIN_OF; dies naming the variable NAME on
# a bad entry. An empty SPEC pins nothing. Needs taskset (util-linux) when SPEC is set.
# shellcheck disable=SC2034 # read by the scripts that source this file
declare -A PIN_OF=()
pin_parse() {
  local name=$1 spec=$2 p pins
  [[ -n $spec ]] || return 0
  command -v taskset >/dev/null || die "$name needs taskset (util-linux)"
  IFS=, read -r -a pins <<<"$spec"
  for p in "${pins[@]}"; do
    [[ $p =~ ^(wrk|origin|proxy)=([0-9]+([-,][0-9]+)*)$ ]] ||
      die "$name entry '$p' is not wrk|origin|proxy=CPULIST (e.g. $name=\"wrk=0,origin=1,proxy=0\")"
    # shellcheck disable=SC2034 # read by the scripts that source this file
    PIN_OF[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
  done
}

# pin_to CPUS PID...: every thread of each PID onto CPUS (a taskset CPU list).
pin_to() {
  local cpus=$1 p
  shift
  for p in "$@"; do taskset -a -p -c "$cpus" "$p" >/dev/null || die "taskset -c $cpus pid $p failed"; done
}

# test_ca DIR SAN: a test CA (DIR/ca.pem) and a leaf for localhost signed by it (DIR/cert.pem,
# DIR/key.pem; subjectAltName SAN, e.g. "DNS:localhost,IP:127.0.0.1"), ECDSA P-256, 7 days:
# rustls clients (quinn's) want a real chain, not a self-signed leaf.
test_ca() {
  local dir=$1 san=$2
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 7 -subj /CN=bench-ca \
    -addext basicConstraints=critical,CA:TRUE -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
    -keyout "$dir/key.pem" -out "$dir/leaf.csr" 2>/dev/null
  printf 'subjectAltName=%s\n' "$san" >"$dir/leaf.ext"
  openssl x509 -req -in "$dir/leaf.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 7 -extfile "$dir/leaf.ext" -out "$dir/cert.pem" 2>/dev/null
}

# pg_start PORT: a fresh PostgreSQL cluster in $WORK/pg (initdb, trust, superuser tessera, fsync
# off) on 127.0.0.1:PORT; sets PID_PG, PG_URL and PSQL (psql command line, rows unaligned). As
# root the server runs as postgres (setpriv execs, so the PID is the server's).
pg_start() {
  local bin as_pg=() i
  bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
  [[ -x $bin/initdb ]] || die "no /usr/lib/postgresql/*/bin/initdb: apt-get install postgresql"
  mkdir -p "$WORK/pg"
  if [[ $(id -u) == 0 ]]; then
    as_pg=(setpriv --reuid=postgres --regid=postgres --init-groups)
    chown postgres "$WORK/pg"
  fi
  "${as_pg[@]}" "$bin/initdb" -A trust -U tessera --no-sync -D "$WORK/pg/data" >"$WORK/initdb.log" 2>&1 ||
    die "initdb failed: $(tail -3 "$WORK/initdb.log")"
  "${as_pg[@]}" "$bin/postgres" -D "$WORK/pg/data" -p "$1" -k "$WORK/pg" -c listen_addresses=127.0.0.1 \
    -c fsync=off >"$WORK/pg.log" 2>&1 &
  PID_PG=$! PIDS+=("$!")
  wait_port "$1" postgres "$PID_PG"
  PSQL=("$bin/psql" -X -q -A -t -h 127.0.0.1 -p "$1" -U tessera -d postgres)
  for ((i = 0; i < 100; i++)); do "${PSQL[@]}" -c 'SELECT 1' >/dev/null 2>&1 && break; sleep 0.05; done
  PG_URL="postgres://tessera@127.0.0.1:$1/postgres"
}

# mariadb_start PORT: a fresh MariaDB in $WORK/mariadb (root without a password, database tessera)
# on 127.0.0.1:PORT; sets PID_MARIADB and MYSQL_URL.
mariadb_start() {
  local d="$WORK/mariadb" i
  command -v mariadbd >/dev/null || die "mariadbd is not installed: apt-get install mariadb-server"
  mkdir -p "$d/tmp"
  mariadb-install-db --no-defaults --auth-root-authentication-method=normal --skip-test-db --user=root \
    --datadir="$d/data" --tmpdir="$d/tmp" >"$WORK/mariadb-install.log" 2>&1 ||
    die "mariadb-install-db failed: $(tail -3 "$WORK/mariadb-install.log")"
  mariadbd --no-defaults --datadir="$d/data" --socket="$d/sock" --pid-file="$d/pid" --tmpdir="$d/tmp" \
    --port="$1" --bind-address=127.0.0.1 --user=root --skip-log-bin --innodb-flush-log-at-trx-commit=2 \
    >"$WORK/mariadb.log" 2>&1 &
  PID_MARIADB=$! PIDS+=("$!")
  for ((i = 0; i < 600; i++)); do
    mariadb --no-defaults -h 127.0.0.1 -P "$1" -u root -e 'CREATE DATABASE IF NOT EXISTS tessera' \
      >/dev/null 2>&1 && break
    kill -0 "$PID_MARIADB" 2>/dev/null || die "mariadbd exited (logs in $WORK)"
    sleep 0.05
  done
  MYSQL_URL="mysql://root@127.0.0.1:$1/tessera"
}
