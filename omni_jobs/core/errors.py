"""Exceptions that cross module boundaries, each carrying what a user needs to fix the problem.

The API maps them to HTTP answers (422, 404, 409); the workers map them to retry or fail.
"""

from __future__ import annotations

from dataclasses import dataclass


class OmniError(Exception):
    """Base of every omni-jobs error."""


class PipelineSpecError(OmniError):
    """A pipeline YAML is invalid: names the file and every problem (stage, field, reason)."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"invalid pipeline {source}:\n" + "\n".join(f"  - {p}" for p in problems))


class UnknownPipeline(OmniError):
    def __init__(self, name: str, available: list[str]) -> None:
        self.name = name
        self.available = available
        super().__init__(f"unknown pipeline '{name}'; available: {', '.join(available) or '(none)'}")


@dataclass(frozen=True)
class FieldError:
    """One invalid field of a request: where it is (``('input', 'prompt')``) and why."""

    loc: tuple[str | int, ...]
    message: str
    type: str = "value_error"


class InvalidRequest(OmniError):
    """A job request failed validation; ``errors`` name each bad field."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{'.'.join(map(str, e.loc))}: {e.message}" for e in errors))


class JobNotFound(OmniError):
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(f"no job '{job_id}'")


class InvalidTransition(OmniError):
    """A status change the job state machine does not allow (e.g. succeeded -> running)."""


class StageError(OmniError):
    """A stage failed for a reason that retrying will not fix (bad model, bad tensor shape)."""


class TransientStageError(OmniError):
    """A stage failed for a reason that may pass (store or broker unreachable): retry with backoff."""


class JobAlreadyFinished(OmniError):
    """The job ended already; it cannot be canceled (or changed) any more."""

    def __init__(self, job_id: str, status: str) -> None:
        self.job_id = job_id
        self.status = status
        super().__init__(f"job '{job_id}' already {status}; only queued or running jobs can be canceled")


class IdempotencyConflict(OmniError):
    """An Idempotency-Key was reused with a different request body."""

    def __init__(self, key: str, job_id: str) -> None:
        self.key = key
        self.job_id = job_id
        super().__init__(
            f"Idempotency-Key {key!r} was already used for job '{job_id}' with a different body; "
            "use a new key for a new request"
        )


class Overloaded(OmniError):
    """A queue holds as many waiting stages as it may; new jobs are refused until it drains."""

    def __init__(self, queue: str, depth: int, limit: int, retry_after_s: int) -> None:
        self.queue = queue
        self.depth = depth
        self.limit = limit
        self.retry_after_s = retry_after_s
        super().__init__(
            f"queue '{queue}' is full ({depth} waiting, limit {limit}); retry after {retry_after_s}s"
        )


class StoreUnavailable(OmniError):
    """The job store (Redis) did not answer for as long as a step may wait for it."""

    def __init__(self, what: str, waited_s: float, cause: BaseException) -> None:
        self.waited_s = waited_s
        super().__init__(f"{what}: the job store did not answer for {waited_s:.0f}s ({type(cause).__name__}: {cause}); "
                         "check OMNI_REDIS_URL and that Redis is up")


class NotDurable(OmniError):
    """A write reached the primary but not where it must be before it is acknowledged: its replicas
    (OMNI_REDIS_WAIT_REPLICAS) or its disk (OMNI_REDIS_WAIT_AOF)."""

    def __init__(self, acked: int, wanted: int, timeout_ms: int, *, disk: str | None = None,
                 job_id: str | None = None) -> None:
        """``disk``: the write was not on the primary's disk (why: a timeout, or the server's error).
        ``job_id``: the job the write made (a submit): it exists, and runs unless Redis loses it."""
        self.acked, self.wanted, self.timeout_ms, self.disk, self.job_id = acked, wanted, timeout_ms, disk, job_id
        if disk is not None:
            where = f"the job store's write was not on Redis's disk (OMNI_REDIS_WAIT_AOF): {disk}"
        else:
            where = (f"the job store's write reached {acked} of {wanted} replica(s) within {timeout_ms} ms "
                     "(OMNI_REDIS_WAIT_REPLICAS)")
        if job_id is not None:
            super().__init__(f"{where}; job {job_id} was made and runs unless Redis loses it: follow it at "
                             f"/v1/jobs/{job_id}, or retry with the same Idempotency-Key, which answers that job")
        else:
            super().__init__(f"{where}; retry with the same Idempotency-Key")

    def of_job(self, job_id: str) -> NotDurable:
        """The same refusal, naming the job that the write made."""
        return NotDurable(self.acked, self.wanted, self.timeout_ms, disk=self.disk, job_id=job_id)


class QuotaExceeded(OmniError):
    """A tenant reached one of its limits (docs/scaling.md): the job is refused, nothing stored."""

    def __init__(self, tenant: str, limit: str, value: int, retry_after_s: float) -> None:
        self.tenant = tenant
        self.limit = limit
        self.value = value
        self.retry_after_s = retry_after_s
        what = {"max_active": "jobs queued or running at once", "jobs_per_minute": "jobs submitted per minute"}
        super().__init__(f"tenant '{tenant}' reached its limit {limit}={value} ({what.get(limit, limit)}); "
                         f"retry after {retry_after_s:.0f}s, or ask for a higher limit (omni-jobs keys limits)")
