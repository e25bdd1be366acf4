"""Which ``model`` names the OpenAI-compatible routes take, apart from the mappings that use them (no
imports beyond the error), so that the settings can default to OpenAI's names.

A name is one of three things: a pipeline (it runs); one of OpenAI's own model names (``gpt-4o``,
``dall-e-3``, ``whisper-1``...: OMNI_OPENAI_MODEL_ALIASES), which OpenAI's clients and existing code
send, so the pipeline is chosen by what is asked; or anything else, a typo or a model this server does
not have, answered 404 ``model_not_found`` as OpenAI answers it. Another pipeline quietly answering a
misspelt name would look like that model's answer.
"""

from __future__ import annotations

from collections.abc import Collection

from omni_jobs.openai_errors import OpenAIError

OPENAI_MODEL_NAMES: tuple[str, ...] = (
    "gpt-4o", "gpt-4o-mini", "gpt-4o-audio-preview", "gpt-4o-mini-audio-preview", "gpt-4o-transcribe",
    "gpt-4o-mini-transcribe", "gpt-4o-mini-tts", "gpt-4.1", "gpt-4.1-mini", "gpt-4.1-nano", "gpt-4-turbo", "gpt-4",
    "gpt-3.5-turbo", "gpt-5", "gpt-5-mini", "gpt-5-nano", "gpt-audio", "gpt-audio-mini", "chatgpt-4o-latest",
    "o1", "o3", "o3-mini", "o4-mini", "dall-e-2", "dall-e-3", "gpt-image-1", "tts-1", "tts-1-hd", "whisper-1",
)
"""OpenAI's model names taken as "choose by what is asked" (the default of OMNI_OPENAI_MODEL_ALIASES)."""


def model_not_found(model: str, pipelines: Collection[str], aliases: Collection[str]) -> OpenAIError:
    """OpenAI's 404 for a model that is neither a pipeline nor one of OpenAI's names, saying what is."""
    listed = ", ".join(sorted(pipelines)) or "none"
    return OpenAIError(404, f"The model '{model}' does not exist: give a pipeline ({listed}; GET /v1/models lists "
                       f"them) or one of OpenAI's model names ({', '.join(sorted(aliases)) or 'none here'}; "
                       "OMNI_OPENAI_MODEL_ALIASES) to have one chosen by what is asked",
                       param="model", code="model_not_found")


def by_request(model: str | None, pipelines: Collection[str], aliases: Collection[str]) -> bool:
    """Whether the pipeline is chosen by what is asked: no model, or one of OpenAI's names that is no
    pipeline. False for a pipeline's name; 404 (model_not_found) for any other name."""
    if model is not None and model in pipelines:
        return False
    if model is None or model in aliases:
        return True
    raise model_not_found(model, pipelines, aliases)
