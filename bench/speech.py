"""Streamed speech: time to the first audio chunk and to the whole clip, the system against the stages called directly.

``python -m bench.speech [--concurrency 1 8 16] [--codes 200] [--reps 2]`` measures Qwen2.5-Omni's speech
(``tiny:qwen2.5-omni``, the built-in ``text-to-speech`` pipeline: thinker -> talker -> code2wav, the code2wav stage
streaming beside its talker) at each concurrency N, two ways, taking turns in every repetition:

* system: N ``text-to-speech`` jobs POSTed at once through the HTTP API of a private EmbeddedSystem (Redis, Celery
  workers on the ``ar``, ``talker`` and ``code2wav`` queues, the results worker), each followed by its own SSE
  reader (``GET /v1/jobs/{id}/events`` with the API key, omni_jobs.client ``Client.events``). Per job: from just
  before its POST to its first audio ``output.delta`` received, and to its ``job.succeeded`` event (the whole
  clip stored).
* direct: the same stages called in one process, the vLLM-Omni way, in a child process that loads its engines
  once (bench.run's DirectProcess): the thinker's recitation of each text (``execute_recite``, one after another),
  then ONE ``engine.generate`` of the N talker requests, whose ``on_codes`` hand each request's codes so far to a
  code2wav thread; that thread feeds a ``Code2WavStream`` per request, one chunk per request in turn (round robin),
  and finishes each clip once the talker is done. The engines take turns on shared CPU cores as the workers'
  engines do (omni_jobs.engines.turns: the talker's steps and code2wav's renders alternate; without turns, on 2
  cores, the two OpenMP teams oversubscribed the cores and one clip took ~2.5x as long). Per request: from the
  start of the repetition to its first chunk out, and to its clip finished.

Every job says ``--codes`` codes (the tiny talker speaks until its ``max_tokens``; 50 codes = 1 s of 24 kHz speech)
in the voice Chelsie, with the pipeline's defaults (talker seed 0, code2wav's 10 steps, chunks of 24 codes).

It prints, per arm and N, the p50 and p90 (over every job of every repetition) of both times, then the ratios, each
the median of its per-repetition ratios (paired: they share the machine's drift): first chunk p50 at the largest N
over at 1 (issue 60's target: <= 2x), and system/direct of first chunk and whole clip at each N. And code2wav's
real-time factor per chunk (seconds to render it / seconds of speech in it; below 1 is faster than real time): from
the direct arm's ``Code2WavStream`` pushes at each N, and for code2wav alone (the chunks of one clip streamed with
nothing else running; and N chunk windows rendered as ONE DiT batch, which the streamed path does not do: what
batching the streams' chunks would give). ``--code2wav-only`` measures only the latter two (~1-3 minutes). The
system's RTF is not measured (its worker reports no per-chunk render time). JSON goes to --out. On 2 cores the
defaults take ~15 minutes (code2wav renders ~1x real time there: 16 jobs x 4 s of speech is a minute of renders
per arm); ``--codes 100`` about halves it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procfs import memory_mib
from bench.run import ROOT, DirectProcess, _pct, _reply, as_engine_process, prompts
from omni_jobs.engines.openmp import release_thread_team
from omni_jobs.local.devservices import exit_on_sigterm

PIPELINE = "text-to-speech"
MODEL = "tiny:qwen2.5-omni"
VOICE = "Chelsie"
SAMPLE_RATE = 24000
SAMPLES_PER_CODE = 480
SYSTEM_QUEUES = {"ar": "threads", "talker": "threads", "code2wav": "threads", "results": "solo"}
"""`omni-jobs up`'s workers that text-to-speech uses: the thinker's (ar), the talker's, code2wav's, and results."""


def turns_env() -> dict[str, str]:
    """The engine turn of both arms' engines: a file of this benchmark's own (OMNI_ENGINE_TURNS), not the host's, so
    that its engines take turns with each other but never wait for a turn held by another system on the same host
    (a test suite's workers: with the host's file, code2wav alone rendered at 7.8x real time instead of ~1x)."""
    return {"OMNI_ENGINE_TURNS": str((ROOT / "speech-engine-turns").resolve())}


def texts(n: int, rep: int) -> list[str]:
    """The repetition's texts to say (bench.run.prompts: distinct, ~30 tokens), the same in both arms."""
    return prompts(n, rep + 500)


