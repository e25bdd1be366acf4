-- KEYS: outbox, items; ARGV: now, release limit, hold until, claim limit, direct ('1': push what it
-- can onto the broker itself), then the queues. The relay's whole pass in one round trip: what the
-- release makes due is claimed (or published) with the rest.
local out, full = release(KEYS[1], KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV, 6)
local claimed, sent = claim(KEYS[1], KEYS[2], ARGV[1], ARGV[3], tonumber(ARGV[4]), '', ARGV[5] == '1')
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')  -- when the next entry comes due
return {out, full, claimed, sent, first[2] or ''}
