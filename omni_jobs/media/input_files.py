"""File inputs of a job (image, audio, video): how a request may carry one, and how it is kept.

A file may come as base64 (a ``data:`` URI, or ``{"data": "<base64>"}``), as raw bytes (a multipart
upload, or the in-process API), or as a reference to an artifact the system already stores: an
output of an earlier job (``{"job_id": ..., "output": ...}`` or that output's API URL
``.../v1/jobs/{id}/outputs/{name}``) or an artifact ref (``{"artifact": {...}}``). URLs are never
fetched from elsewhere: a reference is resolved in this system's own stores, or refused.

Whatever the form, the file is decoded and stored once, in one format per type, under
``jobs/{id}/inputs/``, so that every stage reads one format: an image as a metadata-free RGB PNG
(same pixels, same bytes), audio as a 16-bit PCM WAV at its own rate and channels, video as an H.264
MP4 (copied as it is when it is H.264 already, else re-encoded as it decodes). The job's input
records ``{"artifact": ref, "media_type", "size"}`` and what describes it: ``width``, ``height`` (image);
``duration_s``, ``sample_rate``, ``channels`` (audio); ``frames``, ``fps``, ``width``, ``height``,
``duration_s`` (video). Stages load it with ``load_input_file``.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from PIL import Image
from pydantic import ValidationError

from omni_jobs.artifacts import ArtifactError, ArtifactNotFound, ArtifactRef, ArtifactStore, codecs, mp4
from omni_jobs.core import keys
from omni_jobs.core.errors import FieldError, InvalidRequest, JobNotFound
from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.media import decode
from omni_jobs.media.payloads import AudioClip, VideoClip
from omni_jobs.pipelines.limits import Limits
from omni_jobs.pipelines.schema import FORMS
from omni_jobs.pipelines.spec import InputField, PipelineSpec

if TYPE_CHECKING:
    from omni_jobs.jobs.models import Job
    from omni_jobs.jobs.store import JobStore

MAX_IMAGE_PIXELS = 4096 * 4096
"""Larger images are refused before they are decoded in full (decompression bombs)."""

OUTPUT_URL = re.compile(r"/v1/jobs/(?P<job>job_[A-Za-z0-9]+)/outputs/(?P<output>[a-z][a-z0-9_-]{0,39})/?$")
_DATA_URI = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,(?P<data>.*)$",
                       re.DOTALL)
MEDIA_TYPES: dict[str, tuple[str, ...]] = {"image": ("image/",), "audio": ("audio/", "application/ogg"),
                                           "video": ("video/",)}
"""The media types a data: URI (or a referenced output) of each file type may have; audio may also come
from a video's sound track."""
_EXAMPLE_TYPE = {"image": "image/png", "audio": "audio/wav", "video": "video/mp4"}
_ARTICLE = {"image": "an image", "audio": "audio", "video": "a video"}


@dataclass(frozen=True)
class FileUpload:
    """File bytes that came with the request (decoded base64 or a multipart file)."""

    data: bytes


ImageUpload = FileUpload
"""The name from when images were the only file inputs."""


@dataclass(frozen=True)
class OutputReference:
    """An output of an earlier job."""

    job_id: str
    output: str


@dataclass(frozen=True)
class ArtifactReference:
    """An artifact already in the store, named by its ref."""

    ref: ArtifactRef


FileSource = FileUpload | OutputReference | ArtifactReference
ImageSource = FileSource


@dataclass(frozen=True)
class PreparedFile:
    """A resolved file input in its stored format, ready to be stored once the job has its id:
    its bytes, media type, file extension, and the fields that describe it in the job's input."""

    data: bytes
    media_type: str
    extension: str
    details: JsonObject = field(default_factory=dict)


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"is not valid base64; send {FORMS}") from None


def _from_string(text: str, kind: str) -> FileSource:
    if text.startswith("data:"):
        match = _DATA_URI.match(text)
        if match is None or not match.group("b64"):
            raise ValueError(f"is a data: URI without ';base64,'; send data:{_EXAMPLE_TYPE[kind]};base64,<data>")
        media_type = match.group("type")
        if media_type and not media_type.lower().startswith(MEDIA_TYPES[kind]):
            raise ValueError(f"is a data: URI of {media_type}, not {_ARTICLE[kind]} "
                             f"({' or '.join(t.rstrip('/') + ('/*' if t.endswith('/') else '') for t in MEDIA_TYPES[kind])})")
        return FileUpload(_b64(match.group("data")))
    if "://" in text or text.startswith("/"):
        url = OUTPUT_URL.search(text.split("?", 1)[0])
        if url is None:
            raise ValueError("is a URL that names no stored output; only .../v1/jobs/{id}/outputs/{name} URLs "
                             "of this system are accepted (nothing is fetched from elsewhere)")
        return OutputReference(url.group("job"), url.group("output"))
    return FileUpload(_b64(text))


