"""Audio and video decoding (omni_jobs.media.decode): every format that must decode, every bad file with the
reason it gives, the limits checked from the header before decoding and counted while decoding, and
resampling for engines. The files are made here (tests/media_files.py)."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest

from omni_jobs.artifacts import codecs, mp4
from omni_jobs.media import decode
from omni_jobs.media.decode import MediaError, MediaLimits, decode_audio, decode_video, resample_audio
from omni_jobs.media.payloads import AudioClip
from tests import media_files as mf

AUDIO = MediaLimits(max_seconds=600, seconds_setting="OMNI_MAX_AUDIO_SECONDS")
VIDEO = MediaLimits(max_seconds=120, max_frames=1800, max_pixels=1920 * 1080, seconds_setting="OMNI_MAX_VIDEO_SECONDS",
                    frames_setting="OMNI_MAX_VIDEO_FRAMES", pixels_setting="OMNI_MAX_VIDEO_PIXELS")


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    n = min(a.size, b.size)
    return float(np.corrcoef(a[:n], b[:n])[0, 1])


@pytest.mark.parametrize("name", sorted(mf.AUDIO_FORMATS))
def test_every_audio_format_decodes_to_float32_channels_by_samples(name: str) -> None:
    clip = decode_audio(mf.encode_audio(name, 1.0), AUDIO)
    rate = 48_000 if name == "opus" else 16_000
    channels = 2 if name == "ogg" else 1  # FFmpeg's own Vorbis encoder writes stereo only
    assert clip.sample_rate == rate and clip.samples.dtype == np.float32
    assert clip.samples.shape[0] == channels and clip.samples.flags.c_contiguous
    assert 0.95 <= clip.duration_s <= 1.1  # codec delay and padding (AAC primes 1024 samples)
    assert np.abs(clip.samples).max() <= 1.0
    if name in ("wav", "flac"):  # lossless: the very samples, read as codecs.decode_wav reads 16-bit PCM
        np.testing.assert_array_equal(clip.samples, codecs.decode_wav(mf.wav(1.0))[0])
    else:  # lossy: still the 440 Hz sine, somewhere after the codec's delay
        spectrum = np.abs(np.fft.rfft(clip.samples[0]))
        assert abs(np.argmax(spectrum) * rate / clip.samples.shape[1] - 440) < 5


def test_stereo_and_a_videos_sound_track() -> None:
    stereo = decode_audio(mf.encode_audio("m4a", 0.5, channels=2))
    assert stereo.samples.shape[0] == 2
    only_audio = decode_audio(mf.audio_only_mp4())  # an MP4 read as audio: its AAC track
    assert only_audio.samples.shape[0] == 1 and only_audio.sample_rate == 16_000


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "is empty"),
        (b"hello, this is a text file and not a sound\n" * 20, "is not audio FFmpeg can read"),
        (mf.zip_file(), "is not audio FFmpeg can read"),
        (mf.encode_audio("mp3", 2.0)[:1200], "truncated"),  # a partial last frame, or frames short of its header
        (mf.encode_audio("flac", 1.0)[:-3000], "truncated"),
        (mf.lying_wav(10.0, 0.5), "is truncated or damaged: its header says 10 s, but only 0.5 s decode"),
        (mf.lying_wav(7200.0, 0.5), "is 7,200 s long (as its header says); at most 600 s (OMNI_MAX_AUDIO_SECONDS)"),
        (mf.mp4(), "has no audio stream (mov file holding video)"),
        (mf.stripes().tobytes()[:4000], "is not audio FFmpeg can read"),
    ],
    ids=["empty", "text", "zip", "truncated-mp3", "truncated-flac", "lying-wav", "lying-wav-past-limit", "video-only",
         "raw-pixels"],
)
def test_bad_audio_is_refused_saying_why(data: bytes, message: str) -> None:
    with pytest.raises(MediaError) as info:
        decode_audio(data, AUDIO)
    assert message in str(info.value)


def test_a_two_hour_wav_is_refused_from_its_header_without_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    long_wav = mf.wav(7200, rate=400)  # a real 2-hour WAV, 5.8 MB at 400 Hz

    def no_decoding(*args: object) -> None:
        raise AssertionError("decoded a file its header already refused")

    monkeypatch.setattr(decode, "_audio_frames", no_decoding)
    with pytest.raises(MediaError, match=r"is 7,200 s long \(as its header says\); at most 600 s"):
        decode_audio(long_wav, AUDIO)


def test_decoded_length_is_counted_whatever_the_header_says() -> None:
    understated = mf.understated_mp3(3.0)  # its Info header claims 1 s
    with pytest.raises(MediaError, match=r"is longer than 2 s \(counted as it decoded, whatever its header says\)"):
        decode_audio(understated, MediaLimits(max_seconds=2.0))
    assert decode_audio(understated, MediaLimits(max_seconds=4.0)).duration_s == pytest.approx(3.0)


def test_sample_budget_bounds_memory_for_high_rates_and_channels() -> None:
    # 0.8 s of 96 kHz stereo against a 1 s limit: in time, but 153,600 samples over its 96,000 (1 s of 48 kHz stereo).
    data = mf.wav(0.8, rate=96_000, channels=2)
    with pytest.raises(MediaError, match="decodes to more than 96,000 samples"):
        decode_audio(data, MediaLimits(max_seconds=1.0))
    assert decode_audio(data, MediaLimits(max_seconds=2.0)).samples.shape == (2, 76_800)


def test_resample_audio_to_a_models_rate() -> None:
    clip = decode_audio(mf.wav(1.0, rate=44_100, channels=2))
    mono = resample_audio(clip, 16_000)
    assert mono.sample_rate == 16_000 and mono.samples.shape[0] == 1 and mono.samples.dtype == np.float32
    assert abs(mono.samples.shape[1] - 16_000) <= 32
    reference = mf.sine(1.0, 16_000, 2).mean(axis=0)
    assert correlation(mono.samples[0, 200:], reference[200:]) > 0.99  # the same waveform, at 16 kHz
    both = resample_audio(clip, 16_000, mono=False)
    assert both.samples.shape[0] == 2
    same = resample_audio(AudioClip(clip.samples[:1], 44_100), 44_100)
    np.testing.assert_array_equal(same.samples, clip.samples[:1])
    with pytest.raises(ValueError, match="rate must be positive"):
        resample_audio(clip, 0)


def test_h264_mp4_and_vp9_webm_decode_to_uint8_frames() -> None:
    clip = decode_video(mf.mp4(frames=12, height=32, width=48, fps=12.0), VIDEO)
    assert clip.frames.shape == (12, 32, 48, 3) and clip.frames.dtype == np.uint8 and clip.fps == 12.0
    assert np.abs(clip.frames.astype(int) - mf.stripes(12, 32, 48)).mean() < 8  # H.264 at CRF 18
    webm = decode_video(mf.webm(frames=6, height=31, width=47, fps=10.0), VIDEO)
    assert webm.frames.shape == (6, 31, 47, 3) and webm.fps == 10.0


def faststart(data: bytes, tmp_path: Path) -> bytes:
    """``data`` with its index (moov) before its frames, as a streaming MP4 has it (FFmpeg writes that to a file only)."""
    path = tmp_path / "faststart.mp4"
    with av.open(io.BytesIO(data)) as source, av.open(str(path), "w", format="mp4",
                                                      options={"movflags": "faststart"}) as target:
        stream = target.add_stream_from_template(source.streams.video[0])
        for packet in source.demux(source.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                target.mux(packet)
    return path.read_bytes()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "is empty"),
        (mf.zip_file(), "is not video FFmpeg can read"),
        (mf.audio_only_mp4(), "has no video stream (mov file holding audio)"),
        (mf.wav(), "is not in a format taken as video"),
        (b"just some text, renamed clip.mp4\n" * 30, "is not video FFmpeg can read"),
    ],
    ids=["empty", "zip-renamed-mp4", "audio-only-mp4", "wav", "text"],
)
def test_bad_video_is_refused_saying_why(data: bytes, message: str) -> None:
    with pytest.raises(MediaError) as info:
        decode_video(data, VIDEO)
    assert message in str(info.value)


def test_a_truncated_mp4_is_refused(tmp_path: Path) -> None:
    whole = faststart(mf.mp4(frames=30), tmp_path)
    assert decode_video(whole).num_frames == 30
    with pytest.raises(MediaError, match="damaged or truncated"):
        decode_video(whole[: len(whole) * 3 // 4], VIDEO)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (MediaLimits(max_frames=5, frames_setting="OMNI_MAX_VIDEO_FRAMES"),
         "has 12 frames (as its header says); at most 5 (OMNI_MAX_VIDEO_FRAMES)"),
        (MediaLimits(max_pixels=1000, pixels_setting="OMNI_MAX_VIDEO_PIXELS"),
         "has 48x32 frames (1,536 pixels); at most 1,000 pixels a frame (OMNI_MAX_VIDEO_PIXELS)"),
        (MediaLimits(max_seconds=0.5, seconds_setting="OMNI_MAX_VIDEO_SECONDS"),
         "is 1 s long (as its header says); at most 0.5 s (OMNI_MAX_VIDEO_SECONDS)"),
    ],
)
def test_video_limits_are_checked_from_the_header(limits: MediaLimits, message: str) -> None:
    with pytest.raises(MediaError) as info:
        decode_video(mf.mp4(frames=12, fps=12.0), limits)
    assert message in str(info.value)


def test_video_frames_are_counted_as_they_decode() -> None:
    # WebM declares no frame count: only counting finds too many.
    with pytest.raises(MediaError, match=r"has more than 4 frames \(counted as it decoded"):
        decode_video(mf.webm(frames=6), MediaLimits(max_frames=4))


def test_reader_streams_frames_and_remux_copies_h264() -> None:
    data = mf.mp4(frames=10)
    with decode.VideoReader(data, VIDEO) as reader:
        assert (reader.codec, reader.pix_fmt, reader.width, reader.height) == ("h264", "yuv420p", 48, 32)
        frames = list(reader.frames())
    copied = mp4.remux_h264(data)
    np.testing.assert_array_equal(np.stack(frames), mp4.decode_mp4(copied)[0])
