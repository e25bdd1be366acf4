"""The playground form of a pipeline, generated from its spec, and the job request a posted form makes.

Fields come from what the pipeline declares, nothing is hard-coded per pipeline:
- its ``inputs`` (text, integer, number, boolean; image, audio and video as file uploads; max_length,
  max_bytes, default, required);
- each stage's parameter model (the JSON schema of ``StageSpec.params_model``: types, bounds,
  multiple_of, descriptions), pre-filled with that stage's ``defaults`` from the YAML.

Field names are the request's own paths (``input.prompt``, ``params.dit.height``), so an
``InvalidRequest`` from the submitter (loc ``("params", "dit", "height")``) lands beside its field.
A stage parameter is sent only when it differs from the stage's default (the job then records
the merged values); an emptied optional field means "not set".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.datastructures import FormData, UploadFile

from omni_jobs.core.errors import FieldError
from omni_jobs.pipelines.params import bounds_in_words, number_in_words
from omni_jobs.pipelines.spec import PipelineSpec, StageSpec

Kind = Literal["textarea", "text", "integer", "number", "checkbox", "file", "url", "select"]

LONG_TEXT = 200
"""Text fields allowing more than this many characters (or with no limit) are text areas."""

ENGINE_NAMES = {"ar": "AR · vLLM", "dit": "DiT · diffusers"}

FILE_FORMATS = {"image": "PNG, JPEG, WebP…", "audio": "WAV, MP3, FLAC, OGG, M4A…", "video": "MP4, WebM, MOV…"}
"""What a file input's upload may be, in the field's hint (omni_jobs.media.decode reads audio and video)."""

OPTION_WEBHOOK = "webhook"
OPTION_CANCEL_AFTER = "cancel_after"


@dataclass
class FormField:
    name: str
    """The request path it fills: input.prompt, params.dit.height, webhook, cancel_after."""
    label: str
    kind: Kind
    value: str = ""
    default: Any = None
    required: bool = False
    nullable: bool = False
    description: str = ""
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    exclusive_maximum: float | None = None
    multiple_of: float | None = None
    max_length: int | None = None
    max_bytes: int | None = None
    file_type: str | None = None
    """For a file field: image, audio or video (what it accepts, and how a chosen file is previewed)."""
    choices: tuple[str, ...] = ()
    """For a select: the values offered (a voice, say)."""
    error: str | None = None

    @property
    def html_id(self) -> str:
        return "f-" + self.name.replace(".", "-").replace("_", "-")

    @property
    def step(self) -> str:
        if self.multiple_of is not None:
            return _attr(self.multiple_of)
        return "1" if self.kind == "integer" else "any"

    @property
    def html_min(self) -> str | None:
        low = self.minimum if self.minimum is not None else self.exclusive_minimum
        return _attr(low) if low is not None else None

    @property
    def html_max(self) -> str | None:
        high = self.maximum if self.maximum is not None else self.exclusive_maximum
        return _attr(high) if high is not None else None

    @property
    def hint(self) -> str:
        """The allowed values in words: '16 to 2048, a multiple of 8', 'more than 0 up to 1'."""
        parts: list[str] = []
        if self.kind in ("integer", "number"):
            parts += bounds_in_words(self.minimum, self.maximum, self.exclusive_minimum, self.exclusive_maximum,
                                     self.multiple_of)
            if self.kind == "integer" and self.multiple_of is None:
                parts.append("whole number")
        if self.max_length is not None:
            parts.append(f"up to {self.max_length:,} characters")
        if self.max_bytes is not None:
            size = f"{self.max_bytes / 2**20:.3g} MiB" if self.max_bytes >= 2**20 else f"{self.max_bytes / 2**10:.3g} KiB"
            parts.append(f"{FILE_FORMATS.get(self.file_type or '', 'a file')}, up to {size}")
        if self.nullable and not self.required:
            parts.append("optional")
        if self.default is not None and self.kind not in ("file", "checkbox"):
            parts.append(f"default {_display(self.default)}")
        return "; ".join(parts)

    @property
    def accept(self) -> str:
        """The file input's ``accept``: image/*, audio/* or video/*."""
        return f"{self.file_type}/*" if self.file_type else ""

    @property
    def checked(self) -> bool:
        return self.value.lower() in ("true", "on", "1", "yes")


@dataclass
class StageFields:
    stage: StageSpec
    fields: list[FormField]
    error: str | None = None

    @property
    def name(self) -> str:
        return f"params.{self.stage.id}"

    @property
    def engine_name(self) -> str:
        return ENGINE_NAMES.get(self.stage.engine, self.stage.engine)


