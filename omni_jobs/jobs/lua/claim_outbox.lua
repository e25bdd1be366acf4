-- KEYS: outbox, items; ARGV: now, hold until, limit, entry-id filter ('' for all)
local out = claim(KEYS[1], KEYS[2], ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], false)
return out
