"""``python -m bench [--quick]``: see bench/run.py."""

import sys

from bench.run import main

sys.exit(main())