@dataclass
class PipelineForm:
    spec: PipelineSpec
    inputs: list[FormField]
    stages: list[StageFields]
    options: list[FormField]
    errors: list[str] = field(default_factory=list)
    """Errors that belong to no one field (shown above the form)."""

    def all_fields(self) -> list[FormField]:
        return [*self.inputs, *(f for s in self.stages for f in s.fields), *self.options]

    def field(self, name: str) -> FormField | None:
        return next((f for f in self.all_fields() if f.name == name), None)

    @property
    def has_errors(self) -> bool:
        return bool(self.errors or any(f.error for f in self.all_fields()) or any(s.error for s in self.stages))

    def attach(self, errors: list[FieldError]) -> None:
        """Put each error beside its field (or its stage), the rest above the form."""
        for err in errors:
            loc = tuple(str(p) for p in err.loc)
            name = ".".join(loc)
            if loc[:2] == ("header", "Cancel-After"):
                name = OPTION_CANCEL_AFTER
            target = self.field(name)
            if target is None and len(loc) > 3 and loc[0] == "params":  # e.g. a nested part of a value
                target = self.field(".".join(loc[:3]))
            if target is not None:
                target.error = _join(target.error, err.message)
                continue
            stage = next((s for s in self.stages if s.name == ".".join(loc[:2])), None)
            if stage is not None and len(loc) == 2:
                stage.error = _join(stage.error, err.message)
                continue
            self.errors.append(f"{name}: {err.message}" if name else err.message)


def _join(old: str | None, new: str) -> str:
    return new if not old else f"{old}; {new}"


def _attr(value: float) -> str:
    """A number as an HTML attribute value."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


_num = number_in_words

def _display(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else repr(value[:37] + "…")
    return str(value)


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def _label(name: str) -> str:
    return name.replace("_", " ")


def _schema_branch(prop: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The non-null branch of a property's schema, and whether null is allowed."""
    if "anyOf" in prop:
        branches = [b for b in prop["anyOf"] if b.get("type") != "null"]
        nullable = len(branches) < len(prop["anyOf"])
        branch = dict(branches[0]) if branches else {}
        return branch, nullable
    return dict(prop), False


def _param_field(stage: StageSpec, name: str, prop: dict[str, Any], required: bool) -> FormField:
    branch, nullable = _schema_branch(prop)
    default = stage.defaults.get(name, prop.get("default"))
    json_type = branch.get("type", "string")
    kind: Kind
    if json_type == "integer":
        kind = "integer"
    elif json_type == "number":
        kind = "number"
    elif json_type == "boolean":
        kind = "checkbox"
    elif isinstance(branch.get("enum"), list):
        kind = "select"
    else:
        max_length = branch.get("maxLength")
        kind = "textarea" if max_length is None or max_length > LONG_TEXT else "text"
    return FormField(
        name=f"params.{stage.id}.{name}", label=_label(name), kind=kind, value=_as_text(default), default=default,
        required=required, nullable=nullable, description=prop.get("description", ""),
        minimum=branch.get("minimum"), maximum=branch.get("maximum"),
        exclusive_minimum=branch.get("exclusiveMinimum"), exclusive_maximum=branch.get("exclusiveMaximum"),
        multiple_of=branch.get("multipleOf"), max_length=branch.get("maxLength"),
        choices=tuple(str(c) for c in branch.get("enum") or ()),
    )


def stage_fields(stage: StageSpec) -> StageFields:
    schema = stage.params_model.model_json_schema()
    required = set(schema.get("required", []))
    fields = [_param_field(stage, name, prop, name in required) for name, prop in schema.get("properties", {}).items()]
    return StageFields(stage=stage, fields=fields)


def input_fields(spec: PipelineSpec) -> list[FormField]:
    kinds: dict[str, Kind] = {"integer": "integer", "number": "number", "boolean": "checkbox", "image": "file",
                              "audio": "file", "video": "file"}
    fields = []
    for name, inp in spec.inputs.items():
        kind = kinds.get(inp.type) or ("select" if inp.choices else
                                       "textarea" if inp.max_length is None or inp.max_length > LONG_TEXT else "text")
        fields.append(FormField(
            name=f"input.{name}", label=_label(name), kind=kind, value=_as_text(inp.default), default=inp.default,
            required=inp.required and inp.default is None, nullable=not inp.required, description=inp.description,
            max_length=inp.max_length,
            max_bytes=inp.byte_limit if inp.is_file else None, file_type=inp.type if inp.is_file else None,
            choices=inp.choices or (),
        ))
    return fields


def option_fields() -> list[FormField]:
    return [
        FormField(name=OPTION_WEBHOOK, label="webhook", kind="url", nullable=True,
                  description="An https:// URL that receives the job, signed, as it starts, progresses and ends."),
        FormField(name=OPTION_CANCEL_AFTER, label="cancel after (seconds)", kind="number", nullable=True,
                  exclusive_minimum=0, description="Cancel the job if it has not finished by then."),
    ]


