"""Tiny random-weight builds of multimodal models that vLLM serves, in their real checkpoints' layout.

Each is built with transformers' own classes and saved as the hub checkpoint is (config.json,
generation_config.json, safetensors, tokenizer files with the real special tokens, the processor's
preprocessor/video/chat-template files), so vLLM and transformers load it with exactly the code that
loads the real model; only the sizes (and so the weights) differ:

- ``qwen2.5-vl`` for Qwen/Qwen2.5-VL-3B-Instruct: image and video in, text out;
- ``whisper`` for openai/whisper-large-v3-turbo: audio in (16 kHz, 30 s windows), transcript out;
- ``qwen2.5-omni`` for Qwen/Qwen2.5-Omni-7B: the whole checkpoint (thinker with audio and vision
  towers, talker, token2wav DiT + BigVGAN, ``spk_dict.pt`` with "Chelsie" and "Ethan"); vLLM serves
  its thinker from it.

Random weights are drawn wider than transformers' 0.02 (QWEN_INIT_STD, WHISPER_INIT_STD) and the Qwen output
layers untied: at 0.02 a random model repeats one token whatever it is shown, which would hide whether
the media reached it. The Qwen vocabularies are padded to a multiple of 64 rows, as the real ones are.
The processors need no torchvision: omni_jobs.engines.torchvision_free is installed before any build.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from omni_jobs.local.untyped import constructor

if TYPE_CHECKING:
    import torch
    from tokenizers.pre_tokenizers import PreTokenizer
    from transformers import PreTrainedTokenizerBase, Qwen2Tokenizer, WhisperTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL / Qwen2.5-VL's chat template (the processor's chat_template), verbatim."""

QWEN_OMNI_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio {{ audio_count.value }}: "
    "{% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-Omni's chat template: Qwen2.5-VL's with audio, and the vision tokens renamed."""

QWEN_VL_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
"""Qwen2.5's added tokens, in their order (151643 on in the real vocabulary)."""

QWEN_OMNI_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>",
    "<|VIDEO|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)
"""Qwen2.5-Omni's: Qwen2.5's with the audio tokens in the object/box slots and the vision ones renamed."""

QWEN_OMNI_NAMED = {
    "image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
}
"""The tokenizer attributes Qwen2_5OmniProcessor reads its placeholders from."""

QWEN_MAX_POSITIONS = 32768
QWEN_INIT_STD = 0.1  # transformers' 0.02 makes a random model repeat one token whatever it is shown
QWEN_TEXT_HIDDEN = 128  # 2 heads of 64: a head size vLLM's CPU attention takes
QWEN_MROPE_SECTION = [8, 12, 12]  # temporal, height, width: sums to head_dim / 2 = 32
QWEN_PATCH = 14
QWEN_MERGE = 2
QWEN_MIN_PIXELS = 56 * 56  # the real preprocessor's: 4 tokens at the least
QWEN_MAX_PIXELS = 28 * 28 * 64  # the real one allows 16,384 tokens an image; 64 keeps the profiling run small
"""Qwen2-VL-family vision: 14-pixel patches merged 2x2, so one LLM token per 28x28 pixels (per 2 frames)."""

WHISPER_SAMPLE_RATE = 16000
WHISPER_MEL_BINS = 128  # large-v3(-turbo)'s; whisper-small has 80
WHISPER_D_MODEL = 128  # 2 heads of 64
WHISPER_SOURCE_POSITIONS = 1500  # 30 s of 10 ms mel frames, halved by the encoder's stride-2 conv
WHISPER_TARGET_POSITIONS = 448
WHISPER_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|>
WHISPER_INIT_STD = 0.3
WHISPER_CONTROL_TOKENS = ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                          "<|notimestamps|>")

OMNI_SPEAKERS = ("Chelsie", "Ethan")
OMNI_CODEC_VOCAB = 48  # the talker's codec vocabulary (real: 8448); its last rows are the control codes
OMNI_TALKER_HIDDEN = 64  # real: 896 (14 heads of 64)
OMNI_SPEAKER_DIM = 16  # token2wav's speaker conditioning (enc_emb_dim; real: 192)
OMNI_SAMPLE_RATE = 24000  # token2wav's output
OMNI_REF_MEL_FRAMES = 40
OMNI_AUDIO_CHUNK_S = 300  # the real feature extractor pads every clip to 300 s (its longest)


