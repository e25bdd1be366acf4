"""The real engines on the tiny models: vLLM for AR, diffusers for DiT, each loaded once per module."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from omni_jobs.engines import pool
from omni_jobs.engines.ar import AREngine, ARRequest, SamplingOptions
from omni_jobs.engines.dit import DiTEngine, DiTRequest
from omni_jobs.engines.pool import EnginePool
from omni_jobs.local.tiny import build_tiny_llama, build_tiny_pixart
from omni_jobs.pipelines import model_source

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "The quick brown fox",
    "Hello, world! How are you today?",
    "héllo wörld 🌍 世界 \x00 tab\tand newline\n",
    "A watercolor painting of a lighthouse",
]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def cache(models_dir: Path) -> EnginePool:
    return EnginePool(models_dir, kv_cache_bytes=128 * 2**20, max_model_len=256, device="cpu")


@pytest.fixture(scope="module")
def ar(cache: EnginePool) -> AREngine:
    pytest.importorskip("vllm")
    return cache.ar("tiny:llama", {})


@pytest.fixture(scope="module")
def dit(cache: EnginePool) -> DiTEngine:
    pytest.importorskip("diffusers")
    return cache.dit("tiny:pixart", {})


def _greedy(max_tokens: int = 16) -> SamplingOptions:
    return SamplingOptions(max_tokens=max_tokens, temperature=0.0)


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _files_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------- AR (vLLM)


def test_ar_greedy_matches_transformers(ar: AREngine, models_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    outputs = ar.generate([ARRequest(f"r{i}", p, _greedy()) for i, p in enumerate(PROMPTS)])
    hf = AutoModelForCausalLM.from_pretrained(models_dir / "tiny-llama", dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = ar.tokenize(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
            )
        expected = _until_eos(ref[0, len(ids) :].tolist(), eos)
        assert _until_eos(out.token_ids, eos) == expected
        assert len(out.token_ids) >= 1


def test_ar_same_seed_same_text(ar: AREngine) -> None:
    def sampled(seed: int, rid: str) -> ARRequest:
        return ARRequest(rid, "Once upon a time", SamplingOptions(max_tokens=24, temperature=1.0, seed=seed))

    first = ar.generate([sampled(7, "a"), sampled(7, "b"), sampled(8, "c")])
    again = ar.generate([sampled(7, "d")])
    assert first[0].text == first[1].text == again[0].text
    assert first[0].token_ids == again[0].token_ids
    assert first[2].token_ids != first[0].token_ids  # 24 tokens from ~450 at T=1: a match is ~impossible


def test_ar_batch_in_request_order(ar: AREngine) -> None:
    requests = [ARRequest(f"req-{i}", p, _greedy(max_tokens=i + 1)) for i, p in enumerate(PROMPTS)]
    outputs = ar.generate(requests)
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    for r, o in zip(requests, outputs, strict=True):
        single = ar.generate([r])[0]
        assert o.token_ids == single.token_ids
        assert o.text == single.text
        assert o.prompt_token_ids == ar.tokenize(r.prompt)
        assert 1 <= len(o.token_ids) <= r.sampling.max_tokens
        assert o.finish_reason in ("length", "stop")


def test_ar_too_long_prompt_names_request(ar: AREngine) -> None:
    requests = [ARRequest("ok", "short", _greedy()), ARRequest("too-long", "word " * 400, _greedy())]
    with pytest.raises(ValueError, match="too-long"):
        ar.generate(requests)
    assert ar.generate([requests[0]])[0].request_id == "ok"  # the engine still works


def test_ar_empty_batch(ar: AREngine) -> None:
    assert ar.generate([]) == []


def test_an_ar_engines_process_groups_share_one_gloo_loop_thread(ar: AREngine) -> None:
    """vLLM makes ~13 gloo groups even for one rank; each would keep a thread waking every 10 ms."""
    tasks = Path("/proc/self/task")
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir()]
    assert names.count("gloo_tcp_loop") == 1


def test_ar_missing_model_is_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AREngine(str(tmp_path / "no-such-model"))


def test_cache_reuses_engines(cache: EnginePool, ar: AREngine, dit: DiTEngine) -> None:
    assert cache.ar("tiny:llama", {}) is ar
    assert cache.dit("tiny:pixart", {}) is dit
    other = cache.dit("tiny:pixart", {"call_args": {"max_sequence_length": 64}})
    assert other is not dit
    assert cache.dit("tiny:pixart", {"call_args": {"max_sequence_length": 64}}) is other



def test_the_pool_builds_and_loads_on_threads_that_end_with_the_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread keeps an OpenMP team from torch work it will not do again (omni_jobs.engines.pool):
    the tiny model is built, and diffusers loads it, on threads that are gone when the pool answers."""
    pytest.importorskip("diffusers")
    found = model_source._source_for("tiny:pixart")
    assert found is not None
    tiny, _ = found
    seen: dict[str, list[threading.Thread]] = {"build": [], "load": []}

    def build(name: str, models_dir: Path) -> str:
        seen["build"].append(threading.current_thread())
        return tiny.resolve(name, models_dir)

    class RecordedDiT(DiTEngine):
        def __init__(self, model: str, **kwargs: Any) -> None:
            seen["load"].append(threading.current_thread())
            super().__init__(model, **kwargs)

    monkeypatch.setitem(model_source._SOURCES, "tiny:", replace(tiny, resolve=build))
    monkeypatch.setattr(pool, "DiTEngine", RecordedDiT)
    engines = EnginePool(tmp_path, kv_cache_bytes=2**20, max_model_len=64, device="cpu")
    with pytest.raises(ValueError, match="no-such-model"):  # a failed load reaches the caller; nothing is kept
        engines.dit(str(tmp_path / "no-such-model"), {})
    dit = engines.dit("tiny:pixart", {})
    assert engines.dit("tiny:pixart", {}) is dit
    assert len(seen["build"]) == 1 and len(seen["load"]) == 2  # built once; the bad path and the model
    for thread in seen["build"] + seen["load"]:
        assert thread is not threading.current_thread()
        assert not thread.is_alive()
    assert dit.generate([_req("a", 1, steps=2)])[0].image.size == (32, 32)  # type: ignore[union-attr]


