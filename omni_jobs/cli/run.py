"""``omni-jobs run``: one job of any pipeline in this process (omni_jobs.Omni), outputs saved as files.

No Redis, no workers: the quickest way to try a pipeline YAML you are writing, with the same stage
code and engines the workers use. Its flags are `omni-jobs submit`'s where they mean the same:
``--prompt``, ``-i/--input name=value`` (for a file input, image, audio or video, the value is a file
path) and ``--param
stage.key=value``; ``--params`` also takes per-stage overrides as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from omni_jobs.cli.jobs import stage_params
from omni_jobs.core.errors import InvalidRequest, PipelineSpecError, UnknownPipeline
from omni_jobs.core.settings import load_settings

EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE = 0, 1, 2


def add_run_command(sub: Any) -> None:
    run = sub.add_parser("run", help="run one job of a pipeline in this process (no Redis, no workers)")
    run.add_argument("pipeline", help="a pipeline name, or the path of a pipeline YAML file")
    run.add_argument("--prompt", help="the prompt (input.prompt)")
    run.add_argument("-i", "--input", action="append", default=[], metavar="NAME=VALUE",
                     help="a job input (repeatable); for a file input (image, audio, video), VALUE is a file path")
    run.add_argument("--param", action="append", default=[], metavar="STAGE.KEY=VALUE",
                     help="a stage parameter, e.g. dit.seed=7 (repeatable; over --params)")
    run.add_argument("--params", default=None, help='per-stage overrides as JSON, e.g. \'{"dit": {"seed": 3}}\'')
    run.add_argument("--pipelines", action="append", default=[], metavar="PATH",
                     help="extra pipeline YAML files or directories (added to OMNI_PIPELINES_PATH)")
    run.add_argument("--out", default="var/omni-run", help="directory the output files are written to")
    run.set_defaults(func=cmd_run)


def _inputs(pairs: list[str], file_fields: list[str]) -> dict[str, Any]:
    inputs: dict[str, Any] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        inputs[name] = Path(value) if name in file_fields else value
    return inputs


def cmd_run(args: argparse.Namespace) -> int:
    from omni_jobs.omni import Omni, OmniJobFailed

    settings = load_settings()
    if args.pipelines:
        settings = settings.model_copy(update={"pipelines_path": [*settings.pipelines_path,
                                                                  *(Path(p) for p in args.pipelines)]})
    try:
        runner = Omni(args.pipeline, settings=settings)
        bad = [p for p in args.input if "=" not in p]
        if bad:
            print(f"--input takes NAME=VALUE, got {bad}", file=sys.stderr)
            return EXIT_USAGE
        inputs = _inputs(args.input, runner.spec.file_inputs())
        if args.prompt is not None:
            inputs["prompt"] = args.prompt
        params = stage_params(args.params, args.param)
        result = runner.generate(inputs, params or None)
    except (PipelineSpecError, UnknownPipeline, InvalidRequest) as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    except argparse.ArgumentTypeError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"cannot read an input file: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OmniJobFailed as exc:
        print(exc, file=sys.stderr)
        return EXIT_JOB_FAILED
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for output in result.outputs.values():
        path = out_dir / f"{result.job.id}-{output.entry.artifact.key.rsplit('/', 1)[-1]}"
        path.write_bytes(output.data)
        details = output.entry.model_dump(exclude={"artifact", "url", "name", "media_type"}, exclude_none=True)
        print(f"{output.name}: {path}  {json.dumps(details, ensure_ascii=False)}")
    return EXIT_OK
