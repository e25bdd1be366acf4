"""The pipeline spec: a stage graph written in YAML and validated by pydantic.

A pipeline names its job inputs, its stages and its final outputs. Each stage carries what a
vLLM-Omni stage config carries: its id, engine kind (AR on vLLM / DiT on diffusers) and task,
model, queue, engine args (vLLM engine args; the diffusers pipeline class and load args), default
parameters, which port of which upstream stage (or of the job input) feeds each of its inputs and
what modality that hands over, and which outputs it produces. Everything a worker needs to run a
stage is derived from this object; nothing about a pipeline is hard-coded elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cached_property
from types import MappingProxyType
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from omni_jobs.core.json_types import JsonObject, JsonScalar, JsonValue
from omni_jobs.pipelines.modalities import (
    DEFAULT_TASK,
    ENGINE_TASKS,
    OUTPUT_TYPES,
    STREAMED_OUTPUTS,
    STREAMING_INPUTS,
    EngineKind,
    EnginePorts,
    Modality,
    output_type,
)
from omni_jobs.pipelines.model_info import model_facts
from omni_jobs.pipelines.params import StageParams, params_model

INPUT_SOURCE = "input"
"""The pseudo-stage that stands for the job's own input in a binding like ``input.prompt``."""

_ID = r"^[a-z][a-z0-9_-]{0,39}$"
_PY_IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]*$"

InputType = Literal["text", "integer", "number", "boolean", "image", "audio", "video"]
INPUT_TYPE_MODALITY: dict[InputType, Modality | None] = {
    "text": "text",
    "integer": None,
    "number": None,
    "boolean": None,
    "image": "image",
    "audio": "audio",
    "video": "video",
}
FileInputType = Literal["image", "audio", "video"]
FILE_INPUT_TYPES: tuple[FileInputType, ...] = ("image", "audio", "video")
"""Inputs that are files: sent as base64, a multipart part or a stored output's reference, and stored
as input artifacts (omni_jobs.media.input_files)."""
DEFAULT_MAX_IMAGE_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_BYTES: Mapping[str, int] = {"image": DEFAULT_MAX_IMAGE_BYTES, "audio": 25 * 1024 * 1024,
                                         "video": 64 * 1024 * 1024}
"""The largest upload of each file type, unless the field's ``max_bytes`` lowers (or raises) it."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputField(Strict):
    """One field of a job's ``input`` object."""

    type: InputType = "text"
    required: bool = True
    description: str = ""
    max_length: int | None = Field(None, gt=0, description="For text: the longest value accepted.")
    max_bytes: int | None = Field(
        None, gt=0, description="For file inputs (image, audio, video): the largest upload (default: "
        + ", ".join(f"{kind} {size // 2**20} MiB" for kind, size in DEFAULT_MAX_BYTES.items()) + ").",
    )
    default: JsonScalar = None
    choices: tuple[str, ...] | None = Field(
        None, min_length=1, description="For text: the only values accepted (a voice of the checkpoint's, say).")

    @model_validator(mode="after")
    def _check_kind_options(self) -> InputField:
        if self.max_length is not None and self.type != "text":
            raise ValueError(f"max_length applies to text inputs, not {self.type}")
        if self.choices is not None and self.type != "text":
            raise ValueError(f"choices apply to text inputs, not {self.type}")
        if self.choices is not None and self.default is not None and self.default not in self.choices:
            raise ValueError(f"default {self.default!r} is not one of the choices {list(self.choices)}")
        if self.max_bytes is not None and not self.is_file:
            raise ValueError(f"max_bytes applies to file inputs ({', '.join(FILE_INPUT_TYPES)}), not {self.type}")
        if self.is_file and self.default is not None:
            raise ValueError(f"an {self.type} input cannot have a default")
        return self

    @property
    def is_file(self) -> bool:
        """A file (image, audio, video): stored as an input artifact when a job is accepted."""
        return self.type in FILE_INPUT_TYPES

    @property
    def byte_limit(self) -> int:
        """The largest upload this field takes: its ``max_bytes``, else its type's default (0: not a file)."""
        default = DEFAULT_MAX_BYTES.get(self.type, 0)
        return (self.max_bytes or default) if default else 0


