"""JobView is what is really sent: every job JSON the e2e tests see is checked against it.

A job validates as JobView, and dumping that view (the fields the JSON had, nothing else) gives the
JSON back exactly: a field JobView does not declare would be dropped by the model and show up as a
difference here (the recursive equivalent of ``extra="forbid"``), and a field with another type
fails validation.
"""

from __future__ import annotations

from typing import Any

import httpx

from omni_jobs.jobs.view import JobView

SEEN = {"jobs": 0}


def assert_job_view(data: Any) -> JobView:
    view = JobView.model_validate(data)
    again = view.model_dump(mode="json", exclude_unset=True)
    assert again == data, f"JobView does not describe the job JSON exactly:\nsent: {data}\nview: {again}"
    SEEN["jobs"] += 1
    return view


def check_job_responses(response: httpx.Response) -> None:
    """An httpx response hook: each job object answered under /v1/jobs (one, or a page of them)."""
    path = response.request.url.path
    if not path.startswith("/v1/jobs") or "/outputs/" in path or response.status_code not in (200, 202):
        return  # an output's bytes (a text output is JSON: {"text": ...}), or not a job
    if not response.headers.get("content-type", "").startswith("application/json"):
        return  # the event stream
    response.read()
    body = response.json()
    for job in body["data"] if path.rstrip("/") == "/v1/jobs" and "data" in body else [body]:
        assert_job_view(job)
