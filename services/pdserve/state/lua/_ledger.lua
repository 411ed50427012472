-- Ledger helpers for the ticket scripts. Every ticket script gets the same first three keys, all
-- sharing one decode worker's hash tag:
--   KEYS[1] ledger hash: num_total_blocks, num_reserved_blocks, num_held_blocks
--   KEYS[2] leases zset: ticket id -> lease deadline (exactly the tickets holding reserved blocks)
--   KEYS[3] ticket index zset: ticket id -> purge time; +inf while the ticket owns blocks
--   KEYS[4..] ticket hashes
-- Times are coordinator-clock seconds passed in ARGV as decimal strings. Scripts compare them
-- but never compute new times (Lua would round them to 14 digits): Python passes deadlines in.

local LEDGER, LEASES, INDEX = KEYS[1], KEYS[2], KEYS[3]
local TERMINAL = {done = true, aborted = true, expired = true}

-- The checked fields of a ticket, or nil and an error reply when the token does not name it.
-- A ticket past its purge time is unknown even if its hash has not expired yet.
local function load_ticket(key, ticket_id, attempt, now)
  local t = redis.call('HMGET', key, 'attempt', 'state', 'holding', 'num_blocks',
    'lease_deadline_s', 'purge_s', 'reason', 'created_s')
  if not t[1] or (t[6] and t[6] ~= '' and tonumber(t[6]) <= tonumber(now)) then
    return nil, fail('stale', 'unknown ticket ' .. ticket_id)
  end
  if attempt ~= nil and t[1] ~= attempt then
    return nil, fail('stale', 'ticket ' .. ticket_id .. ' is at attempt ' .. t[1] .. ', not ' .. attempt)
  end
  return {
    id = ticket_id, attempt = t[1], state = t[2], holding = t[3], num_blocks = tonumber(t[4]),
    deadline = tonumber(t[5]), reason = t[7] or '', created = tonumber(t[8]),
  }, nil
end

local function check_owned(t)
  if t.holding == 'free' then
    local why = t.reason
    if why == '' then why = 'freed' end
    return fail('stale', 'ticket ' .. t.id .. ' no longer owns blocks (' .. t.state .. ', ' .. why .. ')')
  end
  return nil
end

local function check_lease(t, now)
  if t.holding == 'reserved' and t.deadline < tonumber(now) then
    return fail('stale', 'ticket ' .. t.id .. ': lease lapsed')
  end
  return nil
end

-- Gives the ticket's blocks back to the ledger (if it still exists) and starts its retention.
-- Callers check holding ~= 'free' first, so blocks are freed exactly once.
local function free_blocks(key, t, now, purge_s, backstop_ms, new_state, reason)
  if redis.call('EXISTS', LEDGER) == 1 then
    if t.holding == 'reserved' then
      redis.call('HINCRBY', LEDGER, 'num_reserved_blocks', -t.num_blocks)
    elseif t.holding == 'held' then
      redis.call('HINCRBY', LEDGER, 'num_held_blocks', -t.num_blocks)
    end
  end
  redis.call('ZREM', LEASES, t.id)
  redis.call('ZADD', INDEX, purge_s, t.id)
  redis.call('HSET', key, 'holding', 'free', 'state', new_state or t.state, 'reason', reason,
    'updated_s', now, 'purge_s', purge_s)
  redis.call('PEXPIRE', key, backstop_ms)
end

-- Reserved -> held: the ticket's blocks now belong to its running sequence (no lease from now on).
-- Callers check the ticket is DONE, owns its blocks and its lease has not lapsed.
local function hold_blocks(key, t, now)
  redis.call('HINCRBY', LEDGER, 'num_reserved_blocks', -t.num_blocks)
  redis.call('HINCRBY', LEDGER, 'num_held_blocks', t.num_blocks)
  redis.call('ZREM', LEASES, t.id)
  redis.call('HSET', key, 'holding', 'held', 'lease_deadline_s', '0.0', 'updated_s', now)
end

-- True when every ticket that owns blocks on this worker is among `ids` (a set), i.e. no ticket
-- was opened between the caller listing them and this script running.
local function covers_live(ids)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', INDEX, '+inf', '+inf')) do
    if not ids[id] then return false end
  end
  return true
end

local function ledger_reply()
  local l = redis.call('HMGET', LEDGER, 'num_total_blocks', 'num_reserved_blocks', 'num_held_blocks')
  return {l[1] or '', l[2] or '', l[3] or ''}
end
