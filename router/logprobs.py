"""Token log-probabilities: read from the prefill's reply (the first token's), and written in
OpenAI's two shapes (the decode server streams the rest as tandem.v1.TokenLogprobs).

  prefill reply choices[0].logprobs --first_token_logprobs--> TokenLogprobs
  prefill reply choices[0].prompt_logprobs --prompt_token_logprobs--> TokenLogprobs per token
  (token id, TokenLogprobs) pairs --LogprobsFormat.chat / .completion--> the response's `logprobs`

The router asks the prefill for `return_tokens_as_token_ids`, so its reply names tokens
"token_id:<id>" (vLLM and tandem's prefill server alike) and no token text is ever re-encoded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.openai_logprobs import clamped, completion_logprobs
from proto.tandem.v1 import decode_pb2

TOKEN_ID_PREFIX = "token_id:"


class LogprobsError(ValueError):
    """A prefill reply without the logprobs it was asked for."""


def first_token_logprobs(choice: dict, top_n: int) -> decode_pb2.TokenLogprobs:
    """The first token's log-probabilities from a prefill's completions `choices[0]` (vLLM's
    shape: tokens, token_logprobs, top_logprobs holding the top `top_n` and the sampled
    token)."""
    logprobs = choice.get("logprobs")
    try:
        chosen = float(logprobs["token_logprobs"][0])
        top = sorted(((float(lp), _token_id(token)) for token, lp in
                      logprobs["top_logprobs"][0].items()), reverse=True)[:top_n]  # fmt: skip
    except (TypeError, KeyError, IndexError, ValueError) as e:
        raise LogprobsError(f"the prefill's reply has no logprobs for its token ({e!r})") from e
    return decode_pb2.TokenLogprobs(logprob=chosen, top_token_ids=[t for _, t in top],
                                    top_logprobs=[lp for lp, _ in top])  # fmt: skip


def prompt_token_logprobs(
    choice: dict, prompt_ids: list[int], top_n: int
) -> list[decode_pb2.TokenLogprobs]:
    """The prompt's log-probabilities from a prefill's completions `choices[0]` (vLLM's
    `prompt_logprobs`: None, then per prompt token {id: {logprob, rank, decoded_token}} of the
    token and of the `top_n` most likely there): prompt token i + 1's at [i]."""
    field = choice.get("prompt_logprobs")
    try:
        if not isinstance(field, list) or len(field) != len(prompt_ids):
            size = len(field) if isinstance(field, list) else None
            raise ValueError(f"{size} entries for a prompt of {len(prompt_ids)} tokens")
        return [_prompt_entry(entry, token, top_n)
                for token, entry in zip(prompt_ids[1:], field[1:], strict=True)]  # fmt: skip
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        message = f"the prefill's reply has no prompt_logprobs for its prompt ({e!r})"
        raise LogprobsError(message) from e


def _prompt_entry(entry: dict, token: int, top_n: int) -> decode_pb2.TokenLogprobs:
    own = entry[str(token)]
    ranked = sorted((int(v["rank"]), int(k), float(v["logprob"])) for k, v in entry.items())
    top = [(t, lp) for rank, t, lp in ranked if rank <= top_n][:top_n]
    return decode_pb2.TokenLogprobs(
        logprob=float(own["logprob"]), rank=int(own["rank"]),
        top_token_ids=[t for t, _ in top], top_logprobs=[lp for _, lp in top],
    )  # fmt: skip


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"token {token!r} is not named by its id")
    return int(token[len(TOKEN_ID_PREFIX) :])


class LogprobsFormat:
    """Writes one response's log-probabilities, in chat's shape or completions', each token
    named by its text (or "token_id:<id>" when the client asked `return_tokens_as_token_ids`).
    Completions' text offsets run on across the calls of one response."""

    def __init__(
        self,
        token_text: Callable[[int], str],
        chat: bool,
        tokens_as_ids: bool = False,
        top_n: int | None = None,
    ) -> None:
        self.token_text = token_text
        """A token's text (engine.openai_logprobs.token_texts of the router's tokenizer)."""
        self.chat = chat
        self.tokens_as_ids = tokens_as_ids
        self.top_n = top_n
        """The request's `logprobs` count: an echoed prompt's entries are cut to it."""
        self._offset = 0

    def render(self, entries: Sequence[tuple[int, decode_pb2.TokenLogprobs | None]]) -> dict:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: Sequence[tuple[int, decode_pb2.TokenLogprobs]]) -> dict:
        """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
        content = []
        for token_id, lp in entries:
            top = [
                self._chat_entry(t, v)
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            ]
            content.append({**self._chat_entry(token_id, lp.logprob), "top_logprobs": top})
        return {"content": content}

    def _completion(self, entries: Sequence[tuple[int, decode_pb2.TokenLogprobs | None]]) -> dict:
        """vLLM's completions shape (engine/openai_logprobs.py), offsets running on."""
        out = completion_logprobs([t for t, _ in entries], [lp for _, lp in entries],
                                  self.token, self._offset, self.top_n)  # fmt: skip
        if out["tokens"]:
            self._offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def token(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"{TOKEN_ID_PREFIX}{token_id}"
        return self.token_text(token_id)

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        token = self.token(token_id)
        return {"token": token, "logprob": clamped(logprob), "bytes": list(token.encode())}
