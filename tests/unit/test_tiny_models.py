"""The tiny omni models build, load with the pipeline classes the catalogue names, and their configs
say what pipeline validation assumes about them without building (TINY_MODEL_INFO)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_jobs.local import tiny
from omni_jobs.pipelines.model_info import model_facts


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("diffusers")
    root = tmp_path_factory.mktemp("tiny")
    for name in ("llama", "pixart", "pixart-llm", "chroma", "stable-audio"):
        tiny.ensure_tiny_model(name, root)
    return root


@pytest.mark.parametrize(("name", "engine"), [("llama", "ar"), ("pixart", "dit"), ("pixart-llm", "dit"),
                                              ("chroma", "dit"), ("stable-audio", "dit")])
def test_static_facts_match_the_built_configs(models: Path, name: str, engine: str) -> None:
    built = model_facts(engine, str(models / f"tiny-{name}"))  # type: ignore[arg-type]
    static = model_facts(engine, f"tiny:{name}")  # type: ignore[arg-type]
    assert (built.hidden_size, built.text_encoder) == (static.hidden_size, static.text_encoder)
    if static.prompt_embed_dim is not None:  # declared for the DiTs that can take prompt_embeds (not audio)
        assert (built.prompt_embed_dim, built.embed_dim_source) == (static.prompt_embed_dim, static.embed_dim_source)


def test_llm_hidden_size_is_the_llm_dit_embedding_size(models: Path) -> None:
    assert model_facts("ar", str(models / "tiny-llama")).hidden_size == tiny.LLAMA_HIDDEN_SIZE
    assert model_facts("dit", str(models / "tiny-pixart-llm")).prompt_embed_dim == tiny.LLAMA_HIDDEN_SIZE
    assert model_facts("dit", str(models / "tiny-pixart-llm")).text_encoder is False


def test_omni_models_load_with_their_pipeline_classes(models: Path) -> None:
    import diffusers

    img2img = diffusers.ChromaImg2ImgPipeline.from_pretrained(models / "tiny-chroma")
    audio = diffusers.StableAudioPipeline.from_pretrained(models / "tiny-stable-audio")
    assert audio.vae.config.sampling_rate == tiny.AUDIO_SAMPLE_RATE and audio.vae.hop_length == 32
    assert img2img.text_encoder.config.d_model == img2img.transformer.config.joint_attention_dim
    llm_dit = diffusers.PixArtSigmaPipeline.from_pretrained(models / "tiny-pixart-llm")
    assert llm_dit.text_encoder is None and llm_dit.tokenizer is None


def test_builds_are_deterministic(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    a = tiny.build_tiny_stable_audio(tmp_path / "a")
    b = tiny.build_tiny_stable_audio(tmp_path / "b")
    for weights in sorted(a.rglob("*.safetensors")):
        assert weights.read_bytes() == (b / weights.relative_to(a)).read_bytes()
