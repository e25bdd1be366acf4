"""Engine workers on their own CPUs (omni_jobs.engines.cpu_layout): the slices `omni-jobs up --engine-workers`
hands out, what a worker's OMNI_ENGINE_CPUS sets before its engine libraries load, and which engines take
turns with which."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from omni_jobs.cli.app import build_parser
from omni_jobs.core.cpu_lists import parse_cpus
from omni_jobs.core.settings import Settings
from omni_jobs.engines import cpu_layout, turns
from omni_jobs.engines.cpu_layout import cpu_spec, cpus_env, engine_slice
from omni_jobs.engines.library_env import apply_engine_library_defaults
from omni_jobs.engines.turns import lock_file
from omni_jobs.local.embedded import EmbeddedSystem


@pytest.mark.parametrize(("spec", "cpus"), [("0", (0,)), ("2-3", (2, 3)), ("0,2,4-5", (0, 2, 4, 5)),
                                            (" 1 , 3 ", (1, 3)), ("1,1-2", (1, 2))])
def test_a_cpu_list_reads_as_linux_writes_it(spec: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpus(spec) == cpus


@pytest.mark.parametrize(("spec", "said"), [("all", "expected CPUs such as '0', '2-3'"),
                                            ("0-", "expected CPUs such as"),
                                            ("3-1", "the range 3-1 runs backwards; write 1-3")])
def test_a_wrong_cpu_list_is_named_with_the_fix(spec: str, said: str) -> None:
    with pytest.raises(ValueError, match="OMNI_ENGINE_CPUS") as err:
        parse_cpus(spec)
    assert said in str(err.value)


def test_the_setting_refuses_a_wrong_cpu_list_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="runs backwards"):
        Settings(redis_url="redis://unused:1/0", artifacts_dir=tmp_path, engine_cpus="3-1")
    assert Settings(redis_url="redis://unused:1/0", artifacts_dir=tmp_path, engine_cpus="0, 1").engine_cpus == "0,1"


def test_each_of_n_workers_gets_its_own_share_of_the_cores() -> None:
    assert [engine_slice(i, 2, (0, 1)) for i in range(2)] == ["0", "1"]
    assert [engine_slice(i, 2, tuple(range(8))) for i in range(2)] == ["0-3", "4-7"]
    assert [engine_slice(i, 3, tuple(range(8))) for i in range(3)] == ["0-1", "2-3", "4-5"]  # the 2 left over stay free
    assert [engine_slice(i, 3, (0, 1)) for i in range(3)] == ["0", "1", "0"]  # more workers than cores: round robin
    # a container's cpuset: its own CPU numbers, not 0..N-1 (vLLM binds to these)
    assert [engine_slice(i, 2, (4, 5, 6, 7)) for i in range(2)] == ["4-5", "6-7"]
    assert [engine_slice(i, 2, (0, 2, 4, 6)) for i in range(2)] == ["0,2", "4,6"]
    with pytest.raises(ValueError, match="engine worker 2 of 2"):
        engine_slice(2, 2, (0, 1))
    assert cpu_spec([3, 0, 1, 2, 6]) == "0-3,6" and parse_cpus(cpu_spec([3, 0, 1, 2, 6])) == (0, 1, 2, 3, 6)
    assert set(cpu_layout.host_cpus()) == os.sched_getaffinity(0)


def test_a_workers_cpus_set_its_engine_libraries_threads_and_binding() -> None:
    assert cpus_env("") == {}
    assert cpus_env("4-7") == {"OMP_NUM_THREADS": "4", "VLLM_CPU_OMP_THREADS_BIND": "4-7"}
    env = apply_engine_library_defaults({"OMNI_ENGINE_CPUS": "1"})
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("1", "1")
    assert env["GOMP_SPINCOUNT"] == "20000"  # the other defaults still apply
    mine = apply_engine_library_defaults({"OMNI_ENGINE_CPUS": "1", "OMP_NUM_THREADS": "3"})
    assert mine["OMP_NUM_THREADS"] == "3"  # a value already set wins, as for every default
    assert "OMP_NUM_THREADS" not in apply_engine_library_defaults({})


def test_engines_take_turns_only_with_engines_on_the_same_cpus(tmp_path: Path) -> None:
    assert lock_file("auto", "cpu") == turns.DEFAULT_FILE
    assert lock_file("auto", "cpu", "1") == turns.DEFAULT_FILE.with_name(turns.DEFAULT_FILE.name + ".cpus-1")
    assert lock_file("auto", "cpu", "0") != lock_file("auto", "cpu", "1")
    assert lock_file("auto", "cpu", "0") == lock_file("auto", "cpu", " 0")
    assert lock_file(str(tmp_path / "t"), "cpu", "2-3") == tmp_path / "t.cpus-2-3"
    assert lock_file("off", "cpu", "1") is None
    assert lock_file("auto", "cuda:0", "1") is None


def test_up_starts_n_workers_per_stage_queue_each_on_its_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_jobs.local import embedded

    monkeypatch.setattr(embedded, "host_cpus", lambda: (0, 1, 2, 3))
    settings = Settings(redis_url="redis://unused:1/0", artifacts_dir=tmp_path)
    system = EmbeddedSystem(settings=settings, home=tmp_path, engine_workers=2)
    assert system.worker_nodes("dit") == [("dit", {"OMNI_ENGINE_CPUS": "0-1"}), ("dit-2", {"OMNI_ENGINE_CPUS": "2-3"})]
    assert system.worker_nodes("results") == [("results", {})]  # no engine: one worker, as before
    assert EmbeddedSystem(settings=settings, home=tmp_path).worker_nodes("ar") == [("ar", {})]


def test_up_takes_engine_workers_and_refuses_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["up", "--engine-workers", "2"]).engine_workers == 2
    assert build_parser().parse_args(["up"]).engine_workers == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--engine-workers", "0"])
    assert "'0': give a whole number, 1 or more" in capsys.readouterr().err