def talker_params(codes: int) -> dict[str, dict[str, Any]]:
    """A job's parameters: the talker writes ``codes`` codes (the tiny talker speaks until its max_tokens)."""
    return {"talker": {"max_tokens": codes}}


# --- the direct arm: one process, the stages called as vLLM-Omni calls them ---


@dataclass
class RequestTimes:
    """One direct request's times from the start of its repetition."""

    first_s: float | None = None
    whole_s: float | None = None
    samples: int = 0


class DirectSpeech:
    """The text-to-speech stages on their engines in this process: thinker (vLLM, recite), talker (vLLM, one batch
    for all requests), code2wav (torch, one Code2WavStream per request on a thread of its own)."""

    def __init__(self, models_dir: Path) -> None:
        from omni_jobs.core.settings import Settings
        from omni_jobs.engines import turns
        from omni_jobs.engines.pool import EnginePool
        from omni_jobs.engines.stage_exec import ar_engine_args, load_stage_engine
        from omni_jobs.engines.talker import Talker
        from omni_jobs.pipelines.catalogue import load_catalogue

        settings = Settings(models_dir=models_dir)
        spec = load_catalogue([]).get(PIPELINE)
        self.stages = {s.id: s for s in spec.stages}
        # the engines a worker's pool makes for these stages (the same settings: KV cache, max_model_len, device),
        # taking turns on shared CPU cores as the workers' engines do (omni_jobs.engines.turns, omni_jobs.runtime):
        # here the talker's steps and code2wav's renders alternate, as they do across the two workers
        turns.configure(turns.lock_file(settings.engine_turns, settings.device, settings.engine_cpus))
        self.pool = EnginePool(settings.models_dir, kv_cache_bytes=settings.ar_kv_cache_bytes,
                               max_model_len=settings.ar_max_model_len, device=settings.device)
        for stage in spec.stages:
            load_stage_engine(self.pool, stage)
        talker = self.stages["talker"]
        self.talker = Talker(self.pool.ar(talker.model, ar_engine_args(talker)))
        self.code2wav = self.pool.code2wav(self.stages["code2wav"].model, {})

    def params(self, stage: str, overrides: dict[str, Any] | None = None) -> Any:
        """A stage's parameters as a job records them: its defaults, then the job's overrides."""
        spec = self.stages[stage]
        return spec.params({**spec.default_params, **(overrides or {})})

    def render_alone(self, codes: list[int]) -> list[float]:
        """code2wav alone: the RTF of each chunk of one clip of ``codes`` streamed through a Code2WavStream."""
        stream = self._stream()
        rtf = []
        for start in range(0, len(codes), stream.chunk):
            t0 = time.perf_counter()
            clip = stream.push(codes[start:start + stream.chunk])
            took = time.perf_counter() - t0
            if clip is not None:
                rtf.append(took / (stream.chunk * SAMPLES_PER_CODE / SAMPLE_RATE))
        stream.finish()
        return rtf

    def alone(self, codes: list[int], batches: list[int], reps: int = 3) -> dict[str, Any]:
        """code2wav by itself: ``render_alone``'s RTF per chunk, and ``render_batched``'s at each batch size (the
        median of ``reps`` tries, the sizes taking turns: one try moved by up to 7x on a shared machine)."""
        rtf: list[float] = []
        batched: dict[str, list[float]] = {str(n): [] for n in batches}
        for _ in range(reps):
            rtf += self.render_alone(codes)
            for n in batches:
                batched[str(n)].append(self.render_batched(n, codes))
        return {"rtf": rtf, "batched": {n: statistics.median(v) for n, v in batched.items()}, "batched_runs": batched}

    def render_batched(self, n: int, seed_codes: list[int]) -> float:
        """code2wav alone, N chunks in ONE DiT batch (what a code2wav that batched its streams' chunks would run):
        the RTF per chunk of N steady-state windows (12 codes of left context + a 24-code chunk, N different clips)."""
        from omni_jobs.engines.code2wav import Code2WavRequest

        p = self.params("code2wav")
        stream = self._stream()
        window = stream.left + stream.chunk
        requests = [Code2WavRequest(f"b{i}", tuple(seed_codes[(i + k) % len(seed_codes)] for k in range(window)), VOICE,
                                    seed=p.seed, offset=stream.chunk, num_steps=p.num_inference_steps,
                                    guidance_scale=p.guidance_scale) for i in range(n)]
        t0 = time.perf_counter()
        self.code2wav.render(requests)
        return (time.perf_counter() - t0) / (n * stream.chunk * SAMPLES_PER_CODE / SAMPLE_RATE)

    def _stream(self) -> Any:
        p = self.params("code2wav")
        return self.code2wav.stream(VOICE, seed=p.seed, num_steps=p.num_inference_steps,
                                    guidance_scale=p.guidance_scale)

    def run(self, said: list[str], codes: int, tag: str) -> dict[str, Any]:
        """N requests at once (N = len(said)): each one's first-chunk and whole-clip seconds from the start, and
        the RTF of every chunk rendered while the talker wrote."""
        from omni_jobs.engines import omni_speech
        from omni_jobs.engines.stage_exec import execute_recite, thinker_states_of
        from omni_jobs.engines.talker import TalkSampling

        n = len(said)
        times = [RequestTimes() for _ in range(n)]
        rtf: list[float] = []
        latest: queue.SimpleQueue[tuple[int, list[int]] | None] = queue.SimpleQueue()
        finals: list[list[int]] = []
        t0 = time.perf_counter()
        # the thinker: each text recited (a pooling pass over prompt + text), one after another
        thinker = self.stages["thinker"]
        states = []
        for i, text in enumerate(said):
            values = execute_recite(self.pool, thinker, self.params("thinker"), {"prompt": text}, f"{tag}-{i}",
                                    lambda done, total: None)
            states.append(thinker_states_of(values))
        t_thinker = time.perf_counter() - t0

        # code2wav: a thread of its own, fed each request's codes so far as the talker writes them
        def code2wav() -> None:
            streams = [self._stream() for _ in range(n)]
            chunk = streams[0].chunk
            known: list[list[int]] = [[] for _ in range(n)]
            pushed = [0] * n
            talker_done = False

            def ready() -> list[int]:
                return [i for i in range(n) if len(known[i]) - pushed[i] >= chunk]

            while True:
                items = [latest.get()] if not talker_done and not ready() else []  # nothing to render: wait
                while True:
                    try:
                        items.append(latest.get_nowait())
                    except queue.Empty:
                        break
                for item in items:  # the newest codes of each request
                    if item is None:
                        talker_done = True
                    elif len(item[1]) > len(known[item[0]]):
                        known[item[0]] = item[1]
                waiting = ready()
                if talker_done and not waiting:
                    break
                for i in waiting:  # one chunk per request in turn: every clip moves on
                    new = known[i][pushed[i]:pushed[i] + chunk]
                    t1 = time.perf_counter()
                    clip = streams[i].push(new)
                    took = time.perf_counter() - t1
                    pushed[i] += len(new)
                    if clip is not None and clip.samples.size:
                        rtf.append(took / (len(new) * SAMPLES_PER_CODE / SAMPLE_RATE))
                        times[i].samples += int(clip.samples.size)
                        if times[i].first_s is None:
                            times[i].first_s = time.perf_counter() - t0
            for i in range(n):  # the talker is done: the rest of each clip, from its recorded codes
                rest = finals[i][pushed[i]:]
                clip = streams[i].push(rest) if rest else None
                tail = streams[i].finish()
                times[i].samples += (int(clip.samples.size) if clip is not None else 0) + int(tail.samples.size)
                now = time.perf_counter() - t0
                if times[i].first_s is None:
                    times[i].first_s = now
                times[i].whole_s = now

        failed: list[BaseException] = []

        def code2wav_thread() -> None:
            try:
                code2wav()
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread after the join
                failed.append(exc)

        renderer = threading.Thread(target=code2wav_thread, name="code2wav")
        renderer.start()
        p = self.params("talker", talker_params(codes)["talker"])
        sampling = TalkSampling(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                repetition_penalty=p.repetition_penalty, seed=p.seed)
        tokens = self.talker.tokens

        def on_codes(i: int) -> Callable[[Sequence[int]], None]:
            return lambda ids: latest.put((i, omni_speech.talker_codes(ids, tokens)))

        requests = [self.talker.request(f"{tag}-{i}:talker", s, VOICE, sampling, on_codes=on_codes(i))
                    for i, s in enumerate(states)]
        outputs = self.talker.engine.generate(requests)
        release_thread_team()  # as a worker's idle engine thread does: an idle team here slows the renders' own
        finals.extend(self.talker.codes(o) for o in outputs)
        t_talker = time.perf_counter() - t0
        latest.put(None)
        renderer.join()
        if failed:
            raise failed[0]
        bad = [(i, t.samples, len(finals[i])) for i, t in enumerate(times) if t.samples != len(finals[i]) * SAMPLES_PER_CODE]
        if bad:
            raise RuntimeError(f"direct: clips of the wrong length (request, samples, codes): {bad[:3]}")
        return {"first_s": [t.first_s for t in times], "whole_s": [t.whole_s for t in times], "rtf": rtf,
                "codes": [len(c) for c in finals], "thinker_s": t_thinker, "talker_s": t_talker}


