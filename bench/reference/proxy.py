#!/usr/bin/env python3
"""Reference authenticating reverse proxy in Python: the yardstick tessera is measured against.

It does tessera's per-request job the way a careful Python team would write it, with the usual
fast stack: asyncio on uvloop, an aiohttp server, one pooled keep-alive aiohttp.ClientSession to
the upstream (connection limit = --pool), PyJWT, redis-py's asyncio client on one connection pool,
and AES-256-GCM from `cryptography`.

Per request:
  1. TRACE/CONNECT -> 405; a `.` or `..` path segment -> 400.
  2. token: `Authorization: Bearer <jwt>`, else cookie `tessera`; none -> 401.
  3. verify: HS512 only (PyJWT), `exp` required, 5 s leeway, a non-empty string `sid` claim; else 401.
  4. session: GET `tessera:session:<sid>` from Redis; missing/expired -> 401, Redis down -> 503.
     The record is `{"credentials":"tsl1.<kid>.<b64url(nonce[12] || ciphertext || tag[16])>",
     "sub":..,"expires_at":..}`; AES-256-GCM with the sid as associated data opens `user:password`.
  5. inject: hop-by-hop headers (and those named in `Connection`), client `Authorization`, the
     `tessera` cookie and client `Forwarded`/`X-Forwarded-*`/`X-Real-IP` are removed; then
     `Authorization: Basic base64(user:password)` and X-Forwarded-For/-Proto/-Host are set. The
     client's Host is kept.
  6. forward over the pool; request and response bodies stream. Upstream hop-by-hop headers and
     Alt-Svc are dropped from the response. An upstream 401 (stored password refused) deletes the
     session and answers 401. Upstream unreachable -> 502, timeout -> 504.
It does not do tessera's login endpoints, JWKS, key rotation or header/URI size limits beyond
aiohttp's own (8190-byte lines). No access log (like tessera with `access_log = false`).

Usage (secrets may be literal, `env:NAME` or `file:PATH`, as in tessera's config; prefer env:):
  python3 bench/reference/proxy.py --listen 127.0.0.1:8081 --upstream http://127.0.0.1:8080 \
      --redis redis://127.0.0.1:6379/0 --jwt-secret env:TESSERA_JWT_SECRET \
      --cred-key env:TESSERA_CRED_KEY [--cred-kid k1] [--pool 64] [--redis-pool 64] [--workers 1]
The first run creates bench/.venv with the pinned requirements (bench/_venv.py). --workers N
forks N processes sharing the port (SO_REUSEPORT), each with its own pools. SIGTERM/SIGINT stop it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _venv  # noqa: E402

_venv.ensure()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import base64  # noqa: E402
import binascii  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import aiohttp  # noqa: E402
import jwt  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
import redis.exceptions  # noqa: E402
import uvloop  # noqa: E402
from aiohttp import web  # noqa: E402
from cryptography.exceptions import InvalidTag  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402
from yarl import URL  # noqa: E402

COOKIE = "tessera"
KEY_PREFIX = "tessera:session:"
LEEWAY = 5
MAX_TOKEN_BYTES = 8192
STORE_TIMEOUT = 1.0
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer",
              "transfer-encoding", "upgrade", "proxy-authorization"}
SPOOFABLE = {"forwarded", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-real-ip"}


class Refused(Exception):
    """Ends a request with `status` (and optional extra headers) before anything is forwarded."""

    def __init__(self, status, reason="", headers=None):
        super().__init__(reason)
        self.status, self.headers = status, headers or {}


def unauthorized(description=None):
    value = "Bearer" if description is None else \
        f'Bearer error="invalid_token", error_description="{description}"'
    return Refused(401, description or "no token", {"WWW-Authenticate": value})


def secret(value):
    """A secret given as literal, `env:NAME` or `file:PATH` (one trailing newline removed)."""
    if value.startswith("env:"):
        return os.environ[value[4:]]
    if value.startswith("file:"):
        with open(value[5:]) as f:
            text = f.read()
        return text[:-1] if text.endswith("\n") else text
    return value


def connection_named(headers):
    names = set()
    for value in headers.getall("Connection", ()):
        names.update(t.strip().lower() for t in value.split(",") if t.strip())
    return names


def token_of(request):
    auth = request.headers.get("Authorization", "")
    scheme, _, rest = auth.partition(" ")
    if scheme.lower() == "bearer" and rest.strip():
        return rest.strip()
    return request.cookies.get(COOKIE)


def without_token_cookie(value):
    kept = [p for p in value.split(";") if p.strip() and p.split("=", 1)[0].strip() != COOKIE]
    return "; ".join(p.strip() for p in kept)


class Proxy:
    def __init__(self, args):
        self.upstream = args.upstream.rstrip("/")
        self.jwt_key = secret(args.jwt_secret).encode()
        key = base64.b64decode(secret(args.cred_key), validate=True)
        if len(key) != 32:
            raise SystemExit("--cred-key must be base64 of 32 bytes")
        self.aead = {args.cred_kid: AESGCM(key)}
        self.pool_size, self.redis_url, self.redis_pool_size = args.pool, args.redis, args.redis_pool
        self.http = self.redis = None

    async def start(self, _app):
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.pool_size, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_read=60),
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
        pool = aioredis.BlockingConnectionPool.from_url(
            self.redis_url, max_connections=self.redis_pool_size, timeout=STORE_TIMEOUT,
            socket_timeout=STORE_TIMEOUT, socket_connect_timeout=STORE_TIMEOUT)
        self.redis = aioredis.Redis(connection_pool=pool)
        yield
        await self.http.close()
        await self.redis.aclose()
        await pool.disconnect()

    async def session(self, request):
        """Token -> verified sid -> `Basic ...` header value; raises Refused."""
        token = token_of(request)
        if not token:
            raise unauthorized()
        if len(token) > MAX_TOKEN_BYTES:
            raise unauthorized("invalid token")
        try:
            claims = jwt.decode(token, self.jwt_key, algorithms=["HS512"], leeway=LEEWAY,
                                options={"require": ["exp"]})
        except jwt.InvalidTokenError:
            raise unauthorized("invalid token") from None
        sid = claims.get("sid")
        if not isinstance(sid, str) or not sid:
            raise unauthorized("invalid token")
        try:
            raw = await self.redis.get(KEY_PREFIX + sid)
        except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError):
            raise Refused(503, "session store unavailable", {"Retry-After": "1"}) from None
        if raw is None:
            raise unauthorized("unknown session")
        try:
            record = json.loads(raw)
            expires = record.get("expires_at")
            if expires is not None and expires <= time.time():
                raise unauthorized("unknown session")
            prefix, kid, blob = record["credentials"].split(".", 2)
            aead = self.aead.get(kid) if prefix == "tsl1" else None
            data = base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4))
            if aead is None or len(data) < 28:
                raise ValueError
            pair = aead.decrypt(data[:12], data[12:], sid.encode()).decode()
        except (ValueError, KeyError, TypeError, AttributeError, InvalidTag, binascii.Error):
            raise unauthorized("unusable session") from None
        user, sep, password = pair.partition(":")
        if not sep or not user or any(ord(c) < 32 or ord(c) == 127 for c in pair):
            raise unauthorized("unusable session")
        return sid, "Basic " + base64.b64encode(pair.encode()).decode()

    def upstream_headers(self, request, basic):
        drop = HOP_BY_HOP | SPOOFABLE | connection_named(request.headers) | {"authorization"}
        out = []
        for name, value in request.headers.items():
            lname = name.lower()
            if lname in drop:
                continue
            if lname == "cookie":
                value = without_token_cookie(value)
                if not value:
                    continue
            out.append((name, value))
        out.append(("Authorization", basic))
        out.append(("X-Forwarded-For", request.remote or ""))
        out.append(("X-Forwarded-Proto", request.scheme))
        if request.host:
            out.append(("X-Forwarded-Host", request.host))
        return out

    async def handle(self, request):
        try:
            if request.method in ("TRACE", "CONNECT"):
                raise Refused(405, "method not allowed")
            if any(seg in (".", "..") for seg in request.raw_path.split("?", 1)[0].split("/")):
                raise Refused(400, "dot segment in path")
            sid, basic = await self.session(request)
        except Refused as r:
            return web.Response(status=r.status, text=str(r) + "\n", headers=r.headers)

        url = URL(self.upstream + request.raw_path, encoded=True)
        headers = self.upstream_headers(request, basic)
        body = request.content if request.body_exists else None
        try:
            up = await self.http.request(
                request.method, url, headers=headers, data=body, allow_redirects=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
        except asyncio.TimeoutError:
            return web.Response(status=504, text="upstream timeout\n")
        except aiohttp.ClientError:
            return web.Response(status=502, text="upstream unavailable\n")

        async with up:
            if up.status == 401:
                # The upstream refused the stored credentials: the session is dead everywhere.
                try:
                    await self.redis.delete(KEY_PREFIX + sid)
                except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError):
                    pass
                r = unauthorized("upstream rejected credentials")
                return web.Response(status=401, text=str(r) + "\n", headers=r.headers)
            drop = HOP_BY_HOP | connection_named(up.headers) | {"alt-svc"}
            resp = web.StreamResponse(status=up.status, reason=up.reason)
            for name, value in up.headers.items():
                if name.lower() not in drop:
                    resp.headers.add(name, value)
            try:
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            except ConnectionResetError:
                pass  # the client went away mid-response; nothing left to tell it
            return resp


async def serve(args, host, port):
    proxy = Proxy(args)
    app = web.Application()
    app.cleanup_ctx.append(proxy.start)
    app.router.add_route("*", "/{path:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_port=True, backlog=1024).start()
    print(f"[proxy {os.getpid()}] listening on {host}:{port}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:8081", help="host:port")
    p.add_argument("--upstream", required=True, help="http://host:port[/prefix]")
    p.add_argument("--redis", required=True, help="redis://host:port/db")
    p.add_argument("--jwt-secret", required=True, help="HS512 secret: literal, env:NAME, file:PATH")
    p.add_argument("--cred-key", required=True, help="base64 of 32 bytes: literal, env:, file:")
    p.add_argument("--cred-kid", default="k1", help="sealing key id the records name (default k1)")
    p.add_argument("--pool", type=int, default=64, help="upstream connection limit (default 64)")
    p.add_argument("--redis-pool", type=int, default=64, help="Redis connections (default 64)")
    p.add_argument("--workers", type=int, default=1, help="processes sharing the port")
    args = p.parse_args()
    if not args.upstream.startswith("http://"):
        p.error("--upstream must be http://")
    host, _, port = args.listen.rpartition(":")
    Proxy(args)  # validate secrets before forking

    if args.workers <= 1:
        uvloop.run(serve(args, host, int(port)))
        return
    children = []
    for _ in range(args.workers):
        pid = os.fork()
        if pid == 0:
            uvloop.run(serve(args, host, int(port)))
            os._exit(0)
        children.append(pid)

    def forward(sig, _frame):
        for pid in children:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
