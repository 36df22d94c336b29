"""Prompt log-probabilities (engine/prompt_logprobs.py) against Hugging Face's logits of the
whole prompt (tiny random Llama, float32): each entry's log-probability, rank and most likely
tokens, with the prompt prefilled in chunks, beside sequences that do not ask, with n choices,
and after the prompt's blocks were cached; the block pool all free after every test."""

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from engine.tests.tiny_hf import VOCAB, hf_logits, hf_model

STOP = StopConditions(max_tokens=3, ignore_eos=True)
TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    hf = hf_model("llama")
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder)
    config = EngineConfig(model=str(folder), dtype="float32", block_size=16, kv_cache_gb=0.01,
                          max_num_batched_tokens=24, max_num_seqs=8,
                          enable_prefix_caching=True)  # fmt: skip
    return hf, LLMEngine.build(config)


def _prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


def _first_outputs(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """{seq_id: its first StepOutput}, every request run to its end."""
    for seq_id, (prompt, sampling) in requests.items():
        engine.add_request(seq_id, prompt, sampling, STOP)
    first = {}
    while engine.has_unfinished:
        for out in engine.step():
            first.setdefault(out.seq_id, out)
    assert engine.pool.num_free == engine.pool.num_total
    return first


def _assert_entries_match_hf(hf, prompt: list[int], entries, top: int) -> None:
    reference = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    assert len(entries) == len(prompt) - 1
    for position, entry in enumerate(entries):
        row, token = reference[position], prompt[position + 1]
        assert entry.logprob == pytest.approx(row[token].item(), abs=TOL)
        assert entry.rank == int((row > row[token]).sum()) + 1  # no ties in random logits
        best = row.topk(top)
        assert list(entry.top_token_ids) == best.indices.tolist()
        assert list(entry.top_logprobs) == pytest.approx(best.values.tolist(), abs=TOL)


def test_a_chunked_prompt_has_every_tokens_entry_beside_one_that_does_not_ask(setup):
    hf, engine = setup
    asks, quiet = _prompt(0, 61), _prompt(1, 30)  # 61 tokens: three chunks of 24 at most
    first = _first_outputs(engine, {
        "asks": (asks, SamplingParams(prompt_logprobs=5)),
        "quiet": (quiet, SamplingParams()),
    })  # fmt: skip
    assert first["quiet"].prompt_logprobs is None
    _assert_entries_match_hf(hf, asks, first["asks"].prompt_logprobs, 5)
    # Only the first token carries them; its own token is the prompt's argmax at the end.
    reference = torch.log_softmax(hf_logits(hf, asks), dim=-1)
    assert first["asks"].token_id == int(reference[-1].argmax())


def test_none_most_likely_and_only_choice_zero_computes_them(setup):
    hf, engine = setup
    prompt = _prompt(2, 20)
    seqs = engine.new_choices("n", prompt, SamplingParams(prompt_logprobs=0, seed=3), STOP, n=2)
    assert [s.sampling.prompt_logprobs for s in seqs] == [0, None]
    for seq in seqs:
        engine.add_sequence(seq)
    firsts = {}
    while engine.has_unfinished:
        for out in engine.step():
            firsts.setdefault(out.seq_id, out)
    assert firsts["n#1"].prompt_logprobs is None
    entries = firsts["n#0"].prompt_logprobs
    _assert_entries_match_hf(hf, prompt, entries, 0)
    assert all(e.top_token_ids == () for e in entries)
    assert engine.pool.num_free == engine.pool.num_total


def test_a_prompt_whose_blocks_are_cached_is_computed_again_for_its_entries(setup):
    hf, engine = setup
    prompt = _prompt(3, 50)
    cache = engine.scheduler.prefix_cache
    _first_outputs(engine, {"warm": (prompt, SamplingParams())})
    hits = cache.hit_tokens
    first = _first_outputs(engine, {"asks": (prompt, SamplingParams(prompt_logprobs=2))})
    assert cache.hit_tokens == hits  # nothing taken from the cache
    _assert_entries_match_hf(hf, prompt, first["asks"].prompt_logprobs, 2)
    _first_outputs(engine, {"again": (prompt, SamplingParams())})
    assert cache.hit_tokens > hits  # its blocks were cached all the same


def test_a_one_token_prompt_has_none(setup):
    _, engine = setup
    first = _first_outputs(engine, {"one": ([7], SamplingParams(prompt_logprobs=3))})
    assert first["one"].prompt_logprobs == ()


def test_the_count_is_checked():
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    with pytest.raises(ValueError, match="prompt_logprobs: 21 is not in"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs: -1 is not in"):
        SamplingParams(prompt_logprobs=-1)
