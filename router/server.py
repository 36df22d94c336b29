"""The router: OpenAI-compatible HTTP in front of prefill and decode instances.

    python -m router.server --model DIR --host 127.0.0.1 --port 8000 \
        --prefill http://127.0.0.1:8100 [--prefill ...] --decode 127.0.0.1:50051 [--decode ...]
    python -m router.server --model DIR --aggregated --decode 127.0.0.1:50051 [--decode ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from router import discovery
from router.clients import GrpcDecodeClient, HttpPrefillClient
from router.openai_api import create_app
from router.orchestrator import Orchestrator
from router.output_parsing import OutputParsing
from router.prompts import PromptTokenizer
from router.requests import ServedModel
from router.sampling_defaults import OPENAI, sampling_defaults
from router.tokenization import SegmentTokenizer


@dataclass(frozen=True)
class RouterConfig:
    model: str
    """Hugging Face folder: the tokenizer, chat template and context length come from it."""
    prefill: tuple[str, ...]
    """Prefill base URLs (tandem's prefill server or vLLM with tandem's connector)."""
    decode: tuple[str, ...]
    """Decode servers' gRPC host:port."""
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = ""
    api_key: str | None = None
    """When set, /v1/* requests need `Authorization: Bearer <api_key>`."""
    max_queue: int = 512
    """Requests in flight beyond this get 429 with Retry-After; 0: no limit."""
    aggregated: bool = False
    """No prefill instance: every request is prefilled by its decode server (the baseline that
    disaggregation is measured against)."""
    decode_only_fallback: bool = True
    """While no prefill instance is healthy, requests are prefilled by their decode server
    (counted in tandem_router_decode_only_fallback_total) instead of failing with 503."""
    decode_services: tuple[str, ...] = ()
    """DNS names (name:port) whose addresses are decode servers, re-resolved (router.discovery)."""
    prefill_services: tuple[str, ...] = ()
    """The same for prefill servers (http://name:port)."""
    spec_metrics: bool = False
    """One-choice responses carry their speculative decoding under `metrics`."""
    generation_config: str = "auto"
    """Where unset sampling fields come from (router/sampling_defaults.py): "auto" (the
    model's generation_config.json), "vllm" (OpenAI's defaults) or a folder."""

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {self.model} is not a Hugging Face folder (no config.json)")
        if not self.decode and not self.decode_services:
            raise ValueError("decode: give at least one --decode or --decode-service")
        prefills = self.prefill or self.prefill_services
        if self.aggregated and prefills:
            raise ValueError("prefill: none with --aggregated (decode servers prefill)")
        if not self.aggregated and not prefills:
            raise ValueError(
                "prefill: give at least one --prefill URL or --prefill-service, or --aggregated"
            )
        for role, specs in (("decode", self.decode_services), ("prefill", self.prefill_services)):
            for spec in specs:
                discovery.service(role, spec)  # ValueError naming the flag
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a port number")
        if self.max_queue < 0:
            raise ValueError(f"max_queue: {self.max_queue} must be >= 0")


def cli_parser() -> argparse.ArgumentParser:
    """The router's command line (also what deploy/ manifests are checked against)."""
    parser = argparse.ArgumentParser(prog="python -m router.server", description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", action="append", default=[], help="prefill base URL")
    parser.add_argument("--decode", action="append", default=[], help="decode host:port")
    parser.add_argument("--served-model-name", default="")
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    parser.add_argument("--max-queue", type=int, default=512, help="429 beyond this many")
    parser.add_argument("--aggregated", action="store_true",
                        help="no prefill: the decode servers prefill every request")  # fmt: skip
    parser.add_argument("--decode-service", action="append", default=[],
                        help="DNS name:port resolving to decode servers (re-resolved)")  # fmt: skip
    parser.add_argument("--prefill-service", action="append", default=[],
                        help="http://name:port resolving to prefill servers")  # fmt: skip
    parser.add_argument("--no-decode-only-fallback", action="store_true",
                        help="with no prefill healthy, answer 503 instead of prefilling on the "
                        "decode servers")  # fmt: skip
    parser.add_argument("--tool-call-parser", default=None,
                        help="vLLM's parser of tool calls in the output (hermes, llama3_json, "
                        "pythonic, ...); needed for tool_choice auto")  # fmt: skip
    parser.add_argument("--per-request-spec-decode-metrics", choices=["none", "summary"],
                        default="none", help="summary: a one-choice response carries its "
                        "speculative decoding under metrics (vLLM's)")  # fmt: skip
    parser.add_argument("--generation-config", default="auto",
                        help="the sampling of a request's unset fields (vLLM's): auto (the "
                        "model's generation_config.json, then OpenAI's defaults: temperature "
                        "1), vllm (OpenAI's defaults only), or a folder with a "
                        "generation_config.json; greedy is temperature 0")  # fmt: skip
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        help="vLLM's parser of reasoning in the output (qwen3, deepseek_r1, ...)",
    )
    return parser


