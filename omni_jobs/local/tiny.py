"""Build small random-weight models locally, deterministically, in seconds.

No model hub is reachable from the demo, the tests or the benchmarks, so every model they use is
built here with real architectures and loaded by the real loading code: a Llama causal LM for
vLLM; for diffusers a PixArt-Sigma pipeline, a PixArt-Sigma DiT conditioned on the Llama's hidden
states (no text encoder of its own), a Chroma pipeline (text-to-image and image-to-image), a
StableAudio pipeline (text-to-audio) and a Wan 2.1 pipeline (text-to-video); and, in the real checkpoints' layout
(omni_jobs.local.tiny_multimodal), the multimodal models vLLM serves: Qwen2.5-VL, Whisper and the whole
Qwen2.5-Omni. The same seed gives byte-identical weight files.

``python -m omni_jobs.local.tiny build --out DIR [--name NAME|all]`` builds them from a shell.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from omni_jobs.local import tiny_multimodal
from omni_jobs.local.tiny_common import CORPUS, seeded
from omni_jobs.local.untyped import constructor

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import T5EncoderModel

TINY_PREFIX = "tiny:"

# A small built-in English corpus: enough text for the BPE trainer and the T5 vocabulary to learn
# real-looking pieces. Its content only shapes the tokenizers; the model weights are random.

LLAMA_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LLAMA_MAX_POSITIONS = 2048

T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # T5 layout: pad=0, eos=1, unk=2
T5_MAX_LENGTH = 300  # PixArt-Sigma pipelines encode up to 300 tokens by default
PIXART_VAE_BLOCKS = (8, 16, 16)  # three blocks -> VAE scale factor 4
PIXART_PATCH_SIZE = 2
PIXART_TEXT_DIM = 32  # d_model of the tiny PixArt's T5 encoder = the prompt embeddings its DiT takes
LLAMA_HIDDEN_SIZE = 256  # the tiny Llama's hidden size = the prompt embeddings tiny:pixart-llm takes
CHROMA_TEXT_DIM = 32
CHROMA_MAX_SEQUENCE = 64  # Chroma pads prompts to this many T5 tokens (its default, 512, is slow here)
AUDIO_SAMPLE_RATE = 16000
AUDIO_DOWNSAMPLING = (2, 4, 4)  # the Oobleck VAE's hop length is their product: 32 samples per latent
AUDIO_LATENT_LENGTH = 512  # latents per clip: 512 * 32 / 16000 = 1.024 s at most
WAN_TEXT_DIM = 32
WAN_MAX_SEQUENCE = 64  # Wan pads prompts to max_sequence_length tokens (512 by default: slow here)




def _train_bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer: any unicode text maps to byte tokens, so no prompt can fail."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=2,
        special_tokens=list(LLAMA_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def build_tiny_llama(
    path: Path,
    *,
    hidden_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    seed: int = 0,
) -> Path:
    """Save a random-weight Llama causal LM and its tokenizer to ``path``; vLLM and transformers load it.

    Keep ``hidden_size // num_heads`` at 64 (or another head size vLLM's CPU attention supports).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    path = Path(path)
    tokenizer = constructor(PreTrainedTokenizerFast)(
        tokenizer_object=_train_bpe_tokenizer(),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=LLAMA_MAX_POSITIONS,
        chat_template=LLAMA_CHAT_TEMPLATE,
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=LLAMA_MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with seeded(seed):
        model = constructor(LlamaForCausalLM)(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _t5_vocab() -> list[tuple[str, float]]:
    """A Unigram vocabulary for T5Tokenizer, from the corpus: whole words plus single characters.

    Single characters keep every ASCII word encodable; anything else becomes ``<unk>``.
    The PixArt pipeline lowercases prompts, so the vocabulary is lowercase.
    """
    words = Counter(w for line in CORPUS for w in line.lower().split())
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"-()/&%+=*#@$"))
    vocab: list[tuple[str, float]] = [(s, 0.0) for s in T5_SPECIALS]
    vocab.append(("▁", -2.0))
    seen = {"▁"}
    for word, count in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        piece = "▁" + word
        if piece not in seen:
            seen.add(piece)
            vocab.append((piece, -3.0 - 1.0 / count))
    for c in chars:
        for piece, score in (("▁" + c, -8.0), (c, -9.0)):
            if piece not in seen:
                seen.add(piece)
                vocab.append((piece, score))
    return vocab


