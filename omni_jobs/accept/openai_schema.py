"""The OpenAI routes' request bodies as the OpenAPI spec says them (api.main puts them in it): one
schema per pipeline a request can run, with what that pipeline's stages take, from the same tables
and the same pipeline choice as omni_jobs.accept.openai_requests."""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass

from omni_jobs.accept.openai_content import (
    FILE_KINDS,
    content_inputs,
    messages_schema,
)
from omni_jobs.accept.openai_requests import (
    CHAT_AUDIO_FORMATS,
    CHAT_FIELDS,
    IMAGE_FIELDS,
    SIZE_TARGETS,
    SPEECH_FIELDS,
    VOICE_SCHEMA,
    Target,
    best_candidate,
    output_modalities,
    pipeline_candidates,
    takes,
    text_input,
    voice_input,
)
from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.core.settings import OPENAI_MODEL_NAMES
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.limits import Limits
from omni_jobs.pipelines.schema import NOT_BLANK, input_field_schema, json_object, params_schema, stage_params_schema
from omni_jobs.pipelines.spec import PipelineSpec


def voice_schema(spec: PipelineSpec) -> JsonObject:
    """A request's voice for ``spec``: one of its voices (or ``{'id': voice}``); anything for a pipeline without."""
    field_ = voice_input(spec)
    if field_ is None or field_.choices is None:
        return {**VOICE_SCHEMA, "description": f"Pipeline '{spec.name}' has no voice choices: any voice is taken"
                + (" as its voice input." if field_ is not None else " and not used.")}
    names: JsonObject = {"enum": [*field_.choices]}
    return {"anyOf": [names, {"type": "object", "properties": {"id": names}, "required": ["id"]}, {"type": "null"}],
            "description": f"One of pipeline '{spec.name}''s voices (default {field_.default})."}


@dataclass(frozen=True)
class Endpoint:
    """What a route maps, for its schema: its fields, whether it takes ``size``, the modality it
    answers with (None: chat's ``modalities``), and the field its prompt comes from."""

    fields: dict[str, tuple[Target, ...]]
    size: bool
    modality: str | None
    prompt: str
    voice: str | None = None
    """Where the request's voice is (``voice``, ``audio.voice``): its schema is the pipeline's voices."""


ENDPOINTS = {"ChatCompletionRequest": Endpoint(CHAT_FIELDS, True, None, "messages", "audio.voice"),
             "ImageGenerationRequest": Endpoint(IMAGE_FIELDS, True, "image", "prompt"),
             "SpeechRequest": Endpoint(SPEECH_FIELDS, False, "audio", "input", "voice")}
"""The component name of each route's body (FastAPI's, from the model) and what it maps."""
_MODALITIES = ("text", "image", "audio")
_NUMBER = "[1-9][0-9]{0,8}"


def _number(value: JsonValue, what: str) -> int | float:
    """A schema's number (a bound, a step), narrowed: TypeError if it is not one."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{what} is not a number: {value!r}")
    return value


def _properties(schema: JsonObject) -> JsonObject:
    """An object schema's ``properties``."""
    return json_object(schema["properties"], "properties")


def _with_required(schema: JsonObject, name: str) -> None:
    """Add ``name`` to ``schema``'s required fields (kept sorted)."""
    required = schema.get("required", [])
    names = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
    if names != required:
        raise TypeError(f"required is not a list of names: {required!r}")
    schema["required"] = [*sorted({*names, name})]


def _allowed_ints(prop: JsonObject) -> set[int] | None:
    """The integers a parameter's schema allows (None: unbounded)."""
    branches = prop.get("anyOf", [prop])
    if not isinstance(branches, list):
        raise TypeError(f"anyOf is not a list: {branches!r}")
    branch = next((b for b in map(json_object, branches) if b.get("type") == "integer"), None)
    if branch is None or "minimum" not in branch or "maximum" not in branch:
        return None
    step = int(_number(branch.get("multipleOf", 1), "multipleOf"))
    low, high = int(_number(branch["minimum"], "minimum")), int(_number(branch["maximum"], "maximum"))
    return {v for v in range(low, high + 1) if v % step == 0 and v > 0}


def _size_schema(stages: list[JsonObject]) -> JsonObject:
    """``size`` for these DiT stages' params schemas: 'auto', or the widths and heights they all take."""
    parts: list[str] = []
    for key in ("width", "height"):
        sets = [_allowed_ints(json_object(_properties(stage)[key], key)) for stage in stages
                if key in _properties(stage)]
        if not sets:
            return {"anyOf": [{"const": "auto"}, {"type": "null"}], "description": "Only 'auto': no stage takes a size."}
        bounded = [found for found in sets if found is not None]
        allowed = set.intersection(*bounded) if bounded else None
        parts.append(_NUMBER if allowed is None else "(?:" + "|".join(str(v) for v in sorted(allowed)) + ")")
    return {"anyOf": [{"type": "string", "pattern": f"^(?:auto|{parts[0]}[xX]{parts[1]})$"}, {"type": "null"}],
            "description": "'WIDTHxHEIGHT' (each a value every image stage takes) or 'auto' (the pipeline's default)."}


