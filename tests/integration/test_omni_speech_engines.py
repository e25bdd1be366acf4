"""Qwen2.5-Omni's speech engines on tiny:qwen2.5-omni (the whole checkpoint): thinker -> talker -> code2wav.

- The thinker stage hands its talker the prompt's token ids and, for prompt + reply, the last hidden states and the
  input embeddings (zero at media placeholders), as transformers' own thinker makes them.
- The talker on vLLM (its own model class, selected by hf_overrides) writes transformers' talker's greedy codes for
  the same inputs. The reference is transformers' talker forward with its attention mask, stepped greedily: that is
  the path that adds the codec pad/start embeddings to the prompt's last two rows, as Qwen's model does (transformers
  5.19's ``generate`` drops an all-ones mask and skips them; with padding in a batch it adds them).
- Code2wav: 24 kHz, 480 samples a code, audible; equal to transformers' token2wav from the same noise; in chunks,
  joined, within the stated tolerance of the whole clip.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from omni_jobs.engines import omni_speech
from omni_jobs.engines.ar import AREngine, AROutput, ARRequest
from omni_jobs.engines.code2wav import Code2Wav, Code2WavRequest
from omni_jobs.engines.pool import EnginePool
from omni_jobs.engines.stage_exec import (
    ar_engine_args,
    ar_request,
    execute_code2wav,
    execute_talk,
    thinker_handover,
)
from omni_jobs.engines.talker import Talker, TalkSampling
from omni_jobs.engines.torchvision_free import install
from omni_jobs.media.payloads import AudioClip
from omni_jobs.pipelines.params import ARParams, ARTalkParams, DiTCode2WavParams
from omni_jobs.pipelines.spec import StageSpec
from omni_jobs.run.audio_stream import AudioDeltaReader, pcm16
from omni_jobs.run.code_stream import SpeechStreamer

pytest.importorskip("vllm")

MODEL = "tiny:qwen2.5-omni"
CHAT = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
REPLY_TOKENS = 10
CODES = 32
STREAM_SNR_DB = 50.0
STREAM_MAX_ABS = 5e-3
"""The chunked clip against the whole one (default stream settings; measured 60.9-62 dB, max |diff| 9.5e-4)."""


def _stage(raw: dict[str, Any]) -> StageSpec:
    return StageSpec.model_validate({"model": MODEL, **raw})


THINKER = _stage({"id": "thinker", "engine": "ar",
                  "inputs": {"prompt": "input.prompt", "audio": "input.audio", "image": "input.image"},
                  "outputs": ["text", "token_ids", "prompt_token_ids", "hidden_states", "token_embeds",
                              "prompt_positions"]})
TALKER = _stage({"id": "talker", "engine": "ar", "task": "talk",
                 "inputs": {"token_ids": "thinker.token_ids", "prompt_token_ids": "thinker.prompt_token_ids",
                            "hidden_states": "thinker.hidden_states", "token_embeds": "thinker.token_embeds",
                            "prompt_positions": "thinker.prompt_positions"}})
CODE2WAV = _stage({"id": "code2wav", "engine": "dit", "task": "code2wav", "inputs": {"audio_codes": "talker.audio_codes"}})


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> EnginePool:
    install()
    return EnginePool(tmp_path_factory.mktemp("models"), kv_cache_bytes=64 * 2**20, max_model_len=512, device="cpu")


@pytest.fixture(scope="module")
def model_dir(pool: EnginePool) -> str:
    return pool._resolve(MODEL)


@pytest.fixture(scope="module")
def thinker(pool: EnginePool) -> AREngine:
    return pool.ar(MODEL, ar_engine_args(THINKER))


@pytest.fixture(scope="module")
def talker(pool: EnginePool) -> Talker:
    return Talker(pool.ar(MODEL, ar_engine_args(TALKER)))


@pytest.fixture(scope="module")
def code2wav(pool: EnginePool) -> Code2Wav:
    return pool.code2wav(MODEL, {})


@pytest.fixture(scope="module")
def hf(model_dir: str) -> Iterator[Any]:
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield model


def _clip(seconds: float = 1.0, seed: int = 0) -> AudioClip:
    samples = (0.1 * np.random.default_rng(seed).standard_normal(int(16000 * seconds))).astype(np.float32)
    return AudioClip(samples.reshape(1, -1), 16000)


def _think(pool: EnginePool, thinker: AREngine, inputs: dict[str, object], request_id: str, *, chat: bool = True
           ) -> tuple[ARParams, AROutput, dict[str, object]]:
    params = ARParams(max_tokens=REPLY_TOKENS, temperature=0.0, chat=chat)
    request = ar_request(pool, THINKER, params, inputs, request_id)
    (output,) = thinker.generate([request])
    return params, output, thinker_handover(pool, THINKER, params, inputs, request_id, output)


def test_the_thinker_hands_over_its_states_with_their_shapes(pool: EnginePool, thinker: AREngine,
                                                             model_dir: str, hf: Any) -> None:
    text_params, text_out, text_states = _think(pool, thinker, {"prompt": "Say something nice."}, "text")
    _, audio_out, audio_states = _think(pool, thinker, {"prompt": "What is this?", "audio": _clip()}, "audio")
    for output, states in ((text_out, text_states), (audio_out, audio_states)):
        prompt, reply = len(output.prompt_token_ids), len(output.token_ids)
        assert set(states) == {"prompt_token_ids", "hidden_states", "token_embeds", "prompt_positions"}
        assert states["prompt_positions"].tolist() == [list(range(prompt))] * 3  # type: ignore[attr-defined]
        assert states["prompt_token_ids"].tolist() == output.prompt_token_ids  # type: ignore[attr-defined]
        for name in ("hidden_states", "token_embeds"):
            value = states[name]
            assert isinstance(value, torch.Tensor) and value.dtype == torch.float32
            assert tuple(value.shape) == (prompt + reply, 128)  # the thinker's hidden size
    # media placeholders: embeddings zeroed (transformers zeroes the audio features there), 25 of them a second
    audio_id = omni_speech.read_config(model_dir)["thinker_config"]["audio_token_index"]
    at = torch.tensor(audio_out.prompt_token_ids) == audio_id
    assert int(at.sum()) == 25
    embeds = audio_states["token_embeds"]
    assert isinstance(embeds, torch.Tensor)
    assert embeds[: at.numel()][at].abs().max() == 0
    assert embeds[: at.numel()][~at].abs().sum(-1).min() > 0
    # the text prompt's states are transformers' thinker's for the same tokens
    ids = torch.tensor([text_out.prompt_token_ids + text_out.token_ids])
    with torch.no_grad():
        out = hf.thinker(input_ids=ids, output_hidden_states=True)
    assert torch.allclose(text_states["hidden_states"], out.hidden_states[-1][0], atol=1e-4)  # type: ignore[arg-type]
    assert torch.allclose(text_states["token_embeds"], out.hidden_states[0][0], atol=1e-6)  # type: ignore[arg-type]
    del text_params


def _hf_talker_inputs(hf: Any, prompt_ids: list[int], reply_tokens: int) -> dict[str, Any]:
    """The talker inputs transformers' own ``generate`` builds from its thinker (its talker call, captured)."""
    captured: dict[str, Any] = {}

    def capture(**kwargs: Any) -> torch.Tensor:
        captured.update({k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})
        raise _Captured

    hf.talker.generate, original = capture, hf.talker.generate
    ids = torch.tensor([prompt_ids])
    try:
        hf.generate(ids, attention_mask=torch.ones_like(ids), speaker="Chelsie", thinker_max_new_tokens=reply_tokens,
                    thinker_do_sample=False, talker_do_sample=False)
    except _Captured:
        pass
    finally:
        hf.talker.generate = original
    return captured


