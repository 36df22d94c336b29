"""Token log-probabilities in OpenAI's completions shape, written as vLLM writes them; tandem's
prefill server and the router answer alike through it. No torch here: the router imports it."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

FLOOR = -9999.0
"""The least log-probability reported (JSON has no -inf; vLLM clamps likewise)."""


def clamped(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence,
    token_text: Callable[[int], str],
    offset: int = 0,
    top_n: int | None = None,
) -> dict:
    """A completion choice's `logprobs` (vLLM's serving_completion
    `_create_completion_logprobs`): per token its text, its logprob, {text: logprob} of the token
    itself then the most likely ones (so N + 1 entries, N when it is one of them), and where its
    text starts, counting from `offset`. `logprobs`: one per token, each with `logprob`,
    `top_token_ids` and `top_logprobs` (the engine's TokenLogprobs or tandem.v1's), or None
    (an echoed prompt's first token: its logprob and top_logprobs are null). `top_n`: the
    entries are cut to the first top_n + 1, as vLLM cuts an echoed prompt's (whose
    prompt_logprobs may list more tokens than the request's logprobs)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text = token_text(token_id)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if lp is None:  # an echoed prompt's first token: nothing came before it
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clamped(lp.logprob))
        # By id first, the token itself first (a top entry for it keeps that place), as vLLM.
        by_id = {token_id: lp.logprob, **dict(zip(lp.top_token_ids, lp.top_logprobs, strict=True))}
        kept = list(by_id.items())[: None if top_n is None else top_n + 1]
        top_logprobs.append({token_text(t): clamped(v) for t, v in kept})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}  # fmt: skip


def prompt_logprobs_field(
    prompt_ids: Sequence[int], entries: Sequence, token_text: Callable[[int], str]
) -> list[dict | None]:
    """A response's `prompt_logprobs` as vLLM writes it: None for the first prompt token, then
    for each one {id: {logprob, rank, decoded_token}} of the token itself, then of its
    position's most likely tokens (ranks 1 ..; one entry for a token that is both), the ids as
    JSON keys. `entries`: prompt token i + 1's at [i], each with `logprob`, `rank`,
    `top_token_ids` and `top_logprobs`."""
    out: list[dict | None] = [None]
    for token_id, lp in zip(prompt_ids[1:], entries, strict=True):
        entry = {str(token_id): _logprob(lp.logprob, lp.rank, token_text(token_id))}
        ranked = enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1)
        for rank, (top_id, value) in ranked:
            entry.setdefault(str(top_id), _logprob(value, rank, token_text(top_id)))
        out.append(entry)
    return out


def _logprob(value: float, rank: int, text: str) -> dict:
    return {"logprob": clamped(value), "rank": rank, "decoded_token": text}


def token_texts(tokenizer) -> Callable[[int], str]:
    """How logprobs name a token, as vLLM names it: its text decoded alone, with the leading
    spaces a SentencePiece (Metaspace) tokenizer's decode drops from it put back (vLLM's
    convert_ids_list_to_tokens), so " the" is not "the"."""
    marker = _leading_space_marker(tokenizer)

    def text(token_id: int) -> str:
        decoded = tokenizer.decode([token_id]) or ""
        if marker is None:
            return decoded
        raw = tokenizer.convert_ids_to_tokens(token_id) or ""
        missing = (len(raw) - len(raw.lstrip(marker))) - (len(decoded) - len(decoded.lstrip(" ")))
        return " " * missing + decoded if missing > 0 else decoded

    return text


def _leading_space_marker(tokenizer) -> str | None:
    """A Metaspace pre-tokenizer's space marker (alone or in a Sequence), else None."""
    pre = getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer", None)
    if pre is None:
        return None
    config = json.loads(pre.__getstate__())
    for part in [config, *config.get("pretokenizers", [])]:
        if part.get("type") == "Metaspace":
            return part.get("replacement", "\u2581")
    return None
