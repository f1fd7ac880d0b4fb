#!/usr/bin/env python3
"""Revocation latency across instances: how long a revoked session's token still works on B.

Two proxy instances A and B share one session store (Redis). For each trial, one (sid, token)
pair from --sessions is used once:
  1. warm: GET --path with `Authorization: Bearer <token>` on A (when given) and on B, twice each;
     every answer must be 200 (so whatever B caches is now warm);
  2. revoke, by one of:
       default          DEL <key-prefix><sid> in Redis
       --revoke-cmd CMD run CMD (split like a shell line, no shell; `{sid}` replaced), e.g.
                        'target/release/tessera session revoke --config t.toml --sid {sid}'
       --logout-path P  POST P on instance A with the token (e.g. /auth/logout), must be 2xx/3xx
     t0 = the moment the revoke returned (DEL reply, command exit, logout response);
  3. poll B with the token, back to back on one keep-alive connection, until it answers 401;
     t1 = when that 401 arrived. Latency = t1 - t0. Anything but 200/401 counts as an error and
     polling goes on; no 401 within --max-wait seconds counts as a timeout.
Reported on stdout (and --out) as JSON: p50/p99/max/min/mean in ms over the trials that saw a 401
(nearest-rank percentiles), timeouts, errors, the revoke call's own p50, and poll_ms_mean (the
mean time of one poll round trip: the resolution of the measurement; a proxy that checks the
store on every request shows about one poll). No token or sid is printed.

Usage:
  python3 bench/revocation.py --a http://127.0.0.1:8081 --b http://127.0.0.1:8082 \
      [--redis redis://127.0.0.1:6379/0] --sessions /tmp/bench.tokens.jsonl [--trials 1000] \
      [--path /1k] [--key-prefix tessera:session:] [--max-wait 10] [--out result.json]
--sessions: one pair per line, either JSON with "sid" and "token" (bench/tokens.py --out, or the
lines `tessera session create` prints) or `sid token` separated by whitespace. With --redis, pairs
whose session is no longer in Redis (revoked by an earlier run) are skipped; without it (any
store, revoked by --logout-path or --revoke-cmd) every pair must be live. At least --trials
must be live, and each trial revokes one. Works against any proxy answering 200 for a live session's
bearer token and 401 once the session is gone.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _venv  # noqa: E402

_venv.ensure()

import argparse  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import urllib.parse  # noqa: E402

import redis  # noqa: E402


class Client:
    """One keep-alive HTTP/1.1 connection to a base URL (reconnects when the server closes)."""

    def __init__(self, base):
        u = urllib.parse.urlsplit(base)
        if u.scheme != "http":
            raise SystemExit(f"only http:// base URLs: {base}")
        self.prefix = u.path.rstrip("/")
        self.conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=10)

    def status(self, method, path, token):
        try:
            self.conn.request(method, self.prefix + path,
                              headers={"Authorization": f"Bearer {token}"})
            resp = self.conn.getresponse()
            resp.read()
            return resp.status
        except (OSError, http.client.HTTPException):
            self.conn.close()
            return 0


def load_sessions(path):
    pairs = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                v = json.loads(line)
                pairs.append((v["sid"], v["token"]))
            else:
                sid, token = line.split()
                pairs.append((sid, token))
    return pairs


def pct(sorted_values, p):
    return sorted_values[max(0, math.ceil(p / 100 * len(sorted_values)) - 1)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", help="instance A base URL (warmed; --logout-path goes here)")
    p.add_argument("--b", required=True, help="instance B base URL (polled)")
    p.add_argument("--redis", help="redis://host:port/db the instances share (needed for the "
                   "default revocation, a DEL; with --logout-path or --revoke-cmd it only skips "
                   "sessions no longer there)")
    p.add_argument("--sessions", required=True, help="file of (sid, token) pairs")
    p.add_argument("--trials", type=int, default=1000)
    p.add_argument("--path", default="/1k", help="path requested through the proxies")
    p.add_argument("--key-prefix", default="tessera:session:")
    rv = p.add_mutually_exclusive_group()
    rv.add_argument("--revoke-cmd", help="command revoking {sid} instead of a Redis DEL")
    rv.add_argument("--logout-path", help="revoke by POSTing this path on A with the token")
    p.add_argument("--max-wait", type=float, default=10.0, help="seconds to wait for a 401")
    p.add_argument("--out", help="also write the JSON result here")
    args = p.parse_args()
    if args.logout_path and not args.a:
        p.error("--logout-path needs --a")
    if not (args.redis or args.logout_path or args.revoke_cmd):
        p.error("give --redis, or revoke with --logout-path or --revoke-cmd")
    pairs = load_sessions(args.sessions)
    r = redis.Redis.from_url(args.redis) if args.redis else None
    if r is not None:
        # Sessions revoked by an earlier run (or expired) are skipped, so a file can be reused.
        pipe = r.pipeline(transaction=False)
        for sid, _ in pairs:
            pipe.exists(args.key_prefix + sid)
        pairs = [pair for pair, live in zip(pairs, pipe.execute()) if live]
    if len(pairs) < args.trials:
        p.error(f"--sessions has {len(pairs)} sessions (live in Redis under "
                f"{args.key_prefix!r} when --redis is given), fewer than --trials {args.trials}")

    a = Client(args.a) if args.a else None
    b = Client(args.b)
    mode = "command" if args.revoke_cmd else "logout-on-A" if args.logout_path else "redis-del"
    latencies, revoke_ms, poll_ms = [], [], []
    timeouts = errors = 0

    for n, (sid, token) in enumerate(pairs[:args.trials], 1):
        for inst, name in ((a, "A"), (b, "B")):
            for _ in range(2 if inst else 0):
                got = inst.status("GET", args.path, token)
                if got != 200:
                    raise SystemExit(f"trial {n}: warm-up GET {args.path} on {name} gave {got}, "
                                     "expected 200")

        start = time.perf_counter()
        if args.revoke_cmd:
            cmd = [part.replace("{sid}", sid) for part in shlex.split(args.revoke_cmd)]
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if done.returncode != 0:
                raise SystemExit(f"trial {n}: revoke command exited {done.returncode}: "
                                 f"{done.stderr.decode(errors='replace')[-500:]}")
        elif args.logout_path:
            got = a.status("POST", args.logout_path, token)
            if not 200 <= got < 400:
                raise SystemExit(f"trial {n}: POST {args.logout_path} on A gave {got}")
        else:
            r.delete(args.key_prefix + sid)
        t0 = time.perf_counter()
        revoke_ms.append((t0 - start) * 1e3)

        polls = 0
        while True:
            got = b.status("GET", args.path, token)
            polls += 1
            now = time.perf_counter()
            if got == 401:
                latencies.append((now - t0) * 1e3)
                poll_ms.append((now - t0) * 1e3 / polls)
                break
            if got != 200:
                errors += 1
            if now - t0 > args.max_wait:
                timeouts += 1
                break

    lat = sorted(latencies)
    result = {
        "b": args.b, "path": args.path, "revoke": mode, "trials": args.trials,
        "completed": len(lat), "timeouts": timeouts, "errors": errors,
        "p50_ms": round(pct(lat, 50), 3) if lat else None,
        "p99_ms": round(pct(lat, 99), 3) if lat else None,
        "max_ms": round(lat[-1], 3) if lat else None,
        "min_ms": round(lat[0], 3) if lat else None,
        "mean_ms": round(statistics.fmean(lat), 3) if lat else None,
        "revoke_call_p50_ms": round(pct(sorted(revoke_ms), 50), 3),
        "poll_ms_mean": round(statistics.fmean(poll_ms), 3) if poll_ms else None,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
