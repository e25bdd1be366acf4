"""A per-stage progress bar for a job's events, drawn on a terminal or written as plain lines.

On a TTY the current stage's bar is redrawn in place and kept when the stage ends; elsewhere (CI
logs, pipes, tests) each stage prints when it starts, at every quarter of its progress and when it
ends, so a log shows the same story without control characters. Needs nothing but the events.
"""

from __future__ import annotations

import sys
from typing import TextIO

from omni_jobs.client import JobEventView, JobView
from omni_jobs.core.json_types import JsonValue


def _count(value: JsonValue) -> int:
    """A number an event's data carries (an attempt, a step), as int() reads it."""
    if isinstance(value, (int, float, str)):
        return int(value)
    raise TypeError(f"an event's count is a number, got {type(value).__name__}")


def bar(step: int, total: int, width: int = 24) -> str:
    filled = 0 if total <= 0 else min(width, round(width * step / total))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


class ProgressDisplay:
    """Feed it a job's events (``show``); it writes to ``stream`` (stderr by default)."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None, width: int = 24) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.width = width
        self._stage: str | None = None
        self._line = ""
        self._quarter: dict[str, int] = {}
        self._name_width = 4

    def queued(self, job: JobView) -> None:
        where = f" (position {job.queue_position} on queue '{self._queue_of(job)}')" if job.queue_position else ""
        self._print(f"{job.id} {job.status.value}{where}")
        self._name_width = max([self._name_width, *(len(s.id) for s in job.stages)])

    @staticmethod
    def _queue_of(job: JobView) -> str:
        waiting = [s for s in job.stages if s.status == "queued"]
        return waiting[0].queue if waiting else "?"

    def show(self, event: JobEventView) -> None:
        data = event.data
        stage = str(data.get("stage", ""))
        if event.type == "stage.started":
            attempt = _count(data.get("attempt", 1))
            self._draw(stage, f"{bar(0, 1, self.width)} started on {data.get('worker', '?')}"
                              + (f" (attempt {attempt})" if attempt > 1 else ""), final=not self.tty)
        elif event.type == "stage.progress":
            step, total, unit = _count(data.get("step", 0)), _count(data.get("total", 0)), str(data.get("unit", "steps"))
            text = f"{bar(step, total, self.width)} {step}/{total} {unit}"
            if self.tty:
                self._draw(stage, text, final=False)
            else:  # a line at each quarter, so logs show movement without one line per step
                quarter = 4 * step // total if total > 0 else 0
                if quarter > self._quarter.get(stage, 0):
                    self._quarter[stage] = quarter
                    self._draw(stage, text, final=True)
        elif event.type == "stage.succeeded":
            duration = data.get("duration_s")
            took = f" in {duration:.2f}s" if isinstance(duration, (int, float)) else ""
            self._draw(stage, f"{bar(1, 1, self.width)} done{took}", final=True)
        elif event.type in ("job.succeeded", "job.failed", "job.canceled"):
            self._end_line()
            detail = ""
            if event.type == "job.failed":
                error = data.get("error") or {}
                if not isinstance(error, dict):
                    raise TypeError(f"a job.failed event's error is an object, got {type(error).__name__}")
                detail = f": {error.get('stage') or ''} {error.get('type', '')}: {error.get('message', '')}"
            elif event.type == "job.canceled":
                detail = f": {data.get('reason', '')}"
            self._print(f"{event.job_id} {event.type.removeprefix('job.')}{detail}")
        elif event.type == "job.running":
            self._print(f"{event.job_id} running")

    # --- drawing ---
    def _label(self, stage: str) -> str:
        return f"  {stage:<{self._name_width}} "

    def _draw(self, stage: str, text: str, *, final: bool) -> None:
        line = self._label(stage) + text
        if not self.tty:
            self._print(line)
            return
        if self._stage not in (None, stage):
            self._end_line()
        self._stage = stage
        self.stream.write("\r" + line + "\x1b[K")
        self._line = line
        if final:
            self._end_line()
        self.stream.flush()

    def _end_line(self) -> None:
        if self.tty and self._stage is not None:
            self.stream.write("\n")
            self.stream.flush()
        self._stage = None
        self._line = ""

    def _print(self, text: str) -> None:
        self._end_line()
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        self._end_line()
