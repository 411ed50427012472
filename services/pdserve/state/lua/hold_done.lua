-- DONE and its blocks held, in one step: the transition to DONE (unless the ticket is DONE
-- already) then mark_held, with their checks. ARGV: ticket_id, attempt, now, allowed source
-- states of DONE (space separated). Replies {'ok', '1' if this call held the blocks else '0',
-- field1, value1, ...}.
local key = KEYS[4]
local now = ARGV[3]
local t, e = load_ticket(key, ARGV[1], ARGV[2], now)
if e then return e end
if t.state ~= 'done' then
  local allowed = false
  for state in string.gmatch(ARGV[4], '%S+') do
    if state == t.state then allowed = true end
  end
  if not allowed then
    return fail('illegal', 'ticket ' .. t.id .. ': ' .. t.state .. ' -> done is not allowed')
  end
  e = check_lease(t, now)
  if e then return e end
  redis.call('HSET', key, 'state', 'done', 'updated_s', now)
end
e = check_owned(t)
if e then return e end
local held = '0'
if t.holding ~= 'held' then
  e = check_lease(t, now)
  if e then return e end
  hold_blocks(key, t, now)
  held = '1'
end
local reply = hash_reply(key)
table.insert(reply, 2, held)
return reply
