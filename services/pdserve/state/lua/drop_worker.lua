-- Forget a decode worker's ledger: every ticket owning blocks there is freed, and non-terminal
-- ones become ABORTED (returned). ARGV: now, purge_s, backstop_ms, reason, then one ticket id per
-- KEYS[4..], which must cover every live ticket of the worker (else {'retry'}).
local now, purge_s, backstop_ms, reason = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ids = {}
for i = 4, #KEYS do ids[ARGV[i + 1]] = true end
if not covers_live(ids) then return {'retry'} end
local reply = {'ok'}
for i = 4, #KEYS do
  local key, id = KEYS[i], ARGV[i + 1]
  local t = load_ticket(key, id, nil, now)
  if t ~= nil and t.holding ~= 'free' then
    if TERMINAL[t.state] then
      local why = t.reason
      if why == '' then why = reason end
      free_blocks(key, t, now, purge_s, backstop_ms, nil, why)
    else
      free_blocks(key, t, now, purge_s, backstop_ms, 'aborted', reason)
      table.insert(reply, redis.call('HGETALL', key))
    end
  end
end
redis.call('DEL', LEDGER, LEASES)
return reply