def build_tiny_pixart(
    path: Path,
    *,
    seed: int = 0,
    text_dim: int = PIXART_TEXT_DIM,
    num_heads: int = 2,
    head_dim: int = 16,
    num_layers: int = 2,
    with_text_encoder: bool = True,
) -> Path:
    """Save a random-weight PixArt-Sigma pipeline to ``path``; ``DiffusionPipeline.from_pretrained`` loads it.

    Images must be multiples of 8 on each side (the pipeline's check; the VAE factor is 4 and the
    patch size 2, so 8 is also the model's own granularity). Prompts are truncated by the tokenizer.
    ``text_dim`` is the size of the prompt embeddings the DiT takes; without a text encoder the
    pipeline can only be called with ``prompt_embeds`` (another model is its text encoder).
    """
    # from the defining modules: mypy reads diffusers' top level as its placeholder classes (no methods)
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import PixArtSigmaPipeline
    from diffusers.schedulers.scheduling_dpmsolver_multistep import DPMSolverMultistepScheduler
    from transformers import T5Tokenizer

    path = Path(path)
    tokenizer = T5Tokenizer(vocab=_t5_vocab(), extra_ids=0, model_max_length=T5_MAX_LENGTH)
    vae_factor = 2 ** (len(PIXART_VAE_BLOCKS) - 1)
    with seeded(seed):
        text_encoder = _tiny_t5_encoder(len(tokenizer), text_dim) if with_text_encoder else None
        transformer = PixArtTransformer2DModel(
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            in_channels=4,
            out_channels=8,
            num_layers=num_layers,
            cross_attention_dim=num_heads * head_dim,
            sample_size=32 // vae_factor,
            patch_size=PIXART_PATCH_SIZE,
            caption_channels=text_dim,
            use_additional_conditions=False,
            interpolation_scale=1,
        )
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * len(PIXART_VAE_BLOCKS),
            up_block_types=("UpDecoderBlock2D",) * len(PIXART_VAE_BLOCKS),
            block_out_channels=PIXART_VAE_BLOCKS,
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=32,
        )
    scheduler = DPMSolverMultistepScheduler()
    # constructor(): tokenizer and text_encoder are optional components (PixArtSigmaPipeline._optional_components),
    # which its __init__'s annotations leave out: None is what a pipeline without them is built with
    pipe = constructor(PixArtSigmaPipeline)(
        tokenizer=tokenizer if with_text_encoder else None,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
    )
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_pixart_llm(path: Path, *, seed: int = 0) -> Path:
    """A PixArt-Sigma DiT that takes the tiny Llama's hidden states as its prompt embeddings.

    The Qwen-Image / BAGEL pattern: the LLM is the DiT's text encoder, so the pipeline has none.
    """
    return build_tiny_pixart(path, seed=seed, text_dim=LLAMA_HIDDEN_SIZE, with_text_encoder=False)


