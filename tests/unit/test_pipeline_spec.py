"""Pipeline YAML validation: the built-in catalogue loads, and each kind of error names file, stage, field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omni_jobs.errors import PipelineSpecError, UnknownPipeline
from omni_jobs.pipelines.catalogue import load_catalogue, load_pipeline_file

VALID = {
    "name": "my-pipe",
    "inputs": {"prompt": {"type": "text"}},
    "stages": [
        {"id": "ar", "engine": "ar", "model": "tiny:llama", "inputs": {"prompt": "input.prompt"}},
        {"id": "dit", "engine": "dit", "model": "tiny:pixart", "inputs": {"prompt": "ar.text"},
         "defaults": {"height": 32, "width": 32}},
    ],
    "outputs": [{"name": "image", "from": "dit.image"}],
}


def write(tmp_path: Path, data: object, name: str = "pipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def broken(**changes: object) -> dict:
    data = yaml.safe_load(yaml.safe_dump(VALID))
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value
    return data


def problems_of(tmp_path: Path, data: object) -> tuple[str, list[str]]:
    path = write(tmp_path, data)
    with pytest.raises(PipelineSpecError) as info:
        load_pipeline_file(path)
    assert info.value.source == str(path)
    return str(info.value), info.value.problems


def test_builtin_catalogue_has_text_to_text_and_text_to_image() -> None:
    catalogue = load_catalogue()
    assert {"text-to-text", "text-to-image"} <= set(catalogue.names())
    t2i = catalogue.get("text-to-image")
    assert [s.id for s in t2i.stages] == ["ar", "dit"]
    assert [s.engine for s in t2i.stages] == ["ar", "dit"]
    assert str(t2i.stage("dit").inputs["prompt"]) == "ar.text"
    assert [o.name for o in t2i.outputs] == ["image", "text"]
    assert [s.id for s in t2i.entry_stages()] == ["ar"]
    assert [s.id for s in t2i.downstream("ar")] == ["dit"]
    assert t2i.queues() == {"ar", "dit"}


def test_unknown_pipeline_lists_the_available_ones() -> None:
    with pytest.raises(UnknownPipeline, match="available: .*text-to-image"):
        load_catalogue().get("nope")


def test_valid_user_pipeline_loads_and_can_replace_nothing_else(tmp_path: Path) -> None:
    spec = load_pipeline_file(write(tmp_path, VALID))
    assert spec.name == "my-pipe"
    catalogue = load_catalogue([tmp_path])
    assert "my-pipe" in catalogue and "text-to-image" in catalogue


def test_not_yaml(tmp_path: Path) -> None:
    message, _ = problems_of(tmp_path, "name: [unclosed")
    assert "not valid YAML" in message


def test_not_a_mapping(tmp_path: Path) -> None:
    _, problems = problems_of(tmp_path, "- a\n- b\n")
    assert "expected a mapping" in problems[0]


def test_unknown_engine_names_stage_and_field(tmp_path: Path) -> None:
    _, problems = problems_of(tmp_path, broken(stages__1__engine="gan"))
    assert any(p.startswith("stages[1] (stage 'dit').engine:") for p in problems), problems


def test_bad_default_value_names_stage_and_field(tmp_path: Path) -> None:
    data = broken()
    data["stages"][1]["defaults"]["height"] = 30  # not a multiple of 8
    _, problems = problems_of(tmp_path, data)
    assert any("stages[1] (stage 'dit')" in p and "height" in p and "multiple of 8" in p for p in problems), problems


def test_unknown_default_field(tmp_path: Path) -> None:
    data = broken()
    data["stages"][0]["defaults"] = {"max_tokenz": 3}
    _, problems = problems_of(tmp_path, data)
    assert any("stages[0] (stage 'ar')" in p and "max_tokenz" in p for p in problems), problems


def test_binding_to_missing_stage(tmp_path: Path) -> None:
    data = broken()
    data["stages"][1]["inputs"]["prompt"] = "llm.text"
    _, problems = problems_of(tmp_path, data)
    assert any("stage 'dit' input 'prompt': no stage 'llm'" in p for p in problems), problems


def test_binding_to_missing_output(tmp_path: Path) -> None:
    data = broken()
    data["stages"][1]["inputs"]["prompt"] = "ar.image"
    _, problems = problems_of(tmp_path, data)
    assert any("stage 'ar' has no output 'image'" in p for p in problems), problems


def test_modality_mismatch(tmp_path: Path) -> None:
    data = broken()
    data["stages"][1]["inputs"]["prompt"] = "ar.token_ids"
    _, problems = problems_of(tmp_path, data)
    assert any("wants text but 'ar.token_ids' gives token_ids" in p for p in problems), problems


def test_missing_job_input(tmp_path: Path) -> None:
    data = broken()
    data["stages"][0]["inputs"]["prompt"] = "input.text"
    _, problems = problems_of(tmp_path, data)
    assert any("the pipeline has no input 'text'" in p for p in problems), problems


def test_unknown_engine_input_port(tmp_path: Path) -> None:
    data = broken()
    data["stages"][1]["inputs"]["mask"] = "input.prompt"
    _, problems = problems_of(tmp_path, data)
    assert any("engine 'dit' has no input ['mask']" in p for p in problems), problems


def test_duplicate_stage_ids(tmp_path: Path) -> None:
    data = broken()
    data["stages"][1]["id"] = "ar"
    data["stages"][1]["inputs"]["prompt"] = "input.prompt"
    data["outputs"] = [{"name": "image", "from": "ar.text"}]
    _, problems = problems_of(tmp_path, data)
    assert any("duplicate stage id ['ar']" in p for p in problems), problems


def test_cycle(tmp_path: Path) -> None:
    data = broken()
    data["stages"][0]["inputs"]["prompt"] = "b.text"
    data["stages"][1] = {"id": "b", "engine": "ar", "model": "m", "inputs": {"prompt": "ar.text"}}
    data["outputs"] = [{"name": "t", "from": "b.text"}]
    _, problems = problems_of(tmp_path, data)
    assert any("cycle" in p for p in problems), problems


def test_output_from_missing_port(tmp_path: Path) -> None:
    data = broken()
    data["outputs"] = [{"name": "audio", "from": "dit.audio"}]
    _, problems = problems_of(tmp_path, data)
    assert any("output 'audio': stage 'dit' has no output 'audio'" in p for p in problems), problems


def test_extra_field_rejected(tmp_path: Path) -> None:
    data = broken()
    data["stages"][0]["gpu"] = 1
    _, problems = problems_of(tmp_path, data)
    assert any("stages[0] (stage 'ar').gpu" in p for p in problems), problems


def test_missing_file_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(PipelineSpecError, match="OMNI_PIPELINES_PATH"):
        load_catalogue([tmp_path / "missing.yaml"])
