"""The job commands of ``omni-jobs``: submit (with a live per-stage progress bar), status, list,
cancel, download, transcribe (speech to text through the OpenAI route), and webhook-secret. They talk to a running API through ``omni_jobs.client``;
``--api-url`` or ``OMNI_API_URL`` chooses it.

Results go to stdout (job ids, output paths, tables; ``--json`` for the raw job), progress and
messages to stderr, so ``omni-jobs submit ... --wait > paths.txt`` keeps only the paths.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from omni_jobs.cli.progress import ProgressDisplay
from omni_jobs.client import DEFAULT_API_URL, ApiError, Client, ConflictError, JobView, NotFoundError
from omni_jobs.client.protocol import AUDIO_EXTENSIONS, TRANSCRIBE_TIMEOUT_S
from omni_jobs.report.webhooks import generate_secret

EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE, EXIT_API = 0, 1, 2, 3


def _parse_value(raw: str) -> Any:
    """``7`` -> 7, ``0.5`` -> 0.5, ``true`` -> True, ``[1,2]`` -> list; anything else stays text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_params(items: list[str]) -> dict[str, dict[str, Any]]:
    """``['dit.seed=7', 'ar.max_tokens=16']`` -> ``{'dit': {'seed': 7}, 'ar': {'max_tokens': 16}}``."""
    params: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        stage, dot, name = key.partition(".")
        if not sep or not dot or not stage or not name:
            raise argparse.ArgumentTypeError(f"--param {item!r}: expected STAGE.KEY=VALUE, e.g. dit.seed=7")
        params.setdefault(stage, {})[name] = _parse_value(value)
    return params


def stage_params(as_json: str | None, items: list[str]) -> dict[str, dict[str, Any]]:
    """``--params`` (one JSON object of stages), then each ``--param STAGE.KEY=VALUE`` over it."""
    try:
        params = json.loads(as_json) if as_json else {}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--params is not valid JSON: {exc}") from None
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise argparse.ArgumentTypeError(f"--params takes a JSON object of stages, e.g. '{{\"dit\": {{\"seed\": 3}}}}'; "
                                         f"got {as_json}")
    for stage, values in parse_params(items).items():
        params[stage] = {**params.get(stage, {}), **values}
    return params


def parse_inputs(items: list[str]) -> tuple[dict[str, Any], dict[str, Path]]:
    """``--input`` values: the JSON inputs, and the files to upload.

    ``image=@photo.png`` (or ``audio=@speech.wav``, ``video=@clip.mp4``) uploads the file (as curl's
    ``-F`` does), and so does a bare value that is the path of an existing file (except ``prompt``); a
    missing ``@`` file is an error before any request is sent."""
    inputs: dict[str, Any] = {}
    files: dict[str, Path] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--input {item!r}: expected KEY=VALUE, e.g. prompt='a cat' or "
                                             "image=@photo.png")
        if value.startswith("@"):
            path = Path(value[1:]).expanduser()
            if not path.is_file():
                raise argparse.ArgumentTypeError(f"--input {key}=@{value[1:]}: no such file: {path.resolve()}")
            files[key] = path
        elif key != "prompt" and value and Path(value).expanduser().is_file():
            files[key] = Path(value).expanduser()
        else:
            inputs[key] = _parse_value(value) if value[:1] in "[{" or value in ("true", "false") else value
    return inputs, files


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _secs(value: float | None) -> str:
    return f"{value:.2f}s" if value is not None else "-"


def _client(args: argparse.Namespace) -> Client:
    return Client(args.api_url, api_key=args.api_key or None, timeout=args.timeout)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _print_outputs(job: JobView, paths: dict[str, Path]) -> None:
    for out in job.outputs:
        path = paths.get(out.name)
        print(f"{out.name}\t{path.resolve() if path else out.url}")


def _save_preview(folder: Path, data: dict[str, Any]) -> None:
    """An output.preview event's image as ``<stage>-step<N>.jpg`` (or .png)."""
    folder.mkdir(parents=True, exist_ok=True)
    ext = ".png" if data.get("media_type") == "image/png" else ".jpg"
    (folder / f"{data.get('stage')}-step{int(data.get('step', 0)):04d}{ext}").write_bytes(
        base64.b64decode(str(data.get("data", ""))))


def cmd_submit(args: argparse.Namespace) -> int:
    inputs, files = parse_inputs(args.input or [])
    if args.prompt is not None:
        inputs["prompt"] = args.prompt
    params = stage_params(args.params, args.param or [])
    with _client(args) as omni:
        job = omni.submit(args.pipeline, inputs, params=params or None, webhook=args.webhook,
                          webhook_events_filter=args.webhook_events or None, files=files or None)
        if not args.wait:
            print(_json(job) if args.json else f"{job.id}\t{job.status.value}")
            return EXIT_OK
        display = ProgressDisplay(sys.stderr)
        display.queued(job)
        for event in omni.events(job.id):
            display.show(event)
            if args.save_previews and event.type == "output.preview":
                _save_preview(Path(args.out) / job.id / "previews", event.data)
        display.close()
        job = omni.get(job.id)
        if args.json:
            print(_json(job))
        if job.status != "succeeded":
            error = f": {job.error.type}: {job.error.message}" if job.error else ""
            _say(f"job {job.id} {job.status.value}{error}")
            return EXIT_JOB_FAILED
        out_dir = Path(args.out) / job.id
        paths = omni.download_outputs(job, out_dir)
        if not args.json:
            _print_outputs(job, paths)
        _say(f"{len(paths)} output(s) in {out_dir.resolve()}")
        return EXIT_OK


