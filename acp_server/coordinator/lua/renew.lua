-- renew.lua: a replica's heartbeat and the renewal of every lease it holds, in one call.
--
-- KEYS[1]   the replica registry ({p}:replicas): sorted set, member = replica id, score = last renew (ms)
-- KEYS[2]   the waiting replicas ({p}:waiting, see acquire.lua)
-- KEYS[3..] per lease, in ARGV order: its record ({p}:lease:<lease>), then each limit set it is in
-- ARGV[1]   replica id
-- ARGV[2]   TTL in ms
-- ARGV[3]   number of leases
-- ARGV[4]   "1": the replica has waiters, its entry in KEYS[2] is extended to now + TTL; "0": unchanged
-- ARGV[5..] per lease: its id, then how many limit sets follow its record in KEYS
--
-- Returns {now, live replicas, lost lease number (1-based), ...}: live replicas renewed within one TTL.
--
-- Invariant: a lease is renewed only when it is still whole (its record exists and it is a live member
-- of every set it holds); an expired or missing lease is never revived here, since its seat may have
-- been taken by another: it is reported lost and left to the holder to re-take through acquire.lua.
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) * 1000 + math.floor(tonumber(now_t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local expiry = now + ttl
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 100 * ttl)
local out = {now, redis.call('ZCOUNT', KEYS[1], now - ttl, '+inf')}
if ARGV[4] == '1' then
  redis.call('ZADD', KEYS[2], expiry, ARGV[1])
end
local k = 3
local a = 5
for number = 1, tonumber(ARGV[3]) do
  local member = ARGV[a]
  local n = tonumber(ARGV[a + 1])
  a = a + 2
  local whole = redis.call('EXISTS', KEYS[k]) == 1
  if whole then
    for j = 1, n do
      local score = redis.call('ZSCORE', KEYS[k + j], member)
      if not score or tonumber(score) <= now then
        whole = false
        break
      end
    end
  end
  if whole then
    redis.call('PEXPIRE', KEYS[k], ttl)
    for j = 1, n do
      redis.call('ZADD', KEYS[k + j], 'XX', expiry, member)
    end
  else
    out[#out + 1] = number
  end
  k = k + 1 + n
end
return out
