-- The stream's epoch and last sequence number, starting a new epoch (and an empty stream) when
-- the meta hash is missing, i.e. after a store loss. KEYS[1] = meta hash, KEYS[2] = stream.
-- ARGV: a fresh epoch to use if there is none.
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if not epoch then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'seq', 0)
  epoch = ARGV[1]
end
return {'ok', epoch, redis.call('HGET', KEYS[1], 'seq')}
