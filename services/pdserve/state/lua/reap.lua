-- Free every listed ticket whose lease lapsed (deadline < now): non-terminal ones become
-- EXPIRED, DONE ones (never marked held) keep their state. Candidates come from the leases zset;
-- each is checked again here. ARGV: now, purge_s, backstop_ms, reason, reason for DONE,
-- then one ticket id per KEYS[4..]. Replies {'ok', {fields of ticket}, ...}.
local now, purge_s, backstop_ms = ARGV[1], ARGV[2], ARGV[3]
local reply = {'ok'}
for i = 4, #KEYS do
  local key, id = KEYS[i], ARGV[i + 2]
  local t = load_ticket(key, id, nil, now)
  if t == nil then
    redis.call('ZREM', LEASES, id)
  elseif t.holding == 'reserved' and t.deadline < tonumber(now) then
    if TERMINAL[t.state] then
      free_blocks(key, t, now, purge_s, backstop_ms, nil, ARGV[5])
    else
      free_blocks(key, t, now, purge_s, backstop_ms, 'expired', ARGV[4])
    end
    table.insert(reply, redis.call('HGETALL', key))
  end
end
return reply
