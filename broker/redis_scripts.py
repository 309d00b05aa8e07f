"""Lua scripts of the Redis weight store: each one is a step that must be atomic.

Scripts run EVALSHA first and fall back to EVAL when the server lost its script cache (redis-py's
`Script` does that). Timestamps come from the server's TIME so every process agrees on expiry,
whatever its own clock says. Every key a script touches is passed in KEYS.
"""

from __future__ import annotations

# Shared Lua fragment: the server time as "seconds.micros", exact in a string.
_NOW = """
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
"""

# KEYS[1] version, KEYS[2] versions zset, KEYS[3] manifest of the new version, KEYS[4..] blobs.
# ARGV[1] expected version, ARGV[2] commit id, ARGV[3] meta JSON, ARGV[4..] pairs of manifest
# field and entry JSON. Returns {'ok', created_at} | {'conflict', current} | {'missing', key}.
PUBLISH = (
    """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local expected = tonumber(ARGV[1])
local version = tostring(expected + 1)
if current ~= expected then
  -- A retry of a commit whose reply was lost finds its own manifest: report success again
  -- (even when another publisher has committed on top of it since).
  if current > expected and redis.call('HGET', KEYS[3], 'commit_id') == ARGV[2] then
    -- Written again (same value) so that a WAIT behind this retry, on whichever connection,
    -- waits for the replicas to reach past the original commit (min_replicas).
    redis.call('HSET', KEYS[3], 'commit_id', ARGV[2])
    return {'ok', redis.call('HGET', KEYS[3], 'created_at')}
  end
  return {'conflict', tostring(current)}
end
for i = 4, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    return {'missing', KEYS[i]}
  end
end
for i = 4, #KEYS do
  redis.call('PERSIST', KEYS[i])
end
"""
    + _NOW
    + """
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], 'version', version, 'created_at', now, 'commit_id', ARGV[2],
           'meta', ARGV[3])
for i = 4, #ARGV, 2 do
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
end
redis.call('ZADD', KEYS[2], version, version)
redis.call('SET', KEYS[1], version)
return {'ok', now}
"""
)

# KEYS: blobs. Deletes those still carrying a pending expiry; a committed blob has none.
DISCARD_PENDING = """
local n = 0
for i = 1, #KEYS do
  if redis.call('PTTL', KEYS[i]) > 0 then
    redis.call('DEL', KEYS[i])
    n = n + 1
  end
end
return n
"""

# KEYS[1] checkpoint hash; ARGV[1] weights, ARGV[2] sha256, ARGV[3] applied, ARGV[4] meta.
SAVE_CHECKPOINT = (
    _NOW
    + """
if #KEYS > 1 and redis.call('GET', KEYS[2]) ~= ARGV[5] then
  return -1
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'weights', ARGV[1], 'sha256', ARGV[2], 'applied', ARGV[3],
           'meta', ARGV[4], 'saved_at', now)
return now
"""
)

# KEYS[1] members zset (member -> expiry), KEYS[2] info hash; ARGV[1] member, ARGV[2] ttl in ms,
# ARGV[3] info JSON or '' to keep the member's previous info. Returns the new expiry.
HEARTBEAT = """
local t = redis.call('TIME')
local expires = string.format('%.6f',
  tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2]) / 1000)
redis.call('ZADD', KEYS[1], expires, ARGV[1])
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
elseif redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then
  redis.call('HSET', KEYS[2], ARGV[1], '{}')
end
return expires
"""

# KEYS: pairs of a kind's members zset and info hash. Prunes the expired members of those kinds,
# returns a flat list of member, expiry, info JSON.
LIVE_MEMBERS = """
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
local out = {}
for k = 1, #KEYS, 2 do
  local expired = redis.call('ZRANGEBYSCORE', KEYS[k], '-inf', now)
  for _, member in ipairs(expired) do
    redis.call('HDEL', KEYS[k + 1], member)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', now)
  local live = redis.call('ZRANGE', KEYS[k], 0, -1, 'WITHSCORES')
  for i = 1, #live, 2 do
    out[#out + 1] = live[i]
    out[#out + 1] = live[i + 1]
    out[#out + 1] = redis.call('HGET', KEYS[k + 1], live[i]) or '{}'
  end
end
return out
"""

# The scripts over a list of members (RENEW_MEMBERS, MEMBER_TTLS): KEYS are pairs of a kind's
# members zset and info hash; ARGV, after the script's own arguments, pairs of slot and member,
# the slot n naming the member's pair KEYS[2n - 1], KEYS[2n] (`redis_members.kind_slots`).

# ARGV[1] ttl in ms, then slots and members. Renews the live ones (XX: never adds one), prunes
# the expired ones among them; per member 1 if it was live, else 0. O(log N) per member: no
# scan of the others.
RENEW_MEMBERS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local expires = string.format('%.6f', now + tonumber(ARGV[1]) / 1000)
local out = {}
for i = 2, #ARGV, 2 do
  local zset, info, member = KEYS[2 * ARGV[i] - 1], KEYS[2 * ARGV[i]], ARGV[i + 1]
  local score = redis.call('ZSCORE', zset, member)
  if score and tonumber(score) > now then
    redis.call('ZADD', zset, 'XX', expires, member)
    out[#out + 1] = 1
  else
    if score then
      redis.call('ZREM', zset, member)
      redis.call('HDEL', info, member)
    end
    out[#out + 1] = 0
  end
end
return out
"""

# ARGV: slots and members. Per member its seconds left as a string while it is live, else ''
# (an expired one is pruned). O(log N) per member.
MEMBER_TTLS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
for i = 1, #ARGV, 2 do
  local zset, info, member = KEYS[2 * ARGV[i] - 1], KEYS[2 * ARGV[i]], ARGV[i + 1]
  local score = redis.call('ZSCORE', zset, member)
  if score and tonumber(score) > now then
    out[#out + 1] = string.format('%.6f', tonumber(score) - now)
  else
    if score then
      redis.call('ZREM', zset, member)
      redis.call('HDEL', info, member)
    end
    out[#out + 1] = ''
  end
end
return out
"""

# KEYS[1] members zset, KEYS[2] info hash; ARGV[1] member. {expiry, info JSON} while it is
# live, else {}.
MEMBER = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then
  return {}
end
local t = redis.call('TIME')
if tonumber(score) <= tonumber(t[1]) + tonumber(t[2]) / 1000000 then
  return {}
end
return {score, redis.call('HGET', KEYS[2], ARGV[1]) or '{}'}
"""

# KEYS[1] lease; ARGV[1] owner, ARGV[2] ttl in ms. 1 if taken or renewed, 0 if held by another.
ACQUIRE_LEASE = """
local owner = redis.call('GET', KEYS[1])
if owner ~= false and owner ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS[1] lease; ARGV[1] owner. Compare-and-delete.
RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
