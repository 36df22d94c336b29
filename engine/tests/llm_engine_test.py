"""The whole engine on the real bundled model (SmolLM2-135M-Instruct) against Hugging Face.

Greedy tokens must equal transformers' greedy `generate` token for token: one sequence at a
time, batched with mixed prompt lengths and finishing steps, with chunked prefill, under
preemption, and admitted prefilled (the decode server's path); with async scheduling too (each
decode step launched before the host reads the one before it). Both sides run in float32 so
that greedy choices cannot flip on rounding. Every test ends with the block pool all free.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import FinishReason, StopConditions

MODEL = Path("tools/smollm2-135m-instruct")  # Bazel data: //tools:smollm2
NEW_TOKENS = 32
GREEDY = SamplingParams()
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
    "List three prime numbers.",
]
TEXTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False
        )
        for c in CHATS
    ]
    chats = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chats]
    return chats + [tokenizer(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    """Hugging Face greedy continuations, NEW_TOKENS each, stopping at EOS like the engine."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def _engine(**overrides) -> LLMEngine:
    config = dict(model=str(MODEL), dtype="float32", block_size=16, kv_cache_gb=0.25)
    return LLMEngine.build(EngineConfig(**{**config, **overrides}))


def _assert_pool_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished and not engine.sequences
    assert engine.pool.num_free == engine.pool.num_total


def test_one_at_a_time_equals_hugging_face(prompts, reference):
    engine = _engine()
    for prompt, expected in zip(prompts, reference, strict=True):
        [tokens] = engine.generate([prompt], GREEDY, StopConditions(max_tokens=NEW_TOKENS))
        assert tokens == expected
    _assert_pool_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batched_with_staggered_lengths_equals_hugging_face(prompts, reference, async_scheduling):
    engine = _engine(async_scheduling=async_scheduling)
    seqs = [
        # Different max_tokens: sequences leave the batch at different steps.
        engine.add_request(f"r{i}", p, GREEDY, StopConditions(max_tokens=NEW_TOKENS - 3 * i))
        for i, p in enumerate(prompts)
    ]
    max_batch, steps, without_step_ahead = 0, 0, 0
    while engine.has_unfinished:
        max_batch = max(max_batch, len(engine.step()))
        steps += 1
        without_step_ahead += steps > 1 and engine.has_unfinished and not engine.has_step_in_flight
    assert max_batch == len(prompts)  # all decoded together
    # After the first step (prefill), every step leaves the next one running: a sequence that
    # stops (on EOS, or on its length) is left out of the steps ahead, not the whole batch.
    assert without_step_ahead == 0 or not async_scheduling
    for i, (seq, expected) in enumerate(zip(seqs, reference, strict=True)):
        assert seq.output_ids == expected[: NEW_TOKENS - 3 * i]
    _assert_pool_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_and_preemption_do_not_change_tokens(prompts, reference, async_scheduling):
    # 24 tokens per forward forces chunked prefill of every chat prompt; 24 blocks of 16 tokens
    # cannot hold 8 sequences of ~60 tokens, so the scheduler must preempt and recompute.
    per_block = 30 * 2 * 3 * 64 * 4 * 16  # layers * (K,V) * kv heads * head dim * fp32 * tokens
    engine = _engine(
        max_num_batched_tokens=24,
        max_num_seqs=8,
        kv_cache_gb=24 * per_block / 2**30,
        async_scheduling=async_scheduling,
    )
    assert engine.pool.num_total == 24
    seqs = [
        engine.add_request(f"r{i}", p, GREEDY, StopConditions(max_tokens=NEW_TOKENS))
        for i, p in enumerate(prompts)
    ]
    while engine.has_unfinished:
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == reference
    _assert_pool_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefilled_admission_continues_from_copied_kv(prompts, reference, async_scheduling):
    """A prompt prefilled by one engine, its KV copied into another engine's blocks, decodes
    there to the same tokens: the decode server's path with the transport replaced by a copy."""
    prefill, decode = _engine(), _engine(async_scheduling=async_scheduling)
    prompt, expected = prompts[2], reference[2]
    seq = prefill.add_request("p", prompt, GREEDY, StopConditions(max_tokens=2))
    [out] = prefill.step()  # the prompt's KV is now in seq's blocks
    first_token = out.token_id
    src_blocks = list(seq.block_ids)
    dst_blocks = decode.pool.allocate(len(src_blocks))
    for (src_k, src_v), (dst_k, dst_v) in zip(
        prefill.kv_cache.kv_caches, decode.kv_cache.kv_caches, strict=True
    ):
        dst_k[dst_blocks] = src_k[src_blocks]
        dst_v[dst_blocks] = src_v[src_blocks]
    assert prefill.abort("p")
    remote = decode.new_sequence("d", prompt, GREEDY, StopConditions(max_tokens=NEW_TOKENS))
    assert decode.add_prefilled(remote, dst_blocks, first_token)
    while decode.has_unfinished:
        decode.step()
    assert remote.output_ids == expected
    assert remote.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    _assert_pool_free(prefill)
    _assert_pool_free(decode)


