"""Webhooks: Standard Webhooks signing, which job events become deliveries, the retry schedule,
the HTTP POST, and the record of every attempt on the job.

Signing follows https://www.standardwebhooks.com: headers ``webhook-id`` (stable across retries),
``webhook-timestamp`` (integer seconds of this attempt) and ``webhook-signature``: space-separated
``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``, one per secret (``whsec_<base64>``) so
that receivers keep verifying while the secret rotates. The body is the job object, as GET shows it
when the attempt is made. The secret lives only in settings: never in a job, a log or a message.

Flow: the store calls ``WebhookNotifier`` after each committed change; it maps the job's new
events to messages (``start`` = job.running, ``progress`` = stage progress or end, throttled,
``completed`` = succeeded | failed | canceled) filtered by the job's ``events``, and hands each to
the Dispatcher (the ``webhooks`` queue). A ``WebhookDeliverer`` then makes one attempt per task
run and says whether and when to try again (``RetryPolicy``).
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import hashlib
import hmac
import json
import logging
import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from omni_jobs import keys
from omni_jobs.dispatch import WEBHOOKS_QUEUE, Dispatcher, NextStep, WebhookMessage
from omni_jobs.errors import FieldError, InvalidRequest, JobNotFound
from omni_jobs.jobs.models import WEBHOOK_EVENTS, Job, JobEvent, JobWebhook, WebhookDelivery, now
from omni_jobs.net_guard import HostDoesNotResolve, NetGuard, UnsafeWebhookUrl

if TYPE_CHECKING:
    import redis

    from omni_jobs.jobs.store import JobStore
    from omni_jobs.settings import Settings

log = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
MAX_URL_LENGTH = 2048
USER_AGENT = "omni-jobs-webhooks/0.1"
EVENT_HEADER = "omni-webhook-event"
"""Names the event (start | progress | completed) of a delivery; not part of the signed content."""

EVENT_OF: dict[str, str] = {
    "job.running": "start",
    "stage.progress": "progress",
    "stage.succeeded": "progress",
    "job.succeeded": "completed",
    "job.failed": "completed",
    "job.canceled": "completed",
}
"""Job event type -> webhook event. Other events (queued, stage.started, ...) send nothing."""

REFUSED = "refused by the SSRF guard"
"""Start of a delivery error that is final: the URL resolved to an address webhooks may not reach."""

INTERMEDIATE_EVENTS = frozenset({"start", "progress"})
"""Events whose news goes stale: retried at most once."""


# --- secrets and signing ---
def generate_secret(n_bytes: int = 32) -> str:
    """A new random signing secret in the ``whsec_<base64>`` form receivers expect."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(n_bytes)).decode()


def parse_secrets(value: str) -> list[bytes]:
    """``whsec_a,whsec_b`` -> the key bytes of each. Errors name the position, never the secret."""
    keys_: list[bytes] = []
    for i, part in enumerate(p.strip() for p in value.split(",")):
        where = f"secret #{i + 1}"
        if not part.startswith(SECRET_PREFIX):
            raise ValueError(f"{where} must start with '{SECRET_PREFIX}' (generate one: omni-jobs webhook-secret)")
        try:
            key = base64.b64decode(part[len(SECRET_PREFIX):], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where} is not valid base64 after '{SECRET_PREFIX}'") from None
        if len(key) < 24:
            raise ValueError(f"{where} decodes to {len(key)} bytes; use at least 24 (32 recommended)")
        keys_.append(key)
    return keys_


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


