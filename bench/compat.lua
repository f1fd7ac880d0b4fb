-- wrk script for bench/ab.sh SHAPE=compat: every request carries the `Authorization` cookie of
-- the next session in COMPAT_TOKENS (one base64 JWT per line, from bench/compat_sessions.py), as
-- a hyper-auth-proxy deployment's browsers send it. Requests are built once per thread; each
-- thread starts at its own offset.
local requests, i = {}, 0

function init(args)
  for token in io.lines(os.getenv("COMPAT_TOKENS")) do
    requests[#requests + 1] = wrk.format(nil, nil, { ["Cookie"] = "Authorization=" .. token })
  end
  assert(#requests > 0, "no tokens in COMPAT_TOKENS")
  -- Each thread has a Lua state of its own: seeded from this table's address, so that threads
  -- start at different sessions.
  math.randomseed(tonumber(tostring({}):match("0x(%x+)") or "0", 16) + os.time())
  i = math.random(#requests)
end

function request()
  i = i % #requests + 1
  return requests[i]
end
