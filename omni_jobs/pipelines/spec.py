"""The pipeline spec: a stage graph written in YAML and validated by pydantic.

A pipeline names its job inputs, its stages (engine, model, queue, engine args, defaults, and which
port of which upstream stage feeds each input) and its final outputs. Everything a worker needs to
run a stage is derived from this object; nothing about a pipeline is hard-coded elsewhere.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_jobs.pipelines.modalities import ENGINE_PORTS, EngineKind, Modality
from omni_jobs.pipelines.params import params_model

INPUT_SOURCE = "input"
"""The pseudo-stage that stands for the job's own input in a binding like ``input.prompt``."""

_ID = r"^[a-z][a-z0-9_-]{0,39}$"

InputType = Literal["text", "integer", "number", "boolean"]
INPUT_TYPE_MODALITY: dict[InputType, Modality | None] = {
    "text": "text",
    "integer": None,
    "number": None,
    "boolean": None,
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputField(Strict):
    """One field of a job's ``input`` object."""

    type: InputType = "text"
    required: bool = True
    description: str = ""
    max_length: int | None = Field(None, gt=0, description="For text: the longest value accepted.")
    default: Any = None


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


class StageSpec(Strict):
    """One stage: which engine runs it, on which model and queue, fed by what."""

    id: str = Field(pattern=_ID)
    engine: EngineKind
    model: str = Field(min_length=1, description="Local path, hub id, or tiny:<name> (built locally).")
    queue: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Celery queue; default: engine.")
    inputs: dict[str, Binding] = Field(description="Engine input port -> '<stage>.<output>' or 'input.<field>'.")
    engine_args: dict[str, Any] = Field(default_factory=dict)
    defaults: dict[str, Any] = Field(default_factory=dict, description="Stage parameters; jobs may override.")
    description: str = ""

    @field_validator("inputs", mode="before")
    @classmethod
    def _parse_bindings(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: Binding.parse(v) if isinstance(v, str) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _check_ports_and_defaults(self) -> StageSpec:
        ports = ENGINE_PORTS[self.engine]
        unknown = sorted(set(self.inputs) - set(ports.inputs))
        if unknown:
            raise ValueError(
                f"inputs: engine '{self.engine}' has no input {unknown}; it accepts {sorted(ports.inputs)}"
            )
        missing = sorted(ports.required_inputs - set(self.inputs))
        if missing:
            raise ValueError(f"inputs: engine '{self.engine}' needs input {missing}")
        params_model(self.engine).model_validate(self.defaults)
        return self

    @property
    def queue_name(self) -> str:
        return self.queue or self.engine

    @property
    def outputs(self) -> dict[str, Modality]:
        return ENGINE_PORTS[self.engine].outputs

    def upstream(self) -> set[str]:
        return {b.source for b in self.inputs.values() if b.source != INPUT_SOURCE}


class OutputSpec(Strict):
    """A final output of the pipeline: a name clients see, and the stage port it comes from."""

    name: str = Field(pattern=_ID)
    source: Binding = Field(alias="from")

    @field_validator("source", mode="before")
    @classmethod
    def _parse(cls, value: Any) -> Any:
        return Binding.parse(value) if isinstance(value, str) else value


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
            for port, binding in stage.inputs.items():
                want = ENGINE_PORTS[stage.engine].inputs[port]
                got = self._modality_of(binding, by_id, where=f"stage '{stage.id}' input '{port}'")
                if got != want:
                    raise ValueError(
                        f"stage '{stage.id}' input '{port}' wants {want} but '{binding}' gives {got}"
                    )
        self._check_acyclic(by_id)
        names = [o.name for o in self.outputs]
        if len(set(names)) != len(names):
            raise ValueError("outputs: duplicate output name")
        for out in self.outputs:
            if out.source.source == INPUT_SOURCE:
                raise ValueError(f"outputs: '{out.name}' must come from a stage, not from the input")
            self._modality_of(out.source, by_id, where=f"output '{out.name}'")
        return self

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
            raise ValueError(
                f"{where}: stage '{binding.source}' has no output '{binding.port}' (outputs: {sorted(upstream.outputs)})"
            )
        return modality

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
