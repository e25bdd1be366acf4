"""Webhooks: Standard Webhooks signing, which job events become deliveries, the retry schedule,
the HTTP POST, and the record of every attempt on the job.

Signing follows https://www.standardwebhooks.com: headers ``webhook-id`` (stable across retries),
``webhook-timestamp`` (integer seconds of this attempt) and ``webhook-signature``: space-separated
``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``, one per secret (``whsec_<base64>``) so
that receivers keep verifying while the secret rotates. The body is the job object, as GET shows it
when the attempt is made. The secret lives only in settings: never in a job, a log or a message.

Flow: a job transition whose events the job's webhook subscribes to (``start`` = job.running,
``progress`` = stage progress or end, throttled, ``completed`` = succeeded | failed | canceled,
``preview`` = a DiT stage's latent preview, throttled like progress and opt-in)
creates the webhook message in the same atomic write (omni_jobs.jobs.ledger), with its first
delivery attempt in the outbox. A ``WebhookDeliverer`` makes one attempt per step on the
``webhooks`` queue, holding a lease like a stage does, records it on the job, and queues the next
attempt (same webhook-id) after the ``RetryPolicy``'s delay, in the same write.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx

from omni_jobs.core.errors import FieldError, InvalidRequest
from omni_jobs.core.json_types import JsonObject
from omni_jobs.core.net_guard import HostDoesNotResolve, NetGuard, UnsafeWebhookUrl
from omni_jobs.dispatch.leases import LeaseKeeper
from omni_jobs.jobs.ledger import JobLedger, Lease, Refused
from omni_jobs.jobs.models import (
    DEFAULT_WEBHOOK_EVENTS,
    WEBHOOK_EVENTS,
    EventType,
    Job,
    JobWebhook,
    WebhookDelivery,
    now,
)
from omni_jobs.jobs.patience import while_store_down
from omni_jobs.jobs.steps import DeliverWebhook, StepOutcome
from omni_jobs.jobs.view import JobJSON

if TYPE_CHECKING:
    from omni_jobs.core.settings import Settings

log = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
MAX_URL_LENGTH = 2048
USER_AGENT = "omni-jobs-webhooks/0.1"
EVENT_HEADER = "omni-webhook-event"
"""Names the event (start | progress | completed) of a delivery; not part of the signed content."""

REFUSED = "refused by the SSRF guard"
"""Start of a delivery error that is final: the URL resolved to an address webhooks may not reach."""

INTERMEDIATE_EVENTS = frozenset({"start", "progress", "preview"})
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
def validate_webhook(url: object, events: object) -> JobWebhook | None:
    """The job's webhook settings (from the request's JSON), or InvalidRequest naming ``webhook`` /
    ``webhook_events_filter``."""
    if url is None:
        if events:
            raise InvalidRequest([FieldError(("webhook_events_filter",), "is set but no 'webhook' URL is given",
                                             "missing")])
        return None
    errors: list[FieldError] = []
    if not isinstance(url, str):
        errors.append(FieldError(("webhook",), "must be an http(s) URL string", "type_error"))
    else:
        try:
            parts = urlsplit(url)
            parts.hostname  # noqa: B018 - a bad [IPv6] literal raises here, not at urlsplit
        except ValueError as exc:  # was a 500: http://[0]/ is not a URL
            raise InvalidRequest([FieldError(("webhook",), f"is not a URL: {exc}", "url_parsing")]) from None
        if parts.scheme not in ("http", "https"):
            errors.append(FieldError(("webhook",), f"must be an http:// or https:// URL, got scheme "
                                     f"'{parts.scheme or '(none)'}'", "url_scheme"))
        elif not parts.hostname:
            errors.append(FieldError(("webhook",), "has no host", "url_parsing"))
        elif len(url) > MAX_URL_LENGTH:
            errors.append(FieldError(("webhook",), f"is {len(url)} characters; at most {MAX_URL_LENGTH}", "too_long"))
    chosen: list[str] = list(DEFAULT_WEBHOOK_EVENTS)
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
        return min(self.base_s * 2.0 ** (attempt - 1), self.max_delay_s)

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
    if value.isascii() and value.isdigit():  # '²'.isdigit() is true, and float('²') raises
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
                 extensions: Mapping[str, object] | None = None) -> AttemptResult:
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


class WebhookDeliverer:
    """Makes one delivery attempt of one message, records it on the job, and schedules the next.

    The body is ``render(job)``, the job as a JobView (omni_jobs.jobs.view), plus ``preview`` (the
    latest output.preview's data) on a preview message."""

    def __init__(self, *, ledger: JobLedger, render: Callable[[Job], JobJSON], signer: WebhookSigner | None,
                 policy: RetryPolicy, timeout_s: float, unsigned_reason: str = "no signing secret",
                 client: httpx.Client | None = None, guard: NetGuard | None = None,
                 keeper: LeaseKeeper | None = None, store_wait_s: float = 600.0) -> None:
        self.ledger = ledger
        self.guard = guard
        self.render = render
        self.signer = signer
        self.unsigned_reason = unsigned_reason
        self.policy = policy
        self.keeper = keeper
        self.store_wait_s = store_wait_s
        self.client = client or httpx.Client(timeout=timeout_s, follow_redirects=False,
                                             headers={"user-agent": USER_AGENT})

    def run(self, step: DeliverWebhook, *, worker: str, owner: str) -> StepOutcome:
        where = f"webhook {step.message_id} ({step.event}, job {step.job_id}) attempt {step.attempt}"
        taken = while_store_down(lambda: self.ledger.acquire(step, worker=worker, owner=owner),
                                 wait_s=self.store_wait_s, what=where)
        if isinstance(taken, Refused):
            return StepOutcome("skipped", taken.reason)
        if self.keeper is None:
            return self._attempt(taken.job, taken.lease, step, where)
        with self.keeper.hold(taken.lease, on_lost=lambda: None):  # a POST is short: it finishes anyway
            return self._attempt(taken.job, taken.lease, step, where)

    def _attempt(self, job: Job, lease: Lease, step: DeliverWebhook, where: str) -> StepOutcome:
        assert job.webhook is not None
        if self.signer is None:
            result = AttemptResult(None, f"not sent: {self.unsigned_reason}", 0.0)
        else:
            document = self.render(job)
            if step.event == "preview":
                document["preview"] = self._latest_preview(job.id)
            body = json.dumps(document, separators=(",", ":")).encode()
            timestamp = int(now())
            headers = {"content-type": "application/json", EVENT_HEADER: step.event,
                       **self.signer.headers(step.message_id, timestamp, body)}
            result = self._post(job.webhook.url, body, headers)
        delivery = WebhookDelivery(id=step.message_id, event=step.event, attempt=step.attempt, at=now(),
                                   status_code=result.status_code, error=result.error,
                                   duration_s=round(result.duration_s, 6))
        refused = result.error is not None and result.error.startswith(REFUSED)
        retry_at: float | None = None
        if result.ok:
            status = "delivered"
        elif (self.signer is not None and result.retryable and not refused
              and step.attempt < self.policy.attempts_for(step.event)):
            status = "retry"
            retry_at = now() + self.policy.delay(step.attempt, result.retry_after_s)
            log.info("%s failed (%s); retrying in %.2fs", where, result.error, retry_at - now())
        else:
            status = "gave_up" if result.retryable and not refused else "rejected"
            log.warning("%s: %s: %s", where, status.replace("_", " "), result.error)
        recorded = while_store_down(
            lambda: self.ledger.finish_webhook(lease, delivery, retry_at=retry_at,
                                               final_status=status if status != "retry" else "queued"),
            wait_s=self.store_wait_s, what=where)
        if not recorded:
            return StepOutcome("lost", "the lease was taken back during the attempt")
        return StepOutcome(status, result.error or "")

    def _latest_preview(self, job_id: str) -> JsonObject | None:
        """The data of the job's newest output.preview event (like the job object, what is newest when
        the attempt is made): ``{stage, step, total, media_type, width, height, data}``."""
        latest: JsonObject | None = None
        after = "0-0"
        while True:
            events = self.ledger.events(job_id, after=after, count=500)
            if not events:
                return latest
            for event in events:
                if event.type == EventType.output_preview:
                    latest = event.data
            after = events[-1].id

    def post(self, url: str, body: bytes, headers: dict[str, str]) -> AttemptResult:
        """One signed POST as every delivery makes it (the batches' webhooks too, omni_jobs.accept.batches)."""
        return self._post(url, body, headers)

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