class _Captured(Exception):
    pass


def _hf_talker_greedy(hf: Any, inputs: dict[str, Any], max_new: int, stop: tuple[int, ...],
                      repetition_penalty: float, **prefill: Any) -> list[int]:
    """transformers' talker forward, stepped greedily with its attention mask and cache (its generate's rules:
    repetition penalty over prompt and codes, the codec start code suppressed)."""
    from transformers import DynamicCache
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    talker = hf.talker
    talker.rope_deltas = None
    seq = inputs["input_ids"].clone()
    penalty = RepetitionPenaltyLogitsProcessor(repetition_penalty)
    codes: list[int] = []
    with torch.no_grad():
        out = talker(input_ids=seq, input_text_ids=inputs["input_text_ids"], inputs_embeds=inputs["inputs_embeds"].clone(),
                     thinker_reply_part=inputs["thinker_reply_part"], attention_mask=torch.ones_like(seq),
                     past_key_values=DynamicCache(config=talker.config), use_cache=True, **prefill)
        for _ in range(max_new):
            logits = penalty(seq, out.logits[:, -1].clone())
            logits[:, talker.codec_bos_token] = float("-inf")
            code = int(logits.argmax(-1))
            if code in stop:
                break
            codes.append(code)
            seq = torch.cat([seq, torch.tensor([[code]])], dim=1)
            out = talker(input_ids=seq[:, -1:], attention_mask=torch.ones_like(seq), past_key_values=out.past_key_values,
                         thinker_reply_part=out.thinker_reply_part, input_text_ids=inputs["input_text_ids"],
                         use_cache=True)
    return codes


