"""AR stages that take media and embeddings: the wiring rules, and the prompt parts built before vLLM sees them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omni_jobs.engines import ar_prompts
from omni_jobs.engines.stage_exec import ar_engine_args
from omni_jobs.media.payloads import AudioClip, VideoClip
from omni_jobs.pipelines.spec import PipelineSpec, StageSpec


def _pipeline(stages: list[dict[str, Any]], inputs: dict[str, Any] | None = None) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "name": "p",
        "inputs": inputs or {"prompt": {"type": "text"}, "front": {"type": "image"}, "back": {"type": "image"},
                             "clip": {"type": "audio"}},
        "stages": stages,
        "outputs": [{"name": "text", "from": f"{stages[-1]['id']}.text"}],
    })


def _problem(stages: list[dict[str, Any]]) -> str:
    with pytest.raises(ValueError) as info:
        _pipeline(stages)
    return str(info.value)


def test_an_ar_stage_takes_several_images_a_clip_and_text() -> None:
    spec = _pipeline([{"id": "vlm", "engine": "ar", "model": "m", "inputs": {
        "prompt": "input.prompt", "image": ["input.front", "input.back"], "audio": "input.clip"}}])
    stage = spec.stage("vlm")
    assert [(port, str(b)) for port, b in stage.bindings()] == [
        ("prompt", "input.prompt"), ("image", "input.front"), ("image", "input.back"), ("audio", "input.clip")]
    assert ar_engine_args(stage) == {"limit_mm_per_prompt": {"image": 2}}


def test_a_list_on_a_port_that_takes_one_source_is_refused_by_name() -> None:
    problem = _problem([{"id": "vlm", "engine": "ar", "model": "m",
                         "inputs": {"prompt": ["input.prompt", "input.prompt"]}}])
    assert "inputs.prompt: engine 'ar' task 'generate' takes one source for 'prompt', not a list" in problem


def test_media_wired_to_the_wrong_modality_is_refused() -> None:
    problem = _problem([{"id": "vlm", "engine": "ar", "model": "m",
                         "inputs": {"prompt": "input.prompt", "audio": "input.front"}}])
    assert "stage 'vlm' input 'audio' wants audio but 'input.front' gives image" in problem


def test_prompt_and_prompt_embeds_exclude_each_other() -> None:
    base = {"id": "enc", "engine": "ar", "task": "encode", "model": "m", "inputs": {"prompt": "input.prompt"}}
    both = {"id": "gen", "engine": "ar", "model": "m",
            "inputs": {"prompt": "input.prompt", "prompt_embeds": "enc.hidden_states"}}
    assert "takes exactly one of ['prompt', 'prompt_embeds']" in _problem([base, both])


def test_an_ar_stage_fed_hidden_states_of_another_size_needs_a_projection(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 1024}))
    enc = {"id": "enc", "engine": "ar", "task": "encode", "model": "tiny:llama", "inputs": {"prompt": "input.prompt"}}
    gen = {"id": "gen", "engine": "ar", "model": str(tmp_path), "inputs": {"prompt_embeds": "enc.hidden_states"}}
    problem = _problem([enc, gen])
    assert "gives hidden states of size 256" in problem and "takes embeddings of size 1024" in problem
    assert "projection" in problem
    gen["projection"] = {"model": "/ckpt", "weight": "talker.thinker_to_talker_proj"}
    spec = _pipeline([enc, gen])
    assert ar_engine_args(spec.stage("gen")) == {"enable_prompt_embeds": True}


def test_a_projection_without_prompt_embeds_is_refused() -> None:
    with pytest.raises(ValueError, match="projection: it maps the stage's prompt_embeds input"):
        StageSpec.model_validate({"id": "gen", "engine": "ar", "model": "m", "inputs": {"prompt": "input.p"},
                                  "projection": {"model": "/ckpt", "weight": "w"}})


def test_a_transcribe_stage_needs_audio() -> None:
    with pytest.raises(ValueError, match=r"needs input \['audio'\]"):
        StageSpec.model_validate({"id": "asr", "engine": "ar", "task": "transcribe", "model": "m",
                                  "inputs": {"prompt": "input.p"}})


def test_missing_placeholders_go_before_the_text_one_per_line() -> None:
    assert ar_prompts.with_placeholders("What is it?", ["<i>", "<i>", "<a>"]) == "<i>\n<i>\n<a>\nWhat is it?"
    assert ar_prompts.with_placeholders("Compare <i> with this", ["<i>", "<i>"]) == "<i>\nCompare <i> with this"
    assert ar_prompts.with_placeholders("plain", []) == "plain"


def test_a_video_is_sampled_at_two_frames_a_second_with_its_metadata() -> None:
    frames = np.zeros((48, 8, 8, 3), dtype=np.uint8)
    frames[:, 0, 0, 0] = np.arange(48)
    sampled, meta = ar_prompts.sample_video(VideoClip(frames, fps=16.0))  # 3 s at 16 fps -> 6 frames
    assert sampled.shape == (6, 8, 8, 3)
    assert meta["frames_indices"] == [0, 9, 19, 28, 38, 47]
    assert sampled[:, 0, 0, 0].tolist() == meta["frames_indices"]
    assert meta["total_num_frames"] == 48 and meta["fps"] == 16.0 and meta["duration"] == 3.0
    assert meta["do_sample_frames"] is False
    short, _ = ar_prompts.sample_video(VideoClip(frames[:3], fps=16.0))
    assert short.shape[0] == 2  # Qwen's vision tower pairs frames: at least 2, an even count
    floats, _ = ar_prompts.sample_video(VideoClip(np.ones((2, 4, 4, 3), dtype=np.float32), fps=1.0))
    assert floats.dtype == np.uint8 and int(floats.max()) == 255


def test_multi_modal_data_is_one_item_or_a_list_per_modality() -> None:
    stereo = AudioClip(np.stack([np.full(8, 0.5), np.full(8, -0.5)]).astype(np.float32), 8000)
    data = ar_prompts.multi_modal_data({
        "image": [Image.new("L", (4, 4)), Image.new("RGB", (2, 2))],
        "audio": [stereo],
        "video": [],
    })
    assert sorted(data) == ["audio", "image"]
    assert [im.mode for im in data["image"]] == ["RGB", "RGB"]
    samples, rate = data["audio"]
    assert rate == 8000.0 and samples.shape == (8,) and float(abs(samples).max()) == 0.0  # downmixed
    with pytest.raises(TypeError, match="an audio input is an AudioClip"):
        ar_prompts.multi_modal_data({"audio": ["not a clip"]})


def test_embeddings_are_checked_before_the_engine() -> None:
    ok = ar_prompts.check_embeds(torch.zeros(1, 5, 16), 16, 10, "r")
    assert ok.shape == (5, 16)
    for bad, message in [
        (torch.zeros(5, 8), "hidden size 8, but the model takes 16"),
        (torch.zeros(20, 16), "20 tokens; at most 10"),
        (torch.zeros(0, 16), "hold no tokens"),
        (torch.zeros(5, 16, dtype=torch.int64), "floating point"),
        (torch.zeros(2, 5, 16), r"\[tokens, hidden\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            ar_prompts.check_embeds(bad, 16, 10, "r")
