#!/usr/bin/env python3
"""Create N tessera-format sessions directly in Redis and write their tokens for load tools.

Each session: sid = base64url of 18 random bytes (144 bits, as tessera makes them); Redis key
`<prefix><sid>` (default prefix `tessera:session:`) set with EX ttl to
`{"credentials":"tsl1.<kid>.<b64url(nonce[12] || ciphertext || tag[16])>","sub":USER,"expires_at":T}`,
sealed with AES-256-GCM under --cred-key with the sid as associated data; token = a JWT (header
typ JWT, and kid when --kid is given) with claims sub, sid, iat, exp, signed with --alg (default
HS512). Every session holds the same USER:PASSWORD unless --distinct-users is given: then
session n (1-based) is user `USER-n` (its sub and its sealed credential), so each session has its
own upstream `Authorization` value (what `upstream.affinity = "session"` keys connections on).
Both tessera (`session.store = "redis://..."`, same secret and key) and
bench/reference/proxy.py (HS512 only) accept them.

--alg HS256/384/512 signs with the secret --jwt-secret; RS256/384/512, PS256/384/512, ES256/384
and EdDSA sign with the PEM private key --jwt-key (PKCS#8 or traditional, e.g. from
`openssl genpkey -algorithm ed25519` or `openssl genpkey -algorithm RSA -pkeyopt
rsa_keygen_bits:2048`). tessera verifies those with a `[[token.keys]]` entry holding the same
kid, alg and `public_key`.

Usage (secrets: literal, env:NAME or file:PATH; the password is read from stdin or env):
  printf 'bench-password\n' | python3 bench/tokens.py --count 1000 --redis redis://127.0.0.1:6379/0 \
      --jwt-secret env:TESSERA_JWT_SECRET --cred-key env:TESSERA_CRED_KEY --user alice \
      --password-stdin --out /tmp/bench.tokens.jsonl [--format jsonl|plain] \
      [--lua /tmp/wrk-rotate.lua] [--ttl 43200] [--cred-kid k1] [--key-prefix tessera:session:] \
      [--distinct-users]
  ... --alg EdDSA --kid ed1 --jwt-key file:/tmp/ed25519.pem   (instead of --jwt-secret)
  wrk -t2 -c8 -d10s -s /tmp/wrk-rotate.lua http://127.0.0.1:8080/1k

--out: jsonl (default) writes `{"sid","token","expires_at"}` per line, the shape
`tessera session create` prints (bench/revocation.py reads it); plain writes one token per line.
--lua writes a wrk script that reads --out at start and rotates over the tokens, one per request
(`Authorization: Bearer`), keeping headers given with `wrk -H`; each wrk thread starts at a
different offset. Files are mode 0600;
stdout says only how many sessions were written where (no token, sid or key).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _venv  # noqa: E402

_venv.ensure()

import argparse  # noqa: E402
import base64  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jwt  # noqa: E402
import redis  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

HMAC_ALGS = {"HS256", "HS384", "HS512"}
PEM_ALGS = {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA"}

LUA = r"""-- wrk script written by bench/tokens.py: one bearer token per request, rotating over the
-- tokens in TOKENS (one per line, plain or the jsonl of bench/tokens.py). No token is in here.
local TOKENS = %s
local tokens = {}
local threads, counter = {}, 0

function setup(thread)
  thread:set("offset", counter)
  counter = counter + 1
  table.insert(threads, thread)
end

