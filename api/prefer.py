"""The ``Prefer`` request header (RFC 7240), as far as the API honours it: ``wait=N``."""

from __future__ import annotations

import re

_WAIT = re.compile(r"^\s*wait\s*=\s*\"?(\d+(?:\.\d+)?)\"?\s*$", re.IGNORECASE)


def prefer_wait(values: list[str]) -> float | None:
    """Seconds asked for by ``Prefer: wait=N`` (in any of the headers or comma-separated items), else None.

    Per RFC 7240 a preference the server cannot read is ignored, not an error.
    """
    for header in values:
        for item in header.split(","):
            match = _WAIT.match(item.split(";", 1)[0])
            if match:
                return float(match.group(1))
    return None
