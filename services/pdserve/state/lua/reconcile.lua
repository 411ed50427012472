-- Make a decode worker's ledger agree with the worker's own report, in one step.
-- ARGV: now, purge_s, backstop_ms, cutoff_s (tickets created before it may be released),
--       num_total_blocks, reason for released tickets, reason for adopted ones, worker id,
--       then for each
--       KEYS[4..]: ticket id, reported attempt ('' if not reported), reported blocks.
-- The ids must cover every live ticket of the worker (else {'retry'}).
-- - reported, unknown here (lost in a store restart): adopted as a held DONE ticket;
-- - reported, known here: kept as it is (a known ticket whose blocks were freed is never revived:
--   the worker was told and frees them itself);
-- - live here, not reported, created before cutoff_s: freed (non-terminal ones ABORTED);
-- - reported, known here but no longer owning blocks, or at another attempt: stale, the worker
--   must drop it (it missed being told: a DropTicket lost in a failover, say).
-- Replies {'ok', {total, reserved, held}, {released tokens}, {adopted tokens}, {stale tokens}}.
local now, purge_s, backstop_ms, cutoff = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local base = 8
local ids = {}
for i = 4, #KEYS do ids[ARGV[base + 3 * (i - 4) + 1]] = true end
if not covers_live(ids) then return {'retry'} end

redis.call('HSET', LEDGER, 'num_total_blocks', ARGV[5])
redis.call('HSETNX', LEDGER, 'num_reserved_blocks', 0)
redis.call('HSETNX', LEDGER, 'num_held_blocks', 0)
local released, adopted, stale = {}, {}, {}
for i = 4, #KEYS do
  local key = KEYS[i]
  local j = base + 3 * (i - 4)
  local id, reported_attempt, reported_blocks = ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
  local t = load_ticket(key, id, nil, now)
  if t == nil then
    if reported_attempt ~= '' then
      redis.call('DEL', key)
      redis.call('HSET', key,
        'ticket_id', id, 'attempt', reported_attempt, 'deployment', '',
        'decode_worker_id', ARGV[8], 'prefill_worker_id', '',
        'num_blocks', reported_blocks, 'state', 'done', 'holding', 'held',
        'lease_deadline_s', '0.0', 'created_s', now, 'updated_s', now, 'request_id', '',
        'num_prompt_tokens', '0', 'reason', ARGV[7], 'purge_s', '')
      redis.call('HINCRBY', LEDGER, 'num_held_blocks', tonumber(reported_blocks))
      redis.call('ZADD', INDEX, '+inf', id)
      table.insert(adopted, id .. '#' .. reported_attempt)
    end
  else
    if t.holding ~= 'free' and t.attempt ~= reported_attempt and t.created < cutoff then
      local new_state = nil
      if not TERMINAL[t.state] then new_state = 'aborted' end
      free_blocks(key, t, now, purge_s, backstop_ms, new_state, ARGV[6])
      table.insert(released, id .. '#' .. t.attempt)
    end
    if reported_attempt ~= '' and (t.holding == 'free' or t.attempt ~= reported_attempt) then
      table.insert(stale, id .. '#' .. reported_attempt)
    end
  end
end
return {'ok', ledger_reply(), released, adopted, stale}
