"""What a schemathesis run against this API excuses, in one place: the in-process fuzz test
(test_fuzz_openapi.py) imports it, and the CLI loads it as a hooks module:

    SCHEMATHESIS_HOOKS=tests.e2e.fuzz_hooks schemathesis run http://127.0.0.1:8000/openapi.json \\
        --checks all --mode all -H "Authorization: Bearer $KEY"

It drops two kinds of failures and keeps every other one. Importing it registers the hook.
"""

from __future__ import annotations

import schemathesis
from schemathesis import Case, Response
from schemathesis.core.failures import Failure

SUBMIT_PATHS = ("/v1/jobs", "/v1/jobs/multipart")
OPENAI_FILE_PATHS = ("/v1/chat/completions", "/v1/audio/transcriptions", "/v1/audio/translations")
FILE_ERRORS = ("invalid_image", "invalid_audio", "invalid_video")


def by_design(case: Case, response: Response) -> bool:
    """The 5xx answers that mean what they say with no workers running (the fuzzed system has none,
    so that random jobs wait on their queues): not ready, and an OpenAI call whose job did not end
    within OMNI_OPENAI_WAIT_S. Both are documented statuses."""
    if case.path == "/readyz":
        return response.status_code == 503 and '"missing"' in response.text
    return response.status_code == 504 and "job_timeout" in response.text


def cannot_be_said(case: Case, response: Response) -> bool:
    """A schema-valid request refused for what no schema can say. The spec has one schema per
    pipeline (its inputs, each stage's params, this server's limits and webhook setting) and per
    pipeline an OpenAI request can run, so what is left is: a file input's bytes must decode as an
    image, audio or video, and a reference to a stored output must name one (the schema gives their shapes); and
    an image-to-image stage takes strength x num_inference_steps >= 1 (a product of two fields, with
    the stage's default for an absent one). The OpenAI routes that take files (a chat's media parts, a
    transcription's file) answer the first of those as a 400 with its type as the code. A batch file
    (POST /v1/files) is lines of requests, each checked by its route: a file of other bytes is a 400
    ``invalid_batch_file``. GET /v1/usage's end must come after its start, by at most 366 days (two fields
    again). Everything else must be accepted."""
    if case.path in OPENAI_FILE_PATHS and response.status_code == 400:
        return response.json()["error"]["code"] in FILE_ERRORS
    if case.path == "/v1/files" and response.status_code == 400:  # a batch file's lines are requests to check
        return response.json()["error"]["code"] == "invalid_batch_file"
    if case.path == "/v1/usage" and response.status_code == 400:  # end after start, by at most 366 days
        return response.json()["error"]["param"] == "end"
    if case.path not in SUBMIT_PATHS or response.status_code != 422:
        return False
    return all(e["type"] in FILE_ERRORS or "leaves no denoising step" in e["msg"] or _other_pipelines_part(case, e)
               for e in response.json()["detail"])


def _other_pipelines_part(case: Case, error: dict[str, object]) -> bool:
    """A multipart form with a file part of another pipeline than the one it names, or without a file
    part its pipeline needs. The form's schema says which parts each pipeline takes and needs (an anyOf
    of one branch per pipeline, told apart by its pipeline const), but schemathesis (4.32) draws a form
    from the top-level properties alone, which list every pipeline's parts and require none."""
    loc, msg = error.get("loc"), str(error.get("msg", ""))
    if case.path != "/v1/jobs/multipart" or not isinstance(loc, list) or len(loc) != 3 or loc[:2] != ["body", "input"]:
        return False
    if error.get("type") == "extra":
        return isinstance(case.body, dict) and f"input.{loc[2]}" in case.body and msg.startswith("unknown field")
    return error.get("type") == "missing" and msg in ("is required (image)", "is required (audio)",
                                                      "is required (video)")


@schemathesis.hook
def filter_failure(context: object, failure: Failure, case: Case, response: Response) -> bool:
    """Keep a failure unless the functions above explain it: a server error by design (ST101), a
    valid request refused for what cannot be said (ST202)."""
    if failure.code == "ST101" and by_design(case, response):
        return False
    return not (failure.code == "ST202" and cannot_be_said(case, response))
