"""From a committed job to a worker's queue and back: steps published from the outbox, fair scheduling,
queues, leases and their reaper, cancellation, retention, the worker registry and readiness checks."""
