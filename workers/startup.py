"""A worker that cannot do its job refuses to start, saying what to install or fix.

Two checks (omni_jobs.dispatch.checks): before connecting to the broker, the engine libraries the worker's
queues need must be inside their supported ranges (OMNI_VERSION_CHECK); while preloading, the
models of its stages must load (OMNI_REFUSE_BROKEN_MODELS: 'builtin' by default, so a user's
pipeline with a bad model path fails its own jobs instead of taking a shared worker down).
The process exits with status 78 (EX_CONFIG) and the problems on stderr and in the log.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.checks import StartupRefused, engine_kinds, model_problem, refuses_for, version_problems
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.spec import PipelineSpec, StageSpec

log = logging.getLogger(__name__)

EXIT_REFUSED = 78  # EX_CONFIG: "configuration error"; compose's restart policy retries, a person must fix it

LoadFailure = tuple[PipelineSpec, StageSpec, BaseException]


def consumed_queues(worker: Any) -> list[str]:
    """Queue names a Celery WorkController will consume (its -Q, or the default queue)."""
    queues = worker.app.amqp.queues
    chosen = queues.consume_from or queues
    return sorted(str(name) for name in chosen)


def refuse(worker: str, problems: list[str]) -> None:
    """Log the problems and exit the worker process with EXIT_REFUSED."""
    refusal = StartupRefused(worker, problems)
    if logging.getLogger().handlers:  # configured (JSON): one line for the log pipeline too
        log.critical("%s", refusal)
    print(refusal, file=sys.stderr, flush=True)  # and plain text for the person reading the terminal
    raise SystemExit(EXIT_REFUSED)


def check_versions(worker: str, catalogue: PipelineCatalogue, queues: Iterable[str], settings: Settings) -> None:
    if not settings.version_check:
        return
    problems = version_problems(engine_kinds(catalogue, queues), settings.supported_versions)
    if problems:
        refuse(worker, problems)


def check_models(worker: str, failures: list[LoadFailure], settings: Settings) -> None:
    """Refuse for the load failures the policy counts; the others are logged (their jobs will fail)."""
    fatal: list[str] = []
    for spec, stage, exc in failures:
        problem = model_problem(spec, stage, exc)
        if refuses_for(spec, settings.refuse_broken_models):
            fatal.append(problem)
        else:
            log.error("%s (worker keeps running: OMNI_REFUSE_BROKEN_MODELS=%s)", problem,
                      settings.refuse_broken_models)
    if fatal:
        refuse(worker, fatal)
