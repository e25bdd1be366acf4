"""The layout shows the architecture, and the direction of imports holds.

The core (omni_jobs/, less the tooling packages) imports neither its tooling (omni_jobs.cli,
omni_jobs.client, omni_jobs.local) nor the shells (api, workers) nor Celery or FastAPI; only the
Prometheus adapter (omni_jobs/report/metrics.py, installed by the shells) imports prometheus_client, and
no core module imports a private name of another. Checked on the source (ASTs), so an import
inside a function or under TYPE_CHECKING counts too. The Layout section of docs/architecture.md names
every top-level module and package of omni_jobs/.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_jobs.pipelines import model_source

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "omni_jobs"
TOOLING = ("cli", "client", "local")
FORBIDDEN_IN_CORE = (*(f"omni_jobs.{t}" for t in TOOLING), "api", "workers", "celery", "fastapi", "starlette")
PROMETHEUS = ("prometheus_client", "omni_jobs.report.metrics")
PROMETHEUS_ADAPTER = PACKAGE / "report" / "metrics.py"
LAYERS = ("core", "pipelines", "artifacts", "jobs", "media", "engines", "dispatch", "run", "report", "accept")
"""The core's packages, lowest first: a job's walk (accept, dispatch, run, report) on what it stands on."""
COMPOSITION = ("executor", "runtime", "omni")
"""The root's modules: they wire the layers together, and only the tooling and the shells import them."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def core_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in TOOLING)


def imports(path: Path, source: str | None = None) -> Iterator[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in ``path``, relative ones resolved."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    text = path.read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [alias.name for alias in node.names]
            yield node.lineno, base, names
            for name in names:  # ``from omni_jobs import cli`` imports the module omni_jobs.cli
                yield node.lineno, f"{base}.{name}", []


def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_tooling_packages_exist() -> None:
    for name in TOOLING:
        assert (PACKAGE / name / "__init__.py").is_file(), name
    assert core_modules(), "no core modules found"


def test_the_core_imports_no_tooling_no_shell_and_no_framework() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in core_modules()
        for line, module, _ in imports(path)
        if _matches(module, FORBIDDEN_IN_CORE)
    ]
    assert not found, "the core must not import these (tooling -> core, never the reverse):\n" + "\n".join(found)


def test_only_the_prometheus_adapter_imports_prometheus() -> None:
    """Storage and engine code report to omni_jobs.core.telemetry; api/ and workers/ install metrics.install()."""
    found = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in core_modules()
        if path != PROMETHEUS_ADAPTER
        for line, module, _ in imports(path)
        if _matches(module, PROMETHEUS)
    ]
    assert not found, "\n".join(found)


def test_no_core_module_imports_a_private_name() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: from {module} import {name}"
        for path in core_modules()
        for line, module, names in imports(path)
        if module.startswith("omni_jobs")
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not found, "\n".join(found)


def _rank(module: str) -> int | None:
    """The layer of an omni_jobs module (len(LAYERS) for the root's composition modules), None for the package."""
    parts = module.split(".")
    if parts[0] != "omni_jobs" or len(parts) == 1:
        return None
    if parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return len(LAYERS)


def test_the_root_holds_the_layers_the_tooling_and_the_composition_alone() -> None:
    entries = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").is_file())}
    assert entries == {*LAYERS, *TOOLING, *COMPOSITION}, (
        f"omni_jobs/ holds {sorted(entries - {*LAYERS, *TOOLING, *COMPOSITION})} outside LAYERS, TOOLING and "
        f"COMPOSITION, and lacks {sorted({*LAYERS, *TOOLING, *COMPOSITION} - entries)}: put a module in the layer "
        "whose work it does (docs/architecture.md, Layout)")


def test_no_import_runs_up_the_layers() -> None:
    found = []
    for path in core_modules():
        own = _rank(_module_name(path))
        assert own is not None or path.name == "__init__.py", path
        for line, module, _ in imports(path):
            theirs = _rank(module) if module.startswith("omni_jobs") else None
            if own is not None and theirs is not None and theirs > own:
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {module} "
                             f"({(LAYERS + ('the root',))[theirs]} is above {(LAYERS + ('the root',))[own]})")
    assert not found, "imports run down the layers (LAYERS, lowest first), never up:\n" + "\n".join(found)


def _type_checking_lines(path: Path) -> set[int]:
    """The lines of ``if TYPE_CHECKING:`` blocks: imports for annotations alone, never run."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _import_graph() -> dict[str, set[str]]:
    """Module -> the omni_jobs modules it imports when it runs (at its top or inside a function)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for_types = _type_checking_lines(path)
        graph[name] = {m for line, m, _ in imports(path)
                       if m in modules and m != name and m != "omni_jobs" and line not in for_types}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_each_other() -> None:
    """An import inside a function counts: it hides a cycle, it does not end it. One under TYPE_CHECKING names
    a type for the checker alone (a Protocol and the class that implements it may name each other)."""
    assert not _cycles(_import_graph())


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_sees_nested_and_relative_imports() -> None:
    source = "def f():\n    from omni_jobs.local import tiny\n    from .x import _private\n"
    found = list(imports(PACKAGE / "engines" / "probe.py", source))
    assert (2, "omni_jobs.local.tiny", []) in found
    assert (3, "omni_jobs.engines.x", ["_private"]) in found


def _layout_section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", text, re.DOTALL | re.MULTILINE)
    assert match, "docs/architecture.md has no '## Layout' section"
    return match.group(1)


def test_the_layout_section_names_every_top_level_module_and_package() -> None:
    layout = _layout_section()
    names = sorted(
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").is_file())
    )
    missing = [n for n in names if not re.search(rf"(?<!\w){re.escape(n)}\b", layout)]
    assert not missing, f"docs/architecture.md's Layout section does not name: {missing}"
    gone = [m for m in re.findall(r"omni_jobs/(\w+)/", layout) if not (PACKAGE / m).is_dir()]
    assert not gone, f"docs/architecture.md's Layout section names packages that do not exist: {gone}"


# --- the model-source registry: how the core resolves tiny:NAME without importing the tooling ---


@pytest.mark.parametrize("model", ["/models/llama", "var/models/tiny-llama", "Qwen/Qwen2.5-0.5B", "s3://b/m"])
def test_a_path_or_hub_id_resolves_to_itself(model: str, tmp_path: Path) -> None:
    assert model_source.resolve_model(model, tmp_path) == model
    assert model_source.source_facts(model) is None


def test_a_registered_source_resolves_its_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source, "_SOURCES", dict(model_source._SOURCES))  # registered for this test only
    calls: list[tuple[str, Path]] = []

    def resolve(name: str, models_dir: Path) -> str:
        calls.append((name, models_dir))
        return str(models_dir / name)

    model_source.register_model_source(
        model_source.ModelSource("probe:", resolve, facts=lambda name: {"hidden_size": 8})
    )
    assert model_source.resolve_model("probe:abc", tmp_path) == str(tmp_path / "abc")
    assert calls == [("abc", tmp_path)]
    assert model_source.source_facts("probe:abc") == {"hidden_size": 8}


def test_tiny_ids_resolve_through_the_default_plugin(tmp_path: Path) -> None:
    """OMNI_MODEL_SOURCES defaults to omni_jobs.local.tiny: its facts are known without building."""
    from omni_jobs.local import tiny
    from omni_jobs.pipelines.model_info import model_facts

    assert model_facts("ar", "tiny:llama").hidden_size == tiny.LLAMA_HIDDEN_SIZE
    with pytest.raises(ValueError, match="unknown tiny model"):
        model_source.resolve_model("tiny:nope", tmp_path)