function init(args)
  local f = assert(io.open(TOKENS, "r"))
  for line in f:lines() do
    local t = line:match('"token"%%s*:%%s*"([^"]+)"') or line:match("^%%s*([%%w%%-_%%.]+)%%s*$")
    if t then table.insert(tokens, t) end
  end
  f:close()
  assert(#tokens > 0, "no token in " .. TOKENS)
  -- spread threads over the list so they do not ask for the same session at the same moment
  i = math.floor((offset or 0) * #tokens / 8) %% #tokens
  -- keep the headers given with wrk -H (e.g. Connection: close); Authorization is set per request
  headers = {}
  for name, value in pairs(wrk.headers) do headers[name] = value end
end

function request()
  i = i %% #tokens + 1
  headers["Authorization"] = "Bearer " .. tokens[i]
  return wrk.format(nil, nil, headers)
end
"""


def secret(value):
    """A secret given as literal, `env:NAME` or `file:PATH` (one trailing newline removed)."""
    if value.startswith("env:"):
        return os.environ[value[4:]]
    if value.startswith("file:"):
        with open(value[5:]) as f:
            text = f.read()
        return text[:-1] if text.endswith("\n") else text
    return value


def seal(key, kid, sid, plaintext):
    nonce = os.urandom(12)
    blob = nonce + AESGCM(key).encrypt(nonce, plaintext, sid.encode())
    return f"tsl1.{kid}.{base64.urlsafe_b64encode(blob).rstrip(b'=').decode()}"


def private_file(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "w")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--redis", required=True, help="redis://host:port/db holding tessera records")
    p.add_argument("--alg", default="HS512", choices=sorted(HMAC_ALGS | PEM_ALGS),
                   help="JWT algorithm (default HS512)")
    p.add_argument("--kid", help="JWT header kid (default: none, tessera's token.secret)")
    p.add_argument("--jwt-secret", help="HS* secret: literal, env:NAME, file:PATH")
    p.add_argument("--jwt-key", help="PEM private key for RS*/PS*/ES*/EdDSA: file:PATH, env:NAME")
    p.add_argument("--cred-key", required=True, help="base64 of 32 bytes: literal, env:, file:")
    p.add_argument("--cred-kid", default="k1")
    p.add_argument("--key-prefix", default="tessera:session:")
    p.add_argument("--user", required=True)
    p.add_argument("--distinct-users", action="store_true",
                   help="session n is user USER-n (one credential per session); default: all USER")
    pw = p.add_mutually_exclusive_group(required=True)
    pw.add_argument("--password-stdin", action="store_true", help="first line of stdin")
    pw.add_argument("--password-env", metavar="NAME", help="environment variable holding it")
    p.add_argument("--ttl", type=int, default=43200, help="seconds (default 43200)")
    p.add_argument("--out", required=True, help="tokens file")
    p.add_argument("--format", choices=("jsonl", "plain"), default="jsonl")
    p.add_argument("--lua", help="also write a wrk script rotating over --out")
    args = p.parse_args()
    if args.count < 1 or args.ttl < 1:
        p.error("--count and --ttl must be positive")
    if ":" in args.user or not args.user:
        p.error("--user must be non-empty without ':'")
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin \
        else os.environ[args.password_env]
    key = base64.b64decode(secret(args.cred_key), validate=True)
    if len(key) != 32:
        p.error("--cred-key must be base64 of 32 bytes")
    if args.alg in HMAC_ALGS:
        if not args.jwt_secret or args.jwt_key:
            p.error(f"--alg {args.alg} takes --jwt-secret (not --jwt-key)")
        jwt_key = secret(args.jwt_secret)
    else:
        if not args.jwt_key or args.jwt_secret:
            p.error(f"--alg {args.alg} takes --jwt-key (a PEM private key), not --jwt-secret")
        # Parsed once: PyJWT would otherwise parse the PEM for every token.
        jwt_key = serialization.load_pem_private_key(secret(args.jwt_key).encode(), password=None)
    headers = {"typ": "JWT"}
    if args.kid:
        headers["kid"] = args.kid

    r = redis.Redis.from_url(args.redis)
    now = int(time.time())
    exp = now + args.ttl
    with private_file(args.out) as out:
        pipe = r.pipeline(transaction=False)
        for n in range(1, args.count + 1):
            sid = base64.urlsafe_b64encode(os.urandom(18)).decode()
            user = f"{args.user}-{n}" if args.distinct_users else args.user
            pair = f"{user}:{password}".encode()
            record = {"credentials": seal(key, args.cred_kid, sid, pair), "sub": user,
                      "expires_at": exp}
            pipe.set(args.key_prefix + sid, json.dumps(record, separators=(",", ":")),
                     ex=args.ttl)
            token = jwt.encode({"sub": user, "sid": sid, "iat": now, "exp": exp}, jwt_key,
                               algorithm=args.alg, headers=headers)
            if args.format == "jsonl":
                out.write(json.dumps({"sid": sid, "token": token, "expires_at": exp}) + "\n")
            else:
                out.write(token + "\n")
            if n % 1000 == 0:
                pipe.execute()
        pipe.execute()
    if args.lua:
        with open(args.lua, "w") as f:
            f.write(LUA % json.dumps(os.path.abspath(args.out)))
    print(f"{args.count} sessions in {args.redis.split('@')[-1]} ({args.alg} tokens"
          + (f", kid {args.kid}" if args.kid else "")
          + (f", users {args.user}-1..{args.user}-{args.count}" if args.distinct_users else "")
          + ") "
          f"(prefix {args.key_prefix}, ttl {args.ttl} s); tokens: {args.out} ({args.format})"
          + (f"; wrk script: {args.lua}" if args.lua else ""))


if __name__ == "__main__":
    main()