class Binding(Strict):
    """``<source>.<port>``: where a stage input comes from (``input.prompt``, ``ar.text``)."""

    source: str
    port: str

    @classmethod
    def parse(cls, text: str) -> Binding:
        source, sep, port = text.partition(".")
        if not sep or not source or not port:
            raise ValueError(f"{text!r} is not '<stage id>.<output>' or 'input.<field>'")
        return cls(source=source, port=port)

    def __str__(self) -> str:
        return f"{self.source}.{self.port}"


class DenoiseCacheSpec(Strict):
    """A diffusers built-in denoising cache (``transformer.enable_cache``), chosen per DiT stage.

    first_block: FirstBlockCacheConfig(threshold); faster: FasterCacheConfig; pab:
    PyramidAttentionBroadcastConfig. Other keys go to the config class as they are.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["first_block", "faster", "pab"]
    threshold: float | None = Field(None, gt=0, le=1, description="first_block: residual-change threshold.")


class DiTEngineArgs(BaseModel):
    """The engine_args of a DiT stage: how the diffusers pipeline is built; other keys go to from_pretrained."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kind: Literal["diffusers", "gpu-shaped"] = Field(
        "diffusers", description="The engine: a diffusers pipeline, or the GPU-shaped stand-in of the benchmark "
        "(GpuShapedArgs; never in a built-in pipeline)."
    )
    pipeline_class: str | None = Field(
        None, pattern=_PY_IDENTIFIER, description="diffusers class, e.g. PixArtSigmaPipeline; default: the model's own."
    )
    torch_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    call_args: JsonObject = Field(default_factory=dict, description="Extra keyword arguments of every call.")
    cache: DenoiseCacheSpec | None = Field(
        None, description="A diffusers denoising cache on the transformer: {type: first_block|faster|pab, ...}."
    )


class GpuShapedArgs(Strict):
    """The engine_args of a DiT stage on the GPU-shaped engine (``kind: gpu-shaped``, omni_jobs.engines.gpu_shaped):
    a benchmark's stand-in for a diffusion model on a GPU. The defaults are the H200's profile (docs/performance.md,
    "On a GPU"): 20 ms an image in batches of 32 at 256 px, 6% of the engine thread's time on the
    CPU side."""

    kind: Literal["gpu-shaped"]
    ms_per_image: float = Field(20.0, gt=0, le=60_000, description="An image's share of a full batch's time.")
    gil_share: float = Field(0.06, ge=0, le=1, description="Of a batch's time, the share that holds the "
                             "interpreter's lock (CPU-side work: launches, preparation); the rest the device's.")
    batch_size: int = Field(32, ge=1, le=1024, description="The largest batch in one device call (more is split), "
                            "and the size at which an image takes ms_per_image.")
    fixed_share: float = Field(0.17, ge=0, lt=1, description="Of a full batch's time, the part that does not "
                               "shrink with a smaller batch (the H200: one image alone took 6.25x its share of 32).")


def dit_engine_args(args: Mapping[str, JsonValue]) -> DiTEngineArgs | GpuShapedArgs:
    """A DiT stage's engine_args, validated for the engine its ``kind`` names; errors name the engine_args field."""
    try:
        if args.get("kind") == "gpu-shaped":
            return GpuShapedArgs.model_validate(args)
        return DiTEngineArgs.model_validate(args)
    except ValidationError as exc:
        raise ValueError(_pydantic_problems(exc, "engine_args")) from None


class BatchingSpec(Strict):
    """How a stage's worker batches requests; unset fields take the OMNI_BATCH_* / OMNI_STAGE_* settings."""

    max_batch_size: int | None = Field(None, ge=1, le=1024, description="Largest engine batch.")
    wait_ms: float | None = Field(None, ge=0, le=10_000, description="How long a request waits for batch-mates.")
    max_in_flight: int | None = Field(None, ge=1, le=1024, description="Jobs of this stage one worker runs at once.")


class StageCacheSpec(Strict):
    """The stage-output cache of a stage: a repeated (config, params, inputs) skips the engine."""

    enabled: bool = False
    max_entries: int | None = Field(None, ge=1, description="Default: OMNI_STAGE_CACHE_MAX_ENTRIES.")
    eviction: Literal["fifo", "lru"] | None = Field(None, description="Default: OMNI_STAGE_CACHE_EVICTION.")


def _pydantic_problems(exc: ValidationError, prefix: str) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        parts.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