def parse_file_value(value: object, field: InputField) -> FileSource:
    """The file a request names for ``field`` (JSON, or bytes), its form and size checked; ValueError with
    a message that completes 'input.<name> ...'. Whether the bytes decode is found when they are prepared."""
    kind = field.type
    source: FileSource
    if isinstance(value, bytes | bytearray | memoryview):
        source = FileUpload(bytes(value))
    elif isinstance(value, str):
        source = _from_string(value, kind)
    elif isinstance(value, dict):
        keys_ = set(value)
        if keys_ == {"data"} and isinstance(value["data"], str):
            source = FileUpload(_b64(value["data"]))
        elif keys_ == {"url"} and isinstance(value["url"], str):
            source = _from_string(value["url"], kind)
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
        raise ValueError(f"must be {_ARTICLE[kind]}: {FORMS}; got {type(value).__name__}")  # noqa: TRY004 (a 422 message)
    limit = field.byte_limit
    if isinstance(source, FileUpload):
        if not source.data:
            raise ValueError("is empty")
        if len(source.data) > limit:
            raise ValueError(f"is {len(source.data)} bytes; at most {limit}")
    return source


parse_image_value = parse_file_value
"""The name from when images were the only file inputs."""


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


def normalize_audio(data: bytes, limits: Limits | None = None) -> PreparedFile:
    """Any audio FFmpeg reads (omni_jobs.media.decode) as a 16-bit PCM WAV at its own rate and channels."""
    limits = limits or Limits()
    try:
        clip = decode.decode_audio(data, decode.MediaLimits(max_seconds=limits.max_audio_seconds,
                                                          seconds_setting="OMNI_MAX_AUDIO_SECONDS"))
        wav = codecs.encode_wav(clip.samples, clip.sample_rate)
    except codecs.CodecError as exc:  # MediaError is a ValueError already
        raise ValueError(f"cannot be stored as WAV: {exc}") from None
    return PreparedFile(wav, codecs.MEDIA_WAV, ".wav", {"duration_s": round(clip.duration_s, 6),
                                                         "sample_rate": clip.sample_rate,
                                                         "channels": int(clip.samples.shape[0])})


def normalize_video(data: bytes, limits: Limits | None = None) -> PreparedFile:
    """Any video FFmpeg reads (omni_jobs.media.decode) as an H.264 MP4 of its frames: an H.264 stream in yuv420p
    is copied as it is (every frame decoded once, to check it); anything else is re-encoded as it
    decodes, cropped to even sides (H.264 in yuv420p needs them)."""
    limits = limits or Limits()
    checks = decode.MediaLimits(max_seconds=limits.max_video_seconds, max_frames=limits.max_video_frames,
                               max_pixels=limits.max_video_pixels, seconds_setting="OMNI_MAX_VIDEO_SECONDS",
                               frames_setting="OMNI_MAX_VIDEO_FRAMES", pixels_setting="OMNI_MAX_VIDEO_PIXELS")
    try:
        with decode.VideoReader(data, checks) as reader:
            if _copyable(reader):
                for _ in reader.frames():
                    pass
                if not reader.resized:
                    return _video_file(mp4.remux_h264(data), reader.decoded, reader.fps, reader.width, reader.height)
        with decode.VideoReader(data, checks) as reader:
            width, height = reader.width - reader.width % 2, reader.height - reader.height % 2
            if width < 2 or height < 2:
                raise ValueError(f"is {reader.width}x{reader.height} pixels; a video is at least 2x2")
            with mp4.Mp4Writer(reader.fps, width=width, height=height) as writer:
                for frame in reader.frames():
                    writer.add(frame[:height, :width])
                return _video_file(writer.finish(), reader.decoded, reader.fps, width, height)
    except codecs.CodecError as exc:
        raise ValueError(f"cannot be stored as MP4: {exc}") from None


def _copyable(reader: decode.VideoReader) -> bool:
    """H.264 in yuv420p with even sides, in MP4 or MOV: its packets can be stored as they are."""
    return (reader.codec == "h264" and reader.pix_fmt == "yuv420p" and "mov" in reader.format_name.split(",")
            and not reader.width % 2 and not reader.height % 2)


def _video_file(data: bytes, frames: int, fps: float, width: int, height: int) -> PreparedFile:
    return PreparedFile(data, codecs.MEDIA_MP4, ".mp4", {"frames": frames, "fps": round(fps, 6), "width": width,
                                                         "height": height, "duration_s": round(frames / fps, 6)})


def _image_file(data: bytes, max_pixels: int | None) -> PreparedFile:
    png, width, height = normalize_image(data, max_pixels)
    return PreparedFile(png, codecs.MEDIA_PNG, ".png", {"width": width, "height": height})


