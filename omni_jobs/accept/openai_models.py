"""Which ``model`` names the OpenAI-compatible routes take, apart from the mappings that use them
(OpenAI's own names, the default of OMNI_OPENAI_MODEL_ALIASES, are ``settings.OPENAI_MODEL_NAMES``).

A name is one of three things: a pipeline (it runs); one of OpenAI's own model names (``gpt-4o``,
``dall-e-3``, ``whisper-1``...: OMNI_OPENAI_MODEL_ALIASES), which OpenAI's clients and existing code
send, so the pipeline is chosen by what is asked; or anything else, a typo or a model this server does
not have, answered 404 ``model_not_found`` as OpenAI answers it. Another pipeline quietly answering a
misspelt name would look like that model's answer.
"""

from __future__ import annotations

from collections.abc import Collection

from omni_jobs.accept.openai_errors import OpenAIError


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
