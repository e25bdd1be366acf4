"""Which job pages get the console's live speech player: pipelines whose audio output comes from a stage that
streams it as it is made (code2wav beside its talker), not those whose audio comes whole."""

from __future__ import annotations

from api.ui.views import streamed_audio
from omni_jobs.pipelines.catalogue import load_catalogue


def test_speech_pipelines_stream_code2wav_audio_and_others_do_not() -> None:
    catalogue = load_catalogue()
    for name in ("text-to-speech", "omni-chat"):
        assert streamed_audio(catalogue.get(name)) == {"stage": "code2wav", "output": "audio"}, name
    for name in ("text-to-audio", "text-to-text", "text-to-image"):
        assert streamed_audio(catalogue.get(name)) is None, name
    assert streamed_audio(None) is None  # a job whose pipeline left the catalogue
