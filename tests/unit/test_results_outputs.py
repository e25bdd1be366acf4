"""ResultsAssembler.write_outputs: a job's outputs written side by side, in the pipeline's order."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from PIL import Image

from omni_jobs.accept.submission import build_job, resolve_params
from omni_jobs.artifacts import ArtifactStore, LocalBackend
from omni_jobs.artifacts.codecs import encode_png
from omni_jobs.core import keys
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import Job
from omni_jobs.media.payloads import encode_payload
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.report.results import ResultsAssembler

CATALOGUE = load_catalogue([])


class SlowLocal(LocalBackend):
    """Each write waits until both have begun (so they must overlap), and one may fail."""

    def __init__(self, root: Path, fail: str | None = None) -> None:
        super().__init__(root)
        self.fail = fail
        self.begun = threading.Barrier(2, timeout=5)
        self.written: list[str] = []

    def put(self, key: str, data: bytes, **kwargs: object) -> None:  # type: ignore[override]
        if "/outputs/" in key:
            self.begun.wait()  # a BrokenBarrierError here: the writes ran one after the other
            if self.fail and key.endswith(self.fail):
                raise OSError(f"disk full writing {key}")
        super().put(key, data)
        self.written.append(key.rsplit("/", 1)[-1])


def text_to_image_job(store: ArtifactStore) -> Job:
    spec = CATALOGUE.get("text-to-image")
    job = build_job(spec, {"prompt": "a fox"}, resolve_params(spec, None))
    text = store.put_intermediate(keys.intermediate_artifact(job.id, "ar", "text"), encode_payload("text", "a fox"),
                                  "application/json")
    image = store.put_intermediate(keys.intermediate_artifact(job.id, "dit", "image"),
                                   encode_png(Image.new("RGB", (8, 4), "red")), "image/png")
    job.stage_record("ar").outputs = {"text": text}
    job.stage_record("dit").outputs = {"image": image}
    return job


def test_outputs_are_written_side_by_side_in_the_pipelines_order(tmp_path: Path) -> None:
    backend = SlowLocal(tmp_path)
    store = ArtifactStore(backend)
    job = text_to_image_job(store)
    results = ResultsAssembler(ledger=JobLedger(MemoryJobStore()), catalogue=CATALOGUE, artifacts=store)
    outputs = results.write_outputs(job)
    assert [o.name for o in outputs] == ["image", "text"]
    assert (outputs[0].width, outputs[0].height, outputs[1].text) == (8, 4, "a fox")
    assert sorted(backend.written[-2:]) == ["image.png", "text.json"]


def test_a_failed_write_is_raised_after_the_others_have_ended(tmp_path: Path) -> None:
    backend = SlowLocal(tmp_path, fail="text.json")
    store = ArtifactStore(backend)
    job = text_to_image_job(store)
    results = ResultsAssembler(ledger=JobLedger(MemoryJobStore()), catalogue=CATALOGUE, artifacts=store)
    with pytest.raises(Exception, match="disk full"):
        results.write_outputs(job)
    assert backend.written[-1] == "image.png"  # the other write finished before the error came back


class ThreadRecordingLocal(LocalBackend):
    """Records which thread wrote each output, and may fail it."""

    def __init__(self, root: Path, fail: bool = False) -> None:
        super().__init__(root)
        self.fail = fail
        self.threads: list[int] = []

    def put(self, key: str, data: bytes, **kwargs: object) -> None:  # type: ignore[override]
        self.threads.append(threading.get_ident())
        if self.fail:
            raise OSError(f"disk full writing {key}")
        super().put(key, data)


@pytest.mark.parametrize("fail", [False, True])
def test_a_lone_output_begun_early_is_written_on_the_calling_thread(tmp_path: Path, fail: bool) -> None:
    """Results inline, the last stage begins its job's files before its own outputs are stored; with
    one output there is nothing to write beside it, so no writer thread is handed the work."""
    backend = ThreadRecordingLocal(tmp_path, fail=fail)
    store = ArtifactStore(backend)
    spec = CATALOGUE.get("image-to-image")
    job = build_job(spec, {"image": "unused", "prompt": "a fox"}, resolve_params(spec, None))
    results = ResultsAssembler(ledger=JobLedger(MemoryJobStore()), catalogue=CATALOGUE, artifacts=store)
    (written,) = results.start_outputs(job, {("dit", "image"): encode_png(Image.new("RGB", (8, 4), "red"))})
    assert written.done() and backend.threads == [threading.get_ident()]
    if fail:
        assert isinstance(written.exception(), Exception) and "disk full" in str(written.exception())
    else:
        assert (written.result().name, written.result().width, written.result().height) == ("image", 8, 4)
