"""Qwen2.5-Omni's speech path, its pure parts: the talker's rows as transformers builds them, its prompt and stop
codes, the talker's own config for vLLM, the stream's noise and fade, and the stages' ports and parameters."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_jobs.core.errors import PipelineSpecError
from omni_jobs.engines import omni_speech
from omni_jobs.engines.code2wav import _noise, raised_cosine_fade
from omni_jobs.engines.omni_speech import TalkerTokens, ThinkerStates, talker_codes, talker_rows
from omni_jobs.media.payloads import decode_payload, encode_payload
from omni_jobs.pipelines.catalogue import parse_pipeline
from omni_jobs.pipelines.params import ARTalkParams, DiTCode2WavParams

H = 4
TOKENS = TalkerTokens(codec_bos=41, codec_eos=42, codec_pad=40, codec_mask=44, text_eos=424, text_pad=422,
                      vocab_size=48)


def _states(prompt: int, reply: list[int], seed: int = 0) -> ThinkerStates:
    g = torch.Generator().manual_seed(seed)
    n = prompt + len(reply)
    return ThinkerStates(prompt_token_ids=torch.arange(prompt), token_ids=torch.tensor(reply),
                         hidden_states=torch.randn(n, H, generator=g), token_embeds=torch.randn(n, H, generator=g))


def _hf_rows(states: ThinkerStates, bos: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor,
             eos_ids: list[int]) -> torch.Tensor:
    """transformers' Qwen2_5OmniForConditionalGeneration.generate, restated for one sample: its talker's
    inputs_embeds, then its thinker_reply_part."""
    L = states.prompt_token_ids.numel()
    ids = states.token_ids.view(1, -1)
    n = ids.shape[1]
    hidden = [states.hidden_states[:L][None]] + [states.hidden_states[L + i : L + i + 1][None] for i in range(n - 1)]
    embeds = [states.token_embeds[:L][None]] + [states.token_embeds[L + i : L + i + 1][None] for i in range(n - 1)]
    reply = torch.cat(hidden[1:], dim=1) + torch.cat(embeds[1:], dim=1)
    first = torch.cat([hidden[0] + embeds[0], bos.view(1, 1, -1), reply[:, :1]], dim=1)
    reply = torch.cat([reply[:, 1:], eos.view(1, 1, -1), pad.view(1, 1, -1)], dim=1)
    is_eos = (ids.unsqueeze(-1) == torch.tensor(eos_ids)).any(-1)
    at = torch.arange(n)
    first_eos = torch.where(is_eos, at, n).min(dim=-1).values.clamp(min=1, max=n - 1)
    pos = torch.arange(reply.shape[1]).unsqueeze(0)
    reply = torch.where((pos >= first_eos.unsqueeze(1)).unsqueeze(-1), pad.view(1, 1, -1), reply)
    reply = torch.where((pos == (first_eos - 1).unsqueeze(1)).unsqueeze(-1), eos.view(1, 1, -1), reply)
    return torch.cat([first[0], reply[0]])


@pytest.mark.parametrize("reply", [[5, 6, 7, 8, 9], [5, 6, 7, 8, 402], [5, 402, 7, 402, 9], [5, 6]])
def test_talker_rows_are_transformers_inputs_and_reply_part(reply: list[int]) -> None:
    states = _states(6, reply)
    bos, eos, pad = torch.full((H,), 1.0), torch.full((H,), 2.0), torch.full((H,), 3.0)
    cond = talker_rows(states, speaker_bos=bos, text_eos=eos, text_pad=pad, thinker_eos_ids=[402, 400])
    assert cond.codec_from == 6 and cond.positions is None
    assert cond.rows.shape == (6 + 2 + len(reply), H)
    assert torch.allclose(cond.rows, _hf_rows(states, bos, eos, pad, [402, 400]))
    assert torch.equal(cond.rows[-1], pad)  # the last row repeats for ever after


def test_a_reply_cut_short_by_an_end_token_is_padded_after_it() -> None:
    states = _states(3, [5, 402, 7, 8])
    one = torch.ones(H)
    cond = talker_rows(states, speaker_bos=one * 1, text_eos=one * 2, text_pad=one * 3, thinker_eos_ids=[402])
    reply = cond.rows[3 + 2 :]
    assert torch.equal(reply[0], one * 2) and all(torch.equal(r, one * 3) for r in reply[1:])


def test_talker_rows_with_media_positions_continue_after_the_prompts_largest() -> None:
    base = _states(4, [5, 6, 7])
    positions = torch.tensor([[0, 1, 1, 5], [0, 1, 2, 5], [0, 2, 1, 5]])
    states = ThinkerStates(base.prompt_token_ids, base.token_ids, base.hidden_states, base.token_embeds, positions)
    one = torch.ones(H)
    cond = talker_rows(states, speaker_bos=one, text_eos=one, text_pad=one, thinker_eos_ids=[])
    assert cond.positions is not None and cond.positions[:, 4:].tolist() == [[6, 7]] * 3
    assert cond.position_delta == 5 + 1 - 4  # decode index 6 is at 8: right after 7


def test_thinker_states_are_checked() -> None:
    good = _states(3, [1, 2])
    with pytest.raises(ValueError, match="hidden_states must be"):
        ThinkerStates(good.prompt_token_ids, good.token_ids, good.hidden_states[:2], good.token_embeds).check()
    with pytest.raises(ValueError, match="wide"):
        ThinkerStates(good.prompt_token_ids, good.token_ids, good.hidden_states, good.token_embeds[:, :2]).check()
    with pytest.raises(ValueError, match="a prompt and a reply"):
        ThinkerStates(good.prompt_token_ids, torch.tensor([], dtype=torch.long), good.hidden_states,
                      good.token_embeds).check()
    with pytest.raises(ValueError, match="one row of 4"):
        talker_rows(good, speaker_bos=torch.ones(3), text_eos=torch.ones(H), text_pad=torch.ones(H), thinker_eos_ids=[])


def test_the_talkers_prompt_stop_codes_and_codes() -> None:
    assert TOKENS.prompt(3) == [44, 44, 44, 40, 41]
    assert TOKENS.stop_codes == (40, 42)  # transformers' talker_eos_token_id: codec pad and codec end
    assert talker_codes([3, 9, 1, 42, 5], TOKENS) == [3, 9, 1]
    assert talker_codes([3, 40], TOKENS) == [3] and talker_codes([], TOKENS) == []


def _checkpoint(tmp_path: Path) -> Path:
    talker = {"model_type": "qwen2_5_omni_talker", "vocab_size": 48, "tts_codec_start_token_id": 41,
              "tts_codec_end_token_id": 42, "tts_codec_pad_token_id": 40, "tts_codec_mask_token_id": 44,
              "tts_text_end_token_id": 424, "tts_text_pad_token_id": 422}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni", "talker_config": talker}))
    return tmp_path


def test_the_talker_engine_gets_the_talkers_own_config(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path)
    assert TalkerTokens.from_config(omni_speech.sub_config(model, "talker_config")) == TOKENS
    plain = {"max_model_len": 64}
    assert omni_speech.talker_engine_args(str(model), plain) == plain  # not a talker: untouched
    args = omni_speech.talker_engine_args(
        str(model), {"hf_overrides": {"architectures": [omni_speech.TALKER_ARCH]}})
    config = json.loads((Path(args["hf_config_path"]) / "config.json").read_text())
    assert config["architectures"] == [omni_speech.TALKER_ARCH] and config["vocab_size"] == 48
    assert args["generation_config"] == "vllm" and args["enable_prefix_caching"] is False
    with pytest.raises(ValueError, match="prefix caching"):
        omni_speech.talker_engine_args(str(model), {"hf_overrides": {"architectures": [omni_speech.TALKER_ARCH]},
                                                    "enable_prefix_caching": True})
    assert omni_speech.talker_config_dir(model) == Path(args["hf_config_path"])  # content-addressed: the same dir


def test_a_model_without_a_talker_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match="no talker_config .*'qwen2'.*whole Qwen2.5-Omni checkpoint"):
        omni_speech.sub_config(tmp_path, "talker_config")
    with pytest.raises(FileNotFoundError, match="spk_dict.pt"):
        omni_speech.speakers(tmp_path)


def test_speakers_are_read_with_weights_only_and_named_when_missing(tmp_path: Path) -> None:
    torch.save({"Chelsie": {"bos_token": 7, "cond": torch.ones(1, 3), "ref_mel": torch.zeros(1, 5, 80)}},
               tmp_path / "spk_dict.pt")
    voice = omni_speech.speaker(tmp_path, "Chelsie")
    assert voice.bos_token == 7 and voice.cond.shape == (1, 3) and voice.ref_mel.shape == (1, 5, 80)
    with pytest.raises(ValueError, match="no speaker 'Ethan'; it has: Chelsie"):
        omni_speech.speaker(tmp_path, "Ethan")


def test_noise_of_a_position_is_the_same_in_every_window() -> None:
    whole = _noise(3, 0, 100, 80)
    assert whole.shape == (1, 100, 80)
    assert torch.equal(_noise(3, 37, 40, 80), whole[:, 37:77])
    assert not torch.equal(_noise(4, 0, 100, 80), whole)


def test_the_crossfade_weights_sum_to_one() -> None:
    out, fade_in = raised_cosine_fade(480)
    assert np.allclose(out + fade_in, 1.0) and fade_in[0] < 0.01 and fade_in[-1] > 0.99
    assert np.all(np.diff(fade_in) > 0)


PIPELINE = {
    "name": "speak", "inputs": {"prompt": {"type": "text"}},
    "stages": [
        {"id": "thinker", "engine": "ar", "model": "tiny:qwen2.5-omni", "inputs": {"prompt": "input.prompt"},
         "outputs": ["text", "token_ids", "prompt_token_ids", "hidden_states", "token_embeds"]},
        {"id": "talker", "engine": "ar", "task": "talk", "model": "tiny:qwen2.5-omni",
         "inputs": {"token_ids": "thinker.token_ids", "prompt_token_ids": "thinker.prompt_token_ids",
                    "hidden_states": "thinker.hidden_states", "token_embeds": "thinker.token_embeds"},
         "defaults": {"speaker": "Ethan"}},
        {"id": "code2wav", "engine": "dit", "task": "code2wav", "model": "tiny:qwen2.5-omni",
         "inputs": {"audio_codes": "talker.audio_codes"}, "defaults": {"speaker": "Ethan"}},
    ],
    "outputs": [{"name": "text", "from": "thinker.text"}, {"name": "audio", "from": "code2wav.audio"}],
}


def test_thinker_talker_code2wav_wire_up() -> None:
    spec = parse_pipeline(PIPELINE, source="test")
    assert spec.stage("talker").outputs == {"audio_codes": "audio_codes"}
    assert spec.stage("code2wav").outputs == {"audio": "audio"}
    assert spec.stage("thinker").outputs["token_embeds"] == "prompt_embeds"
    assert spec.stage("talker").default_params["speaker"] == "Ethan"
    assert spec.stage("talker").params({"speaker": "Ethan"}) == ARTalkParams(speaker="Ethan")
    assert spec.stage("code2wav").params({"seed": 3}) == DiTCode2WavParams(seed=3)


def test_text_token_ids_cannot_be_wired_where_audio_codes_go() -> None:
    data = json.loads(json.dumps(PIPELINE))
    data["stages"][2]["inputs"] = {"audio_codes": "thinker.token_ids"}
    with pytest.raises(PipelineSpecError, match="'audio_codes' wants audio_codes but 'thinker.token_ids' gives "
                                                "token_ids"):
        parse_pipeline(data, source="test")


def test_an_unknown_voice_is_refused_before_any_engine() -> None:
    with pytest.raises(ValueError, match="Chelsie"):
        ARTalkParams.model_validate({"speaker": "Alice"})
    with pytest.raises(ValueError):
        DiTCode2WavParams.model_validate({"num_inference_steps": 1})


def test_audio_codes_travel_as_safetensors() -> None:
    data = encode_payload("audio_codes", [3, 1, 4])
    got = decode_payload("audio_codes", data)
    assert got.dtype == torch.int64 and got.tolist() == [3, 1, 4]
