-- Create or resize a decode worker's ledger. ARGV: num_total_blocks.
redis.call('HSET', LEDGER, 'num_total_blocks', ARGV[1])
redis.call('HSETNX', LEDGER, 'num_reserved_blocks', 0)
redis.call('HSETNX', LEDGER, 'num_held_blocks', 0)
local reply = ledger_reply()
table.insert(reply, 1, 'ok')
return reply
