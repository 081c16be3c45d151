-- release.lua: a lease leaves limit sets; the whole lease, or some sets (a backend permit returned).
--
-- KEYS[1]   the lease's tombstone ({p}:tomb:<lease>)
-- KEYS[2]   the lease record ({p}:lease:<lease>)
-- KEYS[3..] the limit sets to leave ({p}:l:<name>)
-- ARGV[1]   lease id
-- ARGV[2]   "1": the whole lease ends (its record is deleted); "0": only these sets are left
-- ARGV[3]   tombstone TTL in ms (0: none). Set when an acquire of this lease may still be in flight (a
--           cancelled or timed-out call still runs on the server), so that acquire cannot win afterwards.
-- ARGV[4]   channel to publish on when a set was left
--
-- Returns how many sets the lease left.
--
-- Invariant: idempotent (leaving a set twice leaves it once; a second full release changes nothing),
-- and after a release with a tombstone the lease joins no set until the tombstone expires.
local left = 0
for i = 3, #KEYS do
  left = left + redis.call('ZREM', KEYS[i], ARGV[1])
end
if ARGV[2] == '1' then
  redis.call('DEL', KEYS[2])
end
local tomb = tonumber(ARGV[3])
if tomb > 0 then
  redis.call('SET', KEYS[1], '1', 'PX', tomb)
end
if left > 0 then
  redis.call('PUBLISH', ARGV[4], 'left')
end
return left
