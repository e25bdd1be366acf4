local spec = cjson.decode(ARGV[1])
for i, g in ipairs(spec.g) do
  local v = redis.call('HGET', g[1], g[2])
  local ok = false
  for _, a in ipairs(g[3]) do
    if (a == cjson.null and v == false) or (a ~= cjson.null and v == a) then ok = true break end
  end
  if not ok then
    if v == false then return {0, i} end
    return {0, i, v}
  end
end
for i, c in ipairs(spec.c) do
  local n = redis.call('ZCOUNT', c[1], c[2], '+inf')
  if n >= c[3] then return {2, i, n} end
end
for _, op in ipairs(spec.o) do
  local k = op[1]
  if k == 'hset' then
    local flat = {}
    for f, v in pairs(op[3]) do flat[#flat + 1] = f; flat[#flat + 1] = v end
    if #flat > 0 then redis.call('HSET', op[2], unpack(flat)) end
  elseif k == 'hdel' then redis.call('HDEL', op[2], unpack(op[3]))
  elseif k == 'del' then redis.call('DEL', op[2])
  elseif k == 'set' then
    if op[4] > 0 then redis.call('SET', op[2], op[3], 'EX', op[4]) else redis.call('SET', op[2], op[3]) end
  elseif k == 'expire' then redis.call('EXPIRE', op[2], op[3])
  elseif k == 'zadd' then redis.call('ZADD', op[2], op[4], op[3])
  elseif k == 'zaddnx' then redis.call('ZADD', op[2], 'NX', op[4], op[3])
  elseif k == 'zrem' then redis.call('ZREM', op[2], op[3])
  elseif k == 'ztrim' then redis.call('ZREMRANGEBYSCORE', op[2], '-inf', op[3])
  elseif k == 'sadd' then redis.call('SADD', op[2], op[3])
  elseif k == 'xadd' then redis.call('XADD', op[2], 'MAXLEN', '~', op[3], '*', 'event', op[4])
  elseif k == 'rpush' then
    redis.call('RPUSH', op[2], op[3])
    redis.call('LTRIM', op[2], -op[4], -1)
  else return redis.error_reply('unknown op ' .. tostring(k)) end
end
-- Then, where the store is also the broker (ARGV[2], else absent or ''), in the same step: the
-- scheduler's pass over the change's queues, and its due dispatches and what the pass released
-- pushed onto their queues. ARGV[2]: {o: outbox, i: items, n: now, l: limit, q: the pass's queues
-- (five values each, as release), d: the change's dispatch ids due now}.
local released, full, sent = {}, {}, 0
if ARGV[2] and ARGV[2] ~= '' then
  local r = cjson.decode(ARGV[2])
  local ids = r.d
  if #r.q > 0 then
    released, full = release(r.o, r.i, r.n, r.l, r.q, 1)
    for i = 1, #released, 2 do ids[#ids + 1] = released[i] end
  end
  for _, id in ipairs(ids) do
    local item = redis.call('HGET', r.i, id)
    if item and redis.call('ZSCORE', r.o, id) and publish(r.o, r.i, id, item) then sent = sent + 1 end
  end
end
return {1, released, full, sent}
