-- The due entries of the outbox, each held until hold_until (another claimer skips it meanwhile);
-- answers (id, item) pairs, flat, and how many it published itself instead (``direct``: pushed onto
-- its queue where it can be, see publish). An entry whose item is gone is dropped.
local function claim(outbox, items, now, hold_until, limit, filter, direct)
  local due = redis.call('ZRANGEBYSCORE', outbox, '-inf', now, 'LIMIT', 0, limit * 4)
  local out, sent = {}, 0
  for _, id in ipairs(due) do
    if #out / 2 + sent >= limit then break end
    if filter == '' or string.find(id, filter, 1, true) then
      local item = redis.call('HGET', items, id)
      if not item then
        redis.call('ZREM', outbox, id)
      elseif direct and publish(outbox, items, id, item) then
        sent = sent + 1
      else
        redis.call('ZADD', outbox, hold_until, id)
        out[#out + 1] = id
        out[#out + 1] = item
      end
    end
  end
  return out, sent
end
