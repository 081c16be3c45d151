-- acquire.lua: a lease joins the limit sets of one option, all or nothing, after a check of every cap.
--
-- KEYS[1]   the lease's tombstone ({p}:tomb:<lease>): left by a release that raced this call; refuse.
-- KEYS[2]   the lease record ({p}:lease:<lease>) = "<fencing token>|<replica>", expiring with the lease.
-- KEYS[3]   the fencing counter ({p}:fence): one INCR per new holder, so tokens only grow.
-- KEYS[4]   the caps hash ({p}:caps): limit set key -> its cap as last asserted (for `acp-server cluster`).
-- KEYS[5..] limit sets ({p}:l:<name>): sorted sets, member = lease id, score = expiry (ms, Redis time).
-- ARGV[1]   lease id
-- ARGV[2]   TTL in ms
-- ARGV[3]   replica id
-- ARGV[4]   fencing token to keep ("0": draw a new one)
-- ARGV[5]   channel to publish on when sets are left (the "d" list below frees room for others)
-- ARGV[6]   the spec, JSON: {"o": [option, ...], "d": [key index, ...]}; key indexes point into KEYS.
--           option = {"n": [[key, cap, soft], ...], "c": rule}; cap 0 counts without a limit; soft 1
--           lets the next option be tried when this cap is full. rule (class shares of the seats) =
--           {"r": rank (0-based), "s": [seats per rank], "k": [seat set per rank], "w": [room set per rank]}.
--           "d": sets the lease leaves when it gets an option (a waiter leaving the waiting room).
--
-- Returns {option (1-based), token, now} on success; {0, key, count, cap, soft, now} on refusal (the
-- first full hard cap, else the last soft refusal); {-1} when the lease is tombstoned.
--
-- Invariant: no set ever gains a member while it holds `cap` live members (live: expiry > now; expired
-- members are purged before counting), a lease joins every set of one option or none, a tombstoned
-- lease joins nothing, and a class at or above its share of the seats takes a seat only when no class
-- below its share has a waiter, and an arrival (a lease not in the waiting room) never takes a seat
-- while a waiter of its own class waits.
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) * 1000 + math.floor(tonumber(now_t[2]) / 1000)
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {-1}
end
local member = ARGV[1]
local ttl = tonumber(ARGV[2])
local spec = cjson.decode(ARGV[6])
local purged = {}
local function live(i)
  local key = KEYS[i]
  if not purged[i] then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    purged[i] = true
  end
  return redis.call('ZCARD', key)
end
-- A live member only: an expired one may have been counted free by another caller already.
local function holds(i)
  local score = redis.call('ZSCORE', KEYS[i], member)
  return score ~= false and tonumber(score) > now
end

-- The class-share rule: nil when the seat may be taken, else the refusal.
local function class_refusal(rule)
  local r = rule.r + 1
  local seat_key = rule.k[r]
  if holds(seat_key) then return nil end
  local seated, waiting, in_room = {}, {}, false
  for d = 1, #rule.s do
    seated[d] = live(rule.k[d])
    waiting[d] = live(rule.w[d])
    if holds(rule.w[d]) then
      waiting[d] = waiting[d] - 1
      in_room = true
    end
  end
  if not in_room and waiting[r] > 0 then
    return {0, seat_key, seated[r], rule.s[r], 1, now}
  end
  if seated[r] < rule.s[r] then return nil end
  for d = 1, #rule.s do
    if d ~= r and waiting[d] > 0 and seated[d] < rule.s[d] then
      return {0, seat_key, seated[r], rule.s[r], 1, now}
    end
  end
  return nil
end

local function check(option)
  local soft_refusal = nil
  for _, need in ipairs(option.n) do
    local i, cap, soft = need[1], need[2], need[3]
    if cap > 0 and not holds(i) then
      local count = live(i)
      if count >= cap then
        if soft == 0 then return {0, i, count, cap, 0, now} end
        soft_refusal = soft_refusal or {0, i, count, cap, 1, now}
      end
    end
  end
  if soft_refusal then return soft_refusal end
  if option.c then return class_refusal(option.c) end
  return nil
end

local refusal = nil
for number, option in ipairs(spec.o) do
  refusal = check(option)
  if refusal == nil then
    local expiry = now + ttl
    for _, need in ipairs(option.n) do
      redis.call('ZADD', KEYS[need[1]], expiry, member)
      if need[2] > 0 then redis.call('HSET', KEYS[4], KEYS[need[1]], need[2]) end
    end
    local left = 0
    for _, i in ipairs(spec.d or {}) do
      left = left + redis.call('ZREM', KEYS[i], member)
    end
    local token = ARGV[4]
    if token == '0' then token = tostring(redis.call('INCR', KEYS[3])) end
    redis.call('SET', KEYS[2], token .. '|' .. ARGV[3], 'PX', ttl)
    if left > 0 then redis.call('PUBLISH', ARGV[5], 'left') end
    return {number, tonumber(token), now}
  end
  if refusal[5] == 0 then return refusal end
end
return refusal
