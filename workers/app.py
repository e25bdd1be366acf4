"""The Celery application every omni-jobs worker and Flower runs.

Thin shell: configuration comes from omni_jobs.dispatch.queueing, the work from omni_jobs.run.stages and
omni_jobs.report.results. Start a worker per queue, e.g.
``celery -A workers.app:app worker -Q dit -P threads -c 16 -n dit@%h``.
"""

from __future__ import annotations

import sys

from omni_jobs.engines.allocator import tune_engine_malloc
from omni_jobs.engines.library_env import apply_engine_library_defaults

apply_engine_library_defaults()  # before torch loads: oneDNN's cache and OpenMP's spin, bounded

from celery import Celery

from omni_jobs.core.settings import get_settings
from omni_jobs.dispatch.queueing import celery_config
from workers import celery_patches, quiet_cluster

# The only changes to Celery's and kombu's own code (each with its upstream issue: workers/celery_patches.py):
# threads-pool workers survive a broker restart, a kombu channel keeps one Redis client, and a task's thread
# starts before the consumer goes on.
celery_patches.install(get_settings().worker_handoff_ms)

# The engine thread gives up the GIL at every torch op and takes it back from whichever of the worker's
# other threads holds it, after up to the switch interval (OMNI_WORKER_SWITCH_INTERVAL_MS). 1 ms was
# faster than Python's 5 for DiT 32px small on an earlier machine and code; on the 2026-12-05 machine
# and code 5 ms used 3-5% less worker CPU in three paired runs, one of them mirrored, with AR unchanged
# (docs/decisions/switch-interval.md): the default is Python's own again.
sys.setswitchinterval(get_settings().worker_switch_interval_ms / 1000)

# tcmalloc when the launcher preloaded it, else glibc's malloc with thresholds that keep a DiT's freed
# activations for its next step (omni_jobs.engines.allocator); the worker logs which when ready.
ENGINE_MALLOC = tune_engine_malloc(get_settings().engine_malloc)

app = Celery("omni_jobs")
app.conf.update(celery_config(get_settings()))
app.conf.update(include=["workers.tasks"], worker_consumer=quiet_cluster.CONSUMER)  # no gossip, no mingle

# JSON logs with job/stage/task ids and the metrics port: connected before Celery sets up logging.
import workers.observability  # noqa: F401
