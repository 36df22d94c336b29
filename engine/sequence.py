"""One generation request inside the engine, and when it stops.

Life cycle (SequenceStatus):
  WAITING  --scheduled-->  RUNNING  --stop condition-->  FINISHED
     ^                        |
     +------- preempted ------+   (blocks freed; its KV is recomputed from prompt + output)

A sequence admitted with its prompt KV already in its blocks (the decode server's path) starts
with every prompt token computed and the prefill engine's token as its first output. The choices
of one prompt (OpenAI's n) are sequences of their own, "<request id>#<choice>", that hold one
reference each to the prompt's full blocks (engine/kv_cache.py) and a block of their own for a
partial last one; a choice that found no free block for that copy starts with no blocks and its
first token, and recomputes its prompt as a preempted sequence does.

A constrained sequence (structured output, engine/grammar.py) carries its grammar's matcher,
which accepts every token the sequence appends: it stops when the grammar has accepted a stop
token, since nothing may follow one.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from engine.sampling import SamplingParams, SamplingRow, TokenLogprobs

_log = logging.getLogger(__name__)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # end-of-sequence or a stop token
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass(frozen=True)
class StopConditions:
    """When a sequence stops. Token counts include every generated token."""

    max_tokens: int
    """Generated tokens at most (>= 1)."""
    min_tokens: int = 0
    """No stop token ends the sequence before this many tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens; the stop token itself is part of the output."""
    ignore_eos: bool = False
    """Do not stop at the model's end-of-sequence tokens."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: {self.max_tokens} must be at least 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} must be in [0, max_tokens]")


class Sequence:
    """Token ids, blocks and progress of one request."""

    def __init__(
        self,
        seq_id: str,
        prompt_ids: Seq[int],
        sampling: SamplingParams,
        stop: StopConditions,
        eos_token_ids: Seq[int],
        max_model_len: int,
    ) -> None:
        if not prompt_ids:
            raise ValueError("prompt: must hold at least one token")
        if len(prompt_ids) >= max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens leave no room in the context of "
                f"{max_model_len} tokens"
            )
        self.seq_id = seq_id
        # NOTE: one list, appended to: the runner reads a token per step per sequence, and
        # rebuilding prompt + output every step would cost O(context) per token.
        self.token_ids: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.sampling = sampling
        self.stop = stop
        eos = set() if stop.ignore_eos else set(eos_token_ids)
        self._stop_ids = set(stop.stop_token_ids) | eos
        self.max_model_len = max_model_len
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_ids: list[int] = []
        self.num_computed = 0
        """Tokens whose KV is in the cache; the next forward starts at this position."""
        self.block_names: list[bytes] = []
        """Prefix caching (engine/prefix_cache.py): the names of its first full blocks."""
        self.num_named = 0
        """Prefix caching: its leading blocks named in the pool (reset with its blocks)."""
        self.num_cached_tokens: int | None = None
        """Prefix caching: prompt tokens whose KV the cache gave it when first admitted."""
        self.generator: torch.Generator | None = None
        """Seeded requests' own random stream, on the engine's device (set by the engine)."""
        self.num_draft_computed = 0
        """Tokens whose KV a draft model (engine/draft_proposer.py) has in its own cache; reset
        with num_computed when the sequence is preempted."""
        self.draft_hidden: torch.Tensor | None = None
        """The target's states of the positions num_draft_computed .. that an MTP layer or
        EAGLE-3 head has yet to see (engine/hidden_proposer.py)."""
        self.num_draft_tokens = 0
        """Draft tokens proposed for it so far (speculative decoding)."""
        self.num_accepted_tokens = 0
        """Of those, the ones the target accepted."""
        self.num_verifications = 0
        """Steps launched that verified drafts of it, counted where a simulated acceptance curve
        decides them (each its own draw: engine/spec_acceptance.py)."""
        self.acceptance_histogram: list[int] | None = None
        """Speculative decoding: [j] = its verify steps that accepted exactly j drafts (length
        num_speculative_tokens + 1; vLLM's per-request acceptance_histogram)."""
        self.prompt_logprobs: list[TokenLogprobs] = []
        """With SamplingParams.prompt_logprobs: prompt token i + 1's entry at [i], as its prompt
        chunks compute them (engine/prompt_logprobs.py)."""
        self.grammar: Any = None
        """A constrained sequence's xgrammar.GrammarMatcher (set by the engine): it has accepted
        every output token, and masks the logits of the next one (engine/grammar.py)."""

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def lacks_prompt_logprobs(self) -> bool:
        """It asks for its prompt's log-probabilities and some are still to compute."""
        return (
            self.sampling.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to be fed to the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def speculates(self) -> bool:
        """Whether drafts may be proposed for it: not while it samples with penalties or under a
        grammar (each needs the tokens one at a time), nor with a logit bias or allowed tokens
        (verification compares drafts with the raw logits; vLLM refuses a bias with them)."""
        sampling = self.sampling
        return not (sampling.penalized or sampling.logit_bias or sampling.allowed_token_ids
                    or self.grammar is not None)  # fmt: skip

    def sampling_row(self) -> SamplingRow:
        if not self.sampling.penalized:  # only penalties look at the history
            return SamplingRow(self.sampling, self.generator)
        return SamplingRow(self.sampling, self.generator, self.prompt_ids, self.output_ids)

    def append(self, token_id: int) -> FinishReason | None:
        """Adds a generated token; returns why the sequence stops now, if it does."""
        self.token_ids.append(token_id)
        if self.grammar is not None:
            if not self.grammar.accept_token(token_id):
                # The mask allowed only what the grammar accepts: a bug, or non-finite logits.
                _log.error("%s: its grammar refused token %d; aborting it", self.seq_id, token_id)
                return FinishReason.ABORT
            if self.grammar.is_terminated():  # a stop token: nothing may follow, min_tokens or not
                return FinishReason.STOP
        return self._limit(token_id, self.num_output_tokens, self.num_tokens)

    def first_token_finishes(self, token_id: int) -> bool | None:
        """Whether `token_id`, appended as its first output, would stop it (as `append` would
        tell); None under a grammar, which must consume the token to tell."""
        assert self.num_output_tokens == 0
        if self.grammar is not None:
            return None
        return self._limit(token_id, 1, self.num_tokens + 1) is not None

    def _limit(self, token_id: int, generated: int, num_tokens: int) -> FinishReason | None:
        """Why the sequence stops after `token_id`, its `generated`-th output, at `num_tokens`
        tokens in all: a stop token, or a length limit."""
        if generated >= self.stop.min_tokens and token_id in self._stop_ids:
            return FinishReason.STOP
        if generated >= self.stop.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
