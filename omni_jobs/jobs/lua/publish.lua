-- Pushes an outbox entry onto its Celery queue's list, as kombu's Redis transport would, where this
-- Redis is the broker: TEMPLATES holds each step kind's task message with @@NAME@@ where the step's
-- values go (omni_jobs.dispatch.queueing.broker_message_templates; a store that is not the broker has none).
-- Ends the entry. Answers whether it did: not without a template, nor for a value that is not plain
-- text (the relay publishes those through kombu). A template with "@@SNAPSHOT@@" gets the job as it
-- is now in its place: [its hash's fields and values, flat; its progress or ''] (the worker starts
-- from it instead of reading the job; see omni_jobs.dispatch.queueing.job_snapshot).
local function publish(outbox, items, id, item)
  local step = cjson.decode(item)
  local template = TEMPLATES[step.kind]
  if template == nil then return false end
  local values = {ID = id, JOB = step.job_id, ATTEMPT = tostring(step.attempt), QUEUE = step.queue,
                  STAGE = step.stage_id or '', MSG = step.message_id or '', EVENT = step.event or ''}
  for _, value in pairs(values) do
    if type(value) ~= 'string' or not string.find(value, '^[%w_.:#/%-]*$') then return false end
  end
  local message = string.gsub(template, '@@(%u+)@@', values)
  local at, to = string.find(message, '"@@SNAPSHOT@@"', 1, true)
  if at then
    local fields = redis.call('HGETALL', JOB_KEY .. step.job_id)
    local snapshot = 'null'
    if #fields > 0 then
      snapshot = cjson.encode({fields, redis.call('GET', JOB_KEY .. step.job_id .. PROGRESS_SUFFIX) or ''})
    end
    message = string.sub(message, 1, at - 1) .. snapshot .. string.sub(message, to + 1)
  end
  redis.call('LPUSH', step.queue, message)
  redis.call('ZREM', outbox, id)
  redis.call('HDEL', items, id)
  return true
end
