"""Qwen2.5-Omni's code-to-waveform (token2wav) as an engine: codec codes in, 24 kHz speech out, whole or in chunks.

Token2wav is a flow-matching DiT (codes -> mel, 10 Runge-Kutta steps with classifier-free guidance, conditioned
on the speaker's vector and reference mel) and a BigVGAN vocoder (mel -> samples): 2 mel frames per code and 240
samples per frame, so 480 samples (20 ms) per code. The engine is loaded from the whole checkpoint's
``token2wav.*`` weights (transformers' ``Qwen2_5OmniToken2WavModel``) and the speakers of its ``spk_dict.pt``;
its sampling loop is transformers' ``sample`` with the initial noise made here, position by position (``noise``),
so that a clip made in chunks starts every position from the same noise as the whole clip does.

Streaming (``Code2WavStream``): the codes arrive as the talker writes them; after ``first_chunk`` codes, then
every ``chunk``, the chunk is
rendered with ``left`` codes before it (the DiT attends a block of 24 mel frames = 12 codes back per layer that
looks back, and BigVGAN's convolutions reach a few frames) and ``right`` codes after it where ``right`` > 0
(the DiT also looks a block ahead); the context's samples are dropped. Each chunk holds back its last
``holdback`` samples (rendered next to its window's end, where BigVGAN sees no further), which the next chunk
renders again inside its left context and fades into over ``crossfade`` samples (a raised cosine), so the joins
have no step. Windows start on DiT block boundaries (multiples of 12 codes) as the whole clip's do.
The DiT's attention reaches further with every ODE step, so a chunked clip is close to, not equal to, the whole
clip: docs/pipelines.md, "Qwen2.5-Omni speech", gives the measured difference (tiny model, default settings: max |diff|
9.5e-4, 60.9 dB SNR).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from omni_jobs.core import telemetry
from omni_jobs.engines import omni_speech
from omni_jobs.engines.batching import Batcher, BatchPolicy, Member, ProgressFn, batcher_for
from omni_jobs.engines.turns import engine_turn, pass_turn
from omni_jobs.media.payloads import AudioClip

if TYPE_CHECKING:
    import torch

MEL_DIM_KEY = "mel_dim"
NOISE_BLOCK = 24
"""Mel frames of noise drawn per generator seed: the noise of frame ``t`` depends only on (seed, t)."""


@dataclass(frozen=True)
class Code2WavRequest:
    """Codes to render with a speaker's voice, starting from the noise of ``seed`` at positions ``offset`` on
    (a chunk of a longer clip takes its positions' noise)."""

    request_id: str
    codes: tuple[int, ...]
    speaker: str
    seed: int = 0
    offset: int = 0
    """Index of the first code in its clip (its noise starts at mel frame ``offset * repeats``)."""
    num_steps: int = 10
    guidance_scale: float = 0.5


@dataclass
class _Window:
    start: int
    """Index of the window's first code in the clip."""
    samples: np.ndarray


class Code2WavSubmitter(Protocol):
    """A code2wav batcher, in this process (``Batcher``) or an engine process's (engine_client.Submitter)."""

    def submit(self, request: Code2WavRequest, progress: ProgressFn | None = None) -> AudioClip: ...


class Code2WavFront:
    """What streams and stages use of a code2wav engine, wherever it runs: here (``Code2Wav``) or in an engine
    process (engine_client.Code2WavProcess), which knows the model's numbers from its load."""

    model_dir: str
    block_codes: int
    """Codes per DiT attention block (24 mel frames / 2 = 12): windows start on these."""
    num_codes: int
    """Codes 0..num_codes-1 are rendered (the talker's control codes above are not speech)."""
    samples_per_code: int
    sample_rate: int
    max_codes: int
    """The most codes one DiT window takes (its positions); ``full`` renders longer clips in chunks."""

    def render(self, requests: Sequence[Code2WavRequest]) -> list[AudioClip]:
        """Each request's audio; requests of the same length, voice and settings share one DiT batch."""
        raise NotImplementedError

    def batcher(self, policy: BatchPolicy) -> Code2WavSubmitter:
        """The engine's batcher of ``policy``: concurrent requests of one length and voice share a DiT batch."""
        raise NotImplementedError

    def speaker(self, name: str) -> omni_speech.Speaker:
        return omni_speech.speaker(self.model_dir, name)

    def check_codes(self, codes: Sequence[int]) -> None:
        bad = sorted({int(c) for c in codes if not 0 <= int(c) < self.num_codes})
        if bad:
            raise ValueError(f"codes {bad[:8]} are outside token2wav's codebook (0..{self.num_codes - 1}); "
                             "control codes (the talker's stop codes) are not speech")

    def full(self, codes: Sequence[int], speaker: str, *, seed: int = 0, num_steps: int = 10,
             guidance_scale: float = 0.5) -> AudioClip:
        """The whole clip: ``len(codes) * samples_per_code`` samples at 24 kHz (one DiT window; past the DiT's
        longest, in chunks as a stream renders them)."""
        if len(codes) > self.max_codes:
            stream = self.stream(speaker, seed=seed, chunk=self.max_codes // 2 // self.block_codes * self.block_codes,
                                 left=self.block_codes, num_steps=num_steps, guidance_scale=guidance_scale)
            head = stream.push(codes)
            rest = stream.finish()
            return AudioClip(np.concatenate([*([head.samples] if head is not None else []), rest.samples], axis=1),
                             self.sample_rate)
        (clip,) = self.render([Code2WavRequest("full", tuple(int(c) for c in codes), speaker, seed=seed,
                                               num_steps=num_steps, guidance_scale=guidance_scale)])
        return clip

    def stream(self, speaker: str, **settings: Any) -> Code2WavStream:
        """A ``Code2WavStream`` of this engine (its settings: ``Code2WavStream``'s keywords)."""
        return Code2WavStream(self, speaker, **settings)


class Code2Wav(Code2WavFront):
    """One checkpoint's token2wav (DiT + BigVGAN, float32), rendering batches of equally long requests at once."""

    def __init__(self, model: str, *, device: str = "cpu") -> None:
        import torch
        from transformers import Qwen2_5OmniToken2WavConfig, Qwen2_5OmniToken2WavModel

        self.model_dir = model
        config = Qwen2_5OmniToken2WavConfig(**omni_speech.sub_config(model, "token2wav_config"))
        config._attn_implementation = "sdpa"  # transformers' own choice for token2wav (float32, no eager)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        token2wav: Any = Qwen2_5OmniToken2WavModel  # transformers' class (its methods are untyped)
        self.model: Any = token2wav(config).eval()
        missing = self.model.load_state_dict(_prefixed_weights(model, "token2wav."), strict=True)
        del missing
        self.model.to(self.device, dtype=torch.float32)
        dit = self.model.code2wav_dit_model
        self.repeats = int(dit.repeats)
        """Mel frames per code (2)."""
        self.mel_dim = int(dit.mel_dim)
        self.block_codes = max(1, int(dit.block_size) // self.repeats)
        self.num_codes = int(dit.text_embed.codec_embed.num_embeddings)
        hop = 1
        for rate in self.model.code2wav_bigvgan_model.config.upsample_rates:
            hop *= int(rate)
        self.samples_per_code = hop * self.repeats
        self.sample_rate = omni_speech.SAMPLE_RATE
        self.max_codes = int(dit.config.max_position_embeddings) // self.repeats
        self._lock = threading.Lock()

    def noise(self, seed: int, start_frame: int, frames: int) -> torch.Tensor:
        """[1, frames, mel_dim] initial noise of mel frames ``start_frame`` on: block ``k`` of NOISE_BLOCK frames is
        drawn from its own generator (``seed``, ``k``), so a frame's noise is the same in every window."""
        return _noise(seed, start_frame, frames, self.mel_dim)

    def render(self, requests: Sequence[Code2WavRequest]) -> list[AudioClip]:
        groups: dict[Hashable, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(group_key(r), []).append(i)
        out: list[AudioClip | None] = [None] * len(requests)
        for members in groups.values():
            if not requests[members[0]].codes:  # nothing to say: an empty clip
                for i in members:
                    out[i] = AudioClip(np.zeros((1, 0), np.float32), self.sample_rate)
                continue
            batch = [requests[i] for i in members]
            for i, samples in zip(members, self._render_batch(batch), strict=True):
                out[i] = AudioClip(samples.reshape(1, -1), self.sample_rate)
        return [c for c in out if c is not None]

    def _render_batch(self, batch: Sequence[Code2WavRequest]) -> list[np.ndarray]:
        import torch

        first = batch[0]
        for r in batch:
            self.check_codes(r.codes)
        voice = self.speaker(first.speaker)
        n = len(first.codes)
        codes = torch.tensor([list(r.codes) for r in batch], dtype=torch.long, device=self.device)
        noise = torch.cat([self.noise(r.seed, r.offset * self.repeats, n * self.repeats) for r in batch]).to(self.device)
        cond = voice.cond.to(self.device).expand(len(batch), -1)
        ref = voice.ref_mel.to(self.device).expand(len(batch), -1, -1)
        # a batch of streams' first windows keeps the turn: their listeners hear nothing yet, while the talker's
        # codes can wait half a second; any other batch lets a talker on the same cores step between evaluations
        step_aside = pass_turn if any(r.offset > 0 for r in batch) else _keep_turn
        with self._lock, engine_turn(), torch.no_grad():
            telemetry.batch("code2wav", len(batch))
            mel = self._mel(codes, cond, ref, noise, first.num_steps, first.guidance_scale, step_aside=step_aside)
            step_aside()
            wave = self.model.code2wav_bigvgan_model(mel)
        wave = wave.reshape(len(batch), -1).float().numpy()
        return [np.ascontiguousarray(w, dtype=np.float32) for w in wave]

    def _mel(self, codes: torch.Tensor, cond: torch.Tensor, ref: torch.Tensor, noise: torch.Tensor, num_steps: int,
             guidance_scale: float, sway_coefficient: float = -1.0,
             step_aside: Callable[[], None] | None = None) -> torch.Tensor:
        """transformers' ``Qwen2_5OmniToken2WavDiTModel.sample`` from the given initial noise: [B, mel_dim, frames]."""
        import torch
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        dit = self.model.code2wav_dit_model
        frames = noise.shape[1]
        if frames > dit.config.max_position_embeddings:
            raise ValueError(f"{frames // self.repeats} codes make {frames} mel frames, more than token2wav's "
                             f"{dit.config.max_position_embeddings}; render them in chunks (Code2WavStream)")
        speaker = cond.unsqueeze(1).repeat(1, frames, 1)

        def velocity(time_step: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            # between two of the DiT's ~40 evaluations a talker of this host may take its step (engines.turns):
            # a whole render held the turn for up to ~1 s, so a talker beside it made one code per render, and
            # at 16 streams their first chunks waited ~5 s for the talker's 24 codes instead of ~0.5
            if step_aside is not None:
                step_aside()
            if guidance_scale < 1e-5:
                plain: torch.Tensor = dit(hidden_states=state, speaker_embedding=speaker, condition_vector=ref,
                                          quantized_code=codes, time_step=time_step, drop_audio_conditioning=False,
                                          drop_code=False, apply_cfg=False)
                return plain
            both = dit(hidden_states=state, quantized_code=codes, speaker_embedding=speaker, condition_vector=ref,
                       time_step=time_step, apply_cfg=True)
            guided, null = torch.chunk(both, 2, dim=0)
            return guided + (guided - null) * guidance_scale

        times = torch.linspace(0, 1, num_steps, device=noise.device, dtype=cond.dtype)
        if sway_coefficient is not None:
            times += sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
        solver: Any = RungeKutta4ODESolver  # transformers' own solver (untyped)
        trajectory = solver(function=velocity, initial_value=noise).integrate(times)
        mel: torch.Tensor = trajectory[-1].permute(0, 2, 1)
        return mel

    def batcher(self, policy: BatchPolicy) -> Batcher[Code2WavRequest, AudioClip]:
        def run(batch: Sequence[Member[Code2WavRequest, AudioClip]]) -> list[AudioClip | BaseException]:
            return list(self.render([m.request for m in batch]))

        return batcher_for(_batchers, self, policy,
                           lambda p: Batcher(run, p, group_key=group_key, rank=first_chunks_first, name="code2wav"))


def _keep_turn() -> None:
    """Not stepping aside: the render holds the engine turn to its end."""


def group_key(r: Code2WavRequest) -> Hashable:
    """What requests must share to be rendered in one DiT batch."""
    return (len(r.codes), r.speaker, r.num_steps, r.guidance_scale)


def _noise(seed: int, start_frame: int, frames: int, mel_dim: int) -> torch.Tensor:
    import torch

    first, last = start_frame // NOISE_BLOCK, (start_frame + frames - 1) // NOISE_BLOCK
    blocks = []
    for k in range(first, last + 1):
        generator = torch.Generator().manual_seed((int(seed) * 1_000_003 + k) % 2**63)
        blocks.append(torch.randn(NOISE_BLOCK, mel_dim, generator=generator))
    joined = torch.cat(blocks)
    skip = start_frame - first * NOISE_BLOCK
    return joined[skip : skip + frames].unsqueeze(0).contiguous()


def _prefixed_weights(model_dir: str, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under ``prefix`` (prefix removed), read from its safetensors shards only."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key.startswith(prefix):
                    found[key[len(prefix):]] = f.get_tensor(key).float()
    if not found:
        raise ValueError(f"model {model_dir!r} has no {prefix}* weights: code2wav needs the whole Qwen2.5-Omni "
                         "checkpoint")
    return found


# --- streaming ---


def raised_cosine_fade(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(fade-out, fade-in) weights over ``n`` samples that sum to 1 at every sample: for two renderings of the
    same audio (an equal-power fade, made for unrelated signals, would swell their sum by up to 41%)."""
    if n <= 0:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    fade_in = np.sin((np.arange(n, dtype=np.float64) + 0.5) / n * math.pi / 2) ** 2
    return (1.0 - fade_in).astype(np.float32), fade_in.astype(np.float32)


@dataclass
class Code2WavStream:
    """Codes in as the talker writes them, audio out chunk by chunk; joined, the chunks are the clip's length.

    ``push(codes)`` takes the new codes (any number) and returns the audio that is final, or None while a chunk
    is still filling; ``finish()`` renders what is left. Settings (in codes; 1 code = 480 samples = 20 ms):
    ``chunk`` codes per render (a multiple of the DiT block, 12), ``first_chunk`` codes of the first render (a
    multiple of 12; with ``left`` = 12 the second window is then as long as every later one, so it batches with
    them), ``left`` codes of context before it (a multiple of 12), ``right`` codes of context after it (the chunk
    then waits for them). The last ``holdback`` samples of
    a chunk, rendered next to its window's end where BigVGAN's convolutions see no further, are not sent: the next
    chunk renders them again inside its left context and sends them, fading from the first chunk's rendering over
    its first ``crossfade`` samples (a raised cosine).
    """

    engine: Code2WavFront
    speaker: str
    seed: int = 0
    chunk: int = 24
    first_chunk: int = 12
    """The first audio waits for these codes only: a 12-code window renders in 0.51 s at 16 streams in one batch
    on 2 cores, a 24-code one in 0.76 s (0.20 and 0.22 alone)."""
    left: int = 12
    right: int = 0
    holdback: int = 1440
    crossfade: int = 480
    num_steps: int = 10
    guidance_scale: float = 0.5
    render: Callable[[Code2WavRequest], AudioClip] | None = None
    """How a chunk's window is rendered: through the engine's batcher (``code2wav_batcher(...).submit``), so that
    the chunks of concurrent streams of one voice and length share a DiT batch; None: alone."""
    request_id: str = "chunk"
    _codes: list[int] = field(default_factory=list)
    _done: int = 0
    """Codes rendered so far (their audio has gone out, but for the held-back samples)."""
    _tail: np.ndarray | None = None
    """The last chunk's held-back samples, for the next chunk to fade from."""
    _finished: bool = False

    def __post_init__(self) -> None:
        block, per = self.engine.block_codes, self.engine.samples_per_code
        for name, size in (("chunk", self.chunk), ("first_chunk", self.first_chunk)):
            if size < block or size % block:
                raise ValueError(f"{name} must be a multiple of {block} codes (a DiT block), got {size}")
        if self.left < 0 or self.left % block or self.right < 0:
            raise ValueError(f"left must be a multiple of {block} codes and right >= 0, got {self.left}, {self.right}")
        if not 0 <= self.holdback <= self.left * per:
            raise ValueError(f"holdback must be 0 to left x {per} samples (the next chunk renders it again inside "
                             f"its left context), got {self.holdback}")
        if not 0 <= self.crossfade <= self.holdback:
            raise ValueError(f"crossfade must be 0 to holdback ({self.holdback}) samples, got {self.crossfade}")
        self.engine.speaker(self.speaker)  # an unknown voice fails here, before any code arrives

    @property
    def codes(self) -> list[int]:
        return list(self._codes)

    def push(self, codes: Sequence[int]) -> AudioClip | None:
        """Take the talker's new codes; the audio that is final by now, or None."""
        if self._finished:
            raise RuntimeError("the stream is finished")
        self.engine.check_codes(codes)
        self._codes.extend(int(c) for c in codes)
        pieces = []
        while len(self._codes) >= self._done + self._next_size + self.right:
            pieces.append(self._step(self._done + self._next_size, last=False))
        return self._joined(pieces) if pieces else None

    def finish(self) -> AudioClip:
        """Render the codes left: the rest of the clip."""
        if self._finished:
            raise RuntimeError("the stream is finished")
        pieces = []
        while self._done < len(self._codes):
            end = min(self._done + self._next_size, len(self._codes))
            pieces.append(self._step(end, last=end == len(self._codes)))
        if self._tail is not None:  # no codes came after the last full chunk: its held-back end goes as it is
            pieces.append(self._tail)
            self._tail = None
        self._finished = True
        return self._joined(pieces)

    @property
    def _next_size(self) -> int:
        return self.first_chunk if self._done == 0 else self.chunk

    def _joined(self, pieces: list[np.ndarray]) -> AudioClip:
        samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        return AudioClip(samples.reshape(1, -1).astype(np.float32), self.engine.sample_rate)

    def _step(self, end: int, *, last: bool) -> np.ndarray:
        """Render codes [done, end) with their context; the samples that are final now."""
        per = self.engine.samples_per_code
        start = max(0, self._done - self.left)
        stop = min(len(self._codes), end + self.right)
        window = Code2WavRequest(f"{self.request_id}:{start}", tuple(self._codes[start:stop]), self.speaker,
                                 seed=self.seed, offset=start, num_steps=self.num_steps,
                                 guidance_scale=self.guidance_scale)
        clip = self.render(window) if self.render is not None else self.engine.render([window])[0]
        audio = clip.samples.reshape(-1)
        at = (self._done - start) * per  # where this chunk's own codes begin in the window
        out = audio[at : (end - start) * per]
        if self._tail is not None:  # the previous chunk's held-back end, rendered again here
            held = self._tail.shape[0]
            again = audio[at - held : at].copy()
            fade_out, fade_in = raised_cosine_fade(self.crossfade)
            again[: self.crossfade] = self._tail[: self.crossfade] * fade_out + again[: self.crossfade] * fade_in
            out = np.concatenate([again, out])
            self._tail = None
        if self.holdback and not last:
            out, self._tail = out[: out.shape[0] - self.holdback], out[out.shape[0] - self.holdback :].copy()
        self._done = end
        return np.ascontiguousarray(out, dtype=np.float32)


_batchers: weakref.WeakKeyDictionary[Code2Wav, dict[BatchPolicy, Batcher[Code2WavRequest, AudioClip]]] = \
    weakref.WeakKeyDictionary()


def code2wav_batcher(engine: Code2WavFront, policy: BatchPolicy) -> Code2WavSubmitter:
    """Batcher of a code2wav engine, here or in its process: concurrent requests of one length, voice and settings
    share a DiT batch, streams' first windows first."""
    return engine.batcher(policy)


def first_chunks_first(r: Code2WavRequest) -> int:
    """A stream's first window goes before other streams' later ones (rank 0 before 1): its listener hears
    nothing yet, while a later chunk has the audio before it still playing."""
    return 0 if r.offset == 0 else 1