# ---------------------------------------------------------------- DiT (diffusers)


def _req(
    rid: str,
    seed: int,
    *,
    prompt: str = "a red cat",
    height: int = 32,
    width: int = 32,
    steps: int = 4,
    guidance: float = 4.5,
    negative: str | None = None,
) -> DiTRequest:
    return DiTRequest(rid, prompt, height, width, steps, guidance, seed, negative)


@pytest.mark.parametrize(("height", "width"), [(32, 32), (64, 32), (64, 64), (24, 40)])
def test_dit_image_size(dit: DiTEngine, height: int, width: int) -> None:
    (out,) = dit.generate([_req("x", 1, height=height, width=width)])
    assert out.request_id == "x"
    assert out.image.size == (width, height)  # PIL gives (width, height)
    assert out.image.mode == "RGB"


def test_dit_seed_determinism(dit: DiTEngine) -> None:
    a = _png(dit.generate([_req("a", 11)])[0].image)
    b = _png(dit.generate([_req("b", 11)])[0].image)
    c = _png(dit.generate([_req("c", 12)])[0].image)
    assert a == b
    assert a != c


def test_dit_batched_close_to_single(dit: DiTEngine) -> None:
    import numpy as np

    requests = [
        _req("p0", 1, prompt="a red cat"),
        _req("p1", 2, prompt="a blue dog", height=64, width=32),
        _req("p2", 3, prompt="a green tree"),
        _req("p3", 4, prompt="a house", negative="blurry"),
        _req("p4", 5, prompt="the sea"),
    ]
    batched = dit.generate(requests)
    assert [o.request_id for o in batched] == [r.request_id for r in requests]
    for r, o in zip(requests, batched, strict=True):
        single = np.asarray(dit.generate([r])[0].image, dtype=np.int16)
        assert np.abs(np.asarray(o.image, dtype=np.int16) - single).max() <= 1


def test_dit_encodes_a_negative_prompt_once_and_makes_the_pipelines_own_images(dit: DiTEngine) -> None:
    """The pipeline would encode a batch's negative prompt once per member, every batch: the engine
    keeps it (DiTEngine._text_conditioning). Same pixels; the text encoder sees each negative once."""
    import numpy as np

    rows: list[int] = []
    hook = dit.pipe.text_encoder.register_forward_pre_hook(lambda _m, args: rows.append(int(args[0].shape[0])))

    def batch(negative: str | None) -> list[Any]:
        return [np.asarray(o.image) for o in dit.generate(
            [_req(f"n{i}", i, prompt=p, negative=negative) for i, p in enumerate(["a red cat", "the sea", "a house"])])]

    try:
        pixart = dit._pixart_encoding
        assert pixart is not None  # PixArt-Sigma: prompts as embeddings beside masks
        dit._negatives.clear()
        kept = {neg: batch(neg) for neg in (None, "blurry, low quality")}
        again = batch("blurry, low quality")
        encoded_kept = list(rows)
        rows.clear()
        dit._pixart_encoding = None  # the pipeline's own encoding, for comparison
        own = {neg: batch(neg) for neg in (None, "blurry, low quality")}
        encoded_own = list(rows)
    finally:
        dit._pixart_encoding = pixart
        hook.remove()
    for neg, images in kept.items():
        assert all(np.array_equal(a, b) for a, b in zip(images, own[neg], strict=True)), neg
    assert all(np.array_equal(a, b) for a, b in zip(again, kept["blurry, low quality"], strict=True))
    # kept: each negative once (1 row), then the batch's 3 prompts; the pipeline: 3 prompts + 3 negative rows
    assert encoded_kept == [1, 3, 1, 3, 3]
    assert encoded_own == [3, 3, 3, 3]


