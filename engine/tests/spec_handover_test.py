"""A speculating sequence handed from a prefill engine to a decode engine with its proposer's
prompt KV (a draft model's cache, the MTP layer's, an EAGLE-3 head's), on the CPU, float32:
- the prefill fills the proposer's cache of the prompt once it has sampled the first token
  (`LLMEngine.fill_proposer`); the decode engine, given both caches' blocks
  (`add_prefilled`), decodes the tokens of one engine that prefilled itself and proposes,
  at every length both propose at, the same drafts: it reads the cache it was given;
- given the model's KV only (the proposer's cache left unwritten), the decode engine proposes
  other drafts: the proposer's KV is used, not recomputed;
- a second choice forked from the prompt's blocks gets its own copy of the proposer's partial
  last block (its drafts equal the first choice's);
- every pool is all free afterwards."""

from __future__ import annotations

import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import Sequence, StopConditions
from engine.speculative import SpeculativeConfig

GREEDY = SamplingParams()
MAX_TOKENS = 16
# Token ids within both presets' vocabularies; lengths that leave a partial last block of 8.
PROMPTS = [list(range(3, 40)), [5, 17, 3, 9, 5, 17, 3, 9, 5, 17, 3]]
PROPOSERS = {
    "draft_model": ("random:tiny", SpeculativeConfig("draft_model", 3, model="random:tiny")),
    "mtp": ("random:deepseek-tiny", SpeculativeConfig("mtp", 3)),
    "eagle3": ("random:tiny-8l", SpeculativeConfig("eagle3", 3, model="random:eagle3-tiny")),
}


def _engine(model: str, spec: SpeculativeConfig) -> LLMEngine:
    """16 tokens a step: a prompt prefills in chunks, and the proposer's KV of it is computed
    in chunks too."""
    config = EngineConfig(
        model=model, dtype="float32", block_size=8, kv_cache_gb=0.01, speculative_config=spec,
        max_num_batched_tokens=16, max_num_seqs=4,
    )  # fmt: skip
    return LLMEngine.build(config)


def _record_drafts(engine: LLMEngine) -> dict[tuple[str, int], list[int]]:
    """Every proposal the engine makes from now on: (sequence, its length) -> drafts."""
    drafts: dict[tuple[str, int], list[int]] = {}
    propose = engine.proposer.propose

    def recording(seqs, rooms):
        proposed = propose(seqs, rooms)
        for seq, guess in zip(seqs, proposed, strict=True):
            if guess:
                drafts[(seq.seq_id.split("#")[0], seq.num_tokens)] = guess
        return proposed

    engine.proposer.propose = recording
    return drafts


def _prefill(engine: LLMEngine, prompt: list[int]) -> tuple[Sequence, list[int]]:
    """The prompt prefilled and its first token sampled; its blocks held (as a sending
    prefill holds them) and its proposer's prompt KV written into them."""
    seq = engine.add_request("p", prompt, GREEDY, StopConditions(max_tokens=1))
    held: list[int] = []

    def hold(plan):
        for item in plan.scheduled:
            if item.samples and not held:
                held.extend(item.seq.block_ids)
                engine.pool.incref(held)

    while engine.has_unfinished:
        engine.step(before_run=hold)
    engine.fill_proposer([(seq, held)])
    return seq, held


def _hand_over(
    prefill: LLMEngine, decode: LLMEngine, prompt: list[int], n: int = 1, proposer: bool = True
) -> list[Sequence]:
    """What a decode server does with a ticket: blocks of its own, the prefill's KV written
    into them (the proposer's too, unless `proposer` is False), the choices admitted."""
    seq, held = _prefill(prefill, prompt)
    blocks = decode.pool.allocate(len(held))
    caches = [(prefill.kv_cache, decode.kv_cache)]
    if proposer:
        caches.append((prefill.proposer_cache, decode.proposer_cache))
    for src, dst in caches:
        dst.storage[:, :, blocks] = src.storage[:, :, held]
    prefill.pool.free(held)
    choices = decode.new_choices("d", prompt, GREEDY, StopConditions(max_tokens=MAX_TOKENS), n)
    decode.add_prefilled_choices(choices, blocks, [seq.output_ids[0]] * n)
    return choices


def _decode(engine: LLMEngine) -> None:
    while engine.has_unfinished:
        engine.step()


def _local(model: str, spec: SpeculativeConfig, prompt: list[int]):
    """One engine that prefills and decodes the prompt itself: its tokens and drafts."""
    engine = _engine(model, spec)
    drafts = _record_drafts(engine)
    seq = engine.add_request("d", prompt, GREEDY, StopConditions(max_tokens=MAX_TOKENS))
    _decode(engine)
    return seq.output_ids, drafts


@pytest.fixture(params=sorted(PROPOSERS))
def engines(request):
    model, spec = PROPOSERS[request.param]
    return model, spec, _engine(model, spec), _engine(model, spec)


def _free(*engines: LLMEngine) -> bool:
    return all(e.pool.num_free == e.pool.num_total for e in engines)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["37-tokens", "11-tokens"])
def test_the_decode_engine_proposes_from_the_prompt_kv_it_was_given(engines, prompt):
    model, spec, prefill, decode = engines
    expected, local_drafts = _local(model, spec, prompt)
    drafts = _record_drafts(decode)
    [seq] = _hand_over(prefill, decode, prompt)
    _decode(decode)
    assert seq.output_ids == expected
    common = sorted(set(drafts) & set(local_drafts))
    assert len(common) >= 3, (sorted(drafts), sorted(local_drafts))
    assert [drafts[k] for k in common] == [local_drafts[k] for k in common]
    if spec.method == "draft_model":  # proposes at its first step already
        assert ("d", len(prompt) + 1) in drafts
    assert _free(prefill, decode)


def test_without_the_proposers_prompt_kv_the_drafts_differ(engines):
    """The proposer's cache left as the decode engine has it (zeros): the tokens stay the
    target's, the drafts do not, so the decode engine did not recompute the prompt's."""
    model, spec, prefill, decode = engines
    prompt = PROMPTS[0]
    expected, local_drafts = _local(model, spec, prompt)
    drafts = _record_drafts(decode)
    [seq] = _hand_over(prefill, decode, prompt, proposer=False)
    _decode(decode)
    assert seq.output_ids == expected
    common = sorted(set(drafts) & set(local_drafts))
    assert [drafts[k] for k in common] != [local_drafts[k] for k in common]
    assert _free(prefill, decode)


def test_a_forked_choice_copies_the_proposers_partial_block(engines):
    *_, prefill, decode = engines
    prompt = PROMPTS[1]  # 11 tokens: a partial second block
    drafts: dict[str, dict[int, list[int]]] = {"d#0": {}, "d#1": {}}
    propose = decode.proposer.propose

    def recording(seqs, rooms):
        proposed = propose(seqs, rooms)
        for seq, guess in zip(seqs, proposed, strict=True):
            drafts[seq.seq_id][seq.num_tokens] = guess
        return proposed

    decode.proposer.propose = recording
    first, second = _hand_over(prefill, decode, prompt, n=2)
    assert first.block_ids[-1] != second.block_ids[-1]  # the partial block was copied
    _decode(decode)
    assert first.output_ids == second.output_ids
    assert drafts["d#0"] == drafts["d#1"] and any(drafts["d#0"].values())
    assert _free(prefill, decode)
