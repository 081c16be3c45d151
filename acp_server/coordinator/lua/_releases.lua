-- _releases.lua: the steps acquire.lua and release.lua share, put in front of their code when loaded
-- (scripts.py). Redis runs each script alone, so these are plain local functions of it.

-- Apply `count` releases whose keys start at KEYS[k] and whose values start at ARGV[a], laid out as
-- release.lua documents (per release: its tombstone, its record, then its sets; lease id, "1" for the
-- whole lease, tombstone TTL in ms, number of sets). Returns how many sets were left.
local function apply_releases(count, k, a)
  local left = 0
  for _ = 1, count do
    local member = ARGV[a]
    local sets = tonumber(ARGV[a + 3])
    for i = k + 2, k + 1 + sets do
      left = left + redis.call('ZREM', KEYS[i], member)
    end
    if ARGV[a + 1] == '1' then
      redis.call('DEL', KEYS[k + 1])
    end
    local tomb = tonumber(ARGV[a + 2])
    if tomb > 0 then
      redis.call('SET', KEYS[k], '1', 'PX', tomb)
    end
    k = k + 2 + sets
    a = a + 4
  end
  return left, k, a
end

-- True when a replica other than `replica` has a live entry (expiry after `now`, ms) in the waiting
-- replicas `waiting` ({p}:waiting); expired entries are dropped first.
local function others_wait(waiting, replica, now)
  redis.call('ZREMRANGEBYSCORE', waiting, '-inf', now)
  local n = redis.call('ZCARD', waiting)
  return n > 1 or (n == 1 and redis.call('ZSCORE', waiting, replica) == false)
end