def _json(job: JobView) -> str:
    """The job as the API sent it (fields it left out stay out)."""
    return json.dumps(job.model_dump(mode="json", exclude_unset=True), indent=2)


def _describe(job: JobView) -> list[str]:
    head = f"{job.id}  {job.pipeline}  {job.status.value}"
    if job.progress is not None:
        p = job.progress
        head += f"  {p.stage} {p.step}/{p.total} {p.unit}"
    elif job.stage:
        head += f"  {job.stage}"
    if job.queue_position is not None:
        head += f"  (queue position {job.queue_position})"
    m = job.metrics
    timing = (f"  created {_when(job.created_at)} UTC  queue {_secs(m.queue_time_s)}  "
              f"run {_secs(m.run_time_s)}  total {_secs(m.total_time_s)}")
    lines = [head, timing]
    for s in job.stages:
        where = f" on {s.worker}" if s.worker else ""
        attempts = f" (attempt {s.attempts})" if s.attempts > 1 else ""
        lines.append(f"  stage {s.id:<8} {s.status.value:<9} waited {_secs(s.wait_s)}  ran {_secs(s.duration_s)}"
                     f"{where}{attempts}")
    for out in job.outputs:
        size = f"{out.width}x{out.height} " if out.width and out.height else ""
        lines.append(f"  output {out.name:<7} {out.media_type} {size}{out.size} bytes  {out.url}")
    if job.error is not None:
        lines.append(f"  error in {job.error.stage or '-'}: {job.error.type}: {job.error.message}")
    if job.webhook is not None:
        last = job.webhook.deliveries[-1] if job.webhook.deliveries else None
        status = f"last: {last.event} attempt {last.attempt} -> {last.status_code or last.error}" if last else "none yet"
        lines.append(f"  webhook {job.webhook.url} [{','.join(job.webhook.events)}] "
                     f"{len(job.webhook.deliveries)} attempt(s), {status}")
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as omni:
        job = omni.get(args.job_id)
    print(_json(job) if args.json else "\n".join(_describe(job)))
    return EXIT_OK if job.status != "failed" else EXIT_JOB_FAILED


def cmd_list(args: argparse.Namespace) -> int:
    with _client(args) as omni:
        page = omni.list(limit=args.limit, status=args.status)
    if args.json:
        print(json.dumps(page.model_dump(mode="json", exclude_unset=True), indent=2))
        return EXIT_OK
    for job in page.data:
        where = job.stage or ""
        if job.progress is not None:
            where = f"{job.progress.stage} {job.progress.step}/{job.progress.total}"
        print(f"{job.id}\t{job.status.value:<9}\t{job.pipeline}\t{_when(job.created_at)}\t{where}".rstrip())
    if page.next_cursor:
        _say(f"more: --limit {args.limit} shows the newest only ({len(page.data)} shown)")
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as omni:
        job = omni.cancel(args.job_id)
    print(f"{job.id}\t{job.status.value}")
    return EXIT_OK


def cmd_download(args: argparse.Namespace) -> int:
    with _client(args) as omni:
        job = omni.get(args.job_id)
        if not job.outputs:
            _say(f"job {job.id} is {job.status.value} and has no outputs")
            return EXIT_JOB_FAILED
        paths = omni.download_outputs(job, Path(args.out) / job.id, audio_format=args.audio_format)
    _print_outputs(job, paths)
    return EXIT_OK


def cmd_transcribe(args: argparse.Namespace) -> int:
    """Speech to text through the OpenAI route (a job on a speech-to-text pipeline): the transcription on
    stdout in --format (text by default; --json: verbose_json)."""
    path = Path(args.file).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{args.file}: no such file: {path.resolve()}")
    response_format = "verbose_json" if args.json else args.format
    with _client(args) as omni:
        try:
            result = omni.transcribe(path, response_format=response_format, model=args.model,
                                     language=args.language, prompt=args.prompt, temperature=args.temperature,
                                     translate=args.translate, timeout=max(args.timeout, TRANSCRIBE_TIMEOUT_S))
        except ApiError as exc:
            if exc.code in ("job_failed", "job_canceled", "job_timeout"):
                _say(exc.message)
                return EXIT_JOB_FAILED
            raise
    if isinstance(result, str):
        sys.stdout.write(result if result.endswith("\n") else result + "\n")
    else:
        print(json.dumps(result.model_dump(mode="json", exclude_none=True), indent=2))
    return EXIT_OK


