-- The scheduler's pass over the queues given in args from first on, five values each: tenants key,
-- released key, running key, ready-list prefix, window. Answers the released (entry, tenant)
-- pairs, flat, and the numbers (1, 2...) of the queues it left full.
local function release(outbox, items, now, limit, args, first)
  local out, full = {}, {}
  for q = first, #args, 5 do
    local tenants, released, running, prefix = args[q], args[q + 1], args[q + 2], args[q + 3]
    local window = tonumber(args[q + 4])
    local in_service = redis.call('ZCARD', released) + redis.call('ZCARD', running)
    local taken = 0
    while in_service < window and taken < limit do
      local head_tenant = redis.call('ZRANGE', tenants, 0, 0)
      if #head_tenant == 0 then break end
      local tenant = head_tenant[1]
      local ready = prefix .. tenant
      local head = redis.call('ZRANGE', ready, 0, 0)
      if #head == 0 then
        redis.call('ZREM', tenants, tenant)
      else
        local id = head[1]
        redis.call('ZREM', ready, id)
        if redis.call('HEXISTS', items, id) == 1 then
          redis.call('ZADD', outbox, now, id)
          local slot = string.match(id, '^(.*):%d+$')
          redis.call('ZADD', released, now + taken * 0.0000005, slot)  -- release order, within one pass too
          in_service = in_service + 1
          taken = taken + 1
          out[#out + 1] = id
          out[#out + 1] = tenant
        end
        if redis.call('ZCARD', ready) == 0 then
          redis.call('ZREM', tenants, tenant)
        else
          redis.call('ZADD', tenants, now, tenant)
        end
      end
    end
    if in_service >= window then full[#full + 1] = (q - first) / 5 + 1 end
  end
  return out, full
end