def test_the_talker_writes_transformers_greedy_codes(pool: EnginePool, thinker: AREngine, talker: Talker,
                                                    model_dir: str, hf: Any) -> None:
    prompt_ids = thinker.tokenize(CHAT.format(prompt="Say something nice."))
    captured = _hf_talker_inputs(hf, prompt_ids, REPLY_TOKENS)
    stop = talker.tokens.stop_codes
    want = _hf_talker_greedy(hf, captured, CODES, stop, 1.05)
    assert len(set(want)) > 3  # the random talker says something, not one code over and over

    # 1. the same rows into the vLLM talker (two requests in one batch, to see requests kept apart)
    rows = torch.cat([captured["inputs_embeds"][0], captured["thinker_reply_part"][0]])
    cond = omni_speech.TalkerConditioning(rows=rows, codec_from=len(prompt_ids))
    sampling = TalkSampling(max_tokens=CODES, temperature=0.0, repetition_penalty=1.05)
    request = talker.request("same-rows", _states(hf, prompt_ids), "Chelsie", sampling)
    same = ARRequest(request_id="same-rows", prompt="", engine_prompt=request.engine_prompt, sampling=request.sampling,
                     extra_args={omni_speech.TALKER_EXTRA_ARG: cond})
    other = ARRequest(request_id="other", prompt="", engine_prompt=request.engine_prompt, sampling=request.sampling,
                      extra_args={omni_speech.TALKER_EXTRA_ARG: omni_speech.TalkerConditioning(rows=rows * 0.5,
                                                                                           codec_from=len(prompt_ids))})
    outputs = talker.engine.generate([other, same, other])
    assert talker.codes(outputs[1]) == want
    assert talker.codes(outputs[0]) == talker.codes(outputs[2]) != want

    # 2. transformers' thinker states through talker_rows: the rows transformers builds
    built = omni_speech.talker_rows(_states(hf, prompt_ids), speaker_bos=_row(model_dir, "Chelsie"),
                                    text_eos=_row(model_dir, talker.tokens.text_eos),
                                    text_pad=_row(model_dir, talker.tokens.text_pad),
                                    thinker_eos_ids=talker.thinker_eos_ids)
    assert built.codec_from == len(prompt_ids)
    assert torch.allclose(built.rows, rows, atol=1e-5)

    # 3. the whole way on vLLM: the thinker stage's hand-over, then the talk stage
    inputs: dict[str, object] = {"prompt": CHAT.format(prompt="Say something nice.")}
    _, output, states = _think(pool, thinker, inputs, "speak", chat=False)
    assert output.prompt_token_ids == prompt_ids
    streamed: list[list[int]] = []
    params = ARTalkParams(temperature=0.0, max_tokens=CODES)
    values = execute_talk(pool, TALKER, params, {**states, "token_ids": torch.tensor(output.token_ids)}, "talk",
                          lambda done, total: None, on_codes=streamed.append)
    codes = values["audio_codes"]
    assert isinstance(codes, torch.Tensor) and codes.dtype == torch.long
    assert codes.tolist() == want
    assert streamed and streamed[-1] == want and all(s == want[: len(s)] for s in streamed)


