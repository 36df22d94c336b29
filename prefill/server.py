"""tandem's own prefill server, behind the subset of vLLM's HTTP API the router uses, so the
router cannot tell it from vLLM with tandem's connector:

  POST /v1/completions   token-id (or text) prompt; with `kv_transfer_params` carrying a tandem
                         ticket and max_tokens=1, the prompt's KV goes to the decode server and
                         the reply's `kv_transfer_params` holds the first token and transfer stats;
                         `n` choices, choice i seeded seed + i as vLLM's n does, the KV sent once
                         whatever n (with choice 0); vLLM's `structured_outputs` constrains the
                         sampled tokens
  POST /tokenize         {"prompt": str} or {"messages": [...]} -> {"tokens": [...], "count"}
  GET  /health, GET /v1/models

    python -m prefill.server --model DIR --host 127.0.0.1 --port 8100 --transport tcp
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError

from engine.chat_template import render_chat
from engine.grammar import Grammar, structured_outputs_spec
from engine.json_body import InvalidBody, json_object
from engine.llm_engine import EngineConfig, LLMEngine
from engine.openai_logprobs import completion_logprobs, prompt_logprobs_field, token_texts
from engine.sampling import SAMPLING_FIELDS, SamplingParams
from engine.sampling_ranges import MAX_N
from engine.sequence import StopConditions
from prefill import server_timing
from prefill.engine_layout import engine_layout
from prefill.publisher import KV_SEND_MODES, KvPublisher
from prefill.rank_sends import PrefillRankAgent, RankSender
from prefill.ticket import PREFILL_LAYOUT, KvTransfer, TicketError
from prefill.worker import Job, PrefillError, PrefillWorker, Result
from rpc import registration
from tools import preflight
from transport.config import KvTransportConfig

# Completion fields accepted and ignored because they change nothing here.
_IGNORED = {"model", "stream", "echo", "return_token_ids", "user"}
_ACCEPTED = _IGNORED | set(SAMPLING_FIELDS) | {
    "prompt", "max_tokens", "n", "kv_transfer_params", "return_tokens_as_token_ids",
    "structured_outputs",
}  # fmt: skip


@dataclass(frozen=True)
class PrefillServerConfig:
    engine: EngineConfig
    kv: KvTransportConfig = field(default_factory=KvTransportConfig)
    """Transport, the interface the server listens on, and this sender's own transfer timeout
    (the ticket's deadline also holds)."""
    port: int = 0
    served_model_name: str = ""
    kv_send: str = "layerwise"
    """Which forwards send a request's KV, and when (prefill.publisher.KV_SEND_MODES)."""
    drain_grace_s: float = 30.0
    """After SIGTERM: how long the requests already taken may take to finish."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a port number")
        if self.kv_send not in KV_SEND_MODES:
            raise ValueError(f"kv_send: {self.kv_send!r} is not one of {', '.join(KV_SEND_MODES)}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        EngineConfig.add_cli_args(parser)
        KvTransportConfig.add_cli_args(parser)
        parser.add_argument("--port", type=int, default=8100)
        parser.add_argument("--served-model-name", default="")
        parser.add_argument(
            "--kv-send", choices=KV_SEND_MODES, default="layerwise",
            help="layerwise: each layer as the forward completing the prompt computes it "
            "(default); chunkwise: also each earlier prefill chunk's filled blocks; "
            "after-forward: all after that forward (to compare)",
        )  # fmt: skip
        parser.add_argument(
            "--drain-grace-s", type=float, default=30.0,
            help="after SIGTERM, seconds for the requests already taken to finish",
        )  # fmt: skip

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> PrefillServerConfig:
        return cls(
            engine=EngineConfig.from_cli_args(args),
            kv=KvTransportConfig.from_cli_args(args),
            port=args.port,
            served_model_name=args.served_model_name,
            kv_send=args.kv_send,
            drain_grace_s=args.drain_grace_s,
        )


class PrefillServer:
    def __init__(self, config: PrefillServerConfig) -> None:
        self.config = config
        self.name = config.served_model_name or config.engine.model
        publisher = KvPublisher(config.kv_send)
        layout = engine_layout(
            config.engine, name=self.name, layout=PREFILL_LAYOUT, transport=config.kv.backend
        )
        # Every tensor-parallel rank sends its heads (prefill/rank_sends.py).
        ranks = None
        if layout.tp_size > 1:
            ranks = partial(
                PrefillRankAgent, config.kv, layout.SerializeToString(), config.kv_send,
                config.engine.tensor_parallel_size // layout.tp_size,
            )  # fmt: skip
        self.engine = LLMEngine.build(
            config.engine, wrap_attention=publisher.wrap, rank_agent=ranks
        )
        publisher.bind(self.engine.kv_cache)
        self.rank_sender = RankSender.build(
            config.kv, layout, 0, self.engine.kv_cache, self.engine.proposer_cache
        )
        self.sender = self.rank_sender.sender
        # An MLA latent, which every rank holds whole, is sent by rank 0 alone.
        senders = self.engine.tp_workers if layout.tp_size > 1 else None
        self.worker = PrefillWorker(self.engine, publisher, self.sender, senders)
        self.tokenizer = _tokenizer(config.engine.model)
        self._token_texts = None if self.tokenizer is None else token_texts(self.tokenizer)
        self.draining = False
        """Set by SIGTERM: /health and new requests answer 503 (the router goes elsewhere)."""
        self.drain_refusals = 0
        """New requests refused while draining: a router that was told first (this server
        deregistered before the drain) sends none."""
        self.instance_id = uuid.uuid4().hex
        """New at every start (/health): a server restarted on its address has another."""
        self._in_flight = 0
        self.app = self._routes()

    def drain(self) -> int:
        """Refuses new requests, waits up to drain_grace_s for those taken to finish; returns
        how many had not."""
        self.draining = True
        deadline = time.monotonic() + self.config.drain_grace_s
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._in_flight

    def _refuse_if_draining(self) -> None:
        if self.draining:
            self.drain_refusals += 1
            raise PrefillError(503, "draining: this prefill server is shutting down; send new "
                               "requests to another")  # fmt: skip

    def _routes(self) -> FastAPI:
        app = FastAPI(title="tandem prefill")

        @app.exception_handler(PrefillError)
        async def refused(request: Request, error: PrefillError) -> JSONResponse:
            return _error(error.status, str(error), error.param)

        @app.get("/health")
        async def health():
            if self.worker.failure is not None:
                return _error(503, self.worker.failure)
            if self.draining:
                return _error(503, "draining")
            return {"status": "ok", "instance_id": self.instance_id}

        @app.get("/v1/models")
        async def models() -> dict:
            card = {"id": self.name, "object": "model", "owned_by": "tandem",
                    "max_model_len": self.engine.max_model_len}  # fmt: skip
            return {"object": "list", "data": [card]}

        @app.post("/tokenize")
        async def tokenize(request: Request):
            self._refuse_if_draining()
            body = await _json(request)
            if self.tokenizer is None:
                return _error(400, "this model folder has no tokenizer")
            if "messages" in body:  # with the template arguments vLLM's /tokenize takes
                try:
                    text = render_chat(self.tokenizer, body["messages"], body)
                except (TemplateError, TypeError, ValueError) as e:
                    return _error(400, f"chat template: {e}")
                add = body.get("add_special_tokens", False)  # the template writes its own
                tokens = self.tokenizer(text, add_special_tokens=add)["input_ids"]
            elif isinstance(body.get("prompt"), str):
                add = body.get("add_special_tokens", True)
                tokens = self.tokenizer(body["prompt"], add_special_tokens=add)["input_ids"]
            else:
                return _error(400, "tokenize: give `prompt` (a string) or `messages`")
            return {"tokens": tokens, "count": len(tokens),
                    "max_model_len": self.engine.max_model_len}  # fmt: skip

        @app.post("/v1/completions")
        async def completions(request: Request):
            self._refuse_if_draining()
            self._in_flight += 1
            try:
                return await self._complete(request)
            finally:
                self._in_flight -= 1

        return app

    async def _complete(self, request: Request) -> JSONResponse:
        """POST /v1/completions."""
        body = await _json(request)
        jobs = self._jobs(body)
        if body.get("structured_outputs") is not None:
            # Off the event loop: compiling takes milliseconds (the first one seconds, as it
            # loads xgrammar and the tokenizer).
            grammar = await asyncio.to_thread(self._grammar, body["structured_outputs"])
            for job in jobs:  # one compiled grammar; each sequence gets its own matcher
                job.grammar = grammar
        # Any choice failing fails the request: the first failure is the answer.
        futures = self.worker.submit(jobs)
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        reply = self._reply(jobs[0].prompt_ids, results, body.get("return_tokens_as_token_ids"))
        # Choice 0's phases (the one that sends).
        timing = server_timing.header(results[0].timing)
        return JSONResponse(reply, headers={"Server-Timing": timing})

    def _reply(
        self, prompt_ids: list[int], results: list[Result], as_token_ids: bool | None
    ) -> dict:
        """The completion: one choice per result, in order; the prompt is counted once, and the
        transfer's `kv_transfer_params` are choice 0's (the only choice that sends)."""
        token_text = self._token_text(as_token_ids)
        prompt_logprobs = None  # choice 0's (the others' prompt is the same), in every choice
        if results[0].prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_field(
                prompt_ids, results[0].prompt_logprobs, self._token_text(False)
            )
        choices = []
        for index, result in enumerate(results):
            logprobs = None
            if result.logprobs is not None:
                logprobs = completion_logprobs(result.token_ids, result.logprobs, token_text)
            text = self.tokenizer.decode(result.token_ids) if self.tokenizer else ""
            choices.append({
                "index": index, "text": text, "token_ids": result.token_ids,
                "finish_reason": result.finish_reason, "logprobs": logprobs,
                "prompt_logprobs": prompt_logprobs,
            })  # fmt: skip
        prompt = results[0].prompt_tokens
        completion = sum(len(result.token_ids) for result in results)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens}},
            "kv_transfer_params": results[0].kv_transfer_params,
        }  # fmt: skip

    def _jobs(self, body: dict) -> list[Job]:
        """The request's choices as jobs; only choice 0's carries the ticket (the KV is sent
        once, whatever n). PrefillError (400) naming what the request got wrong."""
        prompt = body.get("prompt")
        if isinstance(prompt, str) and self.tokenizer is not None:
            prompt = self.tokenizer(prompt)["input_ids"]
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise PrefillError(400, "prompt: must be a non-empty list of token ids or a string")
        unknown = set(body) - _ACCEPTED
        if unknown:
            raise PrefillError(400, f"unsupported parameter(s): {', '.join(sorted(unknown))}")
        max_tokens = body.get("max_tokens", 16)
        params = body.get("kv_transfer_params")
        try:
            transfer = KvTransfer.parse(params) if params else None
        except TicketError as e:
            raise PrefillError(400, str(e)) from None
        if transfer is not None and max_tokens != 1:
            raise PrefillError(400, f"max_tokens: {max_tokens}; a KV transfer needs exactly 1")
        as_ids = body.get("return_tokens_as_token_ids")
        if not isinstance(as_ids, bool | None):
            raise PrefillError(400, f"return_tokens_as_token_ids: {as_ids!r} is not a boolean")
        try:
            sampling = SamplingParams.from_dict({k: body[k] for k in SAMPLING_FIELDS if k in body})
            stop = StopConditions(max_tokens=int(max_tokens))
        except (ValueError, TypeError) as e:
            raise PrefillError(400, str(e)) from None
        n = choice_count(body.get("n", 1))
        return [
            Job(list(prompt), sampling.for_choice(i), stop, transfer if i == 0 else None)
            for i in range(n)
        ]

    def _grammar(self, structured_outputs: object) -> Grammar | None:
        try:
            spec = structured_outputs_spec(structured_outputs)
            return None if spec is None else self.engine.grammars.compile(spec)
        except ValueError as e:
            raise PrefillError(400, f"structured_outputs: {e}") from None

    def _token_text(self, as_token_ids: bool | None) -> Callable[[int], str]:
        """How a token is named in `logprobs`: vLLM's "token_id:<id>", or its text.
        NOTE: a random model has no tokenizer, so its tokens are always named by id."""
        if as_token_ids or self.tokenizer is None:
            return lambda token_id: f"token_id:{token_id}"
        return self._token_texts

    def stop(self) -> None:
        self.worker.stop()
        self.engine.close()
        self.rank_sender.close()


def choice_count(n: object) -> int:
    """OpenAI's `n`, checked: an integer (not a boolean) in [1, MAX_N]; PrefillError (400)
    naming `n` otherwise."""
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise PrefillError(400, f"n: {n!r} is not an integer in [1, {MAX_N}]", param="n")
    return n


async def _json(request: Request) -> dict:
    try:
        return json_object(await request.body())
    except InvalidBody as e:
        raise PrefillError(400, str(e)) from None


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error body with the router's types (router/errors.py: no component imports the
    router, so these three lines are the prefill server's own)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _tokenizer(model: str):
    if model.startswith("random:"):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def cli_parser() -> argparse.ArgumentParser:
    """The prefill server's command line (also what deploy/ manifests are checked against)."""
    parser = argparse.ArgumentParser(prog="python -m prefill.server", description=__doc__)
    PrefillServerConfig.add_cli_args(parser)
    registration.add_cli_args(parser)
    preflight.add_cli_args(parser)
    return parser


def main() -> None:
    args = cli_parser().parse_args()
    preflight.check_server(args, "prefill.server")
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        sys.exit(f"prefill.server: cannot listen on {args.host}:{args.port}: {e}")
    try:
        registration.check_args(args)
        server = PrefillServer(PrefillServerConfig.from_cli_args(args))
    except (ValueError, OSError) as e:
        sys.exit(f"prefill.server: cannot start: {e}")
    port = sock.getsockname()[1]
    print(f"prefill.server: serving on http://{args.host}:{port}", flush=True)
    http = _HttpServer(uvicorn.Config(server.app, log_level="warning"))
    # A router probes at once and marks it down until it answers: uvicorn starts right after.
    routers = registration.Registration.from_args(args, "prefill", port, "prefill.server")
    routers.start()

    def drain() -> None:
        routers.withdraw()  # each router answers once nothing it sent is on its way here
        print("prefill.server: draining (SIGTERM): new requests refused", flush=True)
        left = server.drain()
        print(f"prefill.server: stopped, {left} request(s) cut at the end of the grace, "
              f"{server.drain_refusals} refused while draining", flush=True)  # fmt: skip
        http.should_exit = True

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=drain, daemon=True).start())
    http.run(sockets=[sock])
    server.stop()


class _HttpServer(uvicorn.Server):
    """uvicorn, its signal handling left to main(): on SIGTERM the server drains first (uvicorn's
    own would stop at once and then re-raise the signal, exiting with -15)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


if __name__ == "__main__":
    main()
