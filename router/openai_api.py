"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (streaming or not),
/v1/models, /health, /metrics. One request, in order:

  gate (API key on /v1/*, X-Request-Id) -> parse the body (router/requests.py) -> tokenize the
  prompt -> check it against the context -> admission (router/limiter.py: 429 past --max-queue)
  -> the orchestrator's token ids -> text (router/streaming.py) -> SSE chunks or one JSON body
  -> counted by status (router/metrics.py).

Every 4xx and 5xx carries OpenAI's error body (router/errors.py).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from router.detokenizer import IncrementalDetokenizer
from router.errors import BackendError, RequestError, error_body
from router.generation import Finished, GenerationRequest
from router.limiter import InFlightLimiter, QueueFull
from router.metrics import RequestTimer, RouterMetrics
from router.orchestrator import Orchestrator
from router.prompts import PromptTokenizer
from router.requests import ApiRequest, Endpoint, generation_request, parse
from router.streaming import collect, completion_body, sse, text_events

RETRY_AFTER_S = 1


def create_app(
    orchestrator: Orchestrator,
    prompts: PromptTokenizer,
    model: str,
    max_model_len: int,
    api_key: str | None = None,
    max_queue: int = 0,
) -> FastAPI:
    """`max_queue` > 0: requests beyond that many in flight get 429 with Retry-After."""
    api = OpenAIApi(orchestrator, prompts, model, max_model_len, api_key,
                    InFlightLimiter(max_queue))  # fmt: skip
    app = FastAPI(title="tandem router")
    app.middleware("http")(api.gate)
    app.add_exception_handler(RequestError, _refused)
    app.add_api_route("/metrics", api.prometheus, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    return app


class OpenAIApi:
    """The handlers, over one orchestrator serving `model`."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        prompts: PromptTokenizer,
        model: str,
        max_model_len: int,
        api_key: str | None,
        limiter: InFlightLimiter,
    ) -> None:
        self.orchestrator = orchestrator
        self.prompts = prompts
        self.model = model
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.limiter = limiter
        self.metrics = RouterMetrics(orchestrator, limiter)

    async def gate(self, request: Request, call_next) -> Response:
        """Middleware: API key (Bearer) on /v1/*, X-Request-Id in and out, responses counted."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = request_id
        authorized = request.headers.get("authorization") == f"Bearer {self.api_key}"
        if self.api_key and request.url.path.startswith("/v1/") and not authorized:
            response = error_response(401, "missing or wrong API key (Authorization: Bearer ...)")
        else:
            response = await call_next(request)
        response.headers["X-Request-Id"] = request_id
        self.metrics.count_response(request.url.path, response.status_code)
        return response

    async def prometheus(self) -> Response:
        return Response(self.metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    async def health(self) -> dict:
        return {
            "status": "ok",
            "tokenizer": {
                "source": self.prompts.source,
                "parity": self.prompts.parity,
                "segmented": self.prompts.local.segmented,
            },
            "decode": {d.address: _up(d.healthy) for d in self.orchestrator.decodes},
            "prefill": {p.url: _up(p.healthy) for p in self.orchestrator.prefills},
        }

    async def models(self) -> dict:
        card = {"id": self.model, "object": "model", "owned_by": "tandem",
                "max_model_len": self.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    async def completions(self, request: Request) -> Response:
        return await self._serve(Endpoint.COMPLETIONS, request)

    async def chat(self, request: Request) -> Response:
        return await self._serve(Endpoint.CHAT, request)

    async def _serve(self, endpoint: Endpoint, request: Request) -> Response:
        api_request = parse(endpoint, await request.body(), self.model)
        prompt_ids = await self._prompt_ids(api_request)
        generation = generation_request(api_request, prompt_ids, self.max_model_len)
        request_id = request.state.request_id
        events = self._events(generation, request_id, api_request.stops)
        try:  # admission, and failures before the first token, get an HTTP status
            first = await anext(events)
        except QueueFull as e:
            return error_response(429, str(e), headers={"Retry-After": str(RETRY_AFTER_S)})
        except BackendError as e:
            return error_response(e.status, str(e))
        events = _chain(first, events)
        response_id = f"{endpoint.id_prefix}-{request_id}"
        created = int(time.time())
        if api_request.stream:
            chunks = sse(events, endpoint, response_id, self.model, created,
                         api_request.include_usage)  # fmt: skip
            return StreamingResponse(chunks, media_type="text/event-stream")
        try:
            text, finish = await collect(events)
        except BackendError as e:
            return error_response(e.status, str(e))
        return JSONResponse(completion_body(endpoint, response_id, self.model, created, text,
                                            finish))  # fmt: skip

    async def _prompt_ids(self, request: ApiRequest) -> list[int]:
        try:
            if request.messages is not None:
                return await self.prompts.chat(request.messages)
            if request.text is not None:
                return await self.prompts.text(request.text)
        except BackendError as e:  # tokenized by a prefill that refused or failed
            raise RequestError(e.status, str(e)) from None
        return request.token_ids

    async def _events(
        self, generation: GenerationRequest, request_id: str, stops: Sequence[str]
    ) -> AsyncIterator[str | Finished]:
        """The request's text events, holding a slot of the limiter throughout: QueueFull at
        the first step when there is none."""
        with self.limiter.slot():
            timer = RequestTimer(self.metrics)
            tokens = timer.timed(self.orchestrator.generate(generation, request_id))
            detok = IncrementalDetokenizer(self.prompts.local.tokenizer, generation.prompt_ids)
            events = text_events(tokens, detok, len(generation.prompt_ids), stops)
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


async def _refused(request: Request, error: RequestError) -> JSONResponse:
    return error_response(error.status, str(error), error.param)


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    async with contextlib.aclosing(rest):
        yield first
        async for item in rest:
            yield item


def _up(healthy: bool) -> str:
    return "up" if healthy else "down"