def config_of(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig of parsed arguments; ValueError naming a bad value."""
    return RouterConfig(args.model, tuple(args.prefill), tuple(args.decode), args.host,
                        args.port, args.served_model_name, args.api_key, args.max_queue,
                        args.aggregated, not args.no_decode_only_fallback,
                        tuple(args.decode_service), tuple(args.prefill_service),
                        args.per_request_spec_decode_metrics == "summary",
                        args.generation_config)  # fmt: skip


def main() -> None:
    args = cli_parser().parse_args()
    logging.basicConfig(format="router.server: %(message)s", level=logging.INFO)
    try:
        config = config_of(args)
        defaults = sampling_defaults(config.model, config.generation_config)
        sock = socket.create_server((config.host, config.port))
    except (ValueError, OSError) as e:
        sys.exit(f"router.server: cannot start: {e}")
    if defaults != OPENAI:
        print(f"router.server: unset sampling fields default to the model's generation config: "
              f"{defaults} (--generation-config vllm for OpenAI's)", flush=True)  # fmt: skip
    # Long prompts are encoded in parts on the tokenizer's threads (router/tokenization.py).
    # The variable exists to keep a process that forks after using them from deadlocking;
    # the router never forks, and tools/serve turns it off for the processes it starts.
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from transformers import AutoTokenizer

    tokenizer = SegmentTokenizer(AutoTokenizer.from_pretrained(config.model))
    if not tokenizer.self_check():
        print("router.server: segment-cached tokenization disagrees with whole-prompt "
              "tokenization for this tokenizer; tokenizing whole prompts", flush=True)  # fmt: skip
    if not tokenizer.cut:
        print("router.server: long prompts are tokenized in one piece (this tokenizer's pieces "
              "cannot be cut at spaces)", flush=True)  # fmt: skip
    hf_config = json.loads((Path(config.model) / "config.json").read_text())
    served = ServedModel(
        config.served_model_name or config.model,
        max_model_len=int(hf_config.get("max_position_embeddings", 4096)),
        vocab_size=int(hf_config.get("vocab_size") or len(tokenizer.tokenizer)),
        spec_metrics=config.spec_metrics,
        sampling_defaults=defaults,
    )
    orchestrator = Orchestrator(config.prefill, config.decode, HttpPrefillClient(),
                                GrpcDecodeClient(), config.aggregated,
                                config.decode_only_fallback)  # fmt: skip
    prompts = PromptTokenizer(tokenizer, orchestrator)
    try:
        parsing = OutputParsing(tokenizer.tokenizer, args.tool_call_parser, args.reasoning_parser)
    except ValueError as e:
        sys.exit(f"router.server: cannot start: {e}")
    app = create_app(orchestrator, prompts, served, config.api_key, config.max_queue, parsing)

    found = discovery.Discovery(orchestrator, config.decode_services, config.prefill_services)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await found.refresh()
        await orchestrator.probe()  # their context lengths
        if orchestrator.prefills:  # aggregated: no prefill's tokenizer to compare with
            await prompts.check_parity()
        # The first structured-output request would otherwise wait seconds for this import.
        warm = asyncio.create_task(asyncio.to_thread(importlib.import_module, "engine.grammar"))
        probe = asyncio.create_task(orchestrator.probe_forever())
        rediscover = asyncio.create_task(found.run_forever())
        yield
        rediscover.cancel()
        probe.cancel()
        warm.cancel()
        await orchestrator.close()

    app.router.lifespan_context = lifespan
    port = sock.getsockname()[1]
    print(f"router.server: serving on http://{config.host}:{port}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main()
