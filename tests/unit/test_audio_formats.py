"""A stored WAV in every OpenAI speech format: each result decodes back (PyAV) at the right rate, length and
channels, in the container its media type says; unknown formats are a ValueError naming the allowed ones."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from omni_jobs.artifacts.codecs import decode_wav, encode_wav
from omni_jobs.media.audio_formats import AUDIO_FORMATS, ENCODINGS, PCM_RATE, check_format, convert, is_wav, media_type

SECONDS = 1.3


def tone(rate: int, channels: int = 1) -> bytes:
    t = np.arange(int(rate * SECONDS)) / rate
    return encode_wav(np.stack([0.5 * np.sin(2 * np.pi * 440 * t)] * channels), rate)


def decoded(data: bytes) -> tuple[str, str, int, int, float]:
    """(container, codec, rate, channels, seconds) of a file, as PyAV reads it back."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        frames = list(container.decode(stream))
        rate = frames[0].sample_rate
        return (container.format.name, stream.codec_context.name, rate, stream.codec_context.channels,
                sum(f.samples for f in frames) / rate)


EXPECTED = {"mp3": ("mp3", "mp3float"), "opus": ("ogg", "opus"), "aac": ("aac", "aac"), "flac": ("flac", "flac"),
            "wav": ("wav", "pcm_s16le")}


@pytest.mark.parametrize("fmt", [f for f in AUDIO_FORMATS if f != "pcm"])
@pytest.mark.parametrize(("rate", "channels"), [(24000, 1), (44100, 2)])
def test_each_format_decodes_back_at_the_rate_and_length(fmt: str, rate: int, channels: int) -> None:
    container, codec, got_rate, got_channels, seconds = decoded(convert(tone(rate, channels), check_format(fmt)))
    assert (container, codec) == EXPECTED[fmt]
    assert got_channels == channels
    # Opus decodes at 48 kHz whatever it was fed; the others keep the stage's rate (MP3 and AAC take both)
    assert got_rate == (48000 if fmt == "opus" else rate)
    assert seconds == pytest.approx(SECONDS, abs=0.1)  # AAC in ADTS keeps its encoder delay (1024 samples)


def test_wav_is_the_stored_bytes() -> None:
    wav = tone(24000)
    assert convert(wav, "wav") is wav


@pytest.mark.parametrize("rate", [24000, 16000, 44100])
def test_pcm_is_24khz_16_bit_mono_as_openai_s(rate: int) -> None:
    pcm = convert(tone(rate, 2), "pcm")
    assert len(pcm) % 2 == 0 and len(pcm) / 2 / PCM_RATE == pytest.approx(SECONDS, abs=0.01)
    samples = np.frombuffer(pcm, "<i2")
    assert 0.4 < np.abs(samples).max() / 32767 < 0.55  # the tone's 0.5, not silence, not clipped


def test_24khz_pcm_is_the_wav_s_own_samples() -> None:
    wav = tone(24000)
    samples, _ = decode_wav(wav)
    expected = (np.clip(samples[0], -1, 1) * 32767).round().astype("<i2")
    got = np.frombuffer(convert(wav, "pcm"), "<i2")
    assert len(got) == len(expected) and np.abs(got.astype(int) - expected).max() <= 1


def test_media_types_and_extensions() -> None:
    assert {f: media_type(f) for f in AUDIO_FORMATS} == {
        "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
        "pcm": "audio/pcm"}
    assert all(e.extension.startswith(".") for e in ENCODINGS.values())
    assert is_wav("audio/wav") and is_wav("audio/x-wav; charset=binary") and not is_wav("audio/mpeg")


def test_unknown_format_names_the_field_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"response_format must be one of mp3, opus, aac, flac, wav, pcm; got 'ogg'"):
        check_format("ogg", field="response_format")
    with pytest.raises(ValueError, match=r"format must be one of wav, pcm16"):
        check_format("mp3", allowed=("wav", "pcm16"))


def test_a_file_that_is_not_a_wav_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        convert(b"not a wav at all", "mp3")