def _train_bpe(pre_tokenizer: PreTokenizer, vocab_size: int = 400) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary and merges learned from the built-in corpus, behind ``pre_tokenizer``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from omni_jobs.local.tiny_common import CORPUS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(CORPUS), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return dict(model["vocab"]), merges


def _with_tokens(vocab: dict[str, int], tokens: tuple[str, ...] | list[str]) -> dict[str, int]:
    """``vocab`` plus ``tokens`` at the next ids, in order (where the real vocabularies keep them)."""
    out = dict(vocab)
    for token in tokens:
        out.setdefault(token, len(out))
    return out


def qwen_tokenizer(specials: tuple[str, ...], chat_template: str, **named: str) -> Qwen2Tokenizer:
    """A ``Qwen2Tokenizer`` (Qwen's pre-tokenizer regex, byte-level BPE) with ``specials`` after the BPE pieces."""
    from tokenizers import AddedToken, Regex, pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    vocab, merges = _train_bpe(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]))
    tokenizer = Qwen2Tokenizer(
        # cast: the tokenizers backend takes merges as (left, right) pairs; transformers annotates them as strings
        vocab=_with_tokens(vocab, specials), merges=cast(Any, merges), eos_token="<|im_end|>",
        pad_token="<|endoftext|>", model_max_length=QWEN_MAX_POSITIONS, chat_template=chat_template,
        extra_special_tokens=named or None,
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    return tokenizer


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of one token of ``tokenizer``'s vocabulary (``convert_tokens_to_ids`` gives a list for a list)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise TypeError(f"{token!r}: expected one id, got {found!r}")
    return found


def _padded(n: int, multiple: int = 64) -> int:
    """Embedding rows as the real checkpoints size them: the vocabulary rounded up (151,665 -> 151,936)."""
    return -(-n // multiple) * multiple


def _qwen_text_config(vocab_size: int, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": QWEN_TEXT_HIDDEN,
        "intermediate_size": 2 * QWEN_TEXT_HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": QWEN_MAX_POSITIONS,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": QWEN_MROPE_SECTION},
        "bos_token_id": token_id(tokenizer, "<|endoftext|>"),
        "eos_token_id": token_id(tokenizer, "<|im_end|>"),
        "pad_token_id": token_id(tokenizer, "<|endoftext|>"),
        "initializer_range": QWEN_INIT_STD,
        # Untied, as the 7B checkpoints are (the 3B ties them): a random model with tied embeddings repeats
        # its last prompt token whatever it is shown, which would hide whether the media reached it.
        "tie_word_embeddings": False,
    }


def _qwen_vision_config(out_hidden: int) -> dict[str, Any]:
    return {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "patch_size": QWEN_PATCH,
        "spatial_merge_size": QWEN_MERGE,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "out_hidden_size": out_hidden,
        "initializer_range": QWEN_INIT_STD,
    }


def _qwen_image_processor() -> Qwen2VLImageProcessorPil:
    """The Qwen2-VL family's image processor (saved as ``Qwen2VLImageProcessor``, as the real one is). Its
    preprocessor_config.json configures the video processor too: the real checkpoints have no other."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS)


class ProcessorPart(Protocol):
    """A processor's part with settings of its own: a feature extractor, an image or video processor."""

    def to_dict(self) -> dict[str, Any]: ...


def save_processor_files(path: Path, processor_class: str, tokenizer: PreTrainedTokenizerBase, *parts: ProcessorPart,
                         chat_template: str | None = None) -> None:
    """Save a processor as the hub checkpoints keep theirs: the tokenizer files (its chat template in
    tokenizer_config.json), one preprocessor_config.json with every part's settings and the processor
    class, and chat_template.json. (transformers 5 would write a processor_config.json instead; this
    layout makes the real loading path read these files the way it reads the real checkpoint's.)"""
    tokenizer.save_pretrained(path, save_jinja_files=False)
    config: dict[str, Any] = {}
    for part in parts:
        config.update(part.to_dict())
    config["processor_class"] = processor_class
    (path / "preprocessor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if chat_template is not None:
        (path / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}, indent=2) + "\n")


