-- Move a ticket along the state machine. ARGV: ticket_id, attempt, now, new_state, reason,
-- allowed source states (space separated, from TICKET_TRANSITIONS), is_freeing ('1' for
-- ABORTED/EXPIRED: frees reserved blocks), purge_s, backstop_ms.
-- KEYS[5..] (one node only): the ticket's id index keys, kept as long as the ticket's own
-- retention once it frees its blocks.
local key = KEYS[4]
local now, new_state, reason = ARGV[3], ARGV[4], ARGV[5]
local t, e = load_ticket(key, ARGV[1], ARGV[2], now)
if e then return e end

local allowed = false
for state in string.gmatch(ARGV[6], '%S+') do
  if state == t.state then allowed = true end
end
if not allowed then
  return fail('illegal', 'ticket ' .. t.id .. ': ' .. t.state .. ' -> ' .. new_state .. ' is not allowed')
end
if reason == '' then reason = t.reason end
if ARGV[7] == '1' then
  free_blocks(key, t, now, ARGV[8], ARGV[9], new_state, reason)
  for i = 5, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[9]) end
  return hash_reply(key)
end
e = check_lease(t, now)
if e then return e end
redis.call('HSET', key, 'state', new_state, 'reason', reason, 'updated_s', now)
return hash_reply(key)
