-- Reserved -> held for a DONE ticket (idempotent once held). ARGV: ticket_id, attempt, now.
local key = KEYS[4]
local now = ARGV[3]
local t, e = load_ticket(key, ARGV[1], ARGV[2], now)
if e then return e end
if t.state ~= 'done' then
  return fail('illegal', 'ticket ' .. t.id .. ' is ' .. t.state .. ': only DONE can be held')
end
e = check_owned(t)
if e then return e end
if t.holding == 'held' then return hash_reply(key) end
e = check_lease(t, now)
if e then return e end
hold_blocks(key, t, now)
return hash_reply(key)
