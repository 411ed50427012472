-- Keep the view of a decode worker that opening a ticket checks beside its ledger, if it has one
-- (a worker without a ledger gets none: the view never creates one). ARGV: deployment, state,
-- record expiry (DecodeWorkerView).
if redis.call('EXISTS', LEDGER) == 1 then
  redis.call('HSET', LEDGER, 'w_deployment', ARGV[1], 'w_state', ARGV[2], 'w_expires_s', ARGV[3])
end
return {'ok'}
