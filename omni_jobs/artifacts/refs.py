"""ArtifactRef: the small, JSON-serializable handle that travels instead of the bytes.

Celery messages and job documents carry refs, never blobs. A ref names its backend and key, and
records size and sha256 so a reader can prove it got the bytes the writer stored (a truncated
upload or a key reused by a retried stage is caught, not silently consumed).
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, Field

BackendName = Literal["redis", "s3", "local"]


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of ``data``: the checksum every ref records."""
    return hashlib.sha256(data).hexdigest()


class ArtifactRef(BaseModel, frozen=True, extra="forbid"):
    """Where an artifact lives and what its bytes must hash to."""

    backend: BackendName = Field(description="Backend holding the bytes: redis, s3 or local.")
    key: str = Field(min_length=1, description="Artifact key (e.g. jobs/{id}/stages/{stage}/{name}).")
    media_type: str = Field(min_length=1, description="Media type of the bytes, e.g. image/png.")
    size: int = Field(ge=0, description="Length of the bytes.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Hex sha256 of the bytes.")

    @classmethod
    def for_bytes(cls, backend: BackendName, key: str, data: bytes, media_type: str) -> ArtifactRef:
        """The ref that ``data`` stored under ``key`` in ``backend`` will have."""
        return cls(backend=backend, key=key, media_type=media_type, size=len(data), sha256=sha256_hex(data))
