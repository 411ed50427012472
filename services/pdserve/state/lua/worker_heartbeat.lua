-- Refresh a live worker record's load and TTL. KEYS[1] = record hash.
-- ARGV: now, expires_s, ttl_ms, num_queued_prefill_tokens, num_running_seqs, num_free_blocks,
--       num_total_blocks. A record past expires_s (coordinator clock) counts as gone.
local expires = redis.call('HGET', KEYS[1], 'expires_s')
if not expires or tonumber(expires) <= tonumber(ARGV[1]) then
  return fail('notfound', 'worker record expired or never registered')
end
redis.call('HSET', KEYS[1], 'last_heartbeat_s', ARGV[1], 'expires_s', ARGV[2],
  'num_queued_prefill_tokens', ARGV[4], 'num_running_seqs', ARGV[5],
  'num_free_blocks', ARGV[6], 'num_total_blocks', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return hash_reply(KEYS[1])
