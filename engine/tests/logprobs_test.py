"""Log-probabilities through the whole engine (random tiny model, CPU): every step's output
carries the sampled token's for a sequence that asks, and they are those of the token's own
position: a fresh prefill of the prompt and the tokens before it gives the same.
"""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions

torch.set_num_threads(1)

PROMPT = [5, 17, 3, 99, 41]
STOP = StopConditions(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = EngineConfig(model="random:tiny", dtype="float32", block_size=16, kv_cache_gb=0.01)
    return LLMEngine.build(config)


def _run(
    engine: LLMEngine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    stop: StopConditions = STOP,
) -> dict:
    """{seq_id: its step outputs, in order}."""
    for seq_id, (prompt, sampling) in requests.items():
        engine.add_request(seq_id, prompt, sampling, stop)
    outputs: dict[str, list] = {seq_id: [] for seq_id in requests}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.seq_id].append(out)
    assert engine.pool.num_free == engine.pool.num_total
    return outputs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_step_carries_the_logprobs_of_its_own_token(engine, async_scheduling):
    engine.async_scheduling = async_scheduling
    outputs = _run(
        engine,
        {
            "asks": (PROMPT, SamplingParams(logprobs=4)),
            "sampled": (PROMPT[:3], SamplingParams(temperature=1.0, seed=7, logprobs=0)),
            "quiet": (PROMPT[1:], SamplingParams()),
        },
    )
    assert all(out.logprobs is None for out in outputs["quiet"])
    asks = outputs["asks"]
    assert len(asks) == STOP.max_tokens
    for out in asks:
        assert len(out.logprobs.top_token_ids) == 4
        assert out.logprobs.top_token_ids[0] == out.token_id  # greedy: the most likely
        assert out.logprobs.logprob == out.logprobs.top_logprobs[0]
    sampled = outputs["sampled"]
    assert len(sampled) == STOP.max_tokens
    assert all(o.logprobs.top_token_ids == () and o.logprobs.logprob <= 0 for o in sampled)

    # The 4th token's, from a prefill of everything before it.
    tokens = [out.token_id for out in asks]
    request = {"again": (PROMPT + tokens[:3], SamplingParams(logprobs=4))}
    [again] = _run(engine, request, StopConditions(max_tokens=1))["again"]
    assert again.token_id == tokens[3]
    assert again.logprobs.top_token_ids == asks[3].logprobs.top_token_ids
    expected = again.logprobs.top_logprobs
    assert asks[3].logprobs.top_logprobs == pytest.approx(expected, abs=1e-4)
