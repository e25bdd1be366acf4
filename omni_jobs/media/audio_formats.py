"""A stored WAV in the audio format a client asks for (PyAV, FFmpeg's encoders): OpenAI's speech formats.

Stages store speech as 16-bit PCM WAV (omni_jobs.artifacts.codecs.encode_wav). A download
(``GET /v1/jobs/{id}/outputs/{name}?format=``) and the OpenAI routes (``/v1/audio/speech``'s
``response_format``, a chat's ``audio.format``) hand it out in any of OpenAI's formats:

========  ==========================  ===============  ====================================================
format    file                        media type       rate
========  ==========================  ===============  ====================================================
``wav``   the stored WAV, unchanged   audio/wav        the stage's
``mp3``   MPEG-1/2 layer III (LAME)   audio/mpeg       the stage's (MP3 takes 8 to 48 kHz)
``opus``  Opus in Ogg                 audio/ogg        the stage's when Opus takes it (8/12/16/24/48 kHz), else 48 kHz
``aac``   AAC-LC in ADTS (as OpenAI)  audio/aac        the stage's
``flac``  FLAC                        audio/flac       the stage's
``pcm``   raw 16-bit LE mono          audio/pcm        24 kHz, as OpenAI's ``pcm`` (no header to say another)
========  ==========================  ===============  ====================================================

Channels are kept, except ``pcm`` (mono, as OpenAI's). Errors are ValueError naming the allowed formats.
PyAV is imported only inside the functions, as in omni_jobs.media.decode.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Literal, get_args

import numpy as np

from omni_jobs.artifacts.codecs import decode_wav

if TYPE_CHECKING:
    import av.audio.frame

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
AUDIO_FORMATS: tuple[AudioFormat, ...] = get_args(AudioFormat)
"""OpenAI's speech formats (``/v1/audio/speech``'s ``response_format``), mp3 first as OpenAI's default."""
PCM_RATE = 24_000
"""OpenAI's ``pcm``: 24 kHz 16-bit signed little-endian mono, without a header."""
WAV_MEDIA_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"})


@dataclass(frozen=True)
class Encoding:
    """How FFmpeg writes one format: its encoder and muxer, the media type, and the rates it takes (None: any)."""

    codec: str
    container: str
    media_type: str
    extension: str
    rates: tuple[int, ...] | None = None
    fallback_rate: int = 48_000


ENCODINGS: dict[AudioFormat, Encoding] = {
    "mp3": Encoding("libmp3lame", "mp3", "audio/mpeg", ".mp3",
                    (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000), 48_000),
    "opus": Encoding("libopus", "ogg", "audio/ogg", ".opus", (8000, 12000, 16000, 24000, 48000), 48_000),
    "aac": Encoding("aac", "adts", "audio/aac", ".aac"),
    "flac": Encoding("flac", "flac", "audio/flac", ".flac"),
    "wav": Encoding("pcm_s16le", "wav", "audio/wav", ".wav"),
    "pcm": Encoding("pcm_s16le", "s16le", "audio/pcm", ".pcm"),
}


def check_format(value: str, *, field: str = "format", allowed: tuple[str, ...] = AUDIO_FORMATS) -> AudioFormat:
    """``value`` as a format, or a ValueError naming ``field`` and the formats it may be."""
    if value not in allowed or value not in ENCODINGS:
        raise ValueError(f"{field} must be one of {', '.join(allowed)}; got {value!r}")
    return value  # narrowed by "in ENCODINGS"


def media_type(fmt: AudioFormat) -> str:
    return ENCODINGS[fmt].media_type


def is_wav(media_type_: str) -> bool:
    """Whether an output's media type says WAV (what convert reads)."""
    return media_type_.split(";")[0].strip().lower() in WAV_MEDIA_TYPES


def convert(wav: bytes, fmt: AudioFormat) -> bytes:
    """The WAV's audio in ``fmt`` (``wav``: the same bytes). A WAV codecs cannot read is a ValueError."""
    if fmt == "wav":
        return wav
    samples, rate = decode_wav(wav)  # CodecError is a ValueError
    if fmt == "pcm":
        return pcm16(samples, rate)
    return encode(samples, rate, fmt)


def pcm16(samples: np.ndarray, rate: int, *, to_rate: int = PCM_RATE) -> bytes:
    """Float samples ``[channels, n]`` at ``rate`` as 16-bit LE mono PCM at ``to_rate`` (OpenAI's pcm16)."""
    import av

    resampler = av.AudioResampler(format="s16", layout="mono", rate=to_rate)
    frames = [*resampler.resample(_frame(samples, rate)), *resampler.resample(None)]
    return b"".join(frame.to_ndarray().astype("<i2").tobytes() for frame in frames)


def encode(samples: np.ndarray, rate: int, fmt: AudioFormat) -> bytes:
    """Float samples ``[channels, n]`` at ``rate`` encoded as ``fmt`` (a compressed format or wav)."""
    import av

    encoding = ENCODINGS[fmt]
    out_rate = rate if encoding.rates is None or rate in encoding.rates else encoding.fallback_rate
    layout = "mono" if samples.shape[0] == 1 else "stereo"
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=encoding.container) as container:
        stream = container.add_stream(encoding.codec, rate=out_rate)
        assert isinstance(stream, av.audio.stream.AudioStream)
        stream.layout = layout
        context = stream.codec_context
        context.open()  # frame_size and the encoder's sample format are known once it is open
        assert context.format is not None
        resampler = av.AudioResampler(format=context.format.name, layout=layout, rate=out_rate)
        fifo = av.AudioFifo()
        for frame in (*resampler.resample(_frame(samples[:2], rate)), *resampler.resample(None)):
            fifo.write(frame)
        size = context.frame_size or 1024  # 0: the encoder takes any frame size (FLAC, PCM)
        written = 0
        while fifo.samples:
            chunk = fifo.read(min(size, fifo.samples))
            if chunk is None:
                break
            chunk.pts, chunk.time_base = written, Fraction(1, out_rate)
            written += chunk.samples
            container.mux(stream.encode(chunk))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def _frame(samples: np.ndarray, rate: int) -> av.audio.frame.AudioFrame:
    """Float samples ``[channels, n]`` (1 or 2 channels; more are cut to the first two) as a planar frame."""
    import av

    planes = np.ascontiguousarray(np.asarray(samples, dtype=np.float32).reshape(samples.shape[0], -1)[:2])
    frame = av.AudioFrame.from_ndarray(planes, format="fltp", layout="mono" if planes.shape[0] == 1 else "stereo")
    frame.sample_rate, frame.pts, frame.time_base = rate, 0, Fraction(1, rate)
    return frame
