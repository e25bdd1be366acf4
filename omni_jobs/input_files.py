"""File inputs of a job (images): how a request may carry one, and how it is kept.

An image may come as base64 (a ``data:`` URI, or ``{"data": "<base64>"}``), as raw bytes (a
multipart upload, or the in-process API), or as a reference to an artifact the system already
stores: an output of an earlier job (``{"job_id": ..., "output": ...}`` or that output's API URL
``.../v1/jobs/{id}/outputs/{name}``) or an artifact ref (``{"artifact": {...}}``). URLs are never
fetched from elsewhere: a reference is resolved in this system's own stores, or refused.

Whatever the form, the image is decoded, converted to RGB and re-encoded as a metadata-free PNG
(same pixels, same bytes), stored once under ``jobs/{id}/inputs/`` and recorded in the job's input
as ``{"artifact": ref, "media_type", "size", "width", "height"}``; stages load it from there.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image
from pydantic import ValidationError

from omni_jobs import keys
from omni_jobs.artifacts import ArtifactError, ArtifactNotFound, ArtifactRef, ArtifactStore, codecs
from omni_jobs.errors import FieldError, InvalidRequest, JobNotFound
from omni_jobs.json_types import JsonObject, JsonValue
from omni_jobs.pipelines.spec import DEFAULT_MAX_IMAGE_BYTES, InputField, PipelineSpec

if TYPE_CHECKING:
    from omni_jobs.jobs.models import Job
    from omni_jobs.jobs.store import JobStore

MAX_IMAGE_PIXELS = 4096 * 4096
"""Larger images are refused before they are decoded in full (decompression bombs)."""

OUTPUT_URL = re.compile(r"/v1/jobs/(?P<job>job_[A-Za-z0-9]+)/outputs/(?P<output>[a-z][a-z0-9_-]{0,39})/?$")
_DATA_URI = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,(?P<data>.*)$",
                       re.DOTALL)
FORMS = ("a data: URI, base64 data, a URL of a stored output (.../v1/jobs/{id}/outputs/{name}), or an object "
         "{data} | {url} | {job_id, output} | {artifact}")


@dataclass(frozen=True)
class ImageUpload:
    """Image bytes that came with the request (decoded base64 or a multipart file)."""

    data: bytes


@dataclass(frozen=True)
class OutputReference:
    """An output of an earlier job."""

    job_id: str
    output: str


@dataclass(frozen=True)
class ArtifactReference:
    """An artifact already in the store, named by its ref."""

    ref: ArtifactRef


ImageSource = ImageUpload | OutputReference | ArtifactReference


@dataclass(frozen=True)
class PreparedImage:
    """A resolved, normalized image input, ready to be stored once the job has its id."""

    png: bytes
    width: int
    height: int


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"is not valid base64; send {FORMS}") from None


def _from_string(text: str) -> ImageSource:
    if text.startswith("data:"):
        match = _DATA_URI.match(text)
        if match is None or not match.group("b64"):
            raise ValueError("is a data: URI without ';base64,'; send data:image/png;base64,<data>")
        if match.group("type") and not match.group("type").startswith("image/"):
            raise ValueError(f"is a data: URI of {match.group('type')}, not an image")
        return ImageUpload(_b64(match.group("data")))
    if "://" in text or text.startswith("/"):
        url = OUTPUT_URL.search(text.split("?", 1)[0])
        if url is None:
            raise ValueError("is a URL that names no stored output; only .../v1/jobs/{id}/outputs/{name} URLs "
                             "of this system are accepted (nothing is fetched from elsewhere)")
        return OutputReference(url.group("job"), url.group("output"))
    return ImageUpload(_b64(text))


def parse_image_value(value: object, field: InputField) -> ImageSource:
    """The image source a request names (JSON, or bytes); ValueError with a message that completes
    'input.<name> ...'."""
    source: ImageSource
    if isinstance(value, bytes | bytearray | memoryview):
        source = ImageUpload(bytes(value))
    elif isinstance(value, str):
        source = _from_string(value)
    elif isinstance(value, dict):
        keys_ = set(value)
        if keys_ == {"data"} and isinstance(value["data"], str):
            source = ImageUpload(_b64(value["data"]))
        elif keys_ == {"url"} and isinstance(value["url"], str):
            source = _from_string(value["url"])
        elif keys_ == {"job_id", "output"} and all(isinstance(value[k], str) for k in keys_):
            source = OutputReference(value["job_id"], value["output"])
        elif keys_ == {"artifact"}:
            try:
                source = ArtifactReference(ArtifactRef.model_validate(value["artifact"]))
            except ValidationError as exc:
                raise ValueError(f"has an invalid artifact ref: {exc.errors()[0]['msg']}") from None
        else:
            raise ValueError(f"is an object with keys {sorted(keys_)}; send {FORMS}")
    else:
        raise ValueError(f"must be an image: {FORMS}; got {type(value).__name__}")  # noqa: TRY004 (a 422 message)
    limit = field.max_bytes or DEFAULT_MAX_IMAGE_BYTES
    if isinstance(source, ImageUpload):
        if not source.data:
            raise ValueError("is empty")
        if len(source.data) > limit:
            raise ValueError(f"is {len(source.data)} bytes; at most {limit}")
    return source


def normalize_image(data: bytes, max_pixels: int | None = None) -> tuple[bytes, int, int]:
    """(PNG bytes, width, height) of any image PIL reads, as RGB with no metadata."""
    max_pixels = max_pixels or MAX_IMAGE_PIXELS
    try:
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
            if width * height > max_pixels:
                raise ValueError(f"is {width}x{height} pixels; at most {max_pixels} pixels (OMNI_MAX_IMAGE_PIXELS)")
            probe.load()
            rgb = probe.convert("RGB")
    except ValueError:
        raise
    except (OSError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:  # what PIL raises on bad data
        raise ValueError(f"is not an image PIL can read ({len(data)} bytes): {exc}") from None
    return codecs.encode_png(rgb), width, height


class InputFiles:
    """Resolves a request's file inputs and stores them as the job's input artifacts."""

    def __init__(self, artifacts: ArtifactStore, jobs: JobStore, *, max_bytes: int | None = None,
                 max_pixels: int | None = None) -> None:
        self.artifacts = artifacts
        self.jobs = jobs
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels

    def _owned_job(self, job_id: str, tenant: str | None) -> Job:
        """The referenced job, if ``tenant`` owns it: another tenant's job reads as missing."""
        job = self.jobs.get(job_id)
        if job is None or (tenant is not None and job.tenant != tenant):
            raise JobNotFound(job_id)
        return job

    def _fetch(self, source: ImageSource, tenant: str | None = None) -> bytes:
        if isinstance(source, ImageUpload):
            return source.data
        if isinstance(source, OutputReference):
            try:
                job = self._owned_job(source.job_id, tenant)
            except JobNotFound:
                raise ValueError(f"names job '{source.job_id}', which does not exist (or expired)") from None
            out = job.output(source.output)
            if out is None:
                names = [o.name for o in job.outputs]
                raise ValueError(f"names output '{source.output}' of job '{source.job_id}', which has outputs {names}")
            ref = out.artifact
        else:
            ref = source.ref
        if not ref.key.startswith("jobs/"):
            raise ValueError(f"names artifact {ref.key!r}, which is not a job's artifact")
        owner = ref.key.split("/", 2)[1]
        try:
            self._owned_job(owner, tenant)
        except JobNotFound:
            raise ValueError(f"names artifact {ref.key!r} of job '{owner}', which does not exist (or expired)") from None
        try:
            return self.artifacts.get(ref)
        except ArtifactNotFound:
            raise ValueError(f"names artifact {ref.key!r}, which is no longer stored") from None
        except ArtifactError as exc:
            raise ValueError(f"names an artifact that cannot be read: {exc}") from None

    def prepare(self, spec: PipelineSpec, input_: Mapping[str, object], *,
                tenant: str | None = None) -> dict[str, PreparedImage]:
        """Resolve and normalize every image input (no job yet); InvalidRequest names each bad field."""
        prepared: dict[str, PreparedImage] = {}
        errors: list[FieldError] = []
        for name in spec.file_inputs():
            if name not in input_:
                continue
            try:
                data = self._fetch(parse_image_value(input_[name], spec.inputs[name]), tenant)
                if self.max_bytes is not None and len(data) > self.max_bytes:
                    raise ValueError(f"is {len(data)} bytes; this server takes at most {self.max_bytes} "
                                     "(OMNI_MAX_IMAGE_BYTES)")
                png, width, height = normalize_image(data, self.max_pixels)
            except ValueError as exc:
                errors.append(FieldError(("input", name), str(exc), "invalid_image"))
                continue
            prepared[name] = PreparedImage(png, width, height)
        if errors:
            raise InvalidRequest(errors)
        return prepared

    def store(self, job_id: str, prepared: dict[str, PreparedImage]) -> dict[str, JsonObject]:
        """Store prepared images as the job's input artifacts; the records that replace them in its input."""
        records: dict[str, JsonObject] = {}
        for name, image in prepared.items():
            ref = self.artifacts.put_output(keys.input_artifact(job_id, f"{name}.png"), image.png, codecs.MEDIA_PNG)
            records[name] = {"artifact": ref.model_dump(mode="json"), "media_type": ref.media_type,
                             "size": ref.size, "width": image.width, "height": image.height}
        return records


def load_input_image(artifacts: ArtifactStore, record: JsonValue) -> Image.Image:
    """The image a job input record (``{"artifact": ref, ...}``) points to, for a stage."""
    if not isinstance(record, dict) or "artifact" not in record:
        raise ValueError(f"a job's image input must be a stored input record {{artifact, ...}}, got {type(record).__name__}")
    ref = ArtifactRef.model_validate(record["artifact"])
    return codecs.decode_png(artifacts.get(ref))
