"""Loading pipeline YAML files: the built-in catalogue plus the user's own.

Errors name the file, the stage (by index and id) and the field, because a user writing a
pipeline reads the message, not a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

import yaml
from pydantic import ValidationError

from omni_jobs.core.errors import PipelineSpecError, UnknownPipeline
from omni_jobs.pipelines.spec import PipelineSpec

BUILTIN_PACKAGE = "omni_jobs.pipelines"
BUILTIN_DIR = "catalogue"


def _describe_loc(loc: tuple[int | str, ...], data: object) -> str:
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(item, int):
            label = f"[{item}]"
            if isinstance(node, list) and item < len(node):
                node = node[item]
                if isinstance(node, dict) and "id" in node:
                    label += f" (stage '{node['id']}')"
            parts.append(label)
        else:
            parts.append(("." if parts else "") + str(item))
            node = node.get(item) if isinstance(node, dict) else None
    return "".join(parts) or "(top level)"


_A_LIST = "expected a list ([a, b], or a '- item' line each)"
_A_MAPPING = "expected a mapping (name: value)"
_SHAPES = {
    "list_type": _A_LIST,
    "tuple_type": _A_LIST,
    "dict_type": _A_MAPPING,
    "model_type": _A_MAPPING,
    "model_attributes_type": _A_MAPPING,
    "string_type": "expected text",
}
"""pydantic's error type -> what the YAML should hold there (its own words name Python types)."""


def _shape_of(value: object) -> str:
    if isinstance(value, dict):
        return f"a mapping {{{', '.join(map(str, list(value)[:3]))}{', ...' if len(value) > 3 else ''}}}"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"[:80]


def parse_pipeline(data: object, *, source: str) -> PipelineSpec:
    """Validate already-parsed YAML (whatever it holds); ``source`` names where it came from in errors."""
    if not isinstance(data, dict):
        raise PipelineSpecError(source, ["(top level): expected a mapping with name, inputs, stages, outputs"])
    try:
        return PipelineSpec.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            shape = _SHAPES.get(err["type"])
            msg = f"{shape}, got {_shape_of(err['input'])}" if shape else err["msg"].removeprefix("Value error, ")
            problems.append(f"{_describe_loc(tuple(err['loc']), data)}: {msg}")
        raise PipelineSpecError(source, problems) from None


def load_pipeline_file(path: Path) -> PipelineSpec:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PipelineSpecError(str(path), [f"cannot read the file: {exc.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PipelineSpecError(str(path), [f"not valid YAML: {exc}"]) from None
    return parse_pipeline(data, source=str(path))


def _yaml_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted([*path.glob("*.yaml"), *path.glob("*.yml")])
    if not path.exists():
        raise PipelineSpecError(str(path), ["no such file or directory (check OMNI_PIPELINES_PATH / --pipelines)"])
    return [path]


class PipelineCatalogue:
    """The pipelines a process knows, by name."""

    def __init__(self, pipelines: Iterable[PipelineSpec]) -> None:
        self._by_name: dict[str, PipelineSpec] = {}
        for spec in pipelines:
            self._by_name[spec.name] = spec

    def get(self, name: str) -> PipelineSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownPipeline(name, sorted(self._by_name)) from None

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __iter__(self) -> Iterator[PipelineSpec]:
        return iter(self._by_name[n] for n in self.names())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name


def builtin_pipelines() -> list[PipelineSpec]:
    folder = resources.files(BUILTIN_PACKAGE).joinpath(BUILTIN_DIR)
    specs = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith((".yaml", ".yml")):
            specs.append(parse_pipeline(yaml.safe_load(entry.read_text(encoding="utf-8")), source=f"builtin:{entry.name}"))
    return specs


def load_catalogue(extra_paths: Iterable[Path] = ()) -> PipelineCatalogue:
    """Built-in pipelines, then the user's files (a user's pipeline may replace a built-in one)."""
    specs = builtin_pipelines()
    for path in extra_paths:
        specs.extend(load_pipeline_file(f) for f in _yaml_files(Path(path)))
    return PipelineCatalogue(specs)