class ProjectionSpec(Strict):
    """A linear map applied to a stage's ``prompt_embeds`` before its engine takes them: a ``torch.nn.Linear``
    stored in a checkpoint, named by its tensors' prefix (Qwen2.5-Omni's talker reads the thinker's hidden
    states through ``talker.thinker_to_talker_proj``)."""

    model: str = Field(min_length=1, description="The checkpoint holding it: a local path, hub id or tiny:<name>.")
    weight: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9_.]+$",
        description="The Linear's name in the checkpoint: '<weight>.weight' [out, in] and, if present, '<weight>.bias'.",
    )


Bindings = Binding | tuple[Binding, ...]
"""What feeds one input port: one source, or (ports that take several, e.g. an AR stage's ``image``) a list."""


class StageSpec(Strict):
    """One stage: which engine runs which task on which model and queue, fed by what, producing what."""

    id: str = Field(pattern=_ID)
    engine: EngineKind
    task: str | None = Field(
        None, description="What the engine does: ar: generate | encode | transcribe | recite | talk; dit: "
        "text-to-image | image-to-image | text-to-audio | text-to-video | code2wav. Default: generate (ar), "
        "text-to-image (dit)."
    )
    model: str = Field(min_length=1, description="Local path, hub id, or tiny:<name> (built locally).")
    queue: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Celery queue; default: engine.")
    inputs: dict[str, Bindings] = Field(
        description="Engine input port -> '<stage>.<output>' or 'input.<field>' (a list for ports that take several)."
    )
    produces: tuple[str, ...] | None = Field(
        None, alias="outputs", description="Which of the task's outputs to produce and hand on; default: the task's."
    )
    engine_args: JsonObject = Field(default_factory=dict)
    projection: ProjectionSpec | None = Field(
        None, description="A linear map from the upstream hidden states to this stage's prompt_embeds input."
    )
    stream_input: str | None = Field(
        None, description="An input port read while its upstream stage still writes it (code2wav: audio_codes): "
        "this stage starts as soon as that stage starts, and streams its own output as it goes.")
    defaults: dict[str, JsonScalar] = Field(default_factory=dict, description="Stage parameters; jobs may override.")
    soft_time_limit_s: float | None = Field(None, gt=0, description="Default: OMNI_STAGE_SOFT_TIME_LIMIT_S.")
    time_limit_s: float | None = Field(None, gt=0, description="Hard limit; default: OMNI_STAGE_TIME_LIMIT_S.")
    batching: BatchingSpec = Field(default_factory=BatchingSpec, description="Batch size, wait window, in-flight.")
    cache: StageCacheSpec = Field(default_factory=StageCacheSpec, description="The stage-output cache (off by default).")
    description: str = ""

    @field_validator("inputs", mode="before")
    @classmethod
    def _parse_bindings(cls, value: object) -> object:
        def parse(v: object) -> object:
            return Binding.parse(v) if isinstance(v, str) else v

        if isinstance(value, dict):
            return {k: tuple(parse(i) for i in v) if isinstance(v, list | tuple) else parse(v) for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _check_task_ports_args_defaults(self) -> StageSpec:
        tasks = ENGINE_TASKS[self.engine]
        if self.task is not None and self.task not in tasks:
            raise ValueError(f"task: engine '{self.engine}' has no task '{self.task}'; tasks: {sorted(tasks)}")
        ports = self.ports
        unknown = sorted(set(self.inputs) - set(ports.inputs))
        if unknown:
            raise ValueError(
                f"inputs: {self._what} has no input {unknown}; it accepts {sorted(ports.inputs)}"
            )
        for port, sources in self.inputs.items():
            if isinstance(sources, tuple) and port not in ports.many:
                raise ValueError(f"inputs.{port}: {self._what} takes one source for '{port}', not a list")
            if isinstance(sources, tuple) and not sources:
                raise ValueError(f"inputs.{port}: an empty list; name at least one source")
        if self.stream_input is not None:
            streamable = STREAMING_INPUTS.get((self.engine, self.task_name), frozenset())
            if self.stream_input not in streamable:
                raise ValueError(f"stream_input: {self._what} reads no input while it is written"
                                 + (f"; it can stream {sorted(streamable)}" if streamable else ""))
            if self.stream_input not in self.inputs or isinstance(self.inputs[self.stream_input], tuple):
                raise ValueError(f"stream_input: '{self.stream_input}' must be an input wired to one source")
        if self.projection is not None and "prompt_embeds" not in self.inputs:
            raise ValueError("projection: it maps the stage's prompt_embeds input, which is not wired")
        missing = sorted(ports.required_inputs - set(self.inputs))
        if missing:
            raise ValueError(f"inputs: {self._what} needs input {missing}")
        for group in ports.exclusive:
            bound = sorted(group & set(self.inputs))
            if len(bound) != 1:
                raise ValueError(
                    f"inputs: {self._what} takes exactly one of {sorted(group)}, got {bound or 'none'}"
                )
        if self.produces is not None:
            bad = [p for p in self.produces if p not in ports.outputs]
            if bad:
                raise ValueError(f"outputs: {self._what} has no output {bad}; it offers {sorted(ports.outputs)}")
            if not self.produces or len(set(self.produces)) != len(self.produces):
                raise ValueError("outputs: list each output once, at least one")
        if self.engine == "dit":
            dit_engine_args(self.engine_args)
        try:
            self.params_model.model_validate(self.defaults)
        except ValidationError as exc:
            raise ValueError(_pydantic_problems(exc, "defaults")) from None
        return self

    @property
    def _what(self) -> str:
        return f"engine '{self.engine}' task '{self.task_name}'"

    @property
    def task_name(self) -> str:
        """The task this stage runs (the engine's default when the YAML names none)."""
        return self.task or DEFAULT_TASK[self.engine]

    @property
    def ports(self) -> EnginePorts:
        return ENGINE_TASKS[self.engine][self.task_name]

    @property
    def queue_name(self) -> str:
        return self.queue or self.engine

    @property
    def outputs(self) -> dict[str, Modality]:
        """The outputs this stage produces (and stores for the next stages), with their modality."""
        wanted = self.produces if self.produces is not None else self.ports.default_outputs
        return {port: modality for port, modality in self.ports.outputs.items() if port in wanted}

    @property
    def conditioned_on_embeds(self) -> bool:
        """A DiT fed prompt embeddings from upstream instead of text for its own text encoder."""
        return "prompt_embeds" in self.inputs

    @property
    def params_model(self) -> type[StageParams]:
        """The parameter model this stage's defaults and a job's overrides are validated against."""
        return params_model(self.engine, self.task_name, conditioned_on_embeds=self.conditioned_on_embeds)

    def params(self, values: Mapping[str, JsonValue]) -> StageParams:
        """Validated parameters from a job's recorded values for this stage."""
        return self.params_model.model_validate(values)

    @cached_property
    def default_params(self) -> Mapping[str, JsonScalar]:
        """The stage's defaults, validated and flat: a job without overrides for this stage records
        these (validated once, not per submit; the spec is frozen)."""
        return MappingProxyType(self.params(self.defaults).model_dump())

    def bindings(self) -> list[tuple[str, Binding]]:
        """Every (port, source) pair, a list-wired port once per source, in order."""
        return [(port, b) for port, bound in self.inputs.items()
                for b in (bound if isinstance(bound, tuple) else (bound,))]

    def binding(self, port: str) -> Binding | None:
        """The one source of a single-source port (None when unwired)."""
        bound = self.inputs.get(port)
        if isinstance(bound, tuple):
            raise TypeError(f"stage '{self.id}' input '{port}' has several sources")
        return bound

    def upstream(self) -> set[str]:
        return {b.source for _, b in self.bindings() if b.source != INPUT_SOURCE}

    @property
    def stream_source(self) -> Binding | None:
        """The upstream output this stage reads while it is written (its ``stream_input``'s source)."""
        return self.binding(self.stream_input) if self.stream_input is not None else None


class OutputSpec(Strict):
    """A final output of the pipeline: a name clients see, and the stage port(s) it comes from.

    Several ports (``from: [ar.text, dit.image]``) make one bundled output (type ``text+image``).
    """

    name: str = Field(pattern=_ID)
    sources: tuple[Binding, ...] = Field(alias="from", min_length=1)

    @field_validator("sources", mode="before")
    @classmethod
    def _parse(cls, value: object) -> object:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list | tuple):
            return tuple(Binding.parse(v) if isinstance(v, str) else v for v in value)
        return value

    @property
    def source(self) -> Binding:
        """The first (for single-port outputs: the only) port this output comes from."""
        return self.sources[0]

    def from_text(self) -> str | list[str]:
        """As written in YAML: one binding, or a list of them."""
        texts = [str(b) for b in self.sources]
        return texts[0] if len(texts) == 1 else texts


