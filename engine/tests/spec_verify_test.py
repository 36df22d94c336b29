"""Speculative decoding's parts on their own: the verifier (greedy acceptance, rejection sampling
whose output distribution is the target's), the n-gram lookup, the configuration and the
simulated acceptance curves."""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.sampling import Sampler, SamplingParams, SamplingRow
from engine.spec_acceptance import AcceptanceCurve
from engine.spec_verify import verify
from engine.speculative import NgramProposer, SpeculativeConfig

GREEDY = SamplingRow(SamplingParams(), None)


def _logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_keeps_the_drafts_up_to_the_first_disagreement():
    # Sequence 0: drafts 1, 2, 3; the target's argmaxes are 1, 2, 0, 3: two accepted, then 0.
    # Sequence 1: no drafts, argmax 2. Sequence 2: draft 3 agrees, then the bonus argmax 1.
    eye = torch.eye(4).tolist()
    logits = _logits(eye[1], eye[2], eye[0], eye[3], eye[2], eye[3], eye[1])
    tokens, accepted, row_tokens = verify(logits, [[1, 2, 3], [], [3]], [GREEDY] * 3, Sampler())
    assert accepted.tolist() == [2, 0, 1]
    assert tokens.tolist() == [0, 2, 1]
    # What each row gave: accepted drafts, then the target's token (repeated past it).
    assert row_tokens.tolist() == [1, 2, 0, 0, 2, 3, 1]


def test_greedy_rows_argmaxes_taken_by_the_graph_decide_alone():
    """A CUDA graph's step has each row's argmax already: given, it decides acceptance and the
    tokens (here over logits that tie everywhere, whose own argmax would be 0 in every row)."""
    argmaxes = torch.tensor([1, 2, 0, 3, 2, 3, 1])
    tokens, accepted, row_tokens = verify(
        torch.zeros(7, 4), [[1, 2, 3], [], [3]], [GREEDY] * 3, Sampler(), greedy=argmaxes
    )
    assert accepted.tolist() == [2, 0, 1]
    assert tokens.tolist() == [0, 2, 1]
    assert row_tokens.tolist() == [1, 2, 0, 0, 2, 3, 1]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# The 99.99th percentile of chi-square with 3 degrees of freedom: a correct sampler fails
# one run in 10,000.
CHI2_3DOF_P9999 = 21.11


@pytest.mark.parametrize("draft", [0, 2])
def test_rejection_sampling_outputs_the_targets_distribution(draft):
    """The first token a sequence gets (its accepted draft, or the target's token after a
    rejection) is distributed as the target's p0, whichever token was drafted; so is the next
    one after an acceptance (the bonus, from p1)."""
    n = 40_000
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    p1 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = torch.stack([p0.log(), p1.log()]).repeat(n, 1)
    row = SamplingRow(SamplingParams(temperature=1.0), None)
    tokens, accepted, _ = verify(logits, [[draft]] * n, [row] * n, Sampler(seed=7))
    first = torch.where(accepted == 1, draft, tokens)
    assert _chi_square(torch.bincount(first, minlength=4).float(), p0) < CHI2_3DOF_P9999
    bonus = tokens[accepted == 1]
    assert len(bonus) == pytest.approx(n * p0[draft].item(), rel=0.05)
    assert _chi_square(torch.bincount(bonus, minlength=4).float(), p1) < CHI2_3DOF_P9999


def test_rejection_sampling_respects_top_k_after_a_rejection():
    """A rejected draft's mass is removed from the filtered distribution: with top_k=2 the
    target's token is one of its two most likely, never the rejected draft."""
    n = 5_000
    logits = torch.tensor([[0.0, 1.0, 3.0, 3.1], [0.0, 0.0, 0.0, 0.0]]).repeat(n, 1)
    row = SamplingRow(SamplingParams(temperature=1.0, top_k=2), None)
    tokens, accepted, _ = verify(logits, [[2]] * n, [row] * n, Sampler(seed=3))
    rejected = tokens[accepted == 0]
    assert len(rejected) > 0 and set(rejected.tolist()) == {3}
    # Accepted with probability p(2) within the top-2: e^3 / (e^3 + e^3.1) ~ 0.475.
    assert (accepted == 1).float().mean().item() == pytest.approx(0.475, abs=0.03)


def test_simulated_acceptance_replaces_the_comparison():
    logits = torch.zeros(8, 4)
    tokens, accepted, _ = verify(logits, [[1, 1, 1], [1, 1, 1]], [GREEDY] * 2, Sampler(), [3, 1])
    assert accepted.tolist() == [3, 1]
    assert tokens.tolist() == [0, 0]  # the target's own token after them (all-zero logits)


def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    ngram = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1))
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 4, 6, 7]
    # Suffix [6, 7] (and no [4, 6, 7] before): last seen at 5, followed by 9, 4, 6.
    assert ngram.lookup(tokens, 3) == [9, 4, 6]
    assert ngram.lookup(tokens, 1) == [9]
    # Suffix [x, 7, 9] of length 3 found: what followed, up to the end.
    assert ngram.lookup([1, 7, 9, 2, 1, 7, 9], 5) == [2, 1, 7, 9]
    assert ngram.lookup([1, 2, 3, 4], 3) == []  # nothing repeats
    strict = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=3))
    assert strict.lookup(tokens, 3) == []  # only 2-token matches exist


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 3}', "not one of ngram, draft_model"),
        ('{"method": "ngram"}', "missing num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "at least 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown key"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "a model is given"),
        ('{"method": "eagle3", "num_speculative_tokens": 2}', "with method draft_model or eagle3"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "a"}', "'<='"),
        ("[1]", "must be a JSON object"),
        ("{", "not JSON"),
    ],
)
def test_speculative_config_refuses_bad_values_by_name(text, problem):
    with pytest.raises(ValueError, match="speculative_config") as e:
        SpeculativeConfig.from_json(text)
    assert problem in str(e.value)


def test_simulated_acceptance_only_in_benchmark_mode():
    spec = SpeculativeConfig("ngram", 3, acceptance_curve="mean-2.5-depth-3")
    with pytest.raises(ValueError, match="only in benchmark mode"):
        EngineConfig(model="random:tiny", speculative_config=spec)
    EngineConfig(model="random:tiny", speculative_config=spec, benchmark_mode=True)


def test_acceptance_curves_are_checked_and_drawn_at_their_mean():
    with pytest.raises(ValueError, match=r"'nope' is not in acceptance_curves\.json"):
        AcceptanceCurve.load("nope", 3)
    with pytest.raises(ValueError, match="covers 3 draft positions, num_speculative_tokens is 4"):
        AcceptanceCurve.load("mean-2.5-depth-3", 4)
    curve = AcceptanceCurve.load("mean-2.5-depth-3", 3, seed=1)
    assert curve.mean_length == pytest.approx(2.52)
    draws = [curve.draw(3, f"s{i % 7}", i // 7) for i in range(20_000)]
    assert 1 + sum(draws) / len(draws) == pytest.approx(curve.mean_length, abs=0.03)
    assert max(curve.draw(1, "s", i) for i in range(100)) == 1  # clipped at the drafts fed
    # A sequence's draws are its own: a draw clipped later equals the draw made at that depth.
    assert all(
        min(curve.draw(3, "s", i), m) == curve.draw(m, "s", i) for i in range(200) for m in (1, 2)
    )
