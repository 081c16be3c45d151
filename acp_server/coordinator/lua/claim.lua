-- claim.lua: claim an idempotency key for one prompt across replicas (SET NX with the TTL).
--
-- KEYS[1]   the claim ({p}:idem:<session>:<key>) = "<fingerprint>|<replica>|<state>|<prompt>"
-- ARGV[1]   the prompt's fingerprint (hex)
-- ARGV[2]   replica id
-- ARGV[3]   TTL in ms
-- ARGV[4]   the prompt id on that replica
--
-- Returns {1} when claimed by this call; {0, fingerprint, replica, state, prompt, pttl} when the key is
-- held already (state "running" or "done").
--
-- Invariant: at most one prompt holds a key at a time, until the key expires or its holder drops it.
local value = ARGV[1] .. '|' .. ARGV[2] .. '|running|' .. ARGV[4]
if redis.call('SET', KEYS[1], value, 'NX', 'PX', tonumber(ARGV[3])) then
  return {1}
end
local held = redis.call('GET', KEYS[1])
local fingerprint, replica, state, prompt = string.match(held, '^([^|]*)|(.*)|([a-z]+)|([^|]*)$')
return {0, fingerprint, replica, state, prompt, redis.call('PTTL', KEYS[1])}
