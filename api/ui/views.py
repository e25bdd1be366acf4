"""What the job pages show, computed from the public job object (``Runtime.present``), not the store.

Templates read only the presented dict (the GET /v1/jobs/{id} shape), so they keep working as the
job state layer changes underneath.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from pydantic import ValidationError

from omni_jobs.artifacts import ArtifactRef
from omni_jobs.pipelines.spec import PipelineSpec

FINAL = frozenset({"succeeded", "failed", "canceled"})

JOB_SECTIONS = ("job-status", "job-timeline", "job-outputs", "job-error", "job-webhook")
"""The parts of a job page that live updates re-render (each a template under job/)."""


def output_kind(out: dict[str, Any]) -> str:
    """How to show an output inline: image, audio, video, text, or file (a download link only)."""
    media = str(out.get("media_type") or "")
    kind = str(out.get("type") or "")
    if media.startswith("image/"):
        return "image"
    if media.startswith("audio/"):
        return "audio"
    if media.startswith("video/") or kind == "video":
        return "video"
    if out.get("text") is not None:
        return "text"
    return "file"


def streamed_audio(spec: PipelineSpec | None) -> dict[str, str] | None:
    """The stage and port whose audio the job page can play while it streams (a stage that reads its input while
    it is written publishes its audio as it is made: omni_jobs.run.speech_stage), else None."""
    if spec is None:
        return None
    for stage in spec.stages:
        if stage.stream_input is None:
            continue
        for out in spec.outputs:
            if out.source.source == stage.id and stage.outputs.get(out.source.port) == "audio":
                return {"stage": stage.id, "output": out.source.port}
    return None


def output_src(job_id: str, name: str, *, download: bool = False) -> str:
    """The console's own route for an output's bytes (the session cookie authorizes it, not a bearer key)."""
    url = f"/ui/jobs/{quote(job_id)}/outputs/{quote(name)}"
    return url + "?download=1" if download else url


def input_artifact(job_id: str, record: object) -> ArtifactRef | None:
    """The stored file of a file input's record (``{"artifact": ref, ...}``), if it is one of this job's
    inputs (jobs/{id}/inputs/...); None for any other value."""
    if not isinstance(record, dict) or not isinstance(record.get("artifact"), dict):
        return None
    try:
        ref = ArtifactRef.model_validate(record["artifact"])
    except ValidationError:
        return None
    return ref if ref.key.startswith(f"jobs/{job_id}/inputs/") else None


def input_kind(job_id: str, record: object) -> str | None:
    """How to show a job input inline: image, audio or video (a stored file input), else None."""
    ref = input_artifact(job_id, record)
    kind = ref.media_type.split("/", 1)[0] if ref is not None else None
    return kind if kind in ("image", "audio", "video") else None


def input_src(job_id: str, name: str, *, download: bool = False) -> str:
    """The console's own route for a file input's stored bytes."""
    url = f"/ui/jobs/{quote(job_id)}/inputs/{quote(name)}"
    return url + "?download=1" if download else url


@dataclass
class Bar:
    stage: str
    status: str
    wait_x: float
    wait_w: float
    run_x: float
    run_w: float
    y: float
    running: bool


TIMELINE_W = 1000.0
TIMELINE_ROW = 22.0


def timeline(job: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """A Gantt chart of the stages: waiting (queued -> started) and running (started -> finished)."""
    now = now if now is not None else time.time()
    t0 = float(job.get("created_at") or now)
    ends = [t0]
    for stage in job.get("stages", []):
        for key in ("queued_at", "started_at", "finished_at"):
            if stage.get(key) is not None:
                ends.append(float(stage[key]))
        if stage.get("status") in ("queued", "running") and job.get("status") not in FINAL:
            ends.append(now)
    if job.get("completed_at") is not None:
        ends.append(float(job["completed_at"]))
    span = max(max(ends) - t0, 1e-3)

    def x(t: float | None) -> float:
        return 0.0 if t is None else round((float(t) - t0) / span * TIMELINE_W, 1)

    bars = []
    for index, stage in enumerate(job.get("stages", [])):
        queued, started, finished = stage.get("queued_at"), stage.get("started_at"), stage.get("finished_at")
        running = stage.get("status") == "running"
        wait_end = started if started is not None else (now if queued is not None and stage.get("status") == "queued"
                                                         and job.get("status") not in FINAL else queued)
        run_end = finished if finished is not None else (now if running and job.get("status") not in FINAL
                                                         else started)
        wait_x = x(queued)
        run_x = x(started)
        bars.append(Bar(
            stage=str(stage.get("id")), status=str(stage.get("status")),
            wait_x=wait_x, wait_w=max(0.0, x(wait_end) - wait_x) if queued is not None else 0.0,
            run_x=run_x, run_w=max(2.0, x(run_end) - run_x) if started is not None else 0.0,
            y=index * TIMELINE_ROW, running=running))
    return {"bars": bars, "span_s": span, "width": TIMELINE_W,
            "height": max(1, len(bars)) * TIMELINE_ROW}


def progress(job: dict[str, Any]) -> dict[str, Any] | None:
    """The running stage's progress: stage, step, total, unit, percent."""
    p = job.get("progress")
    if not p or job.get("status") in FINAL:
        return None
    total = max(int(p.get("total") or 0), 0)
    step = min(max(int(p.get("step") or 0), 0), total) if total else int(p.get("step") or 0)
    return {**p, "step": step, "total": total, "percent": round(step * 100 / total) if total else None}


def job_context(job: dict[str, Any]) -> dict[str, Any]:
    """What the job templates need besides the job itself."""
    return {
        "job": job,
        "final": job.get("status") in FINAL,
        "progress": progress(job),
        "timeline": timeline(job),
        "output_kind": output_kind,
        "output_src": output_src,
        "input_kind": input_kind,
        "input_src": input_src,
    }
