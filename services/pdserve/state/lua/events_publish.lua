-- Append one event; its stream id is "<seq>-0" with seq counted in the meta hash, so readers can
-- tell a gap (a missing seq) exactly. KEYS[1] = meta hash, KEYS[2] = stream.
-- ARGV: a fresh epoch to use if there is none, max stream length (approximate), payload.
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if not epoch then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'seq', 0)
  epoch = ARGV[1]
end
local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], seq .. '-0', 'event', ARGV[3])
return {'ok', epoch, tostring(seq)}
