#!/usr/bin/env python3
"""Sessions in the shape a hyper-auth-proxy deployment holds them, for bench/ab.sh SHAPE=compat.

    compat_sessions.py REDIS_PORT JWT_SECRET_FILE N TOKENS_OUT [DB]

Writes N records to database DB (default 0) of the Redis on 127.0.0.1:REDIS_PORT as the published hyper-auth-proxy stores
them (key: the sid, no prefix; value: {"credentials": "<base64 of user:password>"}, plaintext),
and to TOKENS_OUT one line per session: base64 of an HS512 JWT with that `sid` (and `exp` a day
ahead), the value of the `Authorization` cookie that proxy reads. Standard library only.
"""
import base64
import hashlib
import hmac
import json
import secrets
import socket
import sys
import time


def b64url(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def jwt(secret: bytes, claims: dict) -> str:
    head = b64url(json.dumps({"alg": "HS512", "typ": "JWT"}, separators=(",", ":")).encode())
    body = b64url(json.dumps(claims, separators=(",", ":")).encode())
    sig = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha512).digest()
    return f"{head}.{body}.{b64url(sig)}"


def resp(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def main() -> None:
    port, secret_file, n, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    db = sys.argv[5] if len(sys.argv) > 5 else "0"
    secret = open(secret_file, "rb").read().rstrip(b"\r\n")
    exp = int(time.time()) + 86400
    cmds, tokens = [resp("SELECT", db)], []
    for i in range(n):
        sid = secrets.token_urlsafe(18)
        cred = base64.b64encode(f"user{i}:bench-password-{i}".encode()).decode()
        cmds.append(resp("SET", sid, json.dumps({"credentials": cred})))
        tokens.append(base64.b64encode(jwt(secret, {"sid": sid, "exp": exp}).encode()).decode())
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"".join(cmds))
        got = b""
        while got.count(b"\r\n") < n + 1:
            chunk = s.recv(65536)
            if not chunk:
                sys.exit("redis closed the connection")
            got += chunk
        if got != b"+OK\r\n" * (n + 1):
            sys.exit(f"redis refused a SET: {got[:80]!r}")
    with open(out, "w") as f:
        f.write("\n".join(tokens) + "\n")


if __name__ == "__main__":
    main()
