-- Free a ticket's blocks (reserved or held) exactly once; a non-terminal ticket is aborted.
-- ARGV: ticket_id, attempt, now, purge_s, backstop_ms, default reason.
-- KEYS[5..] (one node only): the ticket's id index keys, kept from now on as long as the
-- ticket's own retention.
local key = KEYS[4]
local now = ARGV[3]
local t, e = load_ticket(key, ARGV[1], ARGV[2], now)
if e then return e end
e = check_owned(t)
if e then return e end
local reason = t.reason
if reason == '' then reason = ARGV[6] end
local new_state = nil
if not TERMINAL[t.state] then new_state = 'aborted' end
free_blocks(key, t, now, ARGV[4], ARGV[5], new_state, reason)
for i = 5, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
return hash_reply(key)
