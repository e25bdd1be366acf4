"""Calling transformers' and diffusers' constructors from code that ``mypy --strict`` checks.

transformers' model, tokenizer, feature-extractor and generation-config classes have ``__init__`` methods
without annotations, so strict mypy refuses to call them from typed code (``no-untyped-call``), although
their instances are typed well enough to use; a few diffusers pipelines annotate their ``__init__`` more
narrowly than they are built (an optional component's None, a factory class for the tokenizer's type).
``constructor(cls)`` is ``cls`` itself, seen as a callable that takes what its ``__init__`` takes and
returns an instance of ``cls``: the arguments go unchecked (upstream does not type them, or types them
wrongly), the result keeps its precise type. Where upstream types them wrongly, the call site says how.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

T = TypeVar("T")


def constructor(cls: type[T]) -> Callable[..., T]:
    """``cls`` as a constructor strict mypy may call with any arguments: its ``__init__`` is untyped or
    mistyped upstream. The instance it builds is still a ``cls``."""
    # cast: only the parameters' types are unknown or wrong upstream; what the call builds is a T
    return cast("Callable[..., T]", cls)
