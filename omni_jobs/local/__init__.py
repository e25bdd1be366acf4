"""Tooling for running omni-jobs on one machine: the embedded system (Redis + API + workers as
subprocesses), the dev services it starts, and the tiny-model builders (``tiny:NAME`` model ids).

Tooling imports the core; the core never imports this package (tests/unit/test_layout.py).
"""
