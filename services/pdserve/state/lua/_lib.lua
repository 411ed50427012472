-- Helpers prepended to every pdserve script (Redis Lua 5.1). Scripts reply with a flat array:
-- {'ok', ...} on success or {'err', code, message, extra}; the Python side maps `code` to a
-- pdserve.common.errors type (stale, illegal, invalid, capacity, notfound).

local function fail(code, message, extra)
  return {'err', code, message, extra or ''}
end

-- {'ok', field1, value1, ...} of a hash.
local function hash_reply(key)
  local fields = redis.call('HGETALL', key)
  table.insert(fields, 1, 'ok')
  return fields
end