class WebhookSigner:
    """Signs with every configured secret: the first is current, the others still accepted."""

    def __init__(self, keys_: Sequence[bytes]) -> None:
        if not keys_:
            raise ValueError("no webhook signing secret")
        self._keys = list(keys_)

    @classmethod
    def from_setting(cls, value: str) -> WebhookSigner:
        return cls(parse_secrets(value))

    def __repr__(self) -> str:
        return f"WebhookSigner({len(self._keys)} secret(s))"

    def signature(self, message_id: str, timestamp: int, body: bytes) -> str:
        signed = message_id.encode() + b"." + str(timestamp).encode() + b"." + body
        return " ".join(
            "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode() for key in self._keys
        )

    def headers(self, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
        return {
            "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": self.signature(message_id, timestamp, body),
        }


# --- what a job asks for ---
def validate_webhook(url: Any, events: Any) -> JobWebhook | None:
    """The job's webhook settings, or InvalidRequest naming ``webhook`` / ``webhook_events_filter``."""
    if url is None:
        if events:
            raise InvalidRequest([FieldError(("webhook_events_filter",), "is set but no 'webhook' URL is given",
                                             "missing")])
        return None
    errors: list[FieldError] = []
    if not isinstance(url, str):
        errors.append(FieldError(("webhook",), "must be an http(s) URL string", "type_error"))
    else:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            errors.append(FieldError(("webhook",), f"must be an http:// or https:// URL, got scheme "
                                     f"'{parts.scheme or '(none)'}'", "url_scheme"))
        elif not parts.hostname:
            errors.append(FieldError(("webhook",), "has no host", "url_parsing"))
        elif len(url) > MAX_URL_LENGTH:
            errors.append(FieldError(("webhook",), f"is {len(url)} characters; at most {MAX_URL_LENGTH}", "too_long"))
    chosen: list[str] = list(WEBHOOK_EVENTS)
    if events is not None:
        if not isinstance(events, list) or not events:
            errors.append(FieldError(("webhook_events_filter",), f"must be a non-empty list of {list(WEBHOOK_EVENTS)}",
                                     "type_error"))
        else:
            for i, name in enumerate(events):
                if name not in WEBHOOK_EVENTS:
                    errors.append(FieldError(("webhook_events_filter", i), f"unknown event {name!r}; "
                                             f"choose from {list(WEBHOOK_EVENTS)}", "literal_error"))
            chosen = [e for e in WEBHOOK_EVENTS if e in events]
    if errors:
        raise InvalidRequest(errors)
    return JobWebhook(url=url, events=chosen)


# --- which events become deliveries ---
class WebhookNotifier:
    """A JobStore commit listener: the job's new events -> webhook messages on the webhooks queue."""

    def __init__(self, redis_client: redis.Redis, dispatcher: Dispatcher, *, progress_interval_s: float,
                 queue: str = WEBHOOKS_QUEUE) -> None:
        self.redis = redis_client
        self.dispatcher = dispatcher
        self.progress_interval_s = progress_interval_s
        self.queue = queue

    def messages(self, job: Job, events: Sequence[JobEvent]) -> list[WebhookMessage]:
        """At most one message per webhook event per commit, in the order they happened."""
        if job.webhook is None:
            return []
        wanted: list[str] = []
        for event in events:
            name = EVENT_OF.get(event.type)
            if name is None or name not in job.webhook.events or name in wanted:
                continue
            if event.type == "stage.progress" and not self._progress_due(job.id):
                continue
            wanted.append(name)
        return [WebhookMessage(new_message_id(), name) for name in wanted]

    def _progress_due(self, job_id: str) -> bool:
        """Throttle across all processes working on the job (SET NX with an expiry)."""
        if self.progress_interval_s <= 0:
            return True
        ms = max(1, int(self.progress_interval_s * 1000))
        return bool(self.redis.set(keys.webhook_progress_throttle(job_id), b"1", nx=True, px=ms))

    def __call__(self, job: Job, events: list[JobEvent]) -> None:
        for message in self.messages(job, events):
            self.dispatcher.dispatch(NextStep(job.id, None, self.queue, webhook=message))


# --- retries ---
@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: attempt n+1 waits ``base * 2**(n-1)`` (capped) x (1 +/- jitter).

    A 429 or 503 with Retry-After waits what the receiver asked (capped). ``start`` and ``progress``
    messages get ``intermediate_max_attempts`` (2: one retry), ``completed`` ``max_attempts``.
    """

    base_s: float = 5.0
    max_delay_s: float = 1800.0
    jitter: float = 0.25
    max_attempts: int = 10
    intermediate_max_attempts: int = 2

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        return cls(base_s=settings.webhook_retry_base_s, max_delay_s=settings.webhook_retry_max_s,
                   jitter=settings.webhook_retry_jitter, max_attempts=settings.webhook_max_attempts,
                   intermediate_max_attempts=min(2, settings.webhook_max_attempts))

    def attempts_for(self, event: str) -> int:
        return self.intermediate_max_attempts if event in INTERMEDIATE_EVENTS else self.max_attempts

    def nominal_delay(self, attempt: int) -> float:
        """Delay after failed attempt ``attempt`` (1-based), before jitter."""
        return min(self.base_s * 2 ** (attempt - 1), self.max_delay_s)

    def delay(self, attempt: int, retry_after_s: float | None = None, rng: Callable[[], float] = random.random) -> float:
        if retry_after_s is not None:
            return min(max(retry_after_s, 0.0), self.max_delay_s)
        return self.nominal_delay(attempt) * (1 + self.jitter * (2 * rng() - 1))

    def schedule(self, event: str = "completed") -> list[float]:
        """Nominal delays between the attempts of one message (for docs and tests)."""
        return [self.nominal_delay(n) for n in range(1, self.attempts_for(event))]


def parse_retry_after(value: str | None, *, at: float | None = None) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date; None if absent or unreadable."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (at if at is not None else time.time()))


# --- one attempt ---
@dataclass(frozen=True)
class AttemptResult:
    status_code: int | None
    error: str | None
    duration_s: float
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300

    @property
    def retryable(self) -> bool:
        """Connection errors and timeouts, 5xx, 408 and 429; other answers (4xx, 3xx) are final."""
        if self.status_code is None:
            return True
        return self.status_code >= 500 or self.status_code in (408, 429)


def post_webhook(client: httpx.Client, url: str, body: bytes, headers: dict[str, str],
                 extensions: dict[str, Any] | None = None) -> AttemptResult:
    """One POST; redirects are not followed (a 3xx is an answer, not a success)."""
    started = time.perf_counter()
    try:
        response = client.post(url, content=body, headers=headers, extensions=extensions)
    except httpx.TimeoutException as exc:
        return AttemptResult(None, f"timeout: {type(exc).__name__}", time.perf_counter() - started)
    except httpx.HTTPError as exc:
        return AttemptResult(None, f"{type(exc).__name__}: {exc}"[:500], time.perf_counter() - started)
    duration = time.perf_counter() - started
    code = response.status_code
    error = None if 200 <= code < 300 else f"HTTP {code}" + (f" {response.reason_phrase}" if response.reason_phrase else "")
    retry_after = parse_retry_after(response.headers.get("retry-after")) if code in (429, 503) else None
    return AttemptResult(code, error, duration, retry_after)


def record_delivery(job: Job, delivery: WebhookDelivery, *, keep: int) -> list[JobEvent]:
    """Append one attempt to the job's record (latest ``keep`` kept). No event: it is not a job change."""
    if job.webhook is None:
        return []
    job.webhook.deliveries.append(delivery)
    del job.webhook.deliveries[:-keep]
    return []


@dataclass(frozen=True)
class DeliveryOutcome:
    status: str  # "delivered" | "retry" | "gave_up" | "rejected" | "skipped"
    retry_in_s: float | None = None
    status_code: int | None = None


class WebhookDeliverer:
    """Makes one delivery attempt of one message and records it on the job."""

    def __init__(self, *, store: JobStore, render: Callable[[Job], dict[str, Any]], signer: WebhookSigner | None,
                 policy: RetryPolicy, timeout_s: float, deliveries_kept: int,
                 unsigned_reason: str = "no signing secret", client: httpx.Client | None = None,
                 guard: NetGuard | None = None) -> None:
        self.store = store
        self.guard = guard
        self.render = render
        self.signer = signer
        self.unsigned_reason = unsigned_reason
        self.policy = policy
        self.deliveries_kept = deliveries_kept
        self.client = client or httpx.Client(timeout=timeout_s, follow_redirects=False,
                                             headers={"user-agent": USER_AGENT})

    def deliver(self, job_id: str, message_id: str, event: str, attempt: int) -> DeliveryOutcome:
        job = self.store.get(job_id)
        if job is None or job.webhook is None:
            log.info("webhook %s: job %s is gone or has no webhook; dropping", message_id, job_id)
            return DeliveryOutcome("skipped")
        if self.signer is None:
            result = AttemptResult(None, f"not sent: {self.unsigned_reason}", 0.0)
        else:
            body = json.dumps(self.render(job), separators=(",", ":")).encode()
            timestamp = int(now())
            headers = {"content-type": "application/json", EVENT_HEADER: event,
                       **self.signer.headers(message_id, timestamp, body)}
            result = self._post(job.webhook.url, body, headers)
        delivery = WebhookDelivery(id=message_id, event=event, attempt=attempt, at=now(),
                                   status_code=result.status_code, error=result.error,
                                   duration_s=round(result.duration_s, 6))
        try:
            self.store.update(job_id, lambda j: record_delivery(j, delivery, keep=self.deliveries_kept))
        except JobNotFound:
            log.info("webhook %s: job %s expired during the attempt; not recording it", message_id, job_id)
        if result.ok:
            return DeliveryOutcome("delivered", status_code=result.status_code)
        refused = result.error is not None and result.error.startswith(REFUSED)
        if self.signer is not None and result.retryable and not refused and attempt < self.policy.attempts_for(event):
            delay = self.policy.delay(attempt, result.retry_after_s)
            log.info("webhook %s (%s, job %s) attempt %d failed (%s); retrying in %.2fs",
                     message_id, event, job_id, attempt, result.error, delay)
            return DeliveryOutcome("retry", delay, result.status_code)
        status = "gave_up" if result.retryable and not refused else "rejected"
        log.warning("webhook %s (%s, job %s) %s after attempt %d: %s", message_id, event, job_id,
                    status.replace("_", " "), attempt, result.error)
        return DeliveryOutcome(status, None, result.status_code)

    def _post(self, url: str, body: bytes, headers: dict[str, str]) -> AttemptResult:
        """Through the net guard when there is one: resolved and checked now, sent to that address."""
        if self.guard is None:
            return post_webhook(self.client, url, body, headers)
        try:
            pinned = self.guard.pin(url)
        except HostDoesNotResolve as exc:
            return AttemptResult(None, f"webhook {exc}"[:500], 0.0)  # DNS may come back: retried
        except UnsafeWebhookUrl as exc:
            return AttemptResult(None, f"{REFUSED}: webhook {exc}"[:500], 0.0)
        return post_webhook(self.client, pinned.url, body, {**headers, **pinned.headers}, pinned.extensions)

    def close(self) -> None:
        self.client.close()
