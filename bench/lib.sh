# Shared helpers of the bench scripts (sourced; the caller defines die() and WORK).

# free_ports N: prints N distinct free loopback TCP ports, all bound at once, then released.
free_ports() {
  python3 -c '
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
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
  trap - EXIT INT TERM
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
  WORK="$(mktemp -d "/tmp/$1.XXXXXX")"
  chmod 711 "$WORK"
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

# tessera_toml FILE PORT ORIGIN_PORT STORE_DIR: a bench config: listen on 127.0.0.1:PORT, the
# origin on 127.0.0.1:ORIGIN_PORT, the embedded store in STORE_DIR, the keys of tessera_keys,
# log level warn, no access log.
tessera_toml() {
  cat >"$1" <<TOML
[server]
listen = "127.0.0.1:$2"
[upstream]
url = "http://127.0.0.1:$3"
[token]
secret = "file:$WORK/keys/jwt.secret"
[session]
store = "embedded:$4/sessions"
[credentials]
keys = { k1 = "file:$WORK/keys/cred.key" }
[log]
level = "warn"
access_log = false
TOML
}
