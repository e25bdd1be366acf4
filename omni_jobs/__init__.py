"""omni-jobs: multi-stage multimodal generation as durable jobs; ``omni_jobs.Omni`` runs a pipeline in-process."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports them on first use
    from omni_jobs.omni import AsyncOmni, Omni, OmniJobFailed, OmniOutput, OmniResult

__all__ = ["AsyncOmni", "Omni", "OmniJobFailed", "OmniOutput", "OmniResult"]
_LAZY = frozenset(__all__)


def __getattr__(name: str) -> object:
    """``omni_jobs.Omni`` without importing the runner (and its dependencies) for every submodule."""
    if name in _LAZY:
        from omni_jobs import omni
        return getattr(omni, name)
    raise AttributeError(f"module 'omni_jobs' has no attribute {name!r}")

