import re
from dataclasses import replace

import pytest
import torch

from engine.sampling import (
    Sampler,
    SamplingParams,
    SamplingRow,
    _apply_penalties,
    compute_logprobs,
)


def _rows(params: SamplingParams, n: int, **kwargs) -> list[SamplingRow]:
    return [SamplingRow(params=params, generator=None, **kwargs) for _ in range(n)]


def _seeded(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=_seeded(0))
    tokens = Sampler()(logits, _rows(SamplingParams(), 5))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_top_k_one_is_argmax_even_when_hot():
    logits = torch.randn(6, 40, generator=_seeded(1))
    tokens = Sampler()(logits, _rows(SamplingParams(temperature=2.0, top_k=1), 6))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_temperature_one_matches_softmax_frequencies():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    tokens = Sampler(seed=3)(logits, _rows(SamplingParams(temperature=1.0), 20000))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    expected = torch.softmax(logits[0], dim=-1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_low_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.5, 0.0]]).repeat(4000, 1)
    hot = Sampler(seed=4)(logits, _rows(SamplingParams(temperature=2.0), 4000))
    cold = Sampler(seed=4)(logits, _rows(SamplingParams(temperature=0.2), 4000))
    assert (cold == 0).float().mean() > (hot == 0).float().mean() + 0.3


def test_top_p_never_samples_outside_the_nucleus():
    # probs ~ [0.64, 0.24, 0.09, 0.03]: top_p=0.8 keeps the first two tokens only.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).log_softmax(-1).repeat(3000, 1)
    tokens = Sampler(seed=5)(logits, _rows(SamplingParams(temperature=1.0, top_p=0.8), 3000))
    assert set(tokens.tolist()) == {0, 1}


def test_top_k_two_keeps_two_tokens():
    logits = torch.tensor([[0.0, 3.0, 2.9, 2.8]]).repeat(3000, 1)
    tokens = Sampler(seed=6)(logits, _rows(SamplingParams(temperature=1.0, top_k=2), 3000))
    assert set(tokens.tolist()) == {1, 2}


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().repeat(3000, 1)
    # threshold 0.2 * 0.5 = 0.1: token 3 (0.05) is dropped, token 2 (0.15) kept.
    tokens = Sampler(seed=7)(logits, _rows(SamplingParams(temperature=1.0, min_p=0.2), 3000))
    assert set(tokens.tolist()) == {0, 1, 2}


def test_seeded_rows_reproduce_independently_of_their_batch():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=42)

    def run(batch_neighbours: int) -> list[int]:
        gen = _seeded(42)
        sampler = Sampler(seed=batch_neighbours)
        out = []
        for _ in range(8):
            others = _rows(SamplingParams(temperature=1.0), batch_neighbours)
            rows = [SamplingRow(params, gen), *others]
            batch = logits.repeat(1 + batch_neighbours, 1)
            out.append(int(sampler(batch, rows)[0]))
        return out

    alone, crowded = run(0), run(3)
    assert alone == crowded
    assert len(set(alone)) > 1  # uniform logits: a seeded stream still varies step to step


def test_mixed_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 0.0]])
    rows = [
        SamplingRow(SamplingParams(), None),
        SamplingRow(SamplingParams(temperature=1.0, seed=1), _seeded(1)),
    ]
    tokens = Sampler()(logits, rows)
    assert tokens[0] == 1 and 0 <= tokens[1] < 3


def test_penalties_follow_openai_and_vllm_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(
        repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, temperature=0.0
    )
    row = SamplingRow(params, None, prompt_ids=[1], output_ids=[0, 0, 2])
    out = _apply_penalties(logits, [row])[0]
    # token 0: seen, 2 -> 1.0 (repetition), minus 0.25*2 frequency, minus 0.5 presence = 0.0
    # token 1: prompt only, -2 -> -4 (repetition multiplies negatives); no output penalties
    # token 2: seen once: 1 -> 0.5, minus 0.25, minus 0.5 = -0.25
    # token 3: unseen: unchanged
    assert out.tolist() == pytest.approx([0.0, -4.0, -0.25, 0.5])


def test_logit_bias_moves_greedy_and_sampled_tokens_and_leaves_other_rows_and_the_logits():
    logits = torch.tensor([[0.0, 5.0, 4.0, 0.0]]).repeat(3, 1)
    before = logits.clone()
    rows = [
        SamplingRow(SamplingParams(logit_bias={"1": -100, 3: 6.5}), None),  # 3: 6.5 beats 2: 4
        SamplingRow(SamplingParams(), None),
        SamplingRow(SamplingParams(logit_bias={"2": 1.5}), None),  # 2: 5.5 beats 1: 5
    ]
    assert Sampler()(logits, rows).tolist() == [3, 1, 2]
    assert torch.equal(logits, before)  # logprobs are taken from them after the sampler
    # Sampled: a banned token is never drawn, even the likeliest.
    banned = _rows(SamplingParams(temperature=1.0, logit_bias={1: -100}), 2000)
    assert 1 not in set(Sampler(seed=7)(logits[:1].repeat(2000, 1), banned).tolist())


