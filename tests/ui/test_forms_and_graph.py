"""The playground form and the stage graph, generated from pipeline specs (no services needed)."""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from starlette.datastructures import FormData, Headers, UploadFile

from api.ui import forms, graph, views
from api.ui.routes import _byte_range
from api.ui.session import safe_next
from omni_jobs.core.errors import FieldError
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.pipelines.spec import PipelineSpec
from tests import media_files as mf

pytestmark = [pytest.mark.ui]

CATALOGUE = load_catalogue([])


def spec(name: str) -> PipelineSpec:
    return CATALOGUE.get(name)


def parse(s: PipelineSpec, values: dict[str, str]) -> tuple[forms.PipelineForm, forms.ParsedForm]:
    form = forms.build_form(s)
    # In a thread of its own: Playwright's sync API (tests/ui's session browser) keeps a loop running here.
    with ThreadPoolExecutor(1) as pool:
        parsed = pool.submit(asyncio.run, forms.parse_form(form, FormData(list(values.items())))).result()
    return form, parsed


@pytest.mark.parametrize("name", CATALOGUE.names())
def test_every_declared_input_and_stage_parameter_has_a_field_with_the_specs_default(name: str) -> None:
    s = spec(name)
    form = forms.build_form(s)
    assert [f.name for f in form.inputs] == [f"input.{n}" for n in s.inputs]
    for stage, fields in zip(s.stages, form.stages, strict=True):
        declared = set(stage.params_model.model_fields)
        assert {f.name.rsplit(".", 1)[1] for f in fields.fields} == declared
        for f in fields.fields:
            key = f.name.rsplit(".", 1)[1]
            default = stage.defaults.get(key, stage.params_model.model_fields[key].default)
            assert f.default == default, f.name


def test_bounds_types_and_hints_come_from_the_parameter_models() -> None:
    form = forms.build_form(spec("text-to-image"))
    height = form.field("params.dit.height")
    assert height is not None and height.kind == "integer" and height.value == "64"
    assert (height.html_min, height.html_max, height.step) == ("16", "2048", "8")
    assert height.hint == "16 to 2048; a multiple of 8; default 64"
    guidance = form.field("params.dit.guidance_scale")
    assert guidance is not None and guidance.kind == "number" and guidance.step == "any"
    template = form.field("params.ar.prompt_template")
    assert template is not None and template.kind == "textarea" and "{prompt}" in template.value
    seed = form.field("params.ar.seed")
    assert seed is not None and seed.nullable and seed.value == "" and "optional" in seed.hint
    prompt = form.field("input.prompt")
    assert prompt is not None and prompt.required and prompt.max_length == 2000
    strength = forms.build_form(spec("image-to-image")).field("params.dit.strength")
    assert strength is not None and strength.hint.startswith("more than 0; at most 1")
    image = forms.build_form(spec("image-to-image")).field("input.image")
    assert image is not None and image.kind == "file" and image.max_bytes == 16 * 2**20


def test_only_changed_parameters_are_sent_typed_and_text_areas_lose_their_crlf() -> None:
    s = spec("text-to-image")
    _form, parsed = parse(s, {
        "input.prompt": "a fox\r\nin snow", "params.dit.height": "32", "params.dit.width": "64",  # width = default
        "params.dit.guidance_scale": "4.50", "params.ar.seed": "", "params.dit.negative_prompt": "",
        "params.ar.prompt_template": "Draw: {prompt}\r\nNow:", "params.ar.max_tokens": " 7 "})
    assert parsed.errors == []
    assert parsed.input == {"prompt": "a fox\nin snow"}
    assert parsed.params == {"dit": {"height": 32}, "ar": {"prompt_template": "Draw: {prompt}\nNow:", "max_tokens": 7}}
    assert isinstance(parsed.params["dit"]["height"], int)
    assert parsed.webhook is None and parsed.cancel_after_s is None


def test_values_that_are_not_numbers_are_named_and_kept_for_the_page() -> None:
    form, parsed = parse(spec("text-to-image"), {"input.prompt": "x", "params.dit.height": "12.5",
                                                 "params.dit.guidance_scale": "lots", "cancel_after": "soon"})
    assert {e.loc: e.message for e in parsed.errors} == {
        ("params", "dit", "height"): "must be a whole number",
        ("params", "dit", "guidance_scale"): "must be a number",
        ("cancel_after",): "must be a number"}
    form.attach(parsed.errors)
    height = form.field("params.dit.height")
    assert height is not None and height.value == "12.5" and height.error == "must be a whole number"


