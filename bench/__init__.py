"""Benchmarks that print ratios side by side (not timed tests): ``python -m bench``."""