def test_logit_bias_is_sorted_pairs_clamped_as_vllm_and_refused_by_name():
    params = SamplingParams.from_dict({"logit_bias": {"9": 250, "2": -1e9, "+4": 0.5}})
    assert params.logit_bias == ((2, -100.0), (4, 0.5), (9, 100.0))
    assert not params.plain_argmax and SamplingParams().plain_argmax
    assert replace(params, seed=3).logit_bias == params.logit_bias
    for bad, problem in [
        ({"x": 1}, "key 'x' is not a token id"),
        ({"-3": 1}, "key '-3' is not a token id"),
        ({"3": "up"}, "the bias of '3', 'up', is not a number"),
        ({"3": float("nan")}, "the bias of '3', nan, is not a number"),
        ({"3": True}, "the bias of '3', True, is not a number"),
        (7, "a int, not an object"),
    ]:
        with pytest.raises(ValueError, match=rf"^logit_bias: {re.escape(problem)}"):
            SamplingParams(logit_bias=bad)


def test_allowed_token_ids_are_the_only_ones_sampled_and_leave_other_rows():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]]).repeat(3, 1)
    before = logits.clone()
    rows = [
        SamplingRow(SamplingParams(allowed_token_ids=[3, 2]), None),  # 2 beats 3; 1 is out
        SamplingRow(SamplingParams(), None),
        SamplingRow(SamplingParams(allowed_token_ids=[3], logit_bias={"0": 50}), None),
    ]
    assert Sampler()(logits, rows).tolist() == [2, 1, 3]  # a bias cannot let 0 back in
    assert torch.equal(logits, before)
    allowed = _rows(SamplingParams(temperature=1.0, allowed_token_ids=[0, 3]), 2000)
    drawn = set(Sampler(seed=7)(logits[:1].repeat(2000, 1), allowed).tolist())
    assert drawn == {0, 3}  # both drawn, nothing else
    params = SamplingParams.from_dict({"allowed_token_ids": [5, 1, 5]})
    assert params.allowed_token_ids == (1, 5) and not params.plain_argmax
    for bad, problem in [([], "empty"), (["1"], "'1' is not a token id"),
                         ([-1], "-1 is not a token id"), (7, "a int, not a list")]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"^allowed_token_ids: {re.escape(problem)}"):
            SamplingParams(allowed_token_ids=bad)


def test_from_dict_rejects_unknown_parameters_by_name():
    with pytest.raises(ValueError, match=r"unsupported sampling parameter.*best_of, echo"):
        SamplingParams.from_dict({"temperature": 0.5, "echo": True, "best_of": 2})
    assert SamplingParams.from_dict({"top_p": None, "top_k": 3}).top_k == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 1.5),
        ("seed", -1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", 2.0),
    ],
)
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        SamplingParams(**{field: value})


def test_logprobs_are_the_raw_log_softmax_of_the_sampled_and_the_top_tokens():
    """Before penalties and temperature (vLLM's raw_logprobs); rows that did not ask get none,
    and logprobs=0 gives the sampled token's alone."""
    logits = torch.randn(4, 50, generator=_seeded(8))
    rows = [
        SamplingRow(SamplingParams(logprobs=3), None),
        SamplingRow(
            SamplingParams(temperature=0.7, repetition_penalty=1.5, logprobs=5),
            _seeded(9),
            prompt_ids=[1, 2, 3],
        ),
        SamplingRow(SamplingParams(temperature=1.0), None),
        SamplingRow(SamplingParams(logprobs=0), None),
    ]
    tokens = Sampler()(logits, rows)
    got = compute_logprobs(logits, tokens, rows).rows([r.params.logprobs for r in rows])
    expected = torch.log_softmax(logits, dim=-1)
    for i in (0, 1, 3):
        assert got[i].logprob == pytest.approx(expected[i, tokens[i]].item(), abs=1e-5)
    for i, n in ((0, 3), (1, 5)):
        top = expected[i].topk(n)
        assert list(got[i].top_token_ids) == top.indices.tolist()
        assert list(got[i].top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-5)
    assert got[0].top_token_ids[0] == tokens[0]  # greedy: the most likely token
    assert got[2] is None
    assert (got[3].top_token_ids, got[3].top_logprobs) == ((), ())


def test_no_logprobs_are_computed_when_no_row_asks():
    logits = torch.randn(2, 50, generator=_seeded(10))
    rows = _rows(SamplingParams(temperature=1.0), 2)
    assert compute_logprobs(logits, Sampler()(logits, rows), rows) is None


def test_each_choice_of_n_gets_the_next_seed_modulo_2_to_the_64():
    sampling = SamplingParams(temperature=1.0, seed=2**64 - 1)
    assert [sampling.for_choice(i).seed for i in range(3)] == [2**64 - 1, 0, 1]
    assert SamplingParams().for_choice(5) == SamplingParams()  # unseeded: independent draws
