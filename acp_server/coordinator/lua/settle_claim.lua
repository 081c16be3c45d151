-- settle_claim.lua: the holder of an idempotency claim marks its prompt ended, or drops the claim.
--
-- KEYS[1]   the claim ({p}:idem:<session>:<key>)
-- ARGV[1]   replica id of the holder
-- ARGV[2]   the prompt id of the holder
-- ARGV[3]   "done": the prompt ended (the claim stays until its TTL, naming the replica with the
--           outcome); "drop": the prompt was refused after the claim, so the key is free again
--
-- Returns 1 when the claim was changed, 0 when it is not (or no longer) this holder's.
--
-- Invariant: only the holder (same replica and prompt) changes or drops a claim, and its TTL is kept.
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
local fingerprint, replica, state, prompt = string.match(held, '^([^|]*)|(.*)|([a-z]+)|([^|]*)$')
if replica ~= ARGV[1] or prompt ~= ARGV[2] then return 0 end
if ARGV[3] == 'drop' then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('SET', KEYS[1], fingerprint .. '|' .. replica .. '|done|' .. prompt, 'KEEPTTL')
return 1