def test_async_steps_return_each_token_once_and_drop_those_past_a_stop(prompts, reference):
    """Sequences that stop on EOS or a stop id leave the batch while the step after is already
    launched: that step's token for them is thrown away, every other token comes back exactly
    once, in order, and an abort while a step is in flight frees everything."""
    engine = _engine(async_scheduling=True)
    stop_id = reference[1][5]  # the 6th token of the second prompt's continuation
    seqs = [
        engine.add_request(
            f"r{i}", p, GREEDY, StopConditions(max_tokens=NEW_TOKENS, stop_token_ids=[stop_id])
        )
        for i, p in enumerate(prompts)
    ]
    streamed: dict[str, list[int]] = {s.seq_id: [] for s in seqs}
    steps = without_step_ahead = 0
    while engine.has_unfinished:
        for out in engine.step():
            streamed[out.seq_id].append(out.token_id)
        steps += 1
        without_step_ahead += steps > 1 and engine.has_unfinished and not engine.has_step_in_flight
    assert without_step_ahead == 0  # the batch goes on ahead past each stop
    for seq, expected in zip(seqs, reference, strict=True):
        cut = expected.index(stop_id) + 1 if stop_id in expected else len(expected)
        assert seq.output_ids == streamed[seq.seq_id] == expected[:cut]
    assert seqs[1].finish_reason is FinishReason.STOP and len(seqs[1].output_ids) == 6
    _assert_pool_free(engine)
    engine.add_request("a", prompts[0], GREEDY, StopConditions(max_tokens=NEW_TOKENS))
    while not engine.has_step_in_flight:
        engine.step()
    assert engine.abort("a")
    assert not engine.has_step_in_flight
    _assert_pool_free(engine)


def test_seeded_sampling_is_reproducible(prompts):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    stop = StopConditions(max_tokens=12, ignore_eos=True)
    first = _engine().generate(prompts[:2], params, stop)
    # Reversed, and each step's sampled tokens fed to the next on the device (async).
    second = _engine(async_scheduling=True).generate(prompts[:2][::-1], params, stop)[::-1]
    assert first == second
    assert first[0] != _engine().generate(prompts[:1], GREEDY, stop)[0]


def test_penalized_sampling_is_the_same_with_async_scheduling(prompts):
    """Penalties count every token generated so far, so a step planned before the last one is
    known must not run them: the engine plans those steps normally, and tokens match."""
    params = SamplingParams(
        temperature=0.8, seed=7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5
    )
    stop = StopConditions(max_tokens=12, ignore_eos=True)
    engine = _engine(async_scheduling=True)
    seqs = [engine.add_request(f"r{i}", p, params, stop) for i, p in enumerate(prompts[:2])]
    while engine.has_unfinished:
        engine.step()
        assert not engine.has_step_in_flight
    assert [s.output_ids for s in seqs] == _engine().generate(prompts[:2], params, stop)
    _assert_pool_free(engine)


def test_out_of_vocabulary_prompt_is_rejected_by_name():
    engine = _engine()
    with pytest.raises(ValueError, match=r"^prompt: token id 49152 is outside"):
        engine.add_request("bad", [1, 49152], GREEDY, StopConditions(max_tokens=1))
    with pytest.raises(ValueError, match=r"^logit_bias: token id 49152 is outside"):
        biased = SamplingParams(logit_bias={5: 1.0, 49152: 1.0})
        engine.add_request("bad", [1, 2], biased, StopConditions(max_tokens=1))
    _assert_pool_free(engine)