def _generation_config(path: Path, **fields: Any) -> None:
    from transformers import GenerationConfig

    constructor(GenerationConfig)(**fields).save_pretrained(path)


def build_tiny_qwen2_5_vl(path: Path, *, seed: int = 0) -> Path:
    """Save a random-weight Qwen2.5-VL (Qwen/Qwen2.5-VL-3B-Instruct's layout, ~0.6M parameters) to ``path``.

    One LLM token per 28x28 pixels of an image (4 to 64 of them here), per 28x28 pixels and 2 frames of
    a video; vLLM serves it as ``Qwen2_5_VLForConditionalGeneration``.
    """
    from omni_jobs.engines.torchvision_free import install

    install()
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from omni_jobs.local.tiny_common import seeded

    path = Path(path)
    tokenizer = qwen_tokenizer(QWEN_VL_SPECIALS, QWEN_VL_CHAT_TEMPLATE)
    ids = partial(token_id, tokenizer)
    text = _qwen_text_config(_padded(len(tokenizer)), tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config={**_qwen_vision_config(QWEN_TEXT_HIDDEN), "tokens_per_second": 2},
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    with seeded(seed):
        model = constructor(Qwen2_5_VLForConditionalGeneration)(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    save_processor_files(path, "Qwen2_5_VLProcessor", tokenizer, _qwen_image_processor(),
                         chat_template=QWEN_VL_CHAT_TEMPLATE)
    _generation_config(path, bos_token_id=text["bos_token_id"], pad_token_id=text["pad_token_id"],
                       eos_token_id=[text["eos_token_id"], text["bos_token_id"]])
    return path


def whisper_special_tokens() -> tuple[list[str], list[str]]:
    """Whisper's control tokens in the real vocabulary's order (after the BPE pieces), then its timestamps."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    specials = ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES),
                "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                "<|notimestamps|>"]
    timestamps = [f"<|{i * 0.02:.2f}|>" for i in range(WHISPER_TIMESTAMPS)]
    return specials, timestamps


def whisper_tokenizer() -> WhisperTokenizer:
    """A ``WhisperTokenizer``: GPT-2-style byte-level BPE, then <|endoftext|>, <|startoftranscript|>, the 100
    language tokens, the task and control tokens, and 1,501 timestamp tokens (not special), as in large-v3."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import WhisperTokenizer

    vocab, merges = _train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False))
    specials, timestamps = whisper_special_tokens()
    tokenizer = WhisperTokenizer(vocab=_with_tokens(vocab, [*specials, *timestamps]), merges=merges,
                                 model_max_length=WHISPER_TARGET_POSITIONS, extra_special_tokens=specials[1:])
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in timestamps])
    return tokenizer


