"""The tiny multimodal builds (omni_jobs.local.tiny_multimodal): the real checkpoints' file layout, configs
whose token ids are the tokenizer's, processors that load through transformers' Auto classes, the whole
Qwen2.5-Omni (talker, token2wav, speakers), and byte-identical rebuilds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from omni_jobs.engines.torchvision_free import install
from omni_jobs.local import tiny, tiny_multimodal

NAMES = ("qwen2.5-vl", "whisper", "qwen2.5-omni")
COMMON = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "preprocessor_config.json"}
LAYOUT = {
    "qwen2.5-vl": COMMON | {"chat_template.json"},
    "whisper": COMMON,
    "qwen2.5-omni": COMMON | {"chat_template.json", "spk_dict.pt"},
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tiny-mm")
    return {name: tiny.ensure_tiny_model(name, root) for name in NAMES}


def _json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _processor(path: Path) -> Any:
    install()
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


@pytest.mark.parametrize("name", NAMES)
def test_files_are_the_hub_checkpoints(built: dict[str, Path], name: str) -> None:
    files = {p.name for p in built[name].iterdir()}
    assert files == LAYOUT[name]
    assert sum(p.stat().st_size for p in built[name].iterdir()) < 8 * 2**20
    assert _json(built[name] / "preprocessor_config.json")["processor_class"] == {
        "qwen2.5-vl": "Qwen2_5_VLProcessor", "whisper": "WhisperProcessor", "qwen2.5-omni": "Qwen2_5OmniProcessor",
    }[name]


def test_qwen_vl_config_and_processor(built: dict[str, Path]) -> None:
    config = _json(built["qwen2.5-vl"] / "config.json")
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    processor = _processor(built["qwen2.5-vl"])
    ids = processor.tokenizer.convert_tokens_to_ids
    assert (config["image_token_id"], config["video_token_id"]) == (ids("<|image_pad|>"), ids("<|video_pad|>"))
    assert (config["vision_start_token_id"], config["vision_end_token_id"]) == (ids("<|vision_start|>"),
                                                                                ids("<|vision_end|>"))
    assert config["text_config"]["vocab_size"] >= len(processor.tokenizer)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert type(processor.video_processor).__module__ == "omni_jobs.engines.pil_video"
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Hi"}]}],
        add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>Hi" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_whisper_vocabulary_is_in_the_real_order(built: dict[str, Path]) -> None:
    processor = _processor(built["whisper"])
    tokenizer = processor.tokenizer
    specials, timestamps = tiny_multimodal.whisper_special_tokens()
    assert len(specials) == 2 + 100 + 6 and len(timestamps) == 1501
    ids = tokenizer.convert_tokens_to_ids([*specials, *timestamps])
    first = ids[0]
    assert ids == list(range(first, first + len(ids))) and first + len(ids) == len(tokenizer)  # all at the end
    assert specials[:4] == ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|zh|>"]
    assert timestamps[-1] == "<|30.00|>"
    prefix = tokenizer("<|startoftranscript|><|en|><|transcribe|><|notimestamps|>", add_special_tokens=False)
    assert len(prefix["input_ids"]) == 4
    config = _json(built["whisper"] / "config.json")
    generation = _json(built["whisper"] / "generation_config.json")
    assert config["decoder_start_token_id"] == ids[1] and config["eos_token_id"] == ids[0]
    assert len(generation["lang_to_id"]) == 100 and generation["lang_to_id"]["<|en|>"] == ids[2]
    assert generation["task_to_id"] == {"transcribe": tokenizer.convert_tokens_to_ids("<|transcribe|>"),
                                        "translate": tokenizer.convert_tokens_to_ids("<|translate|>")}
    features = processor.feature_extractor
    assert (features.feature_size, features.sampling_rate, features.chunk_length) == (128, 16000, 30)
    assert config["num_mel_bins"] == 128 and config["max_source_positions"] == 1500


def test_omni_is_the_whole_checkpoint(built: dict[str, Path]) -> None:
    import torch
    from safetensors import safe_open

    path = built["qwen2.5-omni"]
    config = _json(path / "config.json")
    assert config["architectures"] == ["Qwen2_5OmniForConditionalGeneration"]
    assert set(config) >= {"thinker_config", "talker_config", "token2wav_config"}
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        parts = {key.split(".")[0] for key in weights.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        towers = {key.split(".")[1] for key in weights.keys() if key.startswith("thinker.")}  # noqa: SIM118
    assert parts == {"thinker", "talker", "token2wav"}
    assert towers >= {"audio_tower", "visual", "model", "lm_head"}
    processor = _processor(path)
    ids = processor.tokenizer.convert_tokens_to_ids
    thinker = config["thinker_config"]
    assert (thinker["audio_token_index"], thinker["image_token_index"], thinker["video_token_index"]) == (
        ids("<|AUDIO|>"), ids("<|IMAGE|>"), ids("<|VIDEO|>"))
    assert (type(processor.feature_extractor).__name__, type(processor.image_processor).__name__) == (
        "WhisperFeatureExtractor", "Qwen2VLImageProcessorPil")
    speakers = torch.load(path / "spk_dict.pt", weights_only=True)
    assert sorted(speakers) == ["Chelsie", "Ethan"]
    for speaker in speakers.values():
        assert speaker["cond"].shape == (1, tiny_multimodal.OMNI_SPEAKER_DIM)
        assert speaker["ref_mel"].shape[0] == 1 and speaker["ref_mel"].shape[2] == 80
        assert len(processor.tokenizer) <= speaker["bos_token"] < thinker["text_config"]["vocab_size"]


def test_omni_token2wav_is_audible(built: dict[str, Path]) -> None:
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    install()
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(built["qwen2.5-omni"], dtype=torch.float32).eval()
    speaker = model.speaker_map["Chelsie"]
    codes = torch.arange(24).remainder(32).view(1, -1)
    with torch.no_grad():
        torch.manual_seed(0)
        wav = model.token2wav(codes, conditioning=speaker["cond"], reference_mel=speaker["ref_mel"], num_steps=2)
    assert wav.numel() == 24 * 480  # 480 samples a code at 24 kHz
    assert float(wav.abs().max()) > 1e-3  # not the ~4e-8 of transformers' own small init


def test_static_facts_match_the_built_configs(built: dict[str, Path]) -> None:
    vl = _json(built["qwen2.5-vl"] / "config.json")["text_config"]["hidden_size"]
    omni = _json(built["qwen2.5-omni"] / "config.json")["thinker_config"]["text_config"]["hidden_size"]
    whisper = _json(built["whisper"] / "config.json")["d_model"]
    assert [tiny.TINY_MODEL_INFO[n]["hidden_size"] for n in NAMES] == [vl, whisper, omni]


def test_builds_are_deterministic(built: dict[str, Path], tmp_path: Path) -> None:
    for name in NAMES:
        again = tiny.TINY_MODELS[name](tmp_path / name)
        for first in sorted(built[name].iterdir()):
            assert hashlib.sha256(first.read_bytes()).digest() == hashlib.sha256(
                (again / first.name).read_bytes()).digest(), f"{name}/{first.name}"
