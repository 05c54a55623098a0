"""The Lua scripts ``RedisState`` runs in the store: each is one atomic step (Redis runs a script alone),
so no two processes ever both see room that only one may take.

The keys of one namespace ``ns`` (all in one hash slot, ``{ns}``):

- ``{ns}:holders``: a sorted set, one member per live process (its holder id), scored with the time
  (ms, the store's clock unless a test passes one) its leases expire unless renewed.
- ``{ns}:count``: a hash, key -> what every live holder holds on it.
- ``{ns}:held:<holder>``: a hash, lease id -> ``{"n": amount, "k": [keys]}`` (JSON): what that holder
  holds, so that a dead holder's leases can all be taken back at once.
- ``{ns}:bucket:<name>``: a hash (``left``, ``at``), one rate's token bucket; it expires once full.
- the channel ``{ns}:freed``: each release, and each dead holder taken back, publishes the keys freed
  (a JSON list).

Every script that decides first takes back the leases of holders whose time ran out (``PURGE``), so a
dead process's places come back at the first decision after its lease ends, whoever makes it. The
holders' held hashes are named from ``ARGV`` (not ``KEYS``): fine for one server, and one hash slot.
"""

from __future__ import annotations

PRELUDE = """
if redis.replicate_commands then redis.replicate_commands() end
local function now_ms(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function drop(count, held)
  local entries = redis.call('HGETALL', held)
  local freed = {}
  for i = 2, #entries, 2 do
    local lease = cjson.decode(entries[i])
    for _, k in ipairs(lease.k) do
      if redis.call('HINCRBY', count, k, -lease.n) <= 0 then redis.call('HDEL', count, k) end
      freed[#freed + 1] = k
    end
  end
  redis.call('DEL', held)
  return freed
end
local function publish(channel, freed)
  if #freed > 0 then redis.call('PUBLISH', channel, cjson.encode(freed)) end
end
local function purge(holders, count, prefix, channel, now)
  local dead = redis.call('ZRANGEBYSCORE', holders, '-inf', now, 'LIMIT', 0, 64)
  for _, h in ipairs(dead) do
    publish(channel, drop(count, prefix .. h))
    redis.call('ZREM', holders, h)
  end
end
local function alive(holders, holder, now)
  local score = redis.call('ZSCORE', holders, holder)
  return score and tonumber(score) > now
end
"""

ACQUIRE = PRELUDE + """
-- KEYS: holders, count, held(self); ARGV: prefix, channel, holder, now, lease id, amount, force, then
-- key, limit ('' for none) pairs. Returns 1 taken, 0 refused, -1 this holder is not alive (sync first).
local now = now_ms(ARGV[4])
purge(KEYS[1], KEYS[2], ARGV[1], ARGV[2], now)
if not alive(KEYS[1], ARGV[3], now) then return -1 end
local amount = tonumber(ARGV[6])
local keys = {}
for i = 8, #ARGV, 2 do
  local key, limit = ARGV[i], ARGV[i + 1]
  keys[#keys + 1] = key
  if ARGV[7] ~= '1' and limit ~= '' then
    local held = tonumber(redis.call('HGET', KEYS[2], key) or '0')
    if held + amount > tonumber(limit) then return 0 end
  end
end
for _, key in ipairs(keys) do redis.call('HINCRBY', KEYS[2], key, amount) end
redis.call('HSET', KEYS[3], ARGV[5], cjson.encode({n = amount, k = keys}))
return 1
"""

RELEASE = PRELUDE + """
-- KEYS: count, held(self); ARGV: channel, lease id. Returns 1 released, 0 not held (already taken back).
local v = redis.call('HGET', KEYS[2], ARGV[2])
if not v then return 0 end
local lease = cjson.decode(v)
for _, k in ipairs(lease.k) do
  if redis.call('HINCRBY', KEYS[1], k, -lease.n) <= 0 then redis.call('HDEL', KEYS[1], k) end
end
redis.call('HDEL', KEYS[2], ARGV[2])
publish(ARGV[1], lease.k)
return 1
"""

RENEW = PRELUDE + """
-- KEYS: holders, count; ARGV: prefix, channel, holder, now, lease ms. Returns 1 renewed, 0 this holder
-- had run out (its leases were taken back: sync).
local now = now_ms(ARGV[4])
purge(KEYS[1], KEYS[2], ARGV[1], ARGV[2], now)
if not alive(KEYS[1], ARGV[3], now) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[5]), ARGV[3])
return 1
"""

SYNC = PRELUDE + """
-- KEYS: holders, count, held(self); ARGV: prefix, channel, holder, now, lease ms, leases (a JSON object,
-- lease id -> {n, k}), leave ('1': the holder goes). Makes the store hold exactly these leases for this
-- holder, whatever it held before. Returns 1.
local now = now_ms(ARGV[4])
purge(KEYS[1], KEYS[2], ARGV[1], ARGV[2], now)
publish(ARGV[2], drop(KEYS[2], KEYS[3]))
for id, lease in pairs(cjson.decode(ARGV[6])) do
  for _, k in ipairs(lease.k) do redis.call('HINCRBY', KEYS[2], k, lease.n) end
  redis.call('HSET', KEYS[3], id, cjson.encode(lease))
end
if ARGV[7] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[3])
else
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[5]), ARGV[3])
end
return 1
"""

COUNTS = PRELUDE + """
-- KEYS: holders, count; ARGV: prefix, channel, now, then the keys. Returns what is held on each.
local now = now_ms(ARGV[3])
purge(KEYS[1], KEYS[2], ARGV[1], ARGV[2], now)
local out = {}
for i = 4, #ARGV do out[#out + 1] = tonumber(redis.call('HGET', KEYS[2], ARGV[i]) or '0') end
return out
"""

RATE = PRELUDE + """
-- KEYS: bucket; ARGV: now, items, per minute, 'take', 'charge' (taken whatever is left: the level may go
-- below 0) or 'give'. Returns 0 taken (or charged, or given back), -1 never (more than the bucket holds, or
-- a bucket of nothing), else the ms until the items will be there (nothing taken). The bucket expires once
-- it would be full again.
local now = now_ms(ARGV[1])
local items, per = tonumber(ARGV[2]), tonumber(ARGV[3])
if per <= 0 then return -1 end
local level = per
local v = redis.call('HMGET', KEYS[1], 'left', 'at')
if v[1] then level = math.min(per, tonumber(v[1]) + (now - tonumber(v[2])) * per / 60000) end
if ARGV[4] == 'take' then
  if items > per then return -1 end
  if level < items then return math.max(1, math.ceil((items - level) * 60000 / per)) end
  level = level - items
elseif ARGV[4] == 'charge' then
  level = level - items
else
  level = math.min(per, level + items)
end
if level >= per then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'left', tostring(level), 'at', tostring(now))
  redis.call('PEXPIRE', KEYS[1], math.ceil((per - level) * 60000 / per))
end
return 0
"""