def _field_schema(name: str, pieces: list[JsonObject], spec: PipelineSpec) -> JsonObject:
    """An OpenAI field: what every stage it sets takes, or null when no stage takes it."""
    if not pieces:
        return {"type": "null", "description": f"Not taken by pipeline '{spec.name}' (400 if given)."}
    clean: list[JsonObject] = [{k: v for k, v in piece.items() if k not in ("default", "title")} for piece in pieces]
    taken: JsonObject = clean[0] if len(clean) == 1 else {"allOf": [*clean]}
    return {"anyOf": [taken, {"type": "null"}], "description": pieces[0].get("description", name)}


def _route(base: JsonObject, spec: PipelineSpec, endpoint: Endpoint, limits: Limits,
           model: JsonObject, modalities: JsonObject | None, kinds: frozenset[str] | None = None) -> JsonObject:
    """The body when ``spec`` runs: each field as that pipeline's stages take it, the prompt as its
    text input takes it, a chat's media parts as its file inputs take them (``kinds``: exactly these
    kinds, one part of each at least; None: those it takes), and ``params`` for what no field sets."""
    schemas = {stage.id: stage_params_schema(stage, limits) for stage in spec.stages}
    base_properties = _properties(base)
    properties: JsonObject = {**base_properties, "model": model}
    if modalities is not None:
        properties["modalities"] = modalities
    if endpoint.voice == "voice":
        properties["voice"] = voice_schema(spec)
    elif endpoint.voice == "audio.voice":
        audio = json_object(base_properties["audio"], "audio")
        properties["audio"] = {**audio, "anyOf": [
            {"type": "object", "properties": {"format": {"enum": [*CHAT_AUDIO_FORMATS, None]}, "voice": voice_schema(spec)}},
            {"type": "null"}]}
    set_by_fields: set[tuple[str, str]] = set()
    for name, targets in endpoint.fields.items():
        pieces = [json_object(_properties(schemas[stage.id])[target[1]], target[1]) for stage in spec.stages
                  for target in targets if takes(stage, target)]
        set_by_fields |= {(stage.id, t[1]) for stage in spec.stages for t in targets if takes(stage, t)}
        properties[name] = _field_schema(name, pieces, spec)
    if endpoint.size:
        properties["size"] = _size_schema([schemas[s.id] for s in spec.stages if s.engine == "dit"])
        set_by_fields |= {(s.id, t[1]) for s in spec.stages for t in SIZE_TARGETS if takes(s, t)}
    overrides = params_schema(spec, limits)
    for stage_id, value in _properties(overrides).items():
        stage_schema = json_object(value, stage_id)
        stage_schema["properties"] = {k: v for k, v in _properties(stage_schema).items()
                                      if (stage_id, k) not in set_by_fields}
    overrides["description"] = ("Per-stage overrides, as in POST /v1/jobs (applied last), of what no field of this "
                                "request sets (a field's parameter is set with that field).")
    properties["params"] = overrides if overrides.get("required") else {"anyOf": [overrides, {"type": "null"}]}
    if endpoint.prompt == "messages":  # each text: the whole prompt when it is the only one; media as it fills
        inputs = content_inputs(spec)
        assert inputs is not None  # choose_pipeline and the named routes only take pipelines a chat fills
        text = {**input_field_schema(spec.inputs[inputs.text], max_text_chars=limits.max_prompt_chars),
                "pattern": NOT_BLANK}  # read_content refuses blank text, whether the input is required or not
        properties["messages"] = messages_schema(json_object(base_properties["messages"], "messages"), text, inputs,
                                                 inputs.kinds if kinds is None else kinds,
                                                 inputs.required if kinds is None else
                                                 {k: max(1, inputs.required.get(k, 0)) for k in kinds})
    else:
        prompt_input = text_input(spec)
        assert prompt_input is not None  # choose_pipeline and the named routes only take pipelines with a text prompt
        prompt = input_field_schema(spec.inputs[prompt_input], max_text_chars=limits.max_prompt_chars)
        field = json_object(base_properties[endpoint.prompt], endpoint.prompt)
        longest = [int(_number(n, "maxLength")) for n in (field.get("maxLength"), prompt.get("maxLength"))
                   if n is not None]
        properties[endpoint.prompt] = {**field, **prompt, **({"maxLength": min(longest)} if longest else {})}
    route: JsonObject = {k: v for k, v in base.items() if k not in ("properties", "title", "description")}
    route.update(title=f"{spec.name}", properties=properties)
    if overrides.get("required"):  # params must lower a default above this server's cap
        _with_required(route, "params")
    if endpoint.fields is CHAT_FIELDS:  # one of two ways to say the same thing (400 naming it otherwise)
        route["allOf"] = [
            {"anyOf": [{"properties": {"max_completion_tokens": {"type": "null"}}},
                       {"properties": {"max_tokens": {"type": "null"}}}]},
            {"anyOf": [{"properties": {"size": {"anyOf": [{"const": "auto"}, {"type": "null"}]}}},
                       {"properties": {"width": {"type": "null"}, "height": {"type": "null"}}}]},
        ]
    return route