class PipelineSpec(Strict):
    """A whole pipeline: inputs, the stage graph, and its final outputs."""

    name: str = Field(pattern=_ID)
    description: str = ""
    inputs: dict[str, InputField]
    stages: list[StageSpec] = Field(min_length=1)
    outputs: list[OutputSpec] = Field(min_length=1)

    @field_validator("inputs")
    @classmethod
    def _input_names(cls, value: dict[str, InputField]) -> dict[str, InputField]:
        for name in value:
            if not re.match(_ID, name):
                raise ValueError(f"input name {name!r} must match {_ID}")
        return value

    @model_validator(mode="after")
    def _check_graph(self) -> PipelineSpec:
        ids = [s.id for s in self.stages]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"stages: duplicate stage id {dupes}")
        if INPUT_SOURCE in ids:
            raise ValueError(f"stages: '{INPUT_SOURCE}' is reserved for the job input")
        by_id = {s.id: s for s in self.stages}
        for stage in self.stages:
            for port, binding in stage.bindings():
                accepted = stage.ports.inputs[port]
                got = self._modality_of(binding, by_id, where=f"stage '{stage.id}' input '{port}'")
                if got not in accepted:
                    want = " or ".join(accepted)
                    raise ValueError(f"stage '{stage.id}' input '{port}' wants {want} but '{binding}' gives {got}")
            self._check_sizes(stage, by_id)
            self._check_stream(stage, by_id)
        self._check_acyclic(by_id)
        names = [o.name for o in self.outputs]
        if len(set(names)) != len(names):
            raise ValueError("outputs: duplicate output name")
        for out in self.outputs:
            self.output_type(out)
        return self

    @staticmethod
    def _check_stream(stage: StageSpec, by_id: dict[str, StageSpec]) -> None:
        """A streamed input must come from a stage that publishes that output while it runs."""
        source = stage.stream_source
        if source is None:
            return
        upstream = by_id.get(source.source)
        if upstream is None or source.port not in STREAMED_OUTPUTS.get((upstream.engine, upstream.task_name), ()):
            raise ValueError(f"stage '{stage.id}' stream_input '{stage.stream_input}': '{source}' is not written "
                             "while its stage runs (streamed outputs: ar talk audio_codes)")

    def streamed_outputs(self, stage_id: str) -> set[str]:
        """The outputs of ``stage_id`` that a stage downstream reads while they are written: its run publishes them."""
        return {s.stream_source.port for s in self.stages
                if s.stream_source is not None and s.stream_source.source == stage_id}

    def _check_sizes(self, stage: StageSpec, by_id: dict[str, StageSpec]) -> None:
        """Sizes that must agree across a wire, where the model configs are knowable (model_info)."""
        if stage.engine != "dit":
            self._check_ar_embeds(stage, by_id)
            return
        facts = model_facts("dit", stage.model)
        if "prompt" in stage.inputs and facts.text_encoder is False:
            raise ValueError(
                f"stage '{stage.id}' input 'prompt': model '{stage.model}' has no text encoder, so it cannot take "
                "text; wire 'prompt_embeds' from an AR stage with task: encode (the LLM is its text encoder)"
            )
        binding = stage.binding("prompt_embeds")
        if binding is None or binding.source == INPUT_SOURCE:
            return
        upstream = by_id[binding.source]
        produced = model_facts(upstream.engine, upstream.model).hidden_size if upstream.engine == "ar" else None
        wanted = facts.prompt_embed_dim
        if produced is not None and wanted is not None and produced != wanted:
            raise ValueError(
                f"stage '{stage.id}' input 'prompt_embeds': '{binding}' gives hidden states of size {produced} "
                f"(model '{upstream.model}' hidden_size) but model '{stage.model}' takes prompt embeddings of size "
                f"{wanted} (transformer {facts.embed_dim_source}); use a DiT built for that LLM, or an LLM whose "
                f"hidden_size is {wanted}"
            )

    @staticmethod
    def _check_ar_embeds(stage: StageSpec, by_id: dict[str, StageSpec]) -> None:
        """An AR stage fed hidden states takes them at its own hidden size (after its projection, if any);
        a wrong size was seen to wedge vLLM for every later request, so it is refused here where knowable."""
        binding = stage.binding("prompt_embeds")
        if binding is None or binding.source == INPUT_SOURCE or stage.projection is not None:
            return
        upstream = by_id[binding.source]
        produced = model_facts("ar", upstream.model).hidden_size if upstream.engine == "ar" else None
        wanted = model_facts("ar", stage.model).hidden_size
        if produced is not None and wanted is not None and produced != wanted:
            raise ValueError(
                f"stage '{stage.id}' input 'prompt_embeds': '{binding}' gives hidden states of size {produced} "
                f"(model '{upstream.model}') but model '{stage.model}' takes embeddings of size {wanted} "
                "(its hidden_size); name a projection (projection: {model, weight}) that maps one to the other"
            )

    def _modality_of(self, binding: Binding, by_id: dict[str, StageSpec], *, where: str) -> Modality | None:
        if binding.source == INPUT_SOURCE:
            field = self.inputs.get(binding.port)
            if field is None:
                raise ValueError(f"{where}: the pipeline has no input '{binding.port}' (inputs: {sorted(self.inputs)})")
            return INPUT_TYPE_MODALITY[field.type]
        upstream = by_id.get(binding.source)
        if upstream is None:
            raise ValueError(f"{where}: no stage '{binding.source}' (stages: {sorted(by_id)})")
        modality = upstream.outputs.get(binding.port)
        if modality is None:
            offered = sorted(upstream.ports.outputs)
            if binding.port in upstream.ports.outputs:
                raise ValueError(
                    f"{where}: stage '{binding.source}' does not produce '{binding.port}'; add it to that stage's "
                    f"outputs (it produces {sorted(upstream.outputs)})"
                )
            raise ValueError(f"{where}: stage '{binding.source}' has no output '{binding.port}' (outputs: {offered})")
        return modality

    def output_modalities(self, out: OutputSpec) -> list[Modality]:
        """The modality of each port an output comes from, in order."""
        by_id = {s.id: s for s in self.stages}
        modalities: list[Modality] = []
        for source in out.sources:
            if source.source == INPUT_SOURCE:
                raise ValueError(f"outputs: '{out.name}' must come from a stage, not from the input")
            modality = self._modality_of(source, by_id, where=f"output '{out.name}'")
            assert modality is not None  # stage outputs always have one
            modalities.append(modality)
        return modalities

    def output_type(self, out: OutputSpec) -> str:
        """The output's type (``image``, ``text+image``...): which results handler writes it."""
        kind = output_type(self.output_modalities(out))
        if kind not in OUTPUT_TYPES:
            bundles = [t for t in OUTPUT_TYPES if "+" in t]
            raise ValueError(
                f"output '{out.name}': no output handler for type '{kind}'; an output comes from one port, "
                f"or from several that make one of {bundles}"
            )
        return kind

    def _check_acyclic(self, by_id: dict[str, StageSpec]) -> None:
        state: dict[str, int] = {}

        def visit(sid: str, path: list[str]) -> None:
            if state.get(sid) == 2:
                return
            if state.get(sid) == 1:
                raise ValueError(f"stages: cycle {' -> '.join([*path, sid])}")
            state[sid] = 1
            for up in sorted(by_id[sid].upstream()):
                visit(up, [*path, sid])
            state[sid] = 2

        for sid in by_id:
            visit(sid, [])

    # --- graph queries used by the runner ---
    def stage(self, stage_id: str) -> StageSpec:
        for stage in self.stages:
            if stage.id == stage_id:
                return stage
        raise KeyError(f"pipeline '{self.name}' has no stage '{stage_id}'")

    def entry_stages(self) -> list[StageSpec]:
        """Stages fed only by the job input: enqueued when the job is accepted."""
        return [s for s in self.stages if not s.upstream()]

    def downstream(self, stage_id: str) -> list[StageSpec]:
        return [s for s in self.stages if stage_id in s.upstream()]

    def queues(self) -> set[str]:
        return {s.queue_name for s in self.stages}

    def file_inputs(self) -> list[str]:
        """Job inputs that are files (image, audio, video): stored as input artifacts when a job is accepted."""
        return [name for name, field in self.inputs.items() if field.is_file]