def test_a_cleared_parameter_goes_back_to_its_default_and_a_cleared_nullable_one_is_unset() -> None:
    form, parsed = parse(spec("text-to-image"), {"input.prompt": "x", "params.dit.height": " ", "params.ar.seed": ""})
    assert parsed.params == {}
    height = form.field("params.dit.height")
    assert height is not None and height.value == "64"


def test_errors_are_put_beside_their_field_their_stage_or_above_the_form() -> None:
    form = forms.build_form(spec("image-to-image"))
    form.attach([
        FieldError(("input", "image"), "is required (image)"),
        FieldError(("params", "dit", "strength"), "Input should be greater than 0"),
        FieldError(("params", "dit"), "strength x steps leaves no denoising step"),
        FieldError(("header", "Cancel-After"), "must be between 0 and 86400 seconds"),
        FieldError(("webhook",), "must be https"),
        FieldError(("params", "nope"), "unknown stage 'nope'"),
        FieldError(("pipeline",), "unknown pipeline"),
    ])
    assert form.field("input.image").error == "is required (image)"  # type: ignore[union-attr]
    assert form.field("params.dit.strength").error == "Input should be greater than 0"  # type: ignore[union-attr]
    assert form.stages[0].error == "strength x steps leaves no denoising step"
    assert form.field("cancel_after").error == "must be between 0 and 86400 seconds"  # type: ignore[union-attr]
    assert form.field("webhook").error == "must be https"  # type: ignore[union-attr]
    assert form.errors == ["params.nope: unknown stage 'nope'", "pipeline: unknown pipeline"]
    assert form.has_errors


def test_prefill_takes_a_jobs_inputs_and_recorded_params() -> None:
    form = forms.build_form(spec("text-to-image"))
    forms.prefill(form, {"input": {"prompt": "again"}, "params": {"dit": {"height": 96, "guidance_scale": 2.0},
                                                                   "ar": {"seed": None}}})
    assert form.field("input.prompt").value == "again"  # type: ignore[union-attr]
    assert form.field("params.dit.height").value == "96"  # type: ignore[union-attr]
    assert form.field("params.dit.guidance_scale").value == "2"  # type: ignore[union-attr]
    assert form.field("params.ar.seed").value == ""  # type: ignore[union-attr]


@pytest.mark.parametrize("name", CATALOGUE.names())
def test_the_graph_draws_every_stage_input_output_and_wire(name: str) -> None:
    s = spec(name)
    g = graph.layout(s)
    ids = {n.id for n in g.nodes}
    assert ids == ({f"input:{i}" for i in s.inputs} | {f"stage:{st.id}" for st in s.stages}
                   | {f"output:{o.name}" for o in s.outputs})
    wires = {(e.source, e.target) for e in g.edges}
    for stage in s.stages:
        for binding in stage.inputs.values():
            origin = f"input:{binding.port}" if binding.source == "input" else f"stage:{binding.source}"
            assert (origin, f"stage:{stage.id}") in wires
    by_id = {n.id: n for n in g.nodes}
    for source, target in wires:  # always left to right, nodes inside the drawing, none overlapping
        assert by_id[source].col < by_id[target].col
    for n in g.nodes:
        assert 0 <= n.x and n.x + n.w <= g.width and 0 <= n.y and n.y + n.h <= g.height
    for a in g.nodes:
        for b in g.nodes:
            if a is not b and a.col == b.col:
                assert a.y + a.h <= b.y or b.y + b.h <= a.y


def test_a_wire_that_skips_a_column_runs_below_the_stages() -> None:
    g = graph.layout(spec("text-to-image"))  # ar.text is both dit's prompt and a final output
    skip = next(e for e in g.edges if e.source == "stage:ar" and e.target == "output:text")
    lowest = max(n.y + n.h for n in g.nodes)
    assert skip.label_y > lowest and " L" in skip.path


def test_outputs_are_shown_by_their_media_type() -> None:
    assert views.output_kind({"media_type": "image/png"}) == "image"
    assert views.output_kind({"media_type": "audio/wav"}) == "audio"
    assert views.output_kind({"media_type": "video/mp4"}) == "video"
    assert views.output_kind({"media_type": "application/json", "text": ""}) == "text"
    assert views.output_kind({"media_type": "application/octet-stream", "shape": [1, 4]}) == "file"