def test_two_batchers_of_one_dit_engine_taking_turns_serve_every_request(dit: DiTEngine, tmp_path: Path) -> None:
    """Two stages' policies give one engine two batchers; each waits for the engine and its turn
    before its batch is final, in the order a direct call takes them, so neither waits on the other
    forever while the other passes the turn between steps."""
    from concurrent.futures import ThreadPoolExecutor

    from omni_jobs.engines import turns
    from omni_jobs.engines.batching import BatchPolicy, dit_batcher

    turns.configure(tmp_path / "turns")
    try:
        batchers = [dit_batcher(dit, BatchPolicy(max_batch_size=n, wait_ms=5)) for n in (2, 3)]
        requests = [_req(f"r{i}", i, steps=3) for i in range(8)]
        with ThreadPoolExecutor(9) as pool:
            direct = pool.submit(dit.generate, [_req("direct", 99, steps=3)])
            futures = [pool.submit(batchers[i % 2].submit, r) for i, r in enumerate(requests)]
            outputs = [f.result(timeout=120) for f in futures]
            assert direct.result(timeout=120)[0].request_id == "direct"
        assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    finally:
        turns.configure(None)


def test_dit_on_step(dit: DiTEngine) -> None:
    calls: list[tuple[int, int]] = []
    dit.generate([_req("a", 1, steps=5), _req("b", 2, steps=5)], on_step=lambda i, n: calls.append((i, n)))
    assert calls == [(i, 5) for i in range(1, 6)]

    calls.clear()
    dit.generate([_req("a", 1, steps=3), _req("b", 2, steps=2, width=64)], on_step=lambda i, n: calls.append((i, n)))
    assert calls == [(i, 5) for i in range(1, 6)]  # progress runs across the two groups


def test_dit_on_step_can_abort(dit: DiTEngine) -> None:
    class Cancelled(Exception):
        pass

    def abort(i: int, n: int) -> None:
        if i == 2:
            raise Cancelled

    with pytest.raises(Cancelled):
        dit.generate([_req("a", 1, steps=4)], on_step=abort)
    assert dit.generate([_req("a", 1, steps=4)])[0].image.size == (32, 32)  # still usable


def test_dit_any_unicode_prompt(dit: DiTEngine) -> None:
    prompt = ("日本語のプロンプト 🌍 émoji \x00 " * 20) + "a cat " * 100
    outputs = dit.generate([_req("u", 3, prompt=prompt), _req("e", 3, prompt="")])
    assert [o.image.size for o in outputs] == [(32, 32), (32, 32)]