def build_tiny_whisper(path: Path, *, seed: int = 0) -> Path:
    """Save a random-weight Whisper (openai/whisper-large-v3-turbo's layout: 128 mel bins, 30 s windows,
    1,500 encoder positions; ~1M parameters) to ``path``. vLLM serves it as an encoder-decoder model."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from omni_jobs.local.tiny_common import seeded

    path = Path(path)
    tokenizer = whisper_tokenizer()
    ids = partial(token_id, tokenizer)
    specials, _ = whisper_special_tokens()
    eos, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=WHISPER_MEL_BINS,
        d_model=WHISPER_D_MODEL,
        encoder_layers=1,
        encoder_attention_heads=2,
        encoder_ffn_dim=256,
        decoder_layers=2,
        decoder_attention_heads=2,
        decoder_ffn_dim=256,
        max_source_positions=WHISPER_SOURCE_POSITIONS,
        max_target_positions=WHISPER_TARGET_POSITIONS,
        pad_token_id=eos,
        bos_token_id=eos,
        eos_token_id=eos,
        decoder_start_token_id=sot,
        begin_suppress_tokens=[ids("Ġ"), eos],
        suppress_tokens=[],
        # Whisper ties its output projection to the token embeddings; at the usual 0.02 a random model only
        # repeats its last token whatever it hears. At 0.3 its transcript depends on the audio.
        init_std=WHISPER_INIT_STD,
    )
    with seeded(seed):
        model = WhisperForConditionalGeneration(config)
    features = constructor(WhisperFeatureExtractor)(feature_size=WHISPER_MEL_BINS, sampling_rate=WHISPER_SAMPLE_RATE)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    save_processor_files(path, "WhisperProcessor", tokenizer, features)
    languages = [t for t in specials[2:] if t not in WHISPER_CONTROL_TOKENS]
    _generation_config(
        path, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, decoder_start_token_id=sot,
        begin_suppress_tokens=config.begin_suppress_tokens, suppress_tokens=[], max_length=WHISPER_TARGET_POSITIONS,
        is_multilingual=True, lang_to_id={t: ids(t) for t in languages},
        task_to_id={"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
        no_timestamps_token_id=ids("<|notimestamps|>"), prev_sot_token_id=ids("<|startofprev|>"),
        max_initial_timestamp_index=50, return_timestamps=False, alignment_heads=[[1, 0], [1, 1]],
        forced_decoder_ids=None,
    )
    return path


def _audible(module: torch.nn.Module) -> None:
    """Re-initialise token2wav's convolutions and linears with torch's defaults: with transformers' small
    normal init its BigVGAN output is ~4e-8, silence; with these it is audible (FACTS.md)."""
    import torch

    for layer in module.modules():
        if isinstance(layer, (torch.nn.Conv1d, torch.nn.ConvTranspose1d, torch.nn.Linear)):
            layer.reset_parameters()


TALKER_LOGIT_SCALE = 20.0
"""How much wider the tiny talker's code logits are spread than its init gives them (std ~0.2 -> ~3)."""


def _talks_until_stopped(codec_head: torch.nn.Linear, stop_codes: tuple[int, ...]) -> None:
    """A random talker's head, made to speak until its ``max_tokens``: its stop codes' rows are zero (logit 0)
    and the other codes' logits are spread wide, so a stop code is seldom sampled. With transformers' init every
    code is about as likely, and a stop code (2 of 48) ends a clip after ~24 codes, half a second: too short for
    speech streamed in chunks to be seen."""
    import torch

    with torch.no_grad():
        codec_head.weight.mul_(TALKER_LOGIT_SCALE)
        codec_head.weight[list(stop_codes)] = 0.0


