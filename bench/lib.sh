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