def _tiny_t5_encoder(vocab_size: int, dim: int) -> T5EncoderModel:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=dim,
            d_kv=dim // 4,
            d_ff=2 * dim,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=16,
            dropout_rate=0.0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def build_tiny_chroma(path: Path, *, seed: int = 0) -> Path:
    """Save a random-weight Chroma pipeline; load it as ``ChromaPipeline`` (text-to-image) or
    ``ChromaImg2ImgPipeline`` (image-to-image). Sizes must be multiples of 4 (VAE factor 2, 2x2 packing)."""
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.models.transformers.transformer_chroma import ChromaTransformer2DModel
    from diffusers.pipelines.chroma.pipeline_chroma import ChromaPipeline
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
    from transformers import T5Tokenizer

    path = Path(path)
    tokenizer = T5Tokenizer(vocab=_t5_vocab(), extra_ids=0, model_max_length=CHROMA_MAX_SEQUENCE)
    with seeded(seed):
        text_encoder = _tiny_t5_encoder(len(tokenizer), CHROMA_TEXT_DIM)
        transformer = ChromaTransformer2DModel(
            patch_size=1,
            in_channels=4,  # 1 latent channel, packed 2x2
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=CHROMA_TEXT_DIM,
            axes_dims_rope=(4, 6, 6),
            approximator_num_channels=8,
            approximator_hidden_dim=32,
            approximator_layers=1,
        )
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=1,
            norm_num_groups=8,
            sample_size=32,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,  # ChromaPipeline adds vae.config.shift_factor when it decodes: it must be a number
            scaling_factor=1.5035,
        )
    pipe = ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        transformer=transformer,
    )
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_stable_audio(path: Path, *, seed: int = 0) -> Path:
    """Save a random-weight StableAudio pipeline (text-to-audio): mono, 16 kHz, clips up to 1.024 s."""
    from diffusers.models.autoencoders.autoencoder_oobleck import AutoencoderOobleck
    from diffusers.models.transformers.stable_audio_transformer import StableAudioDiTModel
    from diffusers.pipelines.stable_audio.modeling_stable_audio import StableAudioProjectionModel
    from diffusers.pipelines.stable_audio.pipeline_stable_audio import StableAudioPipeline
    from diffusers.schedulers.scheduling_edm_dpmsolver_multistep import EDMDPMSolverMultistepScheduler
    from transformers import T5Tokenizer

    path = Path(path)
    conditioning_dim = 16
    # StableAudio pads prompts to max_length=tokenizer.model_max_length, so it must be a real length.
    tokenizer = T5Tokenizer(vocab=_t5_vocab(), extra_ids=0, model_max_length=64)
    with seeded(seed):
        text_encoder = _tiny_t5_encoder(len(tokenizer), 32)
        transformer = StableAudioDiTModel(
            sample_size=AUDIO_LATENT_LENGTH,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            num_key_value_attention_heads=2,
            out_channels=4,
            cross_attention_dim=16,
            time_proj_dim=8,
            global_states_input_dim=2 * conditioning_dim,  # start and end seconds, concatenated
            cross_attention_input_dim=conditioning_dim,
        )
        vae = AutoencoderOobleck(
            encoder_hidden_size=8,
            downsampling_ratios=list(AUDIO_DOWNSAMPLING),
            decoder_channels=8,
            decoder_input_channels=4,
            audio_channels=1,
            channel_multiples=[1, 2, 2],
            sampling_rate=AUDIO_SAMPLE_RATE,
        )
        projection = StableAudioProjectionModel(
            text_encoder_dim=32, conditioning_dim=conditioning_dim, min_value=0, max_value=32
        )
    # The original uses CosineDPMSolverMultistepScheduler, which needs torchsde; EDM-DPM needs nothing.
    scheduler = EDMDPMSolverMultistepScheduler(
        solver_order=2, prediction_type="v_prediction", sigma_data=1.0, sigma_schedule="exponential"
    )
    pipe = StableAudioPipeline(
        vae=vae, text_encoder=text_encoder, projection_model=projection, tokenizer=tokenizer,
        transformer=transformer, scheduler=scheduler,
    )
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_wan(path: Path, *, seed: int = 0) -> Path:
    """Save a random-weight Wan 2.1 text-to-video pipeline (UMT5 encoder, WanTransformer3DModel,
    AutoencoderKLWan). The VAE compresses 8x in space and 4x in time, the transformer patches 2x2:
    sides must be multiples of 16 and frame counts 4k+1 (9 frames at 32x32: 3 x 4 x 4 latents)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
    from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

    path = Path(path)
    tokenizer = T5Tokenizer(vocab=_t5_vocab(), extra_ids=0, model_max_length=WAN_MAX_SEQUENCE)
    with seeded(seed):
        text_encoder = constructor(UMT5EncoderModel)(UMT5Config(
            vocab_size=len(tokenizer), d_model=WAN_TEXT_DIM, d_kv=WAN_TEXT_DIM // 4, d_ff=2 * WAN_TEXT_DIM,
            num_layers=2, num_heads=4, relative_attention_num_buckets=16, dropout_rate=0.0, pad_token_id=0,
            eos_token_id=1,
        ))
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=WAN_TEXT_DIM,
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )
        vae = AutoencoderKLWan(
            base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    # constructor(): WanPipeline annotates its tokenizer as AutoTokenizer, a factory no tokenizer is an instance of
    pipe = constructor(WanPipeline)(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path, safe_serialization=True)
    return path


TINY_MODELS: dict[str, Callable[[Path], Path]] = {
    "llama": build_tiny_llama,
    "pixart": build_tiny_pixart,
    "pixart-llm": build_tiny_pixart_llm,
    "chroma": build_tiny_chroma,
    "stable-audio": build_tiny_stable_audio,
    "wan": build_tiny_wan,
    "qwen2.5-vl": tiny_multimodal.build_tiny_qwen2_5_vl,
    "whisper": tiny_multimodal.build_tiny_whisper,
    "qwen2.5-omni": tiny_multimodal.build_tiny_qwen2_5_omni,
}

TINY_MODEL_INFO: dict[str, dict[str, int | bool | str]] = {
    "llama": {"hidden_size": LLAMA_HIDDEN_SIZE},
    "pixart": {"prompt_embed_dim": PIXART_TEXT_DIM, "embed_key": "caption_channels", "text_encoder": True},
    "pixart-llm": {"prompt_embed_dim": LLAMA_HIDDEN_SIZE, "embed_key": "caption_channels", "text_encoder": False},
    "chroma": {"prompt_embed_dim": CHROMA_TEXT_DIM, "embed_key": "joint_attention_dim", "text_encoder": True},
    "stable-audio": {"text_encoder": True},
    "wan": {"text_encoder": True},
    "qwen2.5-vl": {"hidden_size": tiny_multimodal.QWEN_TEXT_HIDDEN},
    "whisper": {"hidden_size": tiny_multimodal.WHISPER_D_MODEL},
    "qwen2.5-omni": {"hidden_size": tiny_multimodal.QWEN_TEXT_HIDDEN},  # the thinker's
}
"""What each tiny model's config will say, known without building it: pipeline validation checks
that an LLM's hidden size matches the prompt-embedding size of the DiT it conditions."""


