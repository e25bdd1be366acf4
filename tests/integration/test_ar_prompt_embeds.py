"""An AR stage fed another stage's embeddings: vLLM's prompt_embeds on the tiny Llama, checked before the engine.

The Llama's own input embeddings of a prompt, handed over as prompt_embeds, must make the same greedy
text as the prompt's tokens; a wrong hidden size must fail its request alone and leave the engine usable
(FACTS: it was seen to wedge vLLM for every later request); a projection named in a checkpoint maps sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omni_jobs.engines.ar import AREngine, ARRequest, SamplingOptions
from omni_jobs.engines.batching import BatchPolicy, ar_batcher
from omni_jobs.engines.pool import EnginePool
from omni_jobs.engines.stage_exec import ar_engine_args, ar_request
from omni_jobs.pipelines.params import ARParams
from omni_jobs.pipelines.spec import StageSpec

PROMPT = "A watercolor painting of a lighthouse"


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> EnginePool:
    pytest.importorskip("vllm")
    return EnginePool(tmp_path_factory.mktemp("models"), kv_cache_bytes=64 * 2**20, max_model_len=256, device="cpu")


def _stage(**changes: object) -> StageSpec:
    raw: dict[str, object] = {"id": "talker", "engine": "ar", "model": "tiny:llama",
                              "inputs": {"prompt_embeds": "thinker.hidden_states"}}
    raw.update(changes)
    return StageSpec.model_validate(raw)


@pytest.fixture(scope="module")
def engine(pool: EnginePool) -> AREngine:
    stage = _stage()
    assert ar_engine_args(stage) == {"enable_prompt_embeds": True}
    return pool.ar(stage.model, ar_engine_args(stage))


def _token_embeddings(pool: EnginePool, engine: AREngine, prompt: str) -> torch.Tensor:
    """The Llama's own embedding rows for the prompt's tokens (what its first layer sees)."""
    from safetensors import safe_open

    model_dir = Path(pool._resolve("tiny:llama"))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    return table[torch.tensor(engine.tokenize(prompt))]


def _greedy(n: int = 12) -> SamplingOptions:
    return SamplingOptions(max_tokens=n, temperature=0.0)


def test_embeddings_of_the_prompt_make_the_prompts_own_text(pool: EnginePool, engine: AREngine) -> None:
    embeds = _token_embeddings(pool, engine, PROMPT)
    by_tokens, by_embeds = engine.generate([
        ARRequest("tokens", PROMPT, _greedy()),
        ARRequest("embeds", "", _greedy(), prompt_embeds=embeds),
    ])
    assert by_embeds.token_ids == by_tokens.token_ids
    assert len(by_tokens.token_ids) == 12


def test_a_wrong_hidden_size_fails_its_request_alone_and_the_engine_goes_on(pool: EnginePool,
                                                                           engine: AREngine) -> None:
    batcher = ar_batcher(engine, BatchPolicy(max_batch_size=4, wait_ms=5))
    with pytest.raises(ValueError, match="hidden size 100, but the model takes 256"):
        batcher.submit(ARRequest("bad", "", _greedy(), prompt_embeds=torch.zeros(5, 100)))
    out = batcher.submit(ARRequest("good", PROMPT, _greedy(4)))
    assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match=r"\[tokens, hidden\]"):
        engine.generate([ARRequest("flat", "", _greedy(), prompt_embeds=torch.zeros(256))])


def test_a_projection_from_a_checkpoint_maps_other_hidden_states(pool: EnginePool, engine: AREngine,
                                                                 tmp_path: Path) -> None:
    """Hidden states of size 64, through a Linear [256, 64] stored in a checkpoint, feed the 256-wide Llama."""
    torch.manual_seed(0)
    weight, bias = torch.randn(256, 64) * 0.05, torch.randn(256) * 0.01
    ckpt = tmp_path / "thinker-ckpt"
    ckpt.mkdir()
    save_file({"talker.thinker_to_talker_proj.weight": weight, "talker.thinker_to_talker_proj.bias": bias,
               "other.weight": torch.zeros(2, 2)}, str(ckpt / "model.safetensors"))
    stage = _stage(projection={"model": str(ckpt), "weight": "talker.thinker_to_talker_proj"})
    hidden = torch.randn(7, 64)
    request = ar_request(pool, stage, ARParams(max_tokens=3), {"prompt_embeds": hidden}, "job:talker")
    assert request.prompt_embeds is not None
    torch.testing.assert_close(request.prompt_embeds, hidden @ weight.T + bias)
    (out,) = engine.generate([request])
    assert len(out.token_ids) == 3

    missing = _stage(projection={"model": str(ckpt), "weight": "talker.nothing"})
    with pytest.raises(ValueError, match="no tensor 'talker.nothing.weight'"):
        ar_request(pool, missing, ARParams(), {"prompt_embeds": hidden}, "job:talker")
