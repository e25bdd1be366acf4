"""Structured logs: one JSON object per line, carrying the job id, stage and task id of the work.

The ids live in context variables, set once where work starts (an API request, a Celery task)
and read by a logging filter, so every log line written during that work, by any module or
library, carries them without being passed around. ``grep job_...`` over the API's and every
worker's logs then shows one job's whole path.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from typing import Literal, TextIO

job_id_var: ContextVar[str | None] = ContextVar("omni_job_id", default=None)
stage_var: ContextVar[str | None] = ContextVar("omni_stage", default=None)
task_id_var: ContextVar[str | None] = ContextVar("omni_task_id", default=None)
request_id_var: ContextVar[str | None] = ContextVar("omni_request_id", default=None)

CONTEXT_VARS: dict[str, ContextVar[str | None]] = {
    "job_id": job_id_var,
    "stage": stage_var,
    "task_id": task_id_var,
    "request_id": request_id_var,
}
"""Field name in the log line -> the context variable that holds it."""

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is logged too.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime",
                                                                                     *CONTEXT_VARS}


def bind(**fields: str | None) -> Callable[[], None]:
    """Set context fields (job_id, stage, task_id, request_id); returns a function that restores them.

    For places that start and end work in two different callbacks (Celery's prerun/postrun).
    """
    tokens: list[tuple[ContextVar[str | None], Token[str | None]]] = []
    for name, value in fields.items():
        var = CONTEXT_VARS[name]
        tokens.append((var, var.set(value)))

    def reset() -> None:
        for var, token in reversed(tokens):
            try:
                var.reset(token)
            except ValueError:  # reset from another context: just clear it
                var.set(None)

    return reset


@contextmanager
def log_context(**fields: str | None) -> Iterator[None]:
    """``with log_context(job_id=..., stage=...):`` every log line inside carries those fields."""
    reset = bind(**fields)
    try:
        yield
    finally:
        reset()


def current_context() -> dict[str, str]:
    return {name: value for name, var in CONTEXT_VARS.items() if (value := var.get()) is not None}


class ContextFilter(logging.Filter):
    """Copies the context fields onto each record (None where unset), for any formatter to use."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in CONTEXT_VARS.items():
            if not hasattr(record, name) or getattr(record, name) is None:
                setattr(record, name, var.get())
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, the context ids, extras, exception."""

    def __init__(self, service: str = "") -> None:
        super().__init__()
        self.service = service
        self.host = socket.gethostname()

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_VARS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                entry[key] = _jsonable(value)
        if self.service:
            entry["service"] = self.service
        entry["host"] = self.host
        entry["pid"] = record.process
        if record.exc_info:
            entry["exc_type"] = record.exc_info[0].__name__ if record.exc_info[0] else None
            entry["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            entry["exc"] = record.exc_text
        return json.dumps(entry, ensure_ascii=False, default=str)


def _jsonable(value: object) -> object:
    """``extra=`` values as they are when JSON can hold them (dicts stay objects), else their repr."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [job=%(job_id)s stage=%(stage)s task=%(task_id)s] %(message)s"


def make_handler(fmt: Literal["json", "text"] = "json", *, service: str = "",
                 stream: TextIO | None = None) -> logging.Handler:
    """A stream handler that writes records with their context ids, as JSON or text."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.set_name("omni-jobs")
    return handler


def configure_logging(fmt: Literal["json", "text"] = "json", level: str | int = "INFO", *, service: str = "",
                      stream: TextIO | None = None) -> logging.Handler:
    """Send every log record (ours, Celery's, uvicorn's) to one handler on stderr in ``fmt``.

    Idempotent: a second call replaces the handler it installed before. Returns that handler.
    """
    handler = make_handler(fmt, service=service, stream=stream)
    root = logging.getLogger()
    for old in list(root.handlers):
        # Ours from an earlier call, and plain stream handlers (basicConfig's): never a test
        # framework's capture handler, which subclasses StreamHandler.
        if old.get_name() == "omni-jobs" or type(old) is logging.StreamHandler:
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())
    # uvicorn installs its own handlers before the app is imported: route them through ours.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lib = logging.getLogger(name)
        lib.handlers = []
        lib.propagate = True
    # The API's own access line (with the job id) replaces uvicorn's.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    return handler