def build_tiny_qwen2_5_omni(path: Path, *, seed: int = 0) -> Path:
    """Save a random-weight Qwen2.5-Omni, the whole checkpoint (Qwen/Qwen2.5-Omni-7B's layout, ~1.3M
    parameters), to ``path``: the thinker (text 128 x 2 layers, a 1-layer audio encoder, a 2-layer vision
    tower), the talker (64 hidden, a codec vocabulary of 48), token2wav (DiT and BigVGAN, 24 kHz) and
    ``spk_dict.pt`` with the speakers "Chelsie" and "Ethan". vLLM serves its thinker from it.

    One thinker token per 40 ms of audio (25 a second, after the encoder's two 2x downsamplings), per
    28x28 pixels of an image, per 28x28 pixels and 2 frames of a video.
    """
    from omni_jobs.engines.torchvision_free import install

    install()
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration, WhisperFeatureExtractor

    from omni_jobs.local.tiny_common import seeded

    path = Path(path)
    tokenizer = qwen_tokenizer(QWEN_OMNI_SPECIALS, QWEN_OMNI_CHAT_TEMPLATE, **QWEN_OMNI_NAMED)
    ids = partial(token_id, tokenizer)
    # The talker's text tokens and the speakers' start tokens live past the tokenizer, in the embedding
    # rows the real checkpoint pads its vocabulary with (151859 on).
    tts_pad, tts_bos, tts_eos, *speaker_bos = range(len(tokenizer), len(tokenizer) + 3 + len(OMNI_SPEAKERS))
    text = _qwen_text_config(_padded(len(tokenizer) + 3 + len(OMNI_SPEAKERS)), tokenizer)
    media_ids = {
        "audio_token_index": ids("<|AUDIO|>"), "image_token_index": ids("<|IMAGE|>"),
        "video_token_index": ids("<|VIDEO|>"), "audio_start_token_id": ids("<|audio_bos|>"),
        "audio_end_token_id": ids("<|audio_eos|>"), "position_id_per_seconds": 25, "seconds_per_chunk": 2,
        "vision_start_token_id": ids("<|vision_bos|>"), "vision_end_token_id": ids("<|vision_eos|>"),
    }
    # the codec's control codes in the real vocabulary's places (8292-8296 of 8448): after the codes
    codec_pad, codec_bos, codec_eos, codec_mask = (OMNI_CODEC_VOCAB - k for k in (8, 7, 6, 4))
    config = Qwen2_5OmniConfig(
        thinker_config={
            "text_config": text,
            "audio_config": {"num_mel_bins": WHISPER_MEL_BINS, "encoder_layers": 1, "encoder_attention_heads": 2,
                             "encoder_ffn_dim": 128, "d_model": 64, "max_source_positions": WHISPER_SOURCE_POSITIONS,
                             "n_window": 100, "output_dim": QWEN_TEXT_HIDDEN, "initializer_range": QWEN_INIT_STD},
            "vision_config": _qwen_vision_config(QWEN_TEXT_HIDDEN),
            "user_token_id": tokenizer.encode("user")[0],
            "initializer_range": QWEN_INIT_STD,
            **media_ids,
        },
        talker_config={
            **media_ids,
            "vocab_size": OMNI_CODEC_VOCAB,
            "tts_text_start_token_id": tts_bos, "tts_text_end_token_id": tts_eos, "tts_text_pad_token_id": tts_pad,
            "tts_codec_start_token_id": codec_bos, "tts_codec_end_token_id": codec_eos,
            "tts_codec_pad_token_id": codec_pad, "tts_codec_mask_token_id": codec_mask,
            # one head of 64: vLLM's Qwen2 layers take head_dim as hidden_size / heads, as the real talker has it
            # (896 / 14 = 64); 2 heads of 64 in a hidden of 64 load in transformers only
            "embedding_size": QWEN_TEXT_HIDDEN, "hidden_size": OMNI_TALKER_HIDDEN, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
            "max_position_embeddings": QWEN_MAX_POSITIONS, "spatial_merge_size": QWEN_MERGE,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": QWEN_MROPE_SECTION},
            "initializer_range": QWEN_INIT_STD,
        },
        token2wav_config={
            "dit_config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 32,
                           "ff_mult": 2, "emb_dim": 32, "look_ahead_layers": [1], "look_backward_layers": [0],
                           "num_embeds": OMNI_CODEC_VOCAB, "mel_dim": 80, "dropout": 0.0,
                           "enc_emb_dim": OMNI_SPEAKER_DIM, "enc_dim": 32, "enc_channels": [32, 32, 32, 32, 96],
                           "enc_attention_channels": 16, "enc_se_channels": 16},
            "bigvgan_config": {"mel_dim": 80, "upsample_initial_channel": 64},
        },
    )
    with seeded(seed):
        model = constructor(Qwen2_5OmniForConditionalGeneration)(config)
        _audible(model.token2wav)
        _talks_until_stopped(model.talker.codec_head, stop_codes=(codec_pad, codec_eos))
        speakers = {
            name: {"bos_token": bos, "cond": torch.randn(1, OMNI_SPEAKER_DIM),
                   "ref_mel": torch.randn(1, OMNI_REF_MEL_FRAMES, 80)}
            for name, bos in zip(OMNI_SPEAKERS, speaker_bos)
        }
    features = constructor(WhisperFeatureExtractor)(feature_size=WHISPER_MEL_BINS, sampling_rate=WHISPER_SAMPLE_RATE,
                                                    chunk_length=OMNI_AUDIO_CHUNK_S, return_attention_mask=True)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    torch.save(speakers, path / "spk_dict.pt")
    save_processor_files(path, "Qwen2_5OmniProcessor", tokenizer, features, _qwen_image_processor(),
                         chat_template=QWEN_OMNI_CHAT_TEMPLATE)
    _generation_config(path, bos_token_id=text["bos_token_id"], pad_token_id=text["pad_token_id"],
                       eos_token_id=[text["eos_token_id"], text["bos_token_id"]])
    return path
