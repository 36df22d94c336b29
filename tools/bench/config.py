"""The benchmark's configuration: one frozen dataclass, its command-line flags, its checks."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass

DATASETS = ("random", "agentic")


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    """The server's root (without /v1); requests go to BASE_URL/v1/..."""
    model: str = ""
    """The `model` field of requests; "": the first id from GET /v1/models."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer KEY` when set."""
    dataset: str = "random"
    num_prompts: int = 100
    """Random requests, or agentic conversations."""
    random_input_len: int = 1024
    random_output_len: int = 128
    agentic_turns: int = 8
    """Turns per agentic conversation."""
    agentic_system_len: int = 2000
    """Tokens of the system prompt that all agentic conversations share."""
    agentic_turn_len: int = 500
    """Mean tokens of each turn's new user message (the task, then tool results)."""
    agentic_output_len: int = 200
    """Output tokens of each agentic turn."""
    tokenizer: str | None = None
    """The server's Hugging Face tokenizer folder: prompts of exact token counts. Without it,
    prompts are random words, about one token each."""
    seed: int = 0
    """Seeds the datasets and the arrival times: same seed, same load."""
    max_concurrency: int | None = None
    """Conversations (requests, for random) in flight at most; None: no limit."""
    request_rate: float = math.inf
    """Conversation (request) starts per second, Poisson; inf: all at once."""
    temperature: float = 0.0
    ignore_eos: bool = True
    """Asks the server (`ignore_eos`, a vLLM extension) to generate exactly `max_tokens`."""
    timeout_s: float = 600.0
    """Per request: connecting, and waiting for each chunk."""
    num_warmups: int = 1
    """Requests sent one at a time before the timed run and left out of its figures (the
    first conversations' first turns): a server's first requests pay its one-time costs
    (kernels compiled for new shapes, connections made)."""
    result_json: str | None = None
    """Where to write the JSON results."""
    plot: str | None = None
    """Where to write the PNG of the latency CDFs."""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: {self.base_url!r} is not an http(s) URL")
        if self.base_url.rstrip("/").endswith("/v1"):
            raise ValueError(f"base_url: {self.base_url!r}: give the server's root, without /v1")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset: {self.dataset!r} is not one of {', '.join(DATASETS)}")
        for name in ("num_prompts", "random_input_len", "random_output_len", "agentic_turns",
                     "agentic_turn_len", "agentic_output_len"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 1")
        if self.agentic_system_len < 0:
            raise ValueError(f"agentic_system_len: {self.agentic_system_len} must be >= 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: {self.max_concurrency} must be >= 1")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: {self.request_rate} must be > 0 (inf: all at once)")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups: {self.num_warmups} must be >= 0")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: {self.timeout_s} must be > 0")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = BenchConfig
        add = parser.add_argument
        add(
            "--base-url", default=d.base_url, help="server root, without /v1 (default: %(default)s)"
        )
        add("--model", default=d.model, help="default: the first id of GET /v1/models")
        add("--api-key", default=d.api_key, help="Bearer key (default: $OPENAI_API_KEY)")
        add("--dataset", choices=DATASETS, default=d.dataset)
        add("--num-prompts", type=int, default=d.num_prompts,
            help="random requests or agentic conversations (default: %(default)s)")  # fmt: skip
        add("--random-input-len", type=int, default=d.random_input_len)
        add("--random-output-len", type=int, default=d.random_output_len)
        add("--agentic-turns", type=int, default=d.agentic_turns, help="turns per conversation")
        add("--agentic-system-len", type=int, default=d.agentic_system_len,
            help="tokens of the shared system prompt")  # fmt: skip
        add("--agentic-turn-len", type=int, default=d.agentic_turn_len,
            help="mean tokens of each turn's new user message")  # fmt: skip
        add("--agentic-output-len", type=int, default=d.agentic_output_len)
        add("--tokenizer", default=d.tokenizer,
            help="HF tokenizer folder: exact prompt lengths (default: words)")  # fmt: skip
        add("--seed", type=int, default=d.seed)
        add("--max-concurrency", type=int, default=d.max_concurrency,
            help="conversations in flight at most (default: no limit)")  # fmt: skip
        add("--request-rate", type=float, default=d.request_rate,
            help="conversation starts per second, Poisson (default: inf, all at once)")  # fmt: skip
        add("--temperature", type=float, default=d.temperature)
        add("--ignore-eos", action=argparse.BooleanOptionalAction, default=d.ignore_eos,
            help="generate exactly max_tokens (default: on)")  # fmt: skip
        add("--timeout-s", type=float, default=d.timeout_s, help="per request and per chunk")
        add("--num-warmups", type=int, default=d.num_warmups,
            help="untimed requests first, one at a time (default: 1)")  # fmt: skip
        add("--result-json", default=d.result_json, help="write the results here")
        add("--plot", default=d.plot, help="write a PNG of the latency CDFs here")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> BenchConfig:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})

    def to_json(self) -> dict:
        """The configuration as recorded in the results: everything but the API key."""
        fields = asdict(self)
        fields["api_key"] = "***" if self.api_key else None
        fields["request_rate"] = str(self.request_rate)  # JSON has no inf
        return fields