def test_audio_and_video_inputs_are_file_fields_that_accept_their_kind() -> None:
    form = forms.build_form(PipelineSpec.model_validate(mf.MEDIA_PIPELINE))
    speech, clip = form.field("input.speech"), form.field("input.clip")
    image = forms.build_form(spec("image-to-image")).field("input.image")
    assert speech is not None and clip is not None and image is not None
    assert (speech.kind, speech.accept, speech.max_bytes) == ("file", "audio/*", 25 * 2**20)
    assert (clip.kind, clip.accept, clip.max_bytes) == ("file", "video/*", 1_000_000)  # the field's own max_bytes
    assert image.accept == "image/*"
    assert speech.hint == "WAV, MP3, FLAC, OGG, M4A…, up to 25 MiB; optional"
    assert clip.hint == "MP4, WebM, MOV…, up to 977 KiB; optional"


def test_a_posted_audio_file_is_sent_as_bytes() -> None:
    data = mf.wav(0.1)
    upload = UploadFile(io.BytesIO(data), filename="speech.wav", size=len(data),
                        headers=Headers({"content-type": "audio/wav"}))
    form = forms.build_form(PipelineSpec.model_validate(mf.MEDIA_PIPELINE))
    with ThreadPoolExecutor(1) as pool:
        parsed = pool.submit(asyncio.run, forms.parse_form(form, FormData([("input.prompt", "x"),
                                                                           ("input.speech", upload)]))).result()
    assert parsed.input == {"prompt": "x", "speech": data} and not parsed.errors


def test_file_inputs_are_shown_from_their_stored_record() -> None:
    ref = {"backend": "local", "key": "jobs/job_1/inputs/speech.wav", "media_type": "audio/wav", "size": 44,
           "sha256": "0" * 64}
    record = {"artifact": ref, "media_type": "audio/wav", "size": 44, "duration_s": 0.5}
    assert views.input_kind("job_1", record) == "audio"
    assert views.input_kind("job_1", {**record, "artifact": {**ref, "key": "jobs/job_1/inputs/clip.mp4",
                                                             "media_type": "video/mp4"}}) == "video"
    assert views.input_kind("job_2", record) is None  # another job's file is not this job's input
    assert views.input_kind("job_1", "a prompt") is None and views.input_kind("job_1", {"artifact": {}}) is None
    assert views.input_src("job_1", "speech") == "/ui/jobs/job_1/inputs/speech"


def test_the_timeline_places_waits_and_runs_on_one_scale() -> None:
    job: dict[str, Any] = {"status": "succeeded", "created_at": 100.0, "completed_at": 110.0, "stages": [
        {"id": "ar", "status": "succeeded", "queued_at": 100.0, "started_at": 101.0, "finished_at": 104.0},
        {"id": "dit", "status": "succeeded", "queued_at": 104.0, "started_at": 105.0, "finished_at": 110.0}]}
    bars = views.timeline(job)["bars"]
    assert [(b.wait_x, b.wait_w, b.run_x, b.run_w) for b in bars] == [(0.0, 100.0, 100.0, 300.0),
                                                                       (400.0, 100.0, 500.0, 500.0)]


def test_progress_is_a_bounded_fraction() -> None:
    running = {"status": "running", "progress": {"stage": "dit", "step": 3, "total": 8, "unit": "steps"}}
    assert views.progress(running) == {"stage": "dit", "step": 3, "total": 8, "unit": "steps", "percent": 38}
    assert views.progress({**running, "status": "succeeded"}) is None


@pytest.mark.parametrize(("header", "size", "expected"), [
    ("bytes=0-99", 1000, (0, 99)), ("bytes=900-", 1000, (900, 999)), ("bytes=-100", 1000, (900, 999)),
    ("bytes=0-5000", 1000, (0, 999)), ("bytes=5-1", 1000, None), ("bytes=0-1,5-6", 1000, None),
    ("items=0-1", 1000, None), (None, 1000, None), ("bytes=x-y", 1000, None)])
def test_byte_ranges_for_seeking_media(header: str | None, size: int, expected: tuple[int, int] | None) -> None:
    assert _byte_range(header, size) == expected


@pytest.mark.parametrize(("target", "expected"), [
    ("/ui/jobs/job_1?x=1", "/ui/jobs/job_1?x=1"), ("/ui/pipelines", "/ui/pipelines"), ("//evil", "/ui/jobs"),
    ("https://evil/ui/", "/ui/jobs"), ("/docs", "/ui/jobs"), ("/ui/login", "/ui/jobs"), (None, "/ui/jobs"),
    ("/ui/\\evil", "/ui/jobs")])
def test_only_console_paths_are_followed_after_sign_in(target: str | None, expected: str) -> None:
    assert safe_next(target) == expected
