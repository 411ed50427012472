-- Set a live worker record's lifecycle state. KEYS[1] = record hash. ARGV: now, state.
local expires = redis.call('HGET', KEYS[1], 'expires_s')
if not expires or tonumber(expires) <= tonumber(ARGV[1]) then
  return fail('notfound', 'worker record expired or never registered')
end
redis.call('HSET', KEYS[1], 'state', ARGV[2])
return hash_reply(KEYS[1])
