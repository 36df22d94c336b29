"""Where a request's prompt log-probabilities enter its stream of items (router/generation.py):
a PromptLogprobs for each choice, before the request's first Tokens or Finished.

A prefill's reply has them before the decode stream starts; a local prefill's decode server
sends them on choice 0's first message, and the other choices' messages that come before it
are held until then (the echo of every choice starts with them).
"""

from __future__ import annotations

from proto.tandem.v1 import decode_pb2
from router.errors import BackendError
from router.generation import Finished, PromptLogprobs, Tokens


class PromptLogprobsFirst:
    def __init__(
        self,
        n: int,
        prompt_ids: list[int],
        from_prefill: list[decode_pb2.TokenLogprobs] | None,
        from_decode: bool,
    ) -> None:
        """`from_prefill`: the prefill's (None: none came, or none was asked); `from_decode`:
        a local prefill that asked, so choice 0's first message carries them."""
        self._n = n
        self._prompt_ids = prompt_ids
        self._expected = len(prompt_ids) - 1
        self._entries = from_prefill
        self._waiting = from_decode
        self._held: list[Tokens | Finished] = []

    def items(
        self, message: decode_pb2.GenerateResponse, items: list[Tokens | Finished]
    ) -> list[Tokens | Finished | PromptLogprobs]:
        """What to yield for `message` (whose items are `items`), in order."""
        if self._waiting:
            if message.index != 0:
                self._held.extend(items)
                return []
            self._waiting = False
            self._entries = list(message.prompt_logprobs)
            if len(self._entries) != self._expected:
                got = len(self._entries)
                raise BackendError(502, f"the decode server sent {got} prompt log-probabilities "
                                   f"for {self._expected + 1} prompt tokens")  # fmt: skip
            items, self._held = [*self._held, *items], []
        if self._entries is None:
            return items
        entries, self._entries = self._entries, None
        return [*(PromptLogprobs(self._prompt_ids, entries, i) for i in range(self._n)), *items]