class InputFiles:
    """Resolves a request's file inputs and stores them as the job's input artifacts. ``limits``: this
    server's (bytes per type, image pixels, audio and video lengths, video frames and frame size);
    without them (in process) the defaults bound what is decoded, and each field's max_bytes its size."""

    def __init__(self, artifacts: ArtifactStore, jobs: JobStore, *, limits: Limits | None = None) -> None:
        self.artifacts = artifacts
        self.jobs = jobs
        self.limits = limits or Limits()
        self.server_byte_caps = limits is not None

    def _owned_job(self, job_id: str, tenant: str | None) -> Job:
        """The referenced job, if ``tenant`` owns it: another tenant's job reads as missing."""
        job = self.jobs.get(job_id)
        if job is None or (tenant is not None and job.tenant != tenant):
            raise JobNotFound(job_id)
        return job

    def _fetch(self, source: FileSource, kind: str, tenant: str | None = None) -> bytes:
        if isinstance(source, FileUpload):
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
            wanted = MEDIA_TYPES[kind] + (("video/",) if kind == "audio" else ())  # a video's sound track
            if not out.media_type.startswith(wanted):
                raise ValueError(f"names output '{source.output}' of job '{source.job_id}', which is {out.type} "
                                 f"({out.media_type}), not {_ARTICLE[kind]}")
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

    def _byte_cap(self, kind: str) -> tuple[int, str]:
        """This server's largest file of ``kind`` (whatever the pipeline allows), and its setting."""
        return {"image": (self.limits.max_image_bytes, "OMNI_MAX_IMAGE_BYTES"),
                "audio": (self.limits.max_audio_bytes, "OMNI_MAX_AUDIO_BYTES"),
                "video": (self.limits.max_video_bytes, "OMNI_MAX_VIDEO_BYTES")}[kind]

    def normalize(self, kind: str, data: bytes) -> PreparedFile:
        """``data`` decoded and re-encoded in its type's stored format (PNG, WAV, MP4) within this server's
        limits; ValueError (MediaError) with a message that completes 'input.<name> ...'."""
        cap, setting = self._byte_cap(kind)
        if self.server_byte_caps and len(data) > cap:
            raise ValueError(f"is {len(data)} bytes; this server takes at most {cap} ({setting})")
        if kind == "image":
            return _image_file(data, self.limits.max_image_pixels)
        if kind == "audio":
            return normalize_audio(data, self.limits)
        return normalize_video(data, self.limits)

    def prepare(self, spec: PipelineSpec, input_: Mapping[str, object], *,
                tenant: str | None = None) -> dict[str, PreparedFile]:
        """Resolve and normalize every file input (no job yet); InvalidRequest names each bad field
        (type ``invalid_image``, ``invalid_audio`` or ``invalid_video``)."""
        prepared: dict[str, PreparedFile] = {}
        errors: list[FieldError] = []
        for name in spec.file_inputs():
            if name not in input_:
                continue
            kind = spec.inputs[name].type
            try:
                data = self._fetch(parse_file_value(input_[name], spec.inputs[name]), kind, tenant)
                prepared[name] = self.normalize(kind, data)
            except ValueError as exc:
                errors.append(FieldError(("input", name), str(exc), f"invalid_{kind}"))
        if errors:
            raise InvalidRequest(errors)
        return prepared

    def store(self, job_id: str, prepared: Mapping[str, PreparedFile]) -> dict[str, JsonObject]:
        """Store prepared files as the job's input artifacts; the records that replace them in its input."""
        records: dict[str, JsonObject] = {}
        for name, file in prepared.items():
            ref = self.artifacts.put_output(keys.input_artifact(job_id, f"{name}{file.extension}"), file.data,
                                            file.media_type)
            records[name] = {"artifact": ref.model_dump(mode="json"), "media_type": ref.media_type,
                             "size": ref.size, **file.details}
        return records


def _record_ref(record: JsonValue, kind: str) -> ArtifactRef:
    if not isinstance(record, dict) or "artifact" not in record:
        raise ValueError(f"a job's {kind} input must be a stored input record {{artifact, ...}}, "
                         f"got {type(record).__name__}")
    return ArtifactRef.model_validate(record["artifact"])


def load_input_file(artifacts: ArtifactStore, field_type: str, record: JsonValue) -> Image.Image | AudioClip | VideoClip:
    """The file a job input record (``{"artifact": ref, ...}``) points to, for a stage: a PIL image
    (``image``), an AudioClip (``audio``: float32 [channels, n] at the file's own rate; engines resample
    it with omni_jobs.media.decode.resample_audio) or a VideoClip (``video``: uint8 [n, h, w, 3])."""
    data = artifacts.get(_record_ref(record, field_type))
    if field_type == "image":
        return codecs.decode_png(data)
    if field_type == "audio":
        samples, rate = codecs.decode_wav(data)
        return AudioClip(samples, rate)
    if field_type == "video":
        frames, fps = mp4.decode_mp4(data)
        return VideoClip(frames, fps)
    raise ValueError(f"input type '{field_type}' is not a file (files: image, audio, video)")


def load_input_image(artifacts: ArtifactStore, record: JsonValue) -> Image.Image:
    """The image a job input record (``{"artifact": ref, ...}``) points to, for a stage."""
    return codecs.decode_png(artifacts.get(_record_ref(record, "image")))
