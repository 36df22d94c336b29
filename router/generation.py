"""The contract between the HTTP side and the orchestrator: a validated GenerationRequest goes
in; Tokens and one Finished per choice come out, after a PromptLogprobs per choice when the
request asks for the prompt's (the choices' items interleave; each carries its choice's `index`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.tandem.v1 import decode_pb2


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    """At least 1; prompt_ids plus max_tokens fit the context."""
    sampling: decode_pb2.SamplingParams
    """The fields the client set and the model's defaults for the others (temperature always,
    from the router; unset here, the engine's default is greedy)."""
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    structured: decode_pb2.StructuredOutput | None = None
    """The grammar the output follows, first token included (the prefill is told too)."""
    n: int = 1
    """Choices: independent generations from the one prompt (OpenAI's n)."""


@dataclass(frozen=True)
class Tokens:
    """Token ids as the decode server streamed them, with their log-probabilities when the
    request's sampling.logprobs is set (one per id; empty otherwise)."""

    ids: list[int]
    logprobs: list[decode_pb2.TokenLogprobs] = field(default_factory=list)
    ends_on_stop_token: bool = False
    """The last id is the stop token (end of sequence, a stop_token_ids entry) that finished
    the generation: its text is not part of the output (vLLM's rule)."""
    index: int = 0
    """The choice these tokens belong to."""


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    """The choice's own."""
    index: int = 0
    """The choice that finished."""
    spec_decode: decode_pb2.SpecDecodeStats | None = None
    """Its speculative decoding, when its decode server speculates (and it ended there, not
    on a stop string the router found)."""


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's log-probabilities (sampling.prompt_logprobs set), for one choice (every
    choice has them: the prompt is the same): prompt token i + 1's at `entries[i]`. A choice's
    come before its first Tokens."""

    prompt_ids: list[int]
    entries: list[decode_pb2.TokenLogprobs]
    index: int = 0
    """The choice."""