def test_talker_requests_of_one_length_share_no_kv_cache(talker: Talker, hf: Any) -> None:
    """Talker prompts of one length have the same token ids (codec masks) but not the same KV cache (the rows):
    a later request must not take an earlier one's cached blocks (the engine runs without prefix caching; with
    it on, the second request here continued from the first one's blocks)."""
    from vllm.inputs import TokensPrompt

    prompt = talker.tokens.prompt(300)  # longer than a KV block (128), so a prefix cache would have one to reuse
    base = talker.request("probe", _states_like(len(prompt) - 2), "Chelsie", TalkSampling(max_tokens=8, temperature=0))
    for seed in (1, 2):
        rows = torch.randn(len(prompt) + 8, 128, generator=torch.Generator().manual_seed(seed))
        cond = omni_speech.TalkerConditioning(rows=rows, codec_from=len(prompt) - 2)
        (out,) = talker.engine.generate([ARRequest(
            request_id=f"kv{seed}", prompt="", engine_prompt=TokensPrompt(prompt_token_ids=prompt),
            sampling=base.sampling, extra_args={omni_speech.TALKER_EXTRA_ARG: cond})])
        inputs = {"input_ids": torch.tensor([prompt]), "input_text_ids": torch.zeros(1, len(prompt), dtype=torch.long),
                  "inputs_embeds": rows[None, : len(prompt)], "thinker_reply_part": rows[None, len(prompt) :]}
        assert talker.codes(out) == _hf_talker_greedy(hf, inputs, 8, talker.tokens.stop_codes, 1.05)


def _states_like(prompt: int) -> omni_speech.ThinkerStates:
    return omni_speech.ThinkerStates(prompt_token_ids=torch.zeros(prompt, dtype=torch.long),
                                     token_ids=torch.zeros(2, dtype=torch.long), hidden_states=torch.zeros(prompt + 2, 128),
                                     token_embeds=torch.zeros(prompt + 2, 128))


