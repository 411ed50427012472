-- Publish a deployment's local-prefill threshold. KEYS[1] = the thresholds hash.
-- ARGV: deployment, threshold_tokens, source, published_s. Field 'v:<deployment>' counts the
-- deployment's publications (kept by a clear); 't:<deployment>' holds the one in force as
-- "<threshold_tokens> <source> <version> <published_s>". Replies {'ok', version}.
local version = redis.call('HINCRBY', KEYS[1], 'v:' .. ARGV[1], 1)
redis.call('HSET', KEYS[1], 't:' .. ARGV[1],
           ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. version .. ' ' .. ARGV[4])
return {'ok', version}
