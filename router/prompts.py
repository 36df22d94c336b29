"""Prompts to token ids: in the router (segment-cached), unless the start-up parity check finds
the router's tokenization disagreeing with the prefill's; then every prompt is tokenized by a
prefill instance's `/tokenize`, so the KV that prefill computes is for the tokens it would have
chosen itself.

The check sends sample prompts (plain text and chat conversations, every turn prefix) to the
prefill's `/tokenize` (tandem's prefill server and vLLM answer it alike) and compares ids.

The router tokenizes on a thread of its own, never on the event loop: an 8k-token prompt takes
~10 ms, a 300k-token agentic context about half a second, during which every stream the router
is sending would stall. One thread, in arrival order: the segment cache is not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from jinja2 import TemplateError

from router.errors import BackendError, RequestError
from router.orchestrator import Orchestrator
from router.tokenization import SAMPLE_CONVERSATIONS, SegmentTokenizer

log = logging.getLogger("router.prompts")

SAMPLE_TEXTS = [
    "Hello, world!",
    "  Leading spaces, UTF-8: naïve café, 東京, emoji 🚀, and\ttabs.\n",
    "def add(a, b):\n    return a + b\n",
]


class PromptTokenizer:
    def __init__(self, local: SegmentTokenizer, orchestrator: Orchestrator) -> None:
        self.local = local
        self.orchestrator = orchestrator
        self.source = "router"
        """Who tokenizes: "router", or "prefill" after a mismatch."""
        self.parity = "unchecked"
        """"ok", "mismatch: ...", or "unchecked" (no prefill answered the check)."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-tokenize")

    async def check_parity(self, attempts: int = 5, wait_s: float = 1.0) -> None:
        """Compares the router's ids with the prefill's on the samples; on any difference
        switches to the prefill's tokenization. Retries while no prefill answers."""
        for attempt in range(attempts):
            try:
                mismatch = await self._first_mismatch()
            except BackendError as e:
                if attempt + 1 == attempts:
                    log.warning("tokenizer parity check could not reach a prefill: %s", e)
                    return
                await asyncio.sleep(wait_s)
                continue
            if mismatch is None:
                self.parity = "ok"
                return
            self.parity = f"mismatch: {mismatch}"
            self.source = "prefill"
            log.warning(
                "router tokenization differs from the prefill's (%s); prompts are tokenized by "
                "the prefill from now on (check that the router's --model folder has the "
                "prefill's tokenizer)",
                mismatch,
            )
            return

    async def text(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A completions prompt (special tokens, such as BOS, added as the tokenizer's defaults
        say unless `add_special_tokens` is False)."""
        if self.source == "prefill":
            return await self.orchestrator.tokenize(
                {"prompt": prompt, "add_special_tokens": add_special_tokens}
            )
        encoded = await self._off_loop(
            partial(self.local.tokenizer, prompt, add_special_tokens=add_special_tokens)
        )
        return encoded["input_ids"]

    async def chat(
        self,
        messages: Sequence[dict],
        template: dict | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """A conversation rendered with the model's chat template; `template`: the request's
        template arguments in vLLM's names (SegmentTokenizer.render), the generation prompt
        added unless they say otherwise; `add_special_tokens`: the tokenizer's own (a BOS)
        added to the rendered text too, as vLLM's chat request field asks."""
        template = {"add_generation_prompt": True, **(template or {})}
        if self.source == "prefill":
            body = {"messages": list(messages), **template}
            if add_special_tokens:
                body["add_special_tokens"] = True
            return await self.orchestrator.tokenize(body)
        return await self._off_loop(partial(self._chat_ids, messages, template, add_special_tokens))

    def _chat_ids(
        self, messages: Sequence[dict], template: dict, add_special_tokens: bool
    ) -> list[int]:
        try:
            text = self.local.render(messages, template)
        except (TemplateError, TypeError, ValueError) as e:  # a template refusing the request
            raise RequestError(400, f"chat template: {e}", "messages") from None
        if add_special_tokens:  # rare: the whole text, past the segment cache
            return self.local.tokenizer(text, add_special_tokens=True)["input_ids"]
        return self.local.encode(text)

    async def _off_loop(self, work: Callable):
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    async def _first_mismatch(self) -> str | None:
        for text in SAMPLE_TEXTS:
            if (
                await self.orchestrator.tokenize({"prompt": text})
                != (self.local.tokenizer(text)["input_ids"])
            ):
                return f"text {text[:24]!r}"
        for conversation in SAMPLE_CONVERSATIONS:
            for turn in range(1, len(conversation) + 1):
                messages = conversation[:turn]
                theirs = await self.orchestrator.tokenize(
                    {"messages": messages, "add_generation_prompt": True}
                )
                if theirs != self.local.encode(self.local.render(messages)):
                    return f"chat of {turn} message(s)"
        return None
