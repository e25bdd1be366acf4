-- KEYS: outbox, items; ARGV: now, limit, then the queues (five values each)
local out, full = release(KEYS[1], KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV, 3)
return {out, full}
