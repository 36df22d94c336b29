"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (streaming or not),
/v1/models, /tokenize, /detokenize, /health, /metrics. One request, in order:

  gate (API key on /v1/*, X-Request-Id) -> parse the body (router/requests.py) -> tokenize the
  prompt -> check it against the context -> admission (router/limiter.py: 429 past --max-queue)
  -> the orchestrator's token ids -> text (router/streaming.py) -> SSE chunks or one JSON body
  -> counted by status (router/metrics.py).

A client that disconnects before its answer is ready (the first token of a stream, the whole
body otherwise) cancels the generation at once: the orchestrator aborts it on the decode
server. Every 4xx and 5xx carries OpenAI's error body (router/errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine.openai_logprobs import token_texts
from router import admin_api
from router.choice_streams import batched, echoed
from router.detokenizer import IncrementalDetokenizer
from router.errors import BackendError, RequestError, error_body
from router.generation import Finished, GenerationRequest
from router.limiter import InFlightLimiter, QueueFull
from router.logprobs import LogprobsFormat
from router.messages import echoed_text
from router.metrics import RequestTimer, RouterMetrics
from router.orchestrator import Orchestrator
from router.output_parsing import OutputParsing
from router.prompts import PromptTokenizer
from router.requests import ApiRequest, Endpoint, ServedModel, generation_request, parse
from router.streaming import (
    ChoiceText,
    Delta,
    collect,
    completion_body,
    sse,
    text_events,
)
from router.streaming import Response as StreamResponse
from router.tokenize_api import detokenize, tokenize

RETRY_AFTER_S = 1
CLIENT_GONE = 499
"""The status logged and counted for a request whose client left before its answer."""


def create_app(
    orchestrator: Orchestrator,
    prompts: PromptTokenizer,
    model: ServedModel,
    api_key: str | None = None,
    max_queue: int = 0,
    parsing: OutputParsing | None = None,
) -> FastAPI:
    """`max_queue` > 0: requests beyond that many in flight get 429 with Retry-After.
    `parsing`: the configured tool-call and reasoning parsers (none: chat text is content)."""
    parsing = parsing or OutputParsing(prompts.local.tokenizer)
    model = dataclasses.replace(model, auto_tools=parsing.auto_tools)
    api = OpenAIApi(orchestrator, prompts, model, api_key, InFlightLimiter(max_queue), parsing)
    app = FastAPI(title="tandem router")
    app.middleware("http")(api.gate)
    app.add_exception_handler(RequestError, _refused)
    app.add_api_route("/metrics", api.prometheus, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    admin_api.add_routes(app, orchestrator)
    return app


class OpenAIApi:
    """The handlers, over one orchestrator serving `model`."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        prompts: PromptTokenizer,
        model: ServedModel,
        api_key: str | None,
        limiter: InFlightLimiter,
        parsing: OutputParsing,
    ) -> None:
        self.orchestrator = orchestrator
        self.prompts = prompts
        self.token_text = token_texts(prompts.local.tokenizer)
        """How logprobs name a token (vLLM's names)."""
        self.model = model
        self.api_key = api_key
        self.limiter = limiter
        self.parsing = parsing
        self.metrics = RouterMetrics(orchestrator, limiter)

    async def gate(self, request: Request, call_next) -> Response:
        """Middleware: API key (Bearer) on /v1/* and /admin/*, X-Request-Id in and out, responses
        counted."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = request_id
        authorized = request.headers.get("authorization") == f"Bearer {self.api_key}"
        guarded = request.url.path.startswith(("/v1/", admin_api.PATH))
        if self.api_key and guarded and not authorized:
            response = error_response(401, "missing or wrong API key (Authorization: Bearer ...)")
        else:
            response = await call_next(request)
        response.headers["X-Request-Id"] = request.state.request_id  # a body's, where it named one
        self.metrics.count_response(request.url.path, response.status_code)
        return response

    async def prometheus(self) -> Response:
        return Response(self.metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    async def health(self) -> dict:
        return {
            "status": "ok",
            "mode": self.orchestrator.decode_only.mode,
            "tokenizer": {
                "source": self.prompts.source,
                "parity": self.prompts.parity,
                "segmented": self.prompts.local.segmented,
            },
            **admin_api.instance_health(self.orchestrator),
        }

    async def models(self) -> dict:
        model = self.served()
        card = {"id": model.name, "object": "model", "created": 0, "owned_by": "tandem",
                "root": model.name, "parent": None,
                "max_model_len": model.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    async def tokenize(self, request: Request) -> dict:
        return await tokenize(await request.body(), self.served(), self.prompts)

    async def detokenize(self, request: Request) -> dict:
        return detokenize(await request.body(), self.served(), self.prompts.local.tokenizer)

    def served(self) -> ServedModel:
        """The model, with the context the decode servers decode (they may take less)."""
        context = self.orchestrator.max_model_len(self.model.max_model_len)
        return dataclasses.replace(self.model, max_model_len=context)

    async def completions(self, request: Request) -> Response:
        return await self._serve(Endpoint.COMPLETIONS, request)

    async def chat(self, request: Request) -> Response:
        return await self._serve(Endpoint.CHAT, request)

    async def _serve(self, endpoint: Endpoint, request: Request) -> Response:
        model = self.served()
        api_request = parse(endpoint, await request.body(), model)
        parts = api_request.one_per_prompt()  # a completions batch: one generation a prompt
        started = time.monotonic()
        prompts = [await self._prompt_ids(part) for part in parts]
        self.orchestrator.on_phase("tokenize", time.monotonic() - started)
        generations = [generation_request(part, prompt_ids, model.max_model_len)
                       for part, prompt_ids in zip(parts, prompts, strict=True)]  # fmt: skip
        if api_request.request_id and "x-request-id" not in request.headers:  # vLLM's order
            request.state.request_id = api_request.request_id
        request_id = request.state.request_id
        response_id = f"{endpoint.id_prefix}-{request_id}"
        response = self._response(api_request, prompts, response_id)
        parser = response.parser(0)
        skip_special = parser.skip_special_tokens if parser else api_request.skip_special_tokens
        streams = [self._events(generation, part, request_id, skip_special)
                   for generation, part in zip(generations, parts, strict=True)]  # fmt: skip
        try:  # admission, and failures before the first token, get an HTTP status
            firsts = await _unless_client_leaves(request, _first_events(streams))
        except QueueFull as e:
            return error_response(429, str(e), headers={"Retry-After": str(RETRY_AFTER_S)})
        except BackendError as e:
            return error_response(e.status, str(e))
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        started_streams = [_chain(f, rest) for f, rest in zip(firsts, streams, strict=True)]
        events = batched(started_streams, api_request.n)
        if api_request.echo and api_request.messages is None:  # a chat's: the Response's
            decode = self.prompts.local.tokenizer.decode
            texts = [part.text if part.text is not None else decode(ids)
                     for part, ids in zip(parts, prompts, strict=True)]  # fmt: skip
            events = echoed(events, texts, api_request.n, api_request.prompt_only)
        if api_request.stream:
            return StreamingResponse(sse(events, response), media_type="text/event-stream")
        try:
            choices = await _unless_client_leaves(request, collect(events))
        except BackendError as e:
            return error_response(e.status, str(e))
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(completion_body(response, choices))

    def _response(
        self, request: ApiRequest, prompts: list[list[int]], response_id: str
    ) -> StreamResponse:
        """The response's framing, with a logprobs writer and an output parser per choice, of
        a request whose prompts are `prompts` (token ids)."""
        prompt_ids, num_prompts = prompts[0], len(prompts)
        logprobs = parsers = ()
        if request.sampling.HasField("logprobs"):
            logprobs = tuple(LogprobsFormat(self.token_text,
                                            chat=request.endpoint is Endpoint.CHAT,
                                            tokens_as_ids=request.tokens_as_ids,
                                            top_n=request.sampling.logprobs)
                             for _ in range(request.n * num_prompts))  # fmt: skip
        if request.tools is not None:  # a chat
            kwargs = (request.template or {}).get("chat_template_kwargs")
            parsers = tuple(self.parsing.start(request.tools, prompt_ids,
                                               request.skip_special_tokens, kwargs,
                                               request.include_reasoning)
                            for _ in range(request.n))  # fmt: skip
        spec = self.model.spec_metrics and request.n == 1
        chat_echo = ""
        if request.echo and request.messages is not None:
            chat_echo = echoed_text(request.messages, request.template or {})
        # vLLM's decoded_token: a prompt token's text, whatever return_tokens_as_token_ids says.
        prompt_text = self.token_text if request.sampling.HasField("prompt_logprobs") else None
        return StreamResponse(request.endpoint, response_id, self.model.name, int(time.time()),
                              request.include_usage, logprobs, parsers, spec, request.n,
                              prompt_text,
                              tuple(prompts) if request.return_token_ids else (),
                              chat_echo)  # fmt: skip

    async def _prompt_ids(self, request: ApiRequest) -> list[int]:
        try:
            if request.messages is not None:
                return await self.prompts.chat(request.messages, request.template,
                                               request.add_special_tokens)  # fmt: skip
            if request.text is not None:
                return await self.prompts.text(request.text, request.add_special_tokens)
        except BackendError as e:  # tokenized by a prefill that refused or failed
            raise RequestError(e.status, str(e)) from None
        return request.token_ids

    async def _events(
        self,
        generation: GenerationRequest,
        request: ApiRequest,
        request_id: str,
        skip_special_tokens: bool,
    ) -> AsyncIterator[Delta | Finished]:
        """The request's text events, holding a slot of the limiter throughout: QueueFull at
        the first step when there is none."""
        prompt_ids = generation.prompt_ids
        with self.limiter.slot():
            timer = RequestTimer(self.metrics)
            started = self.orchestrator.generate(generation, request_id)
            choices = [
                ChoiceText(i, IncrementalDetokenizer(self.prompts.local.tokenizer, prompt_ids,
                                                     skip_special_tokens),
                           len(prompt_ids), request.stops, request.include_stop_str_in_output)
                for i in range(generation.n)
            ]  # fmt: skip
            events = text_events(timer.timed(started), choices, started.stop_choice)
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _unless_client_leaves(request: Request, work: Awaitable):
    """`work`'s result, or ClientGone once the client disconnects first (`work` is then
    cancelled, which aborts its generation). The body has been read, so the next ASGI message
    is the disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, BackendError):
        await task
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


async def _refused(request: Request, error: RequestError) -> JSONResponse:
    return error_response(error.status, str(error), error.param)


async def _first_events(streams: list[AsyncIterator]) -> list:
    """Each stream's first event, taken together; should any fail, every stream is closed (what
    was admitted is aborted) and its error raised."""
    firsts = await asyncio.gather(*(anext(stream) for stream in streams), return_exceptions=True)
    failed = [e for e in firsts if isinstance(e, BaseException)]
    if failed:
        for stream in streams:
            await stream.aclose()
        raise failed[0]
    return firsts


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    async with contextlib.aclosing(rest):
        yield first
        async for item in rest:
            yield item
