-- Push a reserved ticket's lease deadline. ARGV: ticket_id, attempt, now, new lease_deadline_s.
local key = KEYS[4]
local now = ARGV[3]
local t, e = load_ticket(key, ARGV[1], ARGV[2], now)
if e then return e end
e = check_owned(t)
if e then return e end
if t.holding == 'held' then
  return fail('illegal', 'ticket ' .. t.id .. ' is held: it has no lease')
end
e = check_lease(t, now)
if e then return e end
redis.call('HSET', key, 'lease_deadline_s', ARGV[4], 'updated_s', now)
redis.call('ZADD', LEASES, ARGV[4], t.id)
return hash_reply(key)