def test_a_prompt_with_an_image_gives_the_talker_the_thinkers_grid_positions(
        pool: EnginePool, thinker: AREngine, talker: Talker, model_dir: str, hf: Any) -> None:
    """Images sit on a 3-D grid of M-RoPE positions: the thinker hands them over (vLLM's own, for its prompt) and
    the talker continues after them, as transformers' talker does from the image's grid."""
    from PIL import Image
    from transformers import AutoProcessor

    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (84, 56, 3), dtype=np.uint8))
    text = CHAT.format(prompt="<|vision_bos|><|IMAGE|><|vision_eos|>What is it?")
    _, output, states = _think(pool, thinker, {"prompt": text, "image": image}, "image", chat=False)
    positions = states["prompt_positions"]
    assert isinstance(positions, torch.Tensor) and positions.shape == (3, len(output.prompt_token_ids))
    grid = AutoProcessor.from_pretrained(model_dir).image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
    ids = torch.tensor([output.prompt_token_ids])
    want_positions, _ = hf.thinker.get_rope_index(ids, grid, None, torch.ones_like(ids))
    assert torch.equal(positions, want_positions[:, 0])
    assert not torch.equal(positions[0], positions[1])  # a grid, not text positions

    inputs = {**states, "token_ids": torch.tensor(output.token_ids)}
    codes = execute_talk(pool, TALKER, ARTalkParams(temperature=0.0, max_tokens=CODES), inputs, "image:talk",
                         lambda done, total: None)["audio_codes"]
    from omni_jobs.engines.stage_exec import thinker_states_of

    bos = omni_speech.speaker(model_dir, "Chelsie").bos_token
    cond = omni_speech.talker_rows(thinker_states_of(inputs), speaker_bos=_row(model_dir, bos),
                                   text_eos=_row(model_dir, talker.tokens.text_eos),
                                   text_pad=_row(model_dir, talker.tokens.text_pad),
                                   thinker_eos_ids=talker.thinker_eos_ids)
    L = len(output.prompt_token_ids)
    hf_inputs = {"input_ids": torch.tensor([talker.tokens.prompt(L)]),
                 "input_text_ids": torch.tensor([output.prompt_token_ids + [bos, output.token_ids[0]]]),
                 "inputs_embeds": cond.rows[None, : L + 2], "thinker_reply_part": cond.rows[None, L + 2 :]}
    want = _hf_talker_greedy(hf, hf_inputs, CODES, talker.tokens.stop_codes, 1.05,
                             image_grid_thw=grid)
    assert codes.tolist() == want  # type: ignore[union-attr]