def _on_own_thread(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()`` on a new thread: its torch ops on an OpenMP team of their own (this thread's is vLLM's)."""
    out: list[dict[str, Any]] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread after the join
            failed.append(exc)

    thread = threading.Thread(target=run, name="code2wav-alone")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


def serve_direct(args: argparse.Namespace) -> None:
    """The direct child (bench.run's DirectProcess protocol): load and warm up, then answer one JSON request a line:
    ``{"n": N, "rep": R}`` runs N requests; ``{"alone": true}`` measures code2wav by itself."""
    as_engine_process()  # the engine library settings and malloc of a worker
    direct = DirectSpeech(args.models_dir.resolve())
    warm = min(max(args.concurrency), 4)
    direct.run(texts(warm, 997), min(args.codes, 48), "warm")  # no arm pays first-call costs
    _reply({"ready": True})
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        request = json.loads(line)
        cpu0 = time.process_time()
        if request.get("alone"):  # on a thread of its own, as the arm's renders run
            codes = [c % 40 for c in range(7, 7 + args.codes)]  # in the tiny codebook (0..48), none repeated nearby
            answer: dict[str, Any] = _on_own_thread(functools.partial(direct.alone, codes, request["batches"]))
        else:
            answer = direct.run(texts(request["n"], request["rep"]), args.codes, f"d{request['rep']}-{request['n']}")
        answer["cpu_s"] = time.process_time() - cpu0
        release_thread_team()  # the thinker's team (this thread's), idle until the next request
        _reply(answer)
    _reply({"rss_mib": {"driver": round(memory_mib(os.getpid(), "VmHWM"), 1)}})


# --- the system arm: jobs through the HTTP API, each followed by its SSE reader ---


class SpeechSystem:
    """A private EmbeddedSystem with the workers text-to-speech needs; N jobs at once, each with its SSE reader."""

    def __init__(self, args: argparse.Namespace) -> None:
        from omni_jobs.core.settings import Settings
        from omni_jobs.local.embedded import EmbeddedSystem

        self.args = args
        home = (ROOT / "speech-system").resolve()
        import shutil

        shutil.rmtree(home / "redis", ignore_errors=True)  # every run starts from an empty Redis
        most = str(max(args.concurrency))
        # a streamed code2wav stage holds a worker thread while its talker writes: N jobs need N threads, and the
        # talker's batch takes all N
        env = {"OMNI_STAGE_MAX_IN_FLIGHT": most, "OMNI_BATCH_MAX_SIZE": most, "OMNI_LOG_FORMAT": "text",
               "OMNI_MAX_QUEUED_PER_QUEUE": "100000", **turns_env()}
        settings = Settings(models_dir=args.models_dir.resolve(), artifacts_dir=home / "artifacts",
                            redis_url="redis://unused")
        self.system = EmbeddedSystem(settings=settings, home=home, extra_env=env, worker_queues=dict(SYSTEM_QUEUES),
                                     with_flower=False)

    def start(self) -> None:
        self.system.start(say=lambda m: print(f"  [system] {m}", flush=True))

    def stop(self) -> None:
        self.system.stop()

    def run(self, said: list[str], codes: int) -> dict[str, Any]:
        """N jobs POSTed at once (N = len(said)), each followed by its own SSE reader: each one's seconds from just
        before its POST to its first audio delta received and to its job.succeeded event."""
        from omni_jobs.client import Client
        from omni_jobs.run.audio_stream import AudioDeltaReader

        n = len(said)
        clients = [Client(self.system.api_url, api_key=self.system.api_key, timeout=600) for _ in range(n)]
        start = threading.Barrier(n)

        def job(i: int) -> tuple[float, float, int]:
            client = clients[i]
            start.wait()  # every client POSTs at once
            t0 = time.perf_counter()
            job_id = client.submit(PIPELINE, {"prompt": said[i], "voice": VOICE}, params=talker_params(codes)).id
            reader = AudioDeltaReader(output="audio")
            first, samples = None, 0
            for event in client.events(job_id):
                if event.type == "output.delta" and (chunk := reader.feed(event.data)) is not None:
                    samples += chunk.samples
                    if first is None:
                        first = time.perf_counter() - t0
                if event.is_final:
                    if event.type != "job.succeeded":
                        error = event.job.error if event.job is not None else None
                        raise RuntimeError(f"job {job_id} ended {event.type}: {error}")
                    return (first if first is not None else float("nan")), time.perf_counter() - t0, samples
            raise RuntimeError(f"job {job_id}: its event stream ended before the job did")

        try:
            with ThreadPoolExecutor(n) as pool:
                done = list(pool.map(job, range(n)))
        finally:
            for c in clients:
                c.close()
        bad = [(i, s) for i, (_, _, s) in enumerate(done) if s != codes * SAMPLES_PER_CODE]
        if bad:
            raise RuntimeError(f"system: clips streamed of the wrong length (job, samples; want "
                               f"{codes * SAMPLES_PER_CODE}): {bad[:3]}")
        return {"first_s": [f for f, _, _ in done], "whole_s": [w for _, w, _ in done]}


# --- figures ---


@dataclass
class ArmTimes:
    """One arm at one concurrency, repetition by repetition."""

    first_s: list[list[float]] = field(default_factory=list)
    whole_s: list[list[float]] = field(default_factory=list)
    rtf: list[list[float]] = field(default_factory=list)
    talker_s: list[float] = field(default_factory=list)
    """Direct: seconds from the start to the talker's last code, per repetition."""

    def add(self, answer: dict[str, Any]) -> None:
        self.first_s.append([float(x) for x in answer["first_s"]])
        self.whole_s.append([float(x) for x in answer["whole_s"]])
        if "rtf" in answer:
            self.rtf.append([float(x) for x in answer["rtf"]])
        if "talker_s" in answer:
            self.talker_s.append(float(answer["talker_s"]))

    def summary(self) -> dict[str, Any]:
        def flat(runs: list[list[float]]) -> list[float]:
            return sorted(x for run in runs for x in run)

        return {"first_p50": _pct(flat(self.first_s), 50), "first_p90": _pct(flat(self.first_s), 90),
                "whole_p50": _pct(flat(self.whole_s), 50), "whole_p90": _pct(flat(self.whole_s), 90),
                "rtf_p50": _pct(flat(self.rtf), 50), "rtf_p90": _pct(flat(self.rtf), 90),
                "first_p50_runs": [_pct(sorted(r), 50) for r in self.first_s],
                "whole_p50_runs": [_pct(sorted(r), 50) for r in self.whole_s],
                "talker_s": self.talker_s, "first_s": self.first_s, "whole_s": self.whole_s}


def paired(a: list[float | None], b: list[float | None]) -> float | None:
    """The median of the per-repetition ratios a/b (None where either arm lacks a repetition)."""
    ratios = [x / y for x, y in zip(a, b, strict=False) if x is not None and y is not None and y > 0]
    return statistics.median(ratios) if ratios else None


def ratios(rows: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The paired ratios of the rows (N -> arm -> ArmTimes.summary()): first chunk p50 at each N over at the least
    N, per arm; system/direct of first chunk and whole clip p50 at each N."""
    ns = sorted(rows, key=int)
    out: dict[str, Any] = {"first_over_least_n": {}, "system_over_direct": {}}
    if not ns:
        return out
    base = ns[0]
    for n in ns:
        for arm in ("direct", "system"):
            if arm in rows[n] and arm in rows[base] and n != base:
                out["first_over_least_n"].setdefault(arm, {})[n] = paired(rows[n][arm]["first_p50_runs"],
                                                                          rows[base][arm]["first_p50_runs"])
        if "direct" in rows[n] and "system" in rows[n]:
            out["system_over_direct"][n] = {k: paired(rows[n]["system"][f"{k}_p50_runs"],
                                                      rows[n]["direct"][f"{k}_p50_runs"]) for k in ("first", "whole")}
    return out


def _s(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(results: dict[str, Any]) -> str:
    """The printed report: per N and arm, first chunk and whole clip p50/p90 and code2wav's RTF; then the ratios."""
    config = results["config"]
    codes = int(config["codes"])
    rows: dict[str, dict[str, dict[str, Any]]] = results["rows"]
    lines = [(f"streamed speech, {PIPELINE} on {MODEL}: {codes} codes ({codes / 50:.2f} s of speech) a job, "
              f"{config['reps']} rep(s); seconds, p50/p90 over every job of every repetition"),
             (f"{'N':>3} {'arm':7} {'first chunk p50':>15} {'p90':>6} {'whole clip p50':>15} {'p90':>6} "
              f"{'code2wav RTF/chunk p50':>22} {'p90':>5}")]
    for n in sorted(rows, key=int):
        for arm in ("direct", "system"):
            if arm not in rows[n]:
                continue
            a = rows[n][arm]
            lines.append(f"{n:>3} {arm:7} {_s(a['first_p50']):>15} {_s(a['first_p90']):>6} {_s(a['whole_p50']):>15} "
                         f"{_s(a['whole_p90']):>6} {_s(a['rtf_p50']):>22} {_s(a['rtf_p90']):>5}")
    talker = {n: statistics.median(rows[n]["direct"]["talker_s"]) for n in sorted(rows, key=int)
              if rows[n].get("direct", {}).get("talker_s")}
    if talker:
        lines.append("direct: the talker's last code at " + ", ".join(f"N={n}: {v:.2f} s" for n, v in talker.items())
                     + " (median of reps): the rest of the whole clip is code2wav catching up")
    r = results.get("ratios") or ratios(rows)
    ns = sorted(rows, key=int)
    if len(ns) > 1:
        lines.append(f"\nfirst chunk p50 at N over at N={ns[0]} (median of per-rep ratios; issue 60's target at 16: <= 2x):")
        for arm, by_n in r["first_over_least_n"].items():
            lines.append(f"  {arm:7} " + ", ".join(f"N={n}: {_s(v)}x" for n, v in by_n.items()))
    if r["system_over_direct"]:
        lines.append("\nsystem/direct, p50 (median of per-rep ratios; above 1: the system is slower):")
        for n, v in r["system_over_direct"].items():
            lines.append(f"  N={n:>3}: first chunk {_s(v['first'])}, whole clip {_s(v['whole'])}")
    alone = results.get("code2wav_alone")
    if alone:
        lines.append(f"\ncode2wav alone (nothing else running), RTF per chunk of {alone['chunk']} codes: one stream "
                     f"p50 {_s(alone['rtf_p50'])}, p90 {_s(alone['rtf_p90'])}; N chunk windows in one DiT batch (median of 3): "
                     + ", ".join(f"N={k}: {_s(v)}" for k, v in alone["batched"].items()) + " per chunk")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.speech", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16], metavar="N",
                   help="concurrent jobs (requests) per step (default 1 8 16)")
    p.add_argument("--codes", type=int, default=200, help="speech codes per job (50 = 1 s; default 200)")
    p.add_argument("--reps", type=int, default=2, help="repetitions (default 2)")
    p.add_argument("--no-system", dest="system", action="store_false", help="the direct arm only (no Redis)")
    p.add_argument("--no-direct", dest="direct", action="store_false", help="the system arm only")
    p.add_argument("--models-dir", type=Path, default=Path("var/models"),
                   help="where tiny:qwen2.5-omni is (built there on first use; default var/models, as omni-jobs up)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "speech.json")
    p.add_argument("--code2wav-only", action="store_true",
                   help="only code2wav alone: its RTF per chunk, one stream and N chunks in one DiT batch (~1 minute)")
    p.add_argument("--serve-direct", action="store_true", help=argparse.SUPPRESS)  # internal: the direct child
    args = p.parse_args(argv)
    if any(n < 1 for n in args.concurrency):
        p.error("--concurrency: give 1 or more jobs")
    if args.codes < 1 or args.reps < 1:
        p.error("--codes and --reps: give 1 or more")
    if args.code2wav_only and not args.direct:
        p.error("--code2wav-only runs in the direct arm's process: leave out --no-direct")
    if not (args.system or args.direct):
        p.error("--no-system and --no-direct leave nothing to measure")
    args.concurrency = sorted(set(args.concurrency))
    return args


def _write(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.serve_direct:
        serve_direct(args)
        return 0
    exit_on_sigterm()  # a kill stops what it started (the finally blocks, atexit)
    from omni_jobs.local.tiny import resolve_model

    resolve_model(MODEL, args.models_dir.resolve())  # built once, before either arm starts
    results: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "rows": {}}
    times: dict[int, dict[str, ArmTimes]] = {n: {} for n in args.concurrency}
    started = time.time()
    system = SpeechSystem(args) if args.system and not args.code2wav_only else None
    child = None
    try:
        if system is not None:
            system.start()
            warm = min(max(args.concurrency), 4)
            system.run(texts(warm, 998), min(args.codes, 48))  # no arm pays first-call costs
        if args.direct:
            argv_child = [sys.executable, "-m", "bench.speech", "--serve-direct", "--codes", str(args.codes),
                          "--models-dir", str(args.models_dir), "--concurrency", *map(str, args.concurrency)]
            child = DirectProcess(argv_child, ROOT / "logs" / "speech-direct.log", turns_env())
        arms: list[tuple[str, Callable[[int, int], dict[str, Any]]]] = []
        if child is not None:
            arms.append(("direct", lambda n, rep: child.ask(json.dumps({"n": n, "rep": rep})) if child else {}))
        if system is not None:
            arms.append(("system", lambda n, rep: system.run(texts(n, rep), args.codes) if system else {}))
        for rep in range(0 if args.code2wav_only else args.reps):
            order = arms if rep % 2 == 0 else arms[::-1]  # each arm goes first in turn
            for n in args.concurrency:
                for name, run in order:
                    times[n].setdefault(name, ArmTimes()).add(run(n, rep))
                print(f"  rep {rep + 1}, N={n}: " + "; ".join(
                    f"{name} first p50 {_s(_pct(sorted(t.first_s[-1]), 50))} s, whole p50 "
                    f"{_s(_pct(sorted(t.whole_s[-1]), 50))} s" for name, t in times[n].items()), flush=True)
                results["rows"] = {str(k): {a: t.summary() for a, t in v.items()} for k, v in times.items() if v}
                _write(args.out, results)  # step by step: a run cut short keeps what it measured
        if child is not None:
            alone = child.ask(json.dumps({"alone": True, "batches": args.concurrency}))
            results["code2wav_alone"] = {"chunk": 24, "rtf": alone["rtf"], "rtf_p50": _pct(sorted(alone["rtf"]), 50),
                                         "rtf_p90": _pct(sorted(alone["rtf"]), 90), "batched": alone["batched"],
                                         "batched_runs": alone["batched_runs"]}
            results["direct_rss_mib"] = child.close()["rss_mib"]
            child = None
    finally:
        if child is not None:
            child.__exit__(None, None, None)
        if system is not None:
            system.stop()
    results["rows"] = {str(k): {a: t.summary() for a, t in v.items()} for k, v in times.items() if v}
    results["ratios"] = ratios(results["rows"])
    results["wall_s"] = time.time() - started
    print("\n" + table(results))
    _write(args.out, results)
    print(f"\nresults: {args.out} ({results['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