def cmd_webhook_secret(_: argparse.Namespace) -> int:
    print(generate_secret())
    return EXIT_OK


def _run(func: Any) -> Any:
    """Turn API errors into one clear line and an exit status instead of a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except (NotFoundError, ConflictError) as exc:
            _say(ApiError.describe(exc.detail))
            return EXIT_JOB_FAILED
        except ApiError as exc:
            _say(str(exc))
            return EXIT_API
        except argparse.ArgumentTypeError as exc:
            _say(str(exc))
            return EXIT_USAGE
        except httpx.TransportError as exc:  # connection refused, DNS, timeout
            _say(f"cannot reach the API at {args.api_url} ({exc}); is it running? (--api-url / OMNI_API_URL)")
            return EXIT_API

    return run


def add_job_commands(sub: Any) -> None:
    """Register the client commands on the ``omni-jobs`` subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--api-url", default=os.environ.get("OMNI_API_URL", DEFAULT_API_URL),
                        help="the omni-jobs API (default: $OMNI_API_URL or %(default)s)")
    common.add_argument("--api-key", default=os.environ.get("OMNI_API_KEY"),
                        help="API key sent as 'Authorization: Bearer' (default: $OMNI_API_KEY)")
    common.add_argument("--timeout", type=float, default=30.0, help="seconds per HTTP request")
    common.add_argument("--json", action="store_true", help="print the job JSON instead of text")

    s = sub.add_parser("submit", parents=[common], help="submit a job; --wait shows progress and downloads outputs")
    s.add_argument("pipeline")
    s.add_argument("--prompt", help="the prompt (input.prompt)")
    s.add_argument("-i", "--input", action="append", metavar="KEY=VALUE",
                   help="another input field (repeatable); KEY=@FILE (or the path of an existing file) uploads it")
    s.add_argument("--param", action="append", metavar="STAGE.KEY=VALUE",
                   help="a stage parameter, e.g. dit.seed=7 (repeatable)")
    s.add_argument("--params", help='stage parameters as one JSON object, e.g. \'{"dit": {"seed": 3}}\' '
                   "(--param over it)")
    s.add_argument("--wait", action="store_true", help="follow the job's progress, then download its outputs")
    s.add_argument("--out", default="omni-outputs", help="where --wait saves outputs (in OUT/<job id>/)")
    s.add_argument("--webhook", help="URL that receives signed webhooks for this job")
    s.add_argument("--save-previews", action="store_true",
                   help="with --wait: save the job's output.preview images under OUT/<job id>/previews/ (ask "
                        "for them with --param <stage>.preview_every=N)")
    s.add_argument("--webhook-events", action="append", choices=["start", "progress", "completed", "preview"],
                   help="which events send the webhook (repeatable; default all)")
    s.set_defaults(func=_run(cmd_submit))

    st = sub.add_parser("status", parents=[common], help="show a job: status, stage progress, timings, outputs")
    st.add_argument("job_id")
    st.set_defaults(func=_run(cmd_status))

    ls = sub.add_parser("list", parents=[common], help="list jobs, newest first")
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "canceled"])
    ls.set_defaults(func=_run(cmd_list))

    c = sub.add_parser("cancel", parents=[common], help="cancel a queued or running job")
    c.add_argument("job_id")
    c.set_defaults(func=_run(cmd_cancel))

    d = sub.add_parser("download", parents=[common], help="download a job's outputs")
    d.add_argument("job_id")
    d.add_argument("--out", default="omni-outputs", help="outputs go to OUT/<job id>/")
    d.add_argument("--audio-format", choices=list(AUDIO_EXTENSIONS), default=None,
                   help="audio outputs converted by the API (pcm: raw 16-bit mono at 24 kHz); default: as stored (WAV)")
    d.set_defaults(func=_run(cmd_download))

    tr = sub.add_parser("transcribe", parents=[common],
                        help="speech to text (POST /v1/audio/transcriptions): print the transcription")
    tr.add_argument("file", help="the audio file (WAV, FLAC, MP3, OGG, M4A, WebM...)")
    tr.add_argument("--model", default="speech-to-text", help="a speech-to-text pipeline (default %(default)s)")
    tr.add_argument("--language", help="the spoken language, ISO 639-1 (e.g. en); detected if not given")
    tr.add_argument("--prompt", help="text that came before the clip (names, spellings)")
    tr.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    tr.add_argument("--format", default="text", choices=["text", "json", "verbose_json", "srt", "vtt"],
                    help="what to print (default %(default)s; --json is verbose_json)")
    tr.add_argument("--translate", action="store_true", help="English text whatever the language "
                    "(/v1/audio/translations)")
    tr.set_defaults(func=_run(cmd_transcribe))

    w = sub.add_parser("webhook-secret", help="print a new webhook signing secret (for OMNI_WEBHOOK_SECRET)")
    w.set_defaults(func=cmd_webhook_secret)
