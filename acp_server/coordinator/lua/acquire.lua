-- acquire.lua: leases join the limit sets of one of their options, each all or nothing, after a check
-- of every cap. One call serves a batch of requests (the acquisitions of one turn of a replica's event
-- loop), applied in order, so a later request in the batch sees what an earlier one took; the releases
-- queued on the replica meanwhile go first, exactly as release.lua applies them, so the room they free
-- is there for the requests. (Loaded after _releases.lua: apply_releases, others_wait.)
--
-- KEYS[1]   the fencing counter ({p}:fence): one INCR per new holder, so tokens only grow.
-- KEYS[2]   the caps hash ({p}:caps): limit set key -> its cap as last asserted, 0 for a count (for
--           `acp-server cluster`).
-- KEYS[3]   the waiting replicas ({p}:waiting): sorted set, member = replica id, score = expiry (ms): a
--           replica with a waiter refused here, so a set left is announced on the channel only while
--           another replica than the caller is in it.
-- then, per release in ARGV order, its keys as in release.lua (tombstone, record, sets to leave); then,
-- per request in ARGV order:
--   its tombstone ({p}:tomb:<lease>:<attempt>): left by a release that raced this attempt; refuse.
--   its lease record ({p}:lease:<lease>) = "<fencing token>|<replica>", expiring with the lease.
--   the limit sets it names ({p}:l:<name>): sorted sets, member = lease id, score = expiry (ms, Redis
--   time).
-- ARGV[1]   TTL in ms
-- ARGV[2]   replica id
-- ARGV[3]   channel to publish on when sets are left (the "d" list below frees room for others, announced
--           while a capped set of the option taken still has room)
-- ARGV[4]   number of requests
-- ARGV[5]   number of releases
-- ARGV[6]   "1": the replica has no waiter any more, it leaves KEYS[3] first; "0": nothing to change
-- then per release four values, as in release.lua (lease id, "1" for the whole lease, tombstone TTL in
-- ms, number of sets); then per request four values:
--   lease id; fencing token to keep ("0": draw a new one); how many limit sets follow its record in
--   KEYS; the spec, JSON: {"o": [option, ...], "d": [set, ...]}. Sets are numbered 1.. among the
--   request's own limit sets. option = {"n": [[set, cap, soft], ...], "c": rule}; cap 0 counts without
--   a limit; soft 1 lets the next option be tried when this cap is full. rule (class shares of the
--   seats) = {"r": rank (0-based), "s": [seats per rank], "k": [seat set per rank], "w": [room set per
--   rank]}. "d": sets the lease leaves when it gets an option (a waiter leaving the waiting room).
--   "a": [[set, cap], ...] to record in the caps hash, whatever the outcome (a replica records each cap
--   once per connection, not on every call). "q": 1 when the request is a waiter's attempt: refused, it
--   enters (or stays in) KEYS[3] until now + TTL, in the same step as the refusal.
--
-- Returns one reply per request: {option (1-based), token, now} on success; {0, set, count, cap, soft,
-- now} on refusal (the first full hard cap, else the last soft refusal); {-1} when tombstoned.
--
-- Invariant: no set ever gains a member while it holds `cap` live members (live: expiry > now; expired
-- members are purged before counting), a lease joins every set of one option or none, a tombstoned
-- attempt joins nothing, a class at or above its share of the seats takes a seat only when no class
-- below its share has a waiter, an arrival (a lease not in the waiting room) never takes a seat
-- while a waiter of its own class waits, and a waiter's refusal is never later than its replica's
-- entry in KEYS[3] (so every room freed after it is announced while that replica waits).
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) * 1000 + math.floor(tonumber(now_t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local purged = {}
-- set once something is to be announced on ARGV[3]: one message per call, sent at its end
local announce = false

local function acquire(base, member, token, spec)
  -- base: KEYS index of the request's tombstone; its record is base + 1, its set i is base + 1 + i.
  if redis.call('EXISTS', KEYS[base]) == 1 then
    return {-1}
  end
  local function key(i) return KEYS[base + 1 + i] end
  for _, pair in ipairs(spec.a or {}) do
    redis.call('HSET', KEYS[2], key(pair[1]), pair[2])
  end
  local function live(i)
    local k = key(i)
    if not purged[k] then
      redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
      purged[k] = true
    end
    return redis.call('ZCARD', k)
  end
  -- A live member only: an expired one may have been counted free by another caller already.
  local function holds(i)
    local score = redis.call('ZSCORE', key(i), member)
    return score ~= false and tonumber(score) > now
  end

  -- The class-share rule: nil when the seat may be taken, else the refusal. Sets are read only as far
  -- as the answer needs (a class below its share reads two).
  local function class_refusal(rule)
    local r = rule.r + 1
    local seat_set = rule.k[r]
    if holds(seat_set) then return nil end
    local in_room = holds(rule.w[r])
    local seated = live(seat_set)
    local refusal = {0, seat_set, seated, rule.s[r], 1, now}
    if not in_room and live(rule.w[r]) > 0 then return refusal end
    if seated < rule.s[r] then return nil end
    for d = 1, #rule.s do
      if d ~= r and rule.s[d] > 0 and live(rule.w[d]) > 0 and live(rule.k[d]) < rule.s[d] then
        return refusal
      end
    end
    return nil
  end

  local function has_room(option)
    for _, need in ipairs(option.n) do
      if need[2] > 0 and live(need[1]) < need[2] then return true end
    end
    return false
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
        redis.call('ZADD', key(need[1]), expiry, member)
      end
      local left = 0
      for _, i in ipairs(spec.d or {}) do
        left = left + redis.call('ZREM', key(i), member)
      end
      if token == '0' then token = tostring(redis.call('INCR', KEYS[1])) end
      redis.call('SET', KEYS[base + 1], token .. '|' .. ARGV[2], 'PX', ttl)
      -- A waiter leaving the waiting room changes the class rule's view only for a seat that is
      -- still free: with every capped set of its option full, nobody can take anything it left.
      if left > 0 and not announce and has_room(option) and others_wait(KEYS[3], ARGV[2], now) then announce = true end
      return {number, tonumber(token), now}
    end
    if refusal[5] == 0 then return refusal end
  end
  return refusal
end

local base = 4
local a = 7
if ARGV[6] == '1' then redis.call('ZREM', KEYS[3], ARGV[2]) end
local freed
freed, base, a = apply_releases(tonumber(ARGV[5]), base, a)
if freed > 0 and others_wait(KEYS[3], ARGV[2], now) then announce = true end

local replies = {}
for n = 1, tonumber(ARGV[4]) do
  local sets = tonumber(ARGV[a + 2])
  local spec = cjson.decode(ARGV[a + 3])
  local reply = acquire(base, ARGV[a], ARGV[a + 1], spec)
  if spec.q and reply[1] == 0 then redis.call('ZADD', KEYS[3], now + ttl, ARGV[2]) end
  replies[n] = reply
  base = base + 2 + sets
  a = a + 4
end
if announce then redis.call('PUBLISH', ARGV[3], 'left') end
return replies
