"""The ``omni-jobs`` command (tooling: imports the core, never imported by it).

app: the parser and the local commands (up, demo, models, pipelines, doctor); jobs: submit,
status, list, cancel, download, webhook-secret over ``omni_jobs.client``; keys: API keys and
tenant limits; run: one job in this process; progress: the terminal progress bars.
"""

from omni_jobs.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
