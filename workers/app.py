"""The Celery application every omni-jobs worker and Flower runs.

Thin shell: configuration comes from omni_jobs.queueing, the work from omni_jobs.stages and
omni_jobs.results. Start a worker per queue, e.g.
``celery -A workers.app:app worker -Q dit -P threads -c 16 -n dit@%h``.
"""

from __future__ import annotations

import os
import sys

# oneDNN (torch's CPU matmuls) keeps a compiled primitive per matmul shape, 1,024 of them by default,
# and a CPU AR worker meets a new shape with almost every batch: it held 200-360 MB more after 2,000
# to 6,000 jobs (python -m bench.soak: 1.16-1.26 of its RSS after job 200). 128 keeps it flat (1.03)
# at the same speed (bench --ab). Set before torch loads; a value in the environment wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
# torch's OpenMP threads (libgomp) spin before they sleep at a barrier: 300,000 times (~3 ms) while the
# process's teams fit on the CPUs, which they now do (engines load on a passing thread, see
# omni_jobs.engines.pool). Alone, an engine needs ~20,000 (the same vLLM batches: 6.7 s at 20,000, 6.5 at
# 300,000, 7.1 s at 5,000, 7.5 s never spinning). More only burns CPU that an AR and a DiT worker on the
# same cores take from each other: multi-stage bench row 0.945 of the old loading at 20,000, 0.843 at
# 300,000 (README, "One OpenMP team"). Set before torch loads; a value in the environment wins.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from celery import Celery

from omni_jobs.queueing import celery_config
from omni_jobs.settings import get_settings
from workers import broker_fix

broker_fix.install()  # threads-pool workers must survive a broker restart (see workers/broker_fix.py)

# The engine thread gives up the GIL at every torch op and takes it back from whichever of the worker's
# other threads holds it, after up to the switch interval: 5 ms by default, many times per diffusers
# step. 1 ms (OMNI_WORKER_SWITCH_INTERVAL_MS): DiT 32px small faster than 5 ms in 13 of 13 paired reps
# (bench --ab; the size is within the bench's noise, see README); AR unchanged.
sys.setswitchinterval(get_settings().worker_switch_interval_ms / 1000)

app = Celery("omni_jobs")
app.conf.update(celery_config(get_settings()))
app.conf.update(include=["workers.tasks"])

# JSON logs with job/stage/task ids and the metrics port: connected before Celery sets up logging.
import workers.observability  # noqa: F401