def _states(hf: Any, prompt_ids: list[int]) -> omni_speech.ThinkerStates:
    """transformers' thinker's states for the prompt and its greedy reply (as its generate hands them on)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        result = hf.thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=REPLY_TOKENS,
                                     do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
    reply = result.sequences[0, len(prompt_ids):]
    hidden = torch.cat([step[-1][0] for step in result.hidden_states])
    embeds = torch.cat([step[0][0] for step in result.hidden_states])
    return omni_speech.ThinkerStates(prompt_token_ids=ids[0], token_ids=reply, hidden_states=hidden, token_embeds=embeds)


def _row(model_dir: str, token: int | str) -> torch.Tensor:
    if isinstance(token, str):
        token = omni_speech.speaker(model_dir, token).bos_token
    return omni_speech.read_rows(model_dir, omni_speech.THINKER_EMBEDDINGS, [token])[0]


def _codes(n: int, seed: int) -> list[int]:
    return torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_code2wav_is_24khz_480_samples_a_code_and_transformers_token2wav(code2wav: Code2Wav, hf: Any) -> None:
    codes = _codes(48, 1)
    clip = code2wav.full(codes, "Chelsie")
    assert clip.sample_rate == 24000 and clip.samples.shape == (1, 48 * 480)
    assert float(np.abs(clip.samples).max()) > 1e-3
    # transformers' token2wav from the same initial noise: the same samples
    voice = code2wav.speaker("Ethan")
    torch.manual_seed(7)
    with torch.no_grad():
        want = hf.token2wav(torch.tensor([codes]), conditioning=voice.cond, reference_mel=voice.ref_mel)
    torch.manual_seed(7)
    noise = torch.randn(1, 48 * 2, 80)
    with torch.no_grad():
        got = code2wav.model.code2wav_bigvgan_model(
            code2wav._mel(torch.tensor([codes]), voice.cond, voice.ref_mel, noise, 10, 0.5))
    assert torch.allclose(got, want, atol=1e-6)
    # batched: two clips of one length in one DiT batch, each as it is alone
    other = _codes(48, 2)
    batched = code2wav.render([Code2WavRequest("a", tuple(codes), "Chelsie"),
                               Code2WavRequest("b", tuple(other), "Chelsie", seed=3)])
    assert np.allclose(batched[0].samples, clip.samples, atol=1e-5)
    assert np.allclose(batched[1].samples, code2wav.full(other, "Chelsie", seed=3).samples, atol=1e-5)
    with pytest.raises(ValueError, match="outside token2wav's codebook"):
        code2wav.full([1, 2, 4000], "Chelsie")


def test_code2wav_in_chunks_joins_within_tolerance_of_the_whole_clip(code2wav: Code2Wav) -> None:
    codes = _codes(96, 4)
    whole = code2wav.full(codes, "Ethan").samples[0]
    stream = code2wav.stream("Ethan")
    pieces, seconds = [], []
    for i in range(0, len(codes), 5):  # the talker's codes, a few per step
        started = time.perf_counter()
        got = stream.push(codes[i : i + 5])
        if got is not None:
            seconds.append(time.perf_counter() - started)
            pieces.append(got.samples[0])
    pieces.append(stream.finish().samples[0])
    joined = np.concatenate(pieces)
    assert joined.shape == whole.shape
    diff = joined - whole
    snr = 10 * np.log10(np.sum(whole**2) / np.sum(diff**2))
    assert np.abs(diff).max() <= STREAM_MAX_ABS and snr >= STREAM_SNR_DB, (np.abs(diff).max(), snr)
    assert len(seconds) >= 3  # chunks went out while codes were still coming


def test_the_stage_executors_make_codes_and_audio(pool: EnginePool, thinker: AREngine, talker: Talker,
                                                  code2wav: Code2Wav) -> None:
    inputs: dict[str, object] = {"prompt": "Hello there.", "audio": _clip(0.5, seed=3)}
    _, output, states = _think(pool, thinker, inputs, "exec")
    reported: list[tuple[int, int]] = []
    talk = execute_talk(pool, TALKER, ARTalkParams(seed=1, max_tokens=20),
                        {**states, "token_ids": torch.tensor(output.token_ids)}, "exec:talk",
                        lambda done, total: reported.append((done, total)))
    codes = talk["audio_codes"]
    assert isinstance(codes, torch.Tensor) and 0 < codes.numel() <= 20 and reported
    audio = execute_code2wav(pool, CODE2WAV, DiTCode2WavParams(speaker="Ethan"), {"audio_codes": codes},
                             "exec:c2w", lambda done, total: None)["audio"]
    assert isinstance(audio, AudioClip) and audio.sample_rate == 24000
    assert audio.samples.shape == (1, codes.numel() * 480)


def test_a_streamed_clip_restarted_by_a_talker_rerun_is_heard_once_and_stored_as_heard(code2wav: Code2Wav) -> None:
    """SpeechStreamer (code2wav's streamed stage): codes arrive in pieces, the talker runs again with other codes
    halfway; the final clip is the second run's, rendered as a stream renders it, and a listener of the deltas
    hears each sample once: the first run's start, then the rest of the second run's."""
    first, second = _codes(60, 5), _codes(84, 6)
    published: list[dict[str, Any]] = []
    streamer = SpeechStreamer(lambda: code2wav.stream("Chelsie"), published.append, stage="code2wav",
                              output="audio", attempt=1, sample_rate=code2wav.sample_rate)
    streamer.restart(1)
    for i in range(0, 50, 7):
        streamer.push(first[i:i + 7])
    heard_from_first = sum(d["samples"] for d in published)
    streamer.restart(2)  # the talker's second attempt: other codes, from the start
    for i in range(0, 40, 9):
        streamer.push(second[i:i + 9])
    clip = streamer.finish(second)
    alone = code2wav.stream("Chelsie")
    pieces = [p.samples[0] for p in (alone.push(second), alone.finish()) if p is not None]
    assert np.array_equal(clip.samples[0], np.concatenate(pieces)) and streamer.renderings == 2
    reader = AudioDeltaReader()
    heard = b"".join(c.pcm for d in published if (c := reader.feed(d)) is not None)
    assert heard_from_first > 0 and len(heard) // 2 == clip.samples.shape[1]
    assert heard[2 * heard_from_first:] == pcm16(clip.samples[0])[2 * heard_from_first:]
    assert {d["source_attempt"] for d in published} == {1, 2}
