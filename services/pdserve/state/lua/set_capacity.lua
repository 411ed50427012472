-- Create or resize a decode worker's ledger. ARGV: num_total_blocks, then optionally the view of
-- the worker that opening a ticket checks (deployment, state, record expiry: DecodeWorkerView).
redis.call('HSET', LEDGER, 'num_total_blocks', ARGV[1])
redis.call('HSETNX', LEDGER, 'num_reserved_blocks', 0)
redis.call('HSETNX', LEDGER, 'num_held_blocks', 0)
if ARGV[4] then
  redis.call('HSET', LEDGER, 'w_deployment', ARGV[2], 'w_state', ARGV[3], 'w_expires_s', ARGV[4])
end
local reply = ledger_reply()
table.insert(reply, 1, 'ok')
return reply