def build_bench_llama(path: Path) -> Path:
    """The benchmark's Llama: hidden 1024 x 8 layers (~100M parameters), so that the engine's compute,
    not the per-job work around it, sets the pace: 64 prompts x 32 tokens take ~3 s in one batched
    ``generate`` on 2 CPU cores. (At hidden 512 that was ~1 s, and the ~6-8 ms of CPU each job costs
    the API, Redis, Celery and the results step on the same 2 cores was a third of it.)"""
    return build_tiny_llama(path, hidden_size=1024, num_layers=8, num_heads=16)


def build_bench_pixart(path: Path) -> Path:
    """The benchmark's larger PixArt DiT (hidden 256 = 4 heads x 64, 4 layers): compute-bound at 64x64."""
    return build_tiny_pixart(path, num_heads=4, head_dim=64, num_layers=4)


def build_bench_pixart_small(path: Path) -> Path:
    """The benchmark's small PixArt DiT (hidden 128 = 4 heads x 32, 4 layers), for 32x32 images.

    Sized so that both things the benchmark shows hold on 2 CPU cores: batching pays (20 steps at
    32x32: ~145 ms per image alone, ~72 ms per image in a batch of 32, 2.0x), and the engine's
    compute, not the few ms of per-job work around it, sets the pace. The test model tiny:pixart
    is ~53 vs ~13.5 ms (3.9x), two thirds of which is encoding the prompt: overhead-bound."""
    return build_tiny_pixart(path, num_heads=4, head_dim=32, num_layers=4)


def build_bench_pixart_sigma(path: Path) -> Path:
    """PixArt-Sigma's transformer shape (hidden 1152 = 16 heads x 72, 28 layers: ~0.6 B parameters,
    2.4 GB in float32), with the tiny text encoder and VAE: a GPU benchmark's engine cost at a real
    model's scale. The tiny VAE's factor is 4, not 8: at 256x256 it denoises 1,024 tokens, as the
    real model does at 512x512."""
    return build_tiny_pixart(path, num_heads=16, head_dim=72, num_layers=28)


