-- Create a ticket and reserve its blocks, all or nothing, after checking the decode worker
-- against the view kept beside its ledger (set_capacity, describe_worker). KEYS[4] = the new
-- ticket's hash, KEYS[5] = its id -> worker index (the ticket id carries this worker's hash
-- slot, so the index shares it); on one node only, KEYS[6] = the index as earlier releases name
-- it and KEYS[7] = the set of workers with tickets (on a cluster both live on other masters).
-- ARGV: ticket_id, attempt, now, lease_deadline_s, num_blocks, lease_s, deployment,
--       decode_worker_id, prefill_worker_id, request_id, num_prompt_tokens, index ttl (ms),
--       '1' to check the worker against the view (a ledger without one is 'unverified')
local key, owner = KEYS[4], KEYS[5]
local ticket_id, attempt, now, deadline = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local num_blocks, lease_s = tonumber(ARGV[5]), tonumber(ARGV[6])

if redis.call('EXISTS', LEDGER) == 0 then
  return fail('invalid', 'unknown decode worker ' .. ARGV[8], 'decode_worker_id')
end
if ARGV[13] == '1' then
  local v = redis.call('HMGET', LEDGER, 'w_deployment', 'w_state', 'w_expires_s')
  if not v[3] then
    return fail('unverified', 'no view of decode worker ' .. ARGV[8], '')
  end
  if v[1] ~= ARGV[7] then
    return fail('invalid', "decode_worker_id: '" .. ARGV[8] .. "' serves '" .. v[1]
      .. "', not '" .. ARGV[7] .. "'", 'decode_worker_id')
  end
  if tonumber(v[3]) <= tonumber(now) then
    return fail('unavailable', 'decode worker ' .. ARGV[8] .. ' is not in the pool', '')
  end
  if v[2] ~= 'ready' then
    return fail('unavailable', 'decode worker ' .. ARGV[8] .. ' is ' .. v[2], '')
  end
end
if not num_blocks or num_blocks < 1 or num_blocks ~= math.floor(num_blocks) then
  return fail('invalid', 'num_blocks: an integer >= 1, got ' .. ARGV[5], 'num_blocks')
end
local l = redis.call('HMGET', LEDGER, 'num_total_blocks', 'num_reserved_blocks', 'num_held_blocks')
local total, reserved, held = tonumber(l[1]), tonumber(l[2]), tonumber(l[3])
if num_blocks > total then
  return fail('invalid', 'num_blocks: ' .. ARGV[5] .. ' is more than decode worker ' .. ARGV[8]
    .. ' has (' .. l[1] .. ')', 'num_blocks')
end
if not lease_s or not (lease_s > 0) or lease_s == math.huge then
  return fail('invalid', 'lease_s: a finite number > 0, got ' .. ARGV[6], 'lease_s')
end
if redis.call('EXISTS', key) == 1 then
  return fail('exists', 'ticket ' .. ticket_id .. ' exists', 'ticket_id')
end
local num_free = total - reserved - held
if num_free < num_blocks then
  local retry_s = 1.0
  local first = redis.call('ZRANGE', LEASES, 0, 0, 'WITHSCORES')
  if first[2] then
    retry_s = math.min(math.max(tonumber(first[2]) - tonumber(now), 0.05), 5.0)
  end
  return fail('capacity', 'decode worker ' .. ARGV[8] .. ' has ' .. num_free .. ' free blocks, '
    .. ARGV[5] .. ' asked', tostring(retry_s))
end

redis.call('HINCRBY', LEDGER, 'num_reserved_blocks', num_blocks)
redis.call('HSET', key,
  'ticket_id', ticket_id, 'attempt', attempt, 'deployment', ARGV[7],
  'decode_worker_id', ARGV[8], 'prefill_worker_id', ARGV[9], 'num_blocks', ARGV[5],
  'state', 'open', 'holding', 'reserved', 'lease_deadline_s', deadline,
  'created_s', now, 'updated_s', now, 'request_id', ARGV[10], 'num_prompt_tokens', ARGV[11],
  'reason', '', 'purge_s', '')
redis.call('ZADD', LEASES, deadline, ticket_id)
redis.call('ZREMRANGEBYSCORE', INDEX, '-inf', now)  -- retention over (as _is_purged)
redis.call('ZADD', INDEX, '+inf', ticket_id)
redis.call('SET', owner, ARGV[8], 'PX', ARGV[12])
if KEYS[7] then
  redis.call('SET', KEYS[6], ARGV[8], 'NX', 'PX', ARGV[12])
  redis.call('SADD', KEYS[7], ARGV[8])
end
return hash_reply(key)
