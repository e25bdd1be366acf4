"""From an AR request to the prompt vLLM takes: text, media, embeddings, or a speech model's own prompt.

A multimodal model marks where each image, clip or video sits in its prompt with placeholders of its
own (``<|vision_start|><|image_pad|><|vision_end|>``, ``<|audio_bos|><|AUDIO|><|audio_eos|>``); vLLM's
model class says which (``get_placeholder_str``), and its processor expands each into the item's
tokens. So one path serves every multimodal model vLLM runs: the placeholders the text lacks go before
it, as vLLM's own chat front end puts them, the model's chat template wraps the turn, and the media
travel beside it as ``multi_modal_data``. Prompt embeddings are checked against the model's hidden size
here, before the engine sees them: a wrong size was seen to wedge vLLM for every later request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from omni_jobs.media.payloads import AudioClip, VideoClip

if TYPE_CHECKING:
    import torch
    from vllm import LLM

MEDIA_ORDER = ("image", "video", "audio")
_TIMESTAMP = re.compile(r"<\|\d+\.\d+\|>")
"""The order of the placeholders before the text (vision first, as Qwen's templates put them)."""

VIDEO_FPS = 2.0
"""Frames per second handed to the model from a video (Qwen2-VL and Qwen2.5-Omni sample at 2)."""
VIDEO_MAX_FRAMES = 64
"""At most this many frames of one video reach the model (evenly spread over the clip)."""

Media = Mapping[str, Sequence[object]]
"""A request's media by modality: PIL images, AudioClips, VideoClips, in prompt order."""


@dataclass(frozen=True)
class ModelPromptFacts:
    """What the engine's model says about its prompts, read once when the engine loads."""

    hidden_size: int
    modalities: frozenset[str]
    """The media the model takes (empty: a text-only model)."""
    accepts_embeds: bool
    """Whether the engine was started with ``enable_prompt_embeds``."""
    model_cls: Any = None
    """vLLM's model class (its ``get_placeholder_str``)."""

    def placeholders(self, media: Media) -> list[str]:
        """The placeholder of each item, numbered per modality (Qwen2.5-Omni writes 'Audio 2: ...')."""
        return [str(self.model_cls.get_placeholder_str(modality, i))
                for modality in MEDIA_ORDER for i in range(1, len(media.get(modality, ())) + 1)]


def model_prompt_facts(llm: LLM) -> ModelPromptFacts:
    from vllm.model_executor.model_loader import get_model_cls

    model_config = llm.llm_engine.model_config
    modalities: set[str] = set()
    model_cls: Any = None
    if model_config.is_multimodal_model:
        model_cls = get_model_cls(model_config)
        for modality in MEDIA_ORDER:
            try:
                if model_cls.get_placeholder_str(modality, 1):
                    modalities.add(modality)
            except (ValueError, NotImplementedError):
                continue
    return ModelPromptFacts(hidden_size=int(model_config.get_hidden_size()), modalities=frozenset(modalities),
                            accepts_embeds=bool(model_config.enable_prompt_embeds), model_cls=model_cls)


def check_media(facts: ModelPromptFacts, media: Media, model: str) -> None:
    """A modality the model does not take is refused by name (vLLM would fail deep in its processor)."""
    for modality, items in media.items():
        if items and modality not in facts.modalities:
            takes = sorted(facts.modalities) or ["text only"]
            raise ValueError(f"model {model!r} does not take {modality} input (it takes: {', '.join(takes)})")


def with_placeholders(text: str, placeholders: Sequence[str]) -> str:
    """``text`` with each placeholder it does not already hold put before it, one per line (vLLM's way)."""
    missing: list[str] = []
    have: dict[str, int] = {}
    for p in placeholders:
        have[p] = have.get(p, 0) + 1
    for p, n in have.items():
        missing.extend([p] * max(0, n - text.count(p)))
    return "\n".join([*missing, text]) if missing else text


def chat_prompt(llm: LLM, text: str, media: Media, placeholders: Sequence[str], system_prompt: str | None) -> str:
    """One user turn (after an optional system turn) in the model's own chat template, ready to answer.

    A template that reads typed content parts (Qwen's: ``{"type": "image"}``) writes each item's markers
    itself, as the model was trained (Qwen2.5-Omni's ``<|vision_bos|><|IMAGE|><|vision_eos|>``); a template
    that takes text gets the placeholders before it. vLLM decides which the same way (its content format)."""
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

    model_config = llm.llm_engine.model_config
    tokenizer: Any = llm.get_tokenizer()
    content: Any = with_placeholders(text, placeholders)
    if media and resolve_chat_template_content_format(None, None, "auto", tokenizer,
                                                      model_config=model_config) == "openai":
        content = [{"type": modality} for modality in MEDIA_ORDER for _ in media.get(modality, ())]
        content.append({"type": "text", "text": text})
    messages: list[Any] = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages.append({"role": "user", "content": content})
    rendered = safe_apply_chat_template(model_config, tokenizer, messages, tokenize=False, add_generation_prompt=True)
    return str(rendered)


def sample_video(clip: VideoClip, fps: float = VIDEO_FPS, max_frames: int = VIDEO_MAX_FRAMES
                 ) -> tuple[np.ndarray, dict[str, Any]]:
    """Frames at ``fps`` (at most ``max_frames``, at least 2 where the clip has them: Qwen's vision tower
    pairs frames), uint8 [n, h, w, 3], with the metadata vLLM's video processors read."""
    frames = clip.frames
    if frames.dtype != np.uint8:
        frames = (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)
    total = int(frames.shape[0])
    wanted = round(total / clip.fps * fps) if clip.fps > 0 else total
    wanted = max(min(wanted, max_frames, total), min(2, total))
    wanted -= wanted % 2 if wanted > 1 else 0
    indices = np.linspace(0, total - 1, wanted).round().astype(int).tolist()
    metadata = {"total_num_frames": total, "fps": float(clip.fps), "duration": clip.duration_s,
                "video_backend": "pyav", "frames_indices": indices, "do_sample_frames": False}
    return frames[indices], metadata


def audio_item(clip: AudioClip) -> tuple[np.ndarray, float]:
    """One mono float32 waveform and its rate: vLLM resamples it to the model's rate itself."""
    samples = np.asarray(clip.samples, dtype=np.float32)
    mono = samples.mean(axis=0) if samples.ndim == 2 else samples
    return np.ascontiguousarray(mono), float(clip.sample_rate)


def multi_modal_data(media: Media) -> dict[str, Any]:
    """The request's media as vLLM's ``multi_modal_data``: one item per modality, or a list of several."""
    from PIL import Image

    data: dict[str, Any] = {}
    for modality in MEDIA_ORDER:
        items = list(media.get(modality, ()))
        if not items:
            continue
        converted: list[Any] = []
        for item in items:
            if modality == "image":
                if not isinstance(item, Image.Image):
                    raise TypeError(f"an image input is a PIL image, got {type(item).__name__}")
                converted.append(item.convert("RGB"))
            elif modality == "audio":
                if not isinstance(item, AudioClip):
                    raise TypeError(f"an audio input is an AudioClip, got {type(item).__name__}")
                converted.append(audio_item(item))
            else:
                if not isinstance(item, VideoClip):
                    raise TypeError(f"a video input is a VideoClip, got {type(item).__name__}")
                converted.append(sample_video(item))
        data[modality] = converted[0] if len(converted) == 1 else converted
    return data


def check_embeds(embeds: torch.Tensor, hidden_size: int, budget: int, request_id: str) -> torch.Tensor:
    """[tokens, hidden] float embeddings of the model's hidden size, within the length budget."""
    import torch

    if embeds.ndim == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.ndim != 2:
        raise ValueError(f"request {request_id!r}: prompt_embeds must be [tokens, hidden], got {list(embeds.shape)}")
    if embeds.shape[1] != hidden_size:
        raise ValueError(
            f"request {request_id!r}: prompt_embeds have hidden size {embeds.shape[1]}, but the model takes "
            f"{hidden_size}; wire hidden states of that size, or name a projection on the stage"
        )
    if embeds.shape[0] == 0:
        raise ValueError(f"request {request_id!r}: prompt_embeds hold no tokens")
    if embeds.shape[0] > budget:
        raise ValueError(f"request {request_id!r}: prompt_embeds are {embeds.shape[0]} tokens; at most {budget} "
                         "fit beside max_tokens in max_model_len")
    if not torch.is_floating_point(embeds):
        raise ValueError(f"request {request_id!r}: prompt_embeds must be floating point, got {embeds.dtype}")
    return embeds.contiguous()


class Transcriber:
    """The prompts vLLM's own transcription endpoint makes, for any model vLLM serves as speech-to-text
    (``SupportsTranscription``: Whisper, Qwen3-ASR, Voxtral...): the clip resampled to the model's rate and
    cut at quiet points into chunks the model takes (Whisper: 30 s), each with the model's own prompt
    (Whisper's decoder prompt names the language and the task); the language detected first where the
    model needs one named and the request named none."""

    def __init__(self, llm: LLM) -> None:
        from vllm.model_executor.model_loader import get_model_cls
        from vllm.model_executor.models.interfaces import supports_transcription

        self._llm = llm
        self.model_config = llm.llm_engine.model_config
        self.model_cls: Any = get_model_cls(self.model_config)
        if not supports_transcription(self.model_cls):
            raise ValueError(
                f"model {self.model_config.model!r} ({self.model_cls.__name__}) is not a speech-to-text model vLLM "
                "runs; for an audio chat model use a task 'generate' stage with an audio input")

    def chunks(self, clip: AudioClip, task: str) -> tuple[list[np.ndarray], list[tuple[float, float]], float]:
        """(chunks at the model's rate, each one's (start, end) in seconds, the clip's duration)."""
        from vllm.multimodal.audio import resample_audio_pyav, split_audio

        config = self.model_cls.get_speech_to_text_config(self.model_config, task)
        mono, rate = audio_item(clip)
        target = float(config.sample_rate)
        if rate != target:
            mono = resample_audio_pyav(mono, orig_sr=rate, target_sr=target).astype(np.float32)
        duration = float(mono.shape[-1]) / target
        chunks = [mono]
        if config.allow_audio_chunking and config.max_audio_clip_s and duration > config.max_audio_clip_s:
            assert config.min_energy_split_window_size is not None
            chunks = split_audio(mono, int(target), config.max_audio_clip_s, config.overlap_chunk_second,
                                 config.min_energy_split_window_size)
        spans: list[tuple[float, float]] = []
        start = 0.0
        for chunk in chunks:
            spans.append((start, min(start + chunk.shape[-1] / target, duration)))
            start = spans[-1][1]
        return chunks, spans, duration

    def validate_language(self, language: str | None) -> str | None:
        return self.model_cls.validate_language(language)  # type: ignore[no-any-return]  # vLLM's model class method is untyped

    @property
    def detects_language(self) -> bool:
        return bool(getattr(self.model_cls, "supports_explicit_language_detection", False))

    def detection(self, chunk: np.ndarray, task: str) -> tuple[dict[str, Any], list[int]]:
        """The one-token prompt that asks the model the clip's language, and the tokens it may answer."""
        config = self.model_cls.get_speech_to_text_config(self.model_config, task)
        prompt = dict(self.model_cls.get_language_detection_prompt(chunk, config))
        return prompt, list(self.model_cls.get_language_token_ids(self._llm.get_tokenizer()))

    def parse_language(self, token_ids: Sequence[int]) -> str:
        return str(self.model_cls.parse_language_detection_output(list(token_ids), self._llm.get_tokenizer()))

    def prompts(self, chunks: Sequence[np.ndarray], *, task: str, language: str | None,
                prompt: str = "") -> list[dict[str, Any]]:
        from vllm.config.speech_to_text import SpeechToTextParams

        config = self.model_cls.get_speech_to_text_config(self.model_config, task)
        return [self._previous_text_token(dict(self.model_cls.get_generation_prompt(SpeechToTextParams(
            audio=chunk, stt_config=config, model_config=self.model_config, language=language, task_type=task,
            request_prompt=prompt)))) for chunk in chunks]

    def _previous_text_token(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """vLLM 0.32 writes Whisper's previous-text marker as ``<|prev|>``; Whisper's tokenizer calls it
        ``<|startofprev|>`` (``<|prev|>`` would be read as plain text)."""
        decoder = prompt.get("decoder_prompt")
        if not isinstance(decoder, dict):
            return prompt
        text = decoder.get("prompt")
        if isinstance(text, str) and text.startswith("<|prev|>"):
            vocab = self._llm.get_tokenizer().get_vocab()
            if "<|prev|>" not in vocab and "<|startofprev|>" in vocab:
                prompt["decoder_prompt"] = {**decoder, "prompt": "<|startofprev|>" + text.removeprefix("<|prev|>")}
        return prompt

    def join(self, texts: Sequence[str], language: str | None) -> str:
        """The chunks' texts as one, without spaces for languages written without them."""
        no_space = language in getattr(self.model_cls, "no_space_languages", ())
        return ("" if no_space else " ").join(t for t in texts if t)

    def clean(self, text: str) -> str:
        """The model's own clean-up of its raw text (language tags and the like), less timestamp tokens
        (``<|8.92|>``): the prompt asks for none, and they are no words of the transcript."""
        return _TIMESTAMP.sub("", str(self.model_cls.post_process_output(text)))