def build_form(spec: PipelineSpec) -> PipelineForm:
    """The form with the spec's defaults filled in."""
    return PipelineForm(spec=spec, inputs=input_fields(spec), stages=[stage_fields(s) for s in spec.stages],
                        options=option_fields())


def prefill(form: PipelineForm, job: dict[str, Any]) -> None:
    """Fill the form with a job's inputs and parameters ("run again"); files cannot be refilled."""
    for f in form.inputs:
        value = job.get("input", {}).get(f.name.removeprefix("input."))
        if f.kind != "file" and value is not None and not isinstance(value, dict):
            f.value = _as_text(value)
    for stage in form.stages:
        recorded = job.get("params", {}).get(stage.stage.id, {})
        for f in stage.fields:
            key = f.name.rsplit(".", 1)[1]
            if key in recorded:
                f.value = _as_text(recorded[key])


@dataclass
class ParsedForm:
    input: dict[str, Any]
    params: dict[str, dict[str, Any]]
    webhook: str | None
    cancel_after_s: float | None
    errors: list[FieldError]


def _convert(f: FormField, raw: str) -> tuple[Any, str | None]:
    """The typed value of a submitted string, or an error in words."""
    raw = raw.replace("\r\n", "\n")  # browsers send a text area's line breaks as CRLF
    text = raw.strip() if f.kind not in ("textarea", "text") else raw
    if f.kind == "integer":
        try:
            number = float(text)
        except ValueError:
            return None, "must be a whole number"
        if not number.is_integer():
            return None, "must be a whole number"
        return int(number), None
    if f.kind == "number":
        try:
            value = float(text)
        except ValueError:
            return None, "must be a number"
        if not math.isfinite(value):
            return None, "must be a finite number"
        return value, None
    if f.kind == "checkbox":
        return text.lower() in ("true", "on", "1", "yes"), None
    return raw, None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    return bool(a == b)


async def parse_form(form: PipelineForm, data: FormData) -> ParsedForm:
    """The job request the posted form describes; each field keeps what was typed (to show it again)."""
    inputs: dict[str, Any] = {}
    params: dict[str, dict[str, Any]] = {}
    errors: list[FieldError] = []

    def last(name: str) -> str | UploadFile | None:
        values = data.getlist(name)
        return values[-1] if values else None

    for f in form.inputs:
        key = f.name.removeprefix("input.")
        value = last(f.name)
        if f.kind == "file":
            if isinstance(value, UploadFile) and (value.filename or value.size):
                # One byte over the limit is enough for the limit's error.
                inputs[key] = await value.read(f.max_bytes + 1 if f.max_bytes else -1)
            continue
        f.value = value if isinstance(value, str) else ""
        if f.kind == "checkbox":
            inputs[key] = f.checked
            continue
        if f.value == "" and (f.kind not in ("text", "textarea") or not f.required):
            continue  # not given: the input's default applies, or the submitter says it is required
        converted, problem = _convert(f, f.value)
        if problem:
            errors.append(FieldError(tuple(f.name.split(".")), problem, "type_error"))
        else:
            inputs[key] = converted

    for stage in form.stages:
        for f in stage.fields:
            key = f.name.rsplit(".", 1)[1]
            value = last(f.name)
            if value is None:  # not on the posted form at all: the stage default applies
                continue
            f.value = value if isinstance(value, str) else ""
            empty = f.value == "" if f.kind == "textarea" else f.value.strip() == ""
            if empty:
                if f.default is not None and not f.nullable:
                    f.value = _as_text(f.default)  # emptied: back to the default, shown as such
                elif f.default is not None and f.nullable:
                    params.setdefault(stage.stage.id, {})[key] = None  # cleared on purpose
                continue
            converted, problem = _convert(f, f.value)
            if problem:
                errors.append(FieldError(tuple(f.name.split(".")), problem, "type_error"))
            elif not _same(converted, f.default):
                params.setdefault(stage.stage.id, {})[key] = converted

    webhook_field = form.field(OPTION_WEBHOOK)
    cancel_field = form.field(OPTION_CANCEL_AFTER)
    webhook = cancel_after = None
    if webhook_field is not None:
        value = last(OPTION_WEBHOOK)
        webhook_field.value = value.strip() if isinstance(value, str) else ""
        webhook = webhook_field.value or None
    if cancel_field is not None:
        value = last(OPTION_CANCEL_AFTER)
        cancel_field.value = value.strip() if isinstance(value, str) else ""
        if cancel_field.value:
            converted, problem = _convert(cancel_field, cancel_field.value)
            if problem:
                errors.append(FieldError((OPTION_CANCEL_AFTER,), problem, "type_error"))
            else:
                cancel_after = converted
    return ParsedForm(inputs, params, webhook, cancel_after, errors)
