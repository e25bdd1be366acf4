"""Artifacts: refs that travel in messages, the store that routes bytes, and the codecs.

Only the refs load with the package: the store, backends and codecs (boto3, redis, numpy, PIL)
load when one of their names is first used, so a module that needs no more than ``ArtifactRef``
(the job models, and through them the light HTTP client) does not pull the storage layer in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from omni_jobs.artifacts.refs import ArtifactRef, BackendName, sha256_hex

if TYPE_CHECKING:
    from omni_jobs.artifacts.backends import (
        ArtifactBackend,
        ArtifactCorrupted,
        ArtifactError,
        ArtifactNotFound,
        ArtifactStoreUnavailable,
        InvalidArtifactKey,
        LocalBackend,
        RedisBackend,
        S3Backend,
        s3_client_from_settings,
    )
    from omni_jobs.artifacts.codecs import (
        MEDIA_JSON,
        MEDIA_OCTET,
        MEDIA_PNG,
        MEDIA_SAFETENSORS,
        MEDIA_TEXT,
        MEDIA_WAV,
        CodecError,
        decode_json,
        decode_png,
        decode_tensors,
        decode_wav,
        encode_json,
        encode_png,
        encode_tensors,
        encode_wav,
        extension_for,
        png_info,
        wav_info,
    )
    from omni_jobs.artifacts.store import ArtifactStore, artifact_store_from_settings

_HOME = {
    **dict.fromkeys(("ArtifactBackend", "ArtifactCorrupted", "ArtifactError", "ArtifactNotFound",
                     "ArtifactStoreUnavailable", "InvalidArtifactKey", "LocalBackend", "RedisBackend", "S3Backend",
                     "s3_client_from_settings"), ".backends"),
    **dict.fromkeys(("MEDIA_JSON", "MEDIA_OCTET", "MEDIA_PNG", "MEDIA_SAFETENSORS", "MEDIA_TEXT", "MEDIA_WAV",
                     "CodecError", "decode_json", "decode_png", "decode_tensors", "decode_wav", "encode_json",
                     "encode_png", "encode_tensors", "encode_wav", "extension_for", "png_info", "wav_info"), ".codecs"),
    **dict.fromkeys(("ArtifactStore", "artifact_store_from_settings"), ".store"),
}
"""Each lazily loaded name -> the submodule that defines it."""


def __getattr__(name: str) -> object:
    """Load a name of the storage layer on first use (PEP 562)."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name], __name__), name)


__all__ = [
    "MEDIA_JSON",
    "MEDIA_OCTET",
    "MEDIA_PNG",
    "MEDIA_SAFETENSORS",
    "MEDIA_TEXT",
    "MEDIA_WAV",
    "ArtifactBackend",
    "ArtifactCorrupted",
    "ArtifactError",
    "ArtifactNotFound",
    "ArtifactRef",
    "ArtifactStore",
    "ArtifactStoreUnavailable",
    "BackendName",
    "CodecError",
    "InvalidArtifactKey",
    "LocalBackend",
    "RedisBackend",
    "S3Backend",
    "artifact_store_from_settings",
    "decode_json",
    "decode_png",
    "decode_tensors",
    "decode_wav",
    "encode_json",
    "encode_png",
    "encode_tensors",
    "encode_wav",
    "extension_for",
    "png_info",
    "s3_client_from_settings",
    "sha256_hex",
    "wav_info",
]
