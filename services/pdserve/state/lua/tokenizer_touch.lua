-- Extend a live tokenizer bundle's TTL. KEYS[1] = bundle hash. ARGV: now, expires_s, ttl_ms.
-- Replies {'ok', 1} if it was live, {'ok', 0} if gone: past expires_s (coordinator clock) or
-- never stored. Never creates the hash, so a bundle is either whole or absent.
local expires = redis.call('HGET', KEYS[1], 'expires_s')
if not expires or tonumber(expires) <= tonumber(ARGV[1]) then
  return {'ok', 0}
end
redis.call('HSET', KEYS[1], 'expires_s', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'ok', 1}
