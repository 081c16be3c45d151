-- release.lua: leases leave limit sets; each the whole lease, or some sets (a backend permit returned).
-- (Loaded after _releases.lua: apply_releases, others_wait.)
-- One call serves a batch of releases (those queued on a replica since its last call).
--
-- KEYS[1]   the waiting replicas ({p}:waiting, see acquire.lua): a set left is announced only while a
--   replica other than the caller is in it.
-- KEYS[2..] per release in ARGV order: its tombstone ({p}:tomb:<lease>:<attempt>), its record
--   ({p}:lease:<lease>), then the limit sets to leave ({p}:l:<name>).
-- ARGV[1]   channel to publish on when a set was left
-- ARGV[2]   replica id (the caller)
-- ARGV[3]   "1": the caller has no waiter any more, it leaves KEYS[1]; "0": nothing to change there
-- ARGV[4]   number of releases; then per release four values:
--   lease id; "1" when the whole lease ends (its record is deleted), "0" when only these sets are left;
--   tombstone TTL in ms (0: none; set when an acquire of this attempt may still be on its way: one that
--   got no answer may still run on the server, and must not win afterwards); how many sets follow.
--
-- Returns how many sets were left, over the batch.
--
-- Invariant: idempotent (leaving a set twice leaves it once; a second full release changes nothing),
-- after a release with a tombstone that attempt joins no set until the tombstone expires, and a set
-- left while another replica waits is announced.
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[2])
end
local left = apply_releases(tonumber(ARGV[4]), 2, 5)
if left > 0 then
  local t = redis.call('TIME')
  if others_wait(KEYS[1], ARGV[2], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) then
    redis.call('PUBLISH', ARGV[1], 'left')
  end
end
return left
