"""Webhook signing against the Standard Webhooks reference library, the retry schedule, and the
small parsers around webhooks, SSE and Prefer (no services)."""

from __future__ import annotations

import argparse
import base64
import email.utils
import io
import time

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from api.prefer import prefer_wait
from omni_jobs.cli.jobs import parse_params, stage_params
from omni_jobs.cli.progress import ProgressDisplay
from omni_jobs.client import JobEventInfo
from omni_jobs.client.sse import SseParser
from omni_jobs.core.errors import InvalidRequest
from omni_jobs.report.webhooks import (
    AttemptResult,
    RetryPolicy,
    WebhookSigner,
    generate_secret,
    parse_retry_after,
    parse_secrets,
    validate_webhook,
)

BODY = b'{"id":"job_1","status":"succeeded","outputs":[{"name":"text","text":"caf\xc3\xa9"}]}'


def test_reference_vector_of_the_specification() -> None:
    # The example secret, id, timestamp and payload of the Standard Webhooks libraries' tests.
    signer = WebhookSigner.from_setting("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    signature = signer.signature("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_standardwebhooks_verifies_our_headers() -> None:
    secret = generate_secret()
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) == 32
    headers = WebhookSigner.from_setting(secret).headers("msg_abc", int(time.time()), BODY)
    assert set(headers) == {"webhook-id", "webhook-timestamp", "webhook-signature"}
    assert headers["webhook-timestamp"].isdigit()
    assert Webhook(secret).verify(BODY, headers)["outputs"][0]["text"] == "café"
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(BODY.replace(b"succeeded", b"failed"), headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(generate_secret()).verify(BODY, headers)


def test_rotation_signs_with_every_secret_and_each_verifies_alone() -> None:
    old, new = generate_secret(), generate_secret()
    headers = WebhookSigner.from_setting(f"{new}, {old}").headers("msg_rot", int(time.time()), BODY)
    signatures = headers["webhook-signature"].split(" ")
    assert len(signatures) == 2 and all(s.startswith("v1,") for s in signatures)
    for secret in (old, new):
        Webhook(secret).verify(BODY, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(generate_secret()).verify(BODY, headers)


def test_stale_timestamp_is_refused_by_receivers() -> None:
    secret = generate_secret()
    headers = WebhookSigner.from_setting(secret).headers("msg_old", int(time.time()) - 600, BODY)
    with pytest.raises(WebhookVerificationError, match="too old"):
        Webhook(secret).verify(BODY, headers)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("not-a-secret-at-all-1234567890", "must start with 'whsec_'"),
        ("whsec_%%%%not*base64", "not valid base64"),
        ("whsec_" + base64.b64encode(b"short").decode(), "decodes to 5 bytes"),
    ],
)
def test_bad_secrets_are_explained_without_being_repeated(value: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as info:
        parse_secrets(f"{generate_secret()},{value}")
    assert "secret #2" in str(info.value)
    assert value[6:] not in str(info.value) and value not in str(info.value)


def test_retry_schedule_doubles_caps_and_jitters() -> None:
    policy = RetryPolicy(base_s=5, max_delay_s=1800, jitter=0.25, max_attempts=10)
    assert policy.schedule("completed") == [5, 10, 20, 40, 80, 160, 320, 640, 1280]
    assert policy.schedule("start") == [5] and policy.schedule("progress") == [5]
    assert policy.attempts_for("completed") == 10 and policy.attempts_for("progress") == 2
    assert RetryPolicy(base_s=5, max_delay_s=60).nominal_delay(9) == 60
    assert policy.delay(1, rng=lambda: 0.0) == pytest.approx(3.75)
    assert policy.delay(1, rng=lambda: 1.0) == pytest.approx(6.25)
    assert policy.delay(3, rng=lambda: 0.5) == pytest.approx(20)


def test_retry_after_is_honoured_and_capped() -> None:
    policy = RetryPolicy(base_s=5, max_delay_s=60)
    assert policy.delay(1, retry_after_s=1.0) == 1.0
    assert policy.delay(1, retry_after_s=3600) == 60
    assert parse_retry_after("7") == 7.0
    now = time.time()
    assert parse_retry_after(email.utils.formatdate(now + 30, usegmt=True), at=now) == pytest.approx(30, abs=1)
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


@pytest.mark.parametrize(
    ("status", "retryable", "ok"),
    [(200, False, True), (204, False, True), (None, True, False), (500, True, False), (503, True, False),
     (429, True, False), (408, True, False), (400, False, False), (410, False, False), (301, False, False)],
)
def test_what_is_retried(status: int | None, retryable: bool, ok: bool) -> None:
    result = AttemptResult(status, None if ok else "x", 0.01)
    assert (result.ok, result.ok or result.retryable) == (ok, ok or retryable)


def test_webhook_request_fields_are_validated_with_their_names() -> None:
    hook = validate_webhook("https://example.com/hook", None)
    assert hook is not None and hook.events == ["start", "progress", "completed"] and hook.deliveries == []
    assert validate_webhook("http://h/x", ["completed", "start"]).events == ["start", "completed"]  # type: ignore[union-attr]
    assert validate_webhook(None, None) is None
    cases = [
        (("ftp://example.com/x", None), ("webhook",), "http:// or https://"),
        (("https:///nohost", None), ("webhook",), "no host"),
        (("https://e.com", ["done"]), ("webhook_events_filter", 0), "unknown event 'done'"),
        ((None, ["completed"]), ("webhook_events_filter",), "no 'webhook' URL"),
    ]
    for args, loc, fragment in cases:
        with pytest.raises(InvalidRequest) as info:
            validate_webhook(*args)
        (error,) = info.value.errors
        assert error.loc == loc and fragment in error.message, (args, error)


def test_prefer_wait_parsing() -> None:
    assert prefer_wait(["wait=10"]) == 10
    assert prefer_wait(["respond-async, wait=2.5"]) == 2.5
    assert prefer_wait(["return=minimal", "WAIT = 3"]) == 3
    assert prefer_wait(["wait=soon"]) is None and prefer_wait([]) is None


def test_sse_parser_reads_messages_and_skips_comments() -> None:
    parser = SseParser()
    lines = ["retry: 2000", "", ": keep-alive", "", "id: 5-0", "event: stage.progress",
             'data: {"job_id":"j","type":"stage.progress","at":1,"data":{"step":2,"total":4}}', ""]
    messages = [m for m in (parser.feed(line) for line in lines) if m is not None]
    assert len(messages) == 1
    assert (messages[0].id, messages[0].event) == ("5-0", "stage.progress")
    assert JobEventInfo.model_validate_json(messages[0].data).data == {"step": 2, "total": 4}


def test_progress_display_without_a_terminal_prints_quarters() -> None:
    out = io.StringIO()
    display = ProgressDisplay(out, tty=False)

    def ev(type_: str, **data: object) -> JobEventInfo:
        return JobEventInfo(job_id="job_1", type=type_, at=0.0, data=data)

    display.show(ev("stage.started", stage="dit", worker="dit@h", attempt=1))
    for step in range(1, 9):
        display.show(ev("stage.progress", stage="dit", step=step, total=8, unit="steps"))
    display.show(ev("stage.succeeded", stage="dit", duration_s=0.5))
    display.show(ev("job.succeeded"))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    progress = [line for line in lines if "steps" in line]
    assert [p.split()[-2] for p in progress] == ["2/8", "4/8", "6/8", "8/8"]
    assert "[########################] 8/8 steps" in progress[-1]
    assert "done in 0.50s" in lines[-2] and lines[-1] == "job_1 succeeded"


def test_cli_param_parsing() -> None:
    assert parse_params(["dit.seed=7", "dit.guidance_scale=4.5", "ar.prompt_template=Say: {prompt}"]) == {
        "dit": {"seed": 7, "guidance_scale": 4.5}, "ar": {"prompt_template": "Say: {prompt}"}}
    with pytest.raises(Exception, match="STAGE.KEY=VALUE"):
        parse_params(["seed=7"])


def test_cli_params_json_then_each_param_over_it() -> None:
    """`omni-jobs submit` and `omni-jobs run` read stage parameters alike: --params, then --param."""
    assert stage_params('{"dit": {"seed": 3, "height": 64}, "ar": {"max_tokens": 8}}', ["dit.seed=7"]) == {
        "dit": {"seed": 7, "height": 64}, "ar": {"max_tokens": 8}}
    assert stage_params(None, ["ar.max_tokens=4"]) == {"ar": {"max_tokens": 4}}
    assert stage_params(None, []) == {}
    with pytest.raises(argparse.ArgumentTypeError, match="--params is not valid JSON"):
        stage_params("{dit: 3}", [])
    with pytest.raises(argparse.ArgumentTypeError, match=r"--params takes a JSON object of stages.*got \{\"seed\": 3\}"):
        stage_params('{"seed": 3}', [])


def test_progress_display_on_a_terminal_redraws_one_line_per_stage() -> None:
    out = io.StringIO()
    display = ProgressDisplay(out, tty=True)

    def ev(type_: str, **data: object) -> JobEventInfo:
        return JobEventInfo(job_id="job_1", type=type_, at=0.0, data=data)

    for stage, unit, total in (("ar", "tokens", 3), ("dit", "steps", 2)):
        display.show(ev("stage.started", stage=stage, worker=f"{stage}@h", attempt=1))
        for step in range(1, total + 1):
            display.show(ev("stage.progress", stage=stage, step=step, total=total, unit=unit))
        display.show(ev("stage.succeeded", stage=stage, duration_s=0.25))
    display.show(ev("job.succeeded"))
    raw = out.getvalue()
    assert raw.count("\r") == 2 * 2 + 3 + 2  # started + done per stage, and one redraw per step
    screen = [line.rsplit("\r", 1)[-1].replace("\x1b[K", "") for line in raw.split("\n") if line]
    assert screen == ["  ar   [########################] done in 0.25s",
                      "  dit  [########################] done in 0.25s",
                      "job_1 succeeded"]