def test_dit_same_png_across_processes(dit: DiTEngine, models_dir: Path) -> None:
    here = hashlib.sha256(_png(dit.generate([_req("x", 42)])[0].image)).hexdigest()
    script = textwrap.dedent(
        f"""
        import hashlib, io
        from omni_jobs.engines.dit import DiTEngine, DiTRequest
        engine = DiTEngine({str(models_dir / "tiny-pixart")!r}, device="cpu")
        image = engine.generate([DiTRequest("x", "a red cat", 32, 32, 4, 4.5, 42)])[0].image
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        print(hashlib.sha256(buf.getvalue()).hexdigest())
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.strip().splitlines()[-1] == here


# ---------------------------------------------------------------- tiny builds


def test_tiny_builds_are_deterministic(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    for build in (build_tiny_llama, build_tiny_pixart):
        a = _files_digest(build(tmp_path / f"{build.__name__}-a"))
        b = _files_digest(build(tmp_path / f"{build.__name__}-b"))
        assert a == b
        assert any(name.endswith(".safetensors") for name in a)
    seed0 = _files_digest(tmp_path / "build_tiny_llama-a")["model.safetensors"]
    seed1 = _files_digest(build_tiny_llama(tmp_path / "seed1", seed=1))["model.safetensors"]
    assert seed0 != seed1


# ---------------------------------------------------------------- previews and video


@pytest.fixture(scope="module")
def wan(cache: EnginePool) -> DiTEngine:
    pytest.importorskip("diffusers")
    return cache.dit("tiny:wan", {"pipeline_class": "WanPipeline", "call_args": {"max_sequence_length": 64}})


def _held_out_r2(engine: DiTEngine) -> float:
    """How much of the VAE's decoded colour (pooled to latent resolution) the fitted projection
    explains, on colour fields it was not fitted on (1 - mse / variance)."""
    import numpy as np
    import torch

    projection = engine._projection
    assert projection is not None
    vae, config = engine.pipe.vae, engine.pipe.vae.config
    x = torch.nn.functional.interpolate(torch.rand(4, 3, 4, 4, generator=torch.Generator().manual_seed(99)),
                                        size=(64, 64), mode="bicubic").clamp(0, 1) * 2 - 1
    with torch.no_grad():
        if hasattr(config, "z_dim"):
            z = vae.encode(x[:, :, None]).latent_dist.mean
            decoded = vae.decode(z).sample[:, :, 0]
            mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
            std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
            latents = ((z - mean) / std)[:, :, 0]
        else:
            z = vae.encode(x).latent_dist.mean
            decoded = vae.decode(z).sample
            latents = z * config.scaling_factor
    target = torch.nn.functional.adaptive_avg_pool2d((decoded + 1) / 2, latents.shape[-2:])
    target_np = target.permute(0, 2, 3, 1).numpy()
    predicted = np.stack([projection.to_rgb(lat.numpy()) for lat in latents]).astype(float) / 255
    return float(1 - ((predicted - target_np) ** 2).mean() / target_np.var(axis=(0, 1, 2)).mean())


def test_dit_previews_come_at_the_asked_steps_and_change_nothing(dit: DiTEngine) -> None:
    from omni_jobs.media.previews import LatentPreview

    got: list[LatentPreview] = []
    plain = dit.generate([_req("p", 11, steps=7)])[0]
    seen = dit.generate([replace(_req("p", 11, steps=7), preview_every=3, on_preview=got.append)])[0]
    assert _png(plain.image) == _png(seen.image)  # previews only read the latents
    assert [(p.step, p.total, p.latents.shape, (p.width, p.height)) for p in got] == [
        (3, 7, (4, 8, 8), (32, 32)), (6, 7, (4, 8, 8), (32, 32))]
    assert got[0].image().size == (32, 32)
    assert _held_out_r2(dit) > 0  # random weights: better than the mean colour (not by much)


def test_dit_batch_members_preview_on_their_own_schedule(dit: DiTEngine) -> None:
    from omni_jobs.media.previews import LatentPreview

    a: list[LatentPreview] = []
    b: list[LatentPreview] = []
    dit.generate([replace(_req("a", 1), preview_every=1, on_preview=a.append),
                  replace(_req("b", 2), preview_every=2, on_preview=b.append), _req("c", 3)])
    assert [p.step for p in a] == [1, 2, 3] and [p.step for p in b] == [2]
    assert not np_equal(a[1].latents, b[0].latents)  # each its own member's latents


def np_equal(x: Any, y: Any) -> bool:
    import numpy as np

    return bool(np.array_equal(x, y))


def test_wan_makes_video_frames_and_previews_a_middle_frame(wan: DiTEngine) -> None:
    from omni_jobs.media.previews import LatentPreview

    got: list[LatentPreview] = []
    request = DiTRequest("v", prompt="a cat walking", height=32, width=48, num_frames=9, num_inference_steps=4,
                         guidance_scale=5.0, seed=0, preview_every=2, on_preview=got.append)
    (out,) = wan.generate([request])
    assert out.video is not None and out.video.shape == (9, 32, 48, 3)
    assert 0.0 <= float(out.video.min()) and float(out.video.max()) <= 1.0
    assert [(p.step, p.latents.shape) for p in got] == [(2, (16, 4, 6))]  # 16 channels, 3 latent frames -> 1
    assert got[0].image().size == (48, 32)
    assert _held_out_r2(wan) > 0
    (again,) = wan.generate([request])
    assert out.video.tobytes() == again.video.tobytes()  # same seed, same frames


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"num_frames": 10}, r"num_frames 10 must be 4k\+1"),
    ({"height": 40}, "multiples of 16"),
    ({"num_frames": None}, "asks for an image"),
])
def test_wan_refuses_what_it_cannot_make(wan: DiTEngine, changes: dict[str, Any], fragment: str) -> None:
    fields: dict[str, Any] = {"prompt": "x", "height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 1}
    with pytest.raises(ValueError, match=fragment):
        wan.generate([DiTRequest("bad", **{**fields, **changes})])
    with pytest.raises(ValueError, match="makes video, not images"):
        wan.check_task("text-to-image")
    wan.check_task("text-to-video")
