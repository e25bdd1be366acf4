"""omni-jobs: multi-stage multimodal generation as durable jobs; ``omni_jobs.Omni`` runs a pipeline in-process."""

from __future__ import annotations

from typing import Any

_LAZY = ("Omni", "AsyncOmni", "OmniResult", "OmniOutput", "OmniJobFailed")


def __getattr__(name: str) -> Any:
    """``omni_jobs.Omni`` without importing the runner (and its dependencies) for every submodule."""
    if name in _LAZY:
        from omni_jobs import omni

        return getattr(omni, name)
    raise AttributeError(f"module 'omni_jobs' has no attribute {name!r}")


__all__ = list(_LAZY)