def build_bench_qwen2_5_vl(path: Path, *, seed: int = 0) -> Path:
    """The benchmark's vision-language model: tiny:qwen2.5-vl's layout (Qwen2.5-VL-3B-Instruct's files,
    tokenizer, processor and chat template; omni_jobs.local.tiny_multimodal) with the benchmark Llama's
    text model, hidden 1024 x 8 layers (16 heads of 64), and a vision tower of 256 x 4 layers (4 heads of
    64), so that the engine's compute, not the per-job work around it, sets the pace (build_bench_llama).
    One LLM token per 28x28 pixels: a 224x224 image is 64 of them (the processor's most)."""
    from omni_jobs.engines.torchvision_free import install

    install()
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from omni_jobs.local import tiny_multimodal as tm

    path = Path(path)
    tokenizer = tm.qwen_tokenizer(tm.QWEN_VL_SPECIALS, tm.QWEN_VL_CHAT_TEMPLATE)
    ids = partial(tm.token_id, tokenizer)
    text = {**tm._qwen_text_config(tm._padded(len(tokenizer)), tokenizer), "hidden_size": 1024,
            "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16}
    vision = {**tm._qwen_vision_config(1024), "hidden_size": 256, "intermediate_size": 512, "num_heads": 4,
              "depth": 4, "fullatt_block_indexes": [1, 3], "tokens_per_second": 2}
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=False,
    )
    with seeded(seed):
        model = constructor(Qwen2_5_VLForConditionalGeneration)(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tm.save_processor_files(path, "Qwen2_5_VLProcessor", tokenizer, tm._qwen_image_processor(),
                            chat_template=tm.QWEN_VL_CHAT_TEMPLATE)
    tm._generation_config(path, bos_token_id=text["bos_token_id"], pad_token_id=text["pad_token_id"],
                          eos_token_id=[text["eos_token_id"], text["bos_token_id"]])
    return path


BENCH_MODELS: dict[str, Callable[[Path], Path]] = {
    "bench-llama-1024": build_bench_llama,
    "bench-pixart": build_bench_pixart,
    "bench-pixart-128": build_bench_pixart_small,
    "bench-pixart-sigma": build_bench_pixart_sigma,
    "bench-qwen2.5-vl": build_bench_qwen2_5_vl,
}
"""Larger random-weight models for bench/ (``tiny:bench-llama-1024``); built on demand, never by ``up``."""


def _builders() -> dict[str, Callable[[Path], Path]]:
    return {**TINY_MODELS, **BENCH_MODELS}


def _check_name(name: str) -> None:
    if name not in _builders():
        raise ValueError(f"unknown tiny model {name!r}; valid names: {', '.join(sorted(_builders()))}")


def _make_readable(root: Path) -> None:
    """mkdtemp makes a private (0700) directory; other users' workers must be able to read the model."""
    root.chmod(0o755)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o644)


def ensure_tiny_model(name: str, models_dir: Path) -> Path:
    """Return ``models_dir/tiny-NAME``, building it first if missing.

    Safe when several processes race: each builds into its own temporary directory beside the
    target and renames it into place; a rename onto an existing directory fails, so the loser
    discards its copy and everyone returns the same complete directory.
    """
    _check_name(name)
    models_dir = Path(models_dir)
    target = models_dir / f"tiny-{name}"
    if target.is_dir():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{name}.", suffix=".tmp", dir=models_dir))
    try:
        _builders()[name](tmp)
        _make_readable(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str, models_dir: Path) -> str:
    """``tiny:NAME`` -> the local path of that tiny model (built if needed); anything else unchanged."""
    if model.startswith(TINY_PREFIX):
        return str(ensure_tiny_model(model[len(TINY_PREFIX) :], models_dir))
    return model


def register_model_sources() -> None:
    """Make ``tiny:NAME`` model ids resolve in the core (omni_jobs.pipelines.model_source): built on first use."""
    from omni_jobs.pipelines.model_source import ModelSource, register_model_source

    register_model_source(ModelSource(
        prefix=TINY_PREFIX,
        resolve=lambda name, models_dir: str(ensure_tiny_model(name, models_dir)),
        facts=lambda name: TINY_MODEL_INFO.get(name, {}),
    ))


def main(argv: Sequence[str] | None = None) -> int:
    """``build --out DIR [--name NAME|all]``: build tiny models and print their paths."""
    parser = argparse.ArgumentParser(prog="omni_jobs.local.tiny", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build tiny random-weight models")
    build.add_argument("--out", type=Path, required=True, help="models directory")
    build.add_argument("--name", default="all", choices=[*sorted(TINY_MODELS), "all"])
    args = parser.parse_args(argv)
    names = sorted(TINY_MODELS) if args.name == "all" else [args.name]
    for name in names:
        print(ensure_tiny_model(name, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
