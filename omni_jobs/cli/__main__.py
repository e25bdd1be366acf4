"""``python -m omni_jobs.cli ...``: the same as the ``omni-jobs`` command."""

import sys

from omni_jobs.cli import main

sys.exit(main())
