-- then the queue position of the job just written (ARGV[3]: released key, slot, ready key, entry,
-- tenants key; or an empty list when none of its stages waits): see estimate_position
local p = cjson.decode(ARGV[3])
if #p == 0 then return {1, released, full, sent} end
return {1, released, full, sent, redis.call('ZRANK', p[1], p[2]), redis.call('ZCARD', p[1]),
        redis.call('ZRANK', p[3], p[4]), redis.call('ZCARD', p[5])}
