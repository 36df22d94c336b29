"""Token log-probabilities in OpenAI's completions shape, written as vLLM writes them; tandem's
prefill server and the router answer alike through it. No torch here: the router imports it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

FLOOR = -9999.0
"""The least log-probability reported (JSON has no -inf; vLLM clamps likewise)."""


def clamped(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence, token_text: Callable[[int], str], offset: int = 0
) -> dict:
    """A completion choice's `logprobs` (vLLM's serving_completion
    `_create_completion_logprobs`): per token its text, its logprob, {text: logprob} of the token
    itself then the most likely ones (so N + 1 entries, N when it is one of them), and where its
    text starts, counting from `offset`. `logprobs`: one per token, each with `logprob`,
    `top_token_ids` and `top_logprobs` (the engine's TokenLogprobs or tandem.v1's)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(clamped(lp.logprob))
        # By id first, the token itself first (a top entry for it keeps that place), as vLLM.
        by_id = {token_id: lp.logprob, **dict(zip(lp.top_token_ids, lp.top_logprobs, strict=True))}
        top_logprobs.append({token_text(t): clamped(v) for t, v in by_id.items()})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}  # fmt: skip