def _modalities_within(offered: set[str]) -> JsonObject:
    """Chat's ``modalities`` when ``model`` names a pipeline: some of those it outputs."""
    within: JsonObject = {"type": "array", "items": {"enum": [*sorted(offered)]}}
    return {"anyOf": [within, {"type": "null"}]} if "text" in offered else {**within, "minItems": 1}


def _modalities_exactly(wanted: set[str]) -> JsonObject:
    """Chat's ``modalities`` when they are these (in any order, repeated or not; ['text'] by default)."""
    if wanted == {"text"}:
        return {"anyOf": [{"type": "array", "items": {"const": "text"}}, {"type": "null"}]}
    return {"type": "array", "items": {"enum": [*sorted(wanted)]},
            "allOf": [{"contains": {"const": m}} for m in sorted(wanted)]}


def alias_schema(catalogue: PipelineCatalogue, aliases: Collection[str], *, nullable: bool) -> JsonObject | None:
    """``model`` when the pipeline is chosen by what is asked: one of OpenAI's names that is no pipeline (or
    none, where ``nullable``); None when there is no such value (any other name is 404)."""
    names = sorted(set(aliases) - set(catalogue.names()))
    description = ("One of OpenAI's model names (OMNI_OPENAI_MODEL_ALIASES): the pipeline is chosen by the "
                   "modalities asked (GET /v1/models); any other name is 404 model_not_found.")
    branches: list[JsonValue] = [{"type": "string", "enum": [*names]}] if names else []
    if nullable:
        branches.append({"type": "null"})
    if not branches:
        return None
    return {**json_object(branches[0]), "description": description} if len(branches) == 1 else \
        {"anyOf": branches, "description": description}


def request_schema(name: str, base: JsonObject, catalogue: PipelineCatalogue, limits: Limits,
                   aliases: Collection[str] = OPENAI_MODEL_NAMES) -> JsonObject:
    """The body of an OpenAI route as the spec says it: ``base`` (the model's schema) once per pipeline
    the request can run, with what that pipeline takes. ``model`` naming a pipeline picks it (if it
    gives the modality and takes a text prompt); no model or one of OpenAI's names (``aliases``) picks one
    by the modalities asked and, in a chat, the kinds of media its messages hold (choose_pipeline), so
    there is a route per set of modalities (and media) too; any other name is in no route (404). A
    pipeline that cannot serve the request is in no route (400)."""
    endpoint = ENDPOINTS[name]
    required = base.get("required", [])
    other = alias_schema(catalogue, aliases, nullable=not isinstance(required, list) or "model" not in required)
    chat = endpoint.prompt == "messages"
    routes: list[JsonValue] = []
    for spec in catalogue:
        offered = output_modalities(spec) & set(_MODALITIES)
        fillable = content_inputs(spec) is not None if chat else text_input(spec) is not None
        if not fillable or not offered or (endpoint.modality and endpoint.modality not in offered):
            continue
        modalities = None if endpoint.modality else _modalities_within(offered)
        route = _route(base, spec, endpoint, limits, {"const": spec.name}, modalities)
        _with_required(route, "model")  # a body without a model is not this route (the routes of other names take it)
        if modalities is not None and "text" not in offered:  # the default, ['text'], is not one
            _with_required(route, "modalities")
        routes.append(route)
    choices = [{endpoint.modality}] if endpoint.modality else [
        set(c) for n in range(1, len(_MODALITIES) + 1) for c in itertools.combinations(_MODALITIES, n)]
    kind_sets = [frozenset(c) for n in range(len(FILE_KINDS) + 1) for c in itertools.combinations(FILE_KINDS, n)]
    for wanted in choices:
        for kinds in kind_sets if chat else [frozenset()]:
            candidates = pipeline_candidates(catalogue, wanted, kinds)
            if not candidates or other is None:
                continue  # no pipeline gives them: 400; no name to ask for them by: 404
            spec = best_candidate(candidates, wanted, kinds)
            route = _route(base, spec, endpoint, limits, other,
                           None if endpoint.modality else _modalities_exactly(wanted), kinds if chat else None)
            media = f" with {'+'.join(k for k in FILE_KINDS if k in kinds)}" if kinds else ""
            route["title"] = f"an OpenAI model name, {'+'.join(sorted(wanted))}{media}: {spec.name}"
            if endpoint.modality is None and wanted != {"text"}:
                _with_required(route, "modalities")
            routes.append(route)
    description = base.get("description", "")
    if not isinstance(description, str):
        raise TypeError(f"description is not text: {description!r}")
    schema: JsonObject = {"title": base.get("title", name), "description": description + " One schema per "
                          "pipeline the request can run (by `model`, else by the modalities asked), with what it takes; a "
                          "`model` that is neither a pipeline nor one of OpenAI's names is 404 model_not_found."}
    if routes:  # disjoint (by model; for OpenAI's names, by the modalities and media asked): exactly one holds
        schema["oneOf"] = routes  # (and schemathesis models a oneOf of many routes, where an anyOf outgrows it)
    else:
        schema["not"] = {}
    return schema
