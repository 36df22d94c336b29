"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (streaming or not),
/v1/models, /health. Bad input gets a 4xx with OpenAI's error body; parameters the stack cannot
honour are refused by name, never dropped."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from proto.tandem.v1 import decode_pb2
from router.detokenizer import IncrementalDetokenizer
from router.metrics import RequestTimer, RouterMetrics
from router.orchestrator import BackendError, Finished, GenerationRequest, Orchestrator
from router.prompts import PromptTokenizer

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
             "presence_penalty", "frequency_penalty")  # fmt: skip
_COMMON = {"model", "max_tokens", "stop", "stop_token_ids", "stream", "stream_options", "n",
           "ignore_eos", "min_tokens", "user", *_SAMPLING}  # fmt: skip
_COMPLETIONS = _COMMON | {"prompt"}
_CHAT = _COMMON | {"messages", "max_completion_tokens"}
MAX_BODY_BYTES = 8 * 1024 * 1024


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def create_app(
    orchestrator: Orchestrator,
    prompts: PromptTokenizer,
    model: str,
    max_model_len: int,
    api_key: str | None = None,
    max_queue: int = 0,
) -> FastAPI:
    """`max_queue` > 0: requests beyond that many in flight get 429 with Retry-After."""
    app = FastAPI(title="tandem router")
    hf = prompts.local.tokenizer
    metrics = RouterMetrics(orchestrator)

    @app.middleware("http")
    async def gate_and_count(request: Request, call_next):
        """API key (Bearer) on /v1/*, X-Request-Id in and out, request and error counts."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = request_id
        authorized = request.headers.get("authorization") == f"Bearer {api_key}"
        if api_key and request.url.path.startswith("/v1/") and not authorized:
            response = error_response(401, "missing or wrong API key (Authorization: Bearer ...)")
        else:
            response = await call_next(request)
        response.headers["X-Request-Id"] = request_id
        metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        if response.status_code >= 400:
            kind = "bad_request" if response.status_code < 500 else "backend"
            metrics.errors.labels(kind).inc()
        return response

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        return error_response(error.status, str(error), error.param)

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "tokenizer": {
                "source": prompts.source,
                "parity": prompts.parity,
                "segmented": prompts.local.segmented,
            },
            "decode": {d.address: "up" if d.healthy else "down" for d in orchestrator.decodes},
            "prefill": {p.url: "up" if p.healthy else "down" for p in orchestrator.prefills},
        }

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model,
            "object": "model",
            "owned_by": "tandem",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request, _COMPLETIONS)
        request_id = request.state.request_id
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await _tokenized(prompts.text(prompt))
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            prompt_ids = prompt
        else:
            raise RequestError(400, "prompt: a string or a non-empty list of token ids", "prompt")
        max_tokens = body.get("max_tokens", 16)
        return await _respond(body, prompt_ids, "text_completion", max_tokens, request_id)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request, _CHAT)
        request_id = request.state.request_id
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m
            for m in messages
        )):  # fmt: skip
            raise RequestError(400, "messages: a non-empty list of {role, content}", "messages")
        prompt_ids = await _tokenized(prompts.chat(messages))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        return await _respond(body, prompt_ids, "chat.completion", limit, request_id)

    async def _tokenized(ids) -> list[int]:
        try:
            return await ids
        except BackendError as e:  # tokenized by a prefill that refused or failed
            raise RequestError(e.status, str(e)) from None

    async def _body(request: Request, allowed: set[str]) -> dict:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise RequestError(413, f"body: {len(raw)} bytes, at most {MAX_BODY_BYTES}")
        try:
            body = json.loads(raw)
        except ValueError:
            raise RequestError(400, "body: not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError(400, "body: must be a JSON object")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise RequestError(400, f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])
        if body.get("model", model) != model:
            raise RequestError(404, f"model {body['model']!r} not found (serving {model!r})")
        if body.get("n", 1) != 1:
            raise RequestError(400, "n: only 1 is supported", "n")
        return body

    async def _respond(body: dict, prompt_ids: list[int], kind: str, max_tokens, request_id):
        generation = _generation(body, prompt_ids, max_tokens, max_model_len)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise RequestError(400, "stop: a string or a list of non-empty strings", "stop")
        if max_queue and metrics.active >= max_queue:
            response = error_response(429, f"{metrics.active} requests in flight, the limit")
            response.headers["Retry-After"] = "1"
            return response
        # NOTE: nothing awaits between this check and the generator's first step, which counts
        # the request as active: concurrent requests cannot all slip past the limit.
        events = _text_events(orchestrator, hf, generation, request_id, stops, metrics)
        request_id = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{request_id}"
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            try:  # failures before the first token still get an HTTP status
                first = await anext(events)
            except BackendError as e:
                return error_response(e.status, str(e))
            chunks = _sse(_chain(first, events), kind, request_id, model, include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        text, finish = [], None
        try:
            async for piece in events:
                if isinstance(piece, str):
                    text.append(piece)
                else:
                    finish = piece
        except BackendError as e:
            return error_response(e.status, str(e))
        return _whole(kind, request_id, model, "".join(text), finish)

    return app


def _generation(body: dict, prompt_ids: list[int], max_tokens, max_model_len: int):
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt_ids)
    if type(max_tokens) is not int or max_tokens < 1:
        raise RequestError(
            400, f"max_tokens: {max_tokens!r} must be a positive integer", "max_tokens"
        )
    if len(prompt_ids) + max_tokens > max_model_len:
        raise RequestError(
            400,
            f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceeds the context "
            f"length {max_model_len}",
            "max_tokens",
        )
    sampling = decode_pb2.SamplingParams()
    for name in _SAMPLING:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(400, f"{name}: {value!r} is not a number", name)
        if name in ("top_k", "seed") and (value != int(value) or value < 0):
            raise RequestError(400, f"{name}: {value!r} must be a non-negative integer", name)
        setattr(sampling, name, int(value) if name in ("top_k", "seed") else float(value))
    stop_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(type(t) is int for t in stop_ids)):
        raise RequestError(400, "stop_token_ids: a list of token ids", "stop_token_ids")
    min_tokens = body.get("min_tokens", 0)
    if type(min_tokens) is not int or not 0 <= min_tokens <= max_tokens:
        raise RequestError(400, f"min_tokens: {min_tokens!r} not in [0, max_tokens]", "min_tokens")
    return GenerationRequest(
        prompt_ids=list(prompt_ids),
        max_tokens=max_tokens,
        sampling=sampling,
        min_tokens=min_tokens,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


async def _text_events(
    orchestrator: Orchestrator,
    hf,
    request: GenerationRequest,
    request_id: str,
    stops: list[str],
    metrics: RouterMetrics,
) -> AsyncIterator[str | Finished]:
    """Text deltas, then a Finished; stop strings end the generation (and are not returned)."""
    detok = IncrementalDetokenizer(hf, request.prompt_ids)
    completion = 0
    held = ""  # text that could still be the start of a stop string
    stream = orchestrator.generate(request, request_id)
    timer = RequestTimer(metrics)
    metrics.in_flight.inc()
    metrics.active += 1
    try:
        async for item in stream:
            if not isinstance(item, Finished):
                timer.tokens_arrived(len(item))
            if isinstance(item, Finished):
                tail = held + detok.flush()
                if tail:
                    yield tail
                yield Finished(item.finish_reason, len(request.prompt_ids), completion)
                return
            completion += len(item)
            held += detok.add(item)
            for stop in stops:
                if stop in held:
                    if text := held[: held.index(stop)]:
                        yield text
                    yield Finished("stop", len(request.prompt_ids), completion)
                    return
            keep = max((len(s) - 1 for s in stops), default=0)
            if len(held) > keep:
                cut = len(held) - keep
                yield held[:cut]
                held = held[cut:]
    finally:
        metrics.active -= 1
        metrics.in_flight.dec()
        timer.done()
        await stream.aclose()  # a stop string or a gone client: abort on the decode server


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


async def _sse(events, kind: str, request_id: str, model: str, include_usage: bool):
    chunk_kind = "chat.completion.chunk" if kind.startswith("chat") else "text_completion"
    head = {"id": request_id, "object": chunk_kind, "created": int(time.time()), "model": model}
    first = True
    try:
        async for event in events:
            if isinstance(event, Finished):
                yield _event({**head, "choices": [_choice(kind, "", first, event.finish_reason)]})
                if include_usage:
                    yield _event({**head, "choices": [], "usage": _usage(event)})
                break
            yield _event({**head, "choices": [_choice(kind, event, first, None)]})
            first = False
    except BackendError as e:
        yield _event({"error": _error_body(e.status, str(e))["error"]})
    yield "data: [DONE]\n\n"


def _choice(kind: str, text: str, first: bool, finish: str | None) -> dict:
    if kind.startswith("chat"):
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _whole(kind: str, request_id: str, model: str, text: str, finish: Finished) -> dict:
    if kind.startswith("chat"):
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish.finish_reason}  # fmt: skip
    else:
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": finish.finish_reason}  # fmt: skip
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": _usage(finish)}  # fmt: skip


def _usage(finish: Finished) -> dict:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}  # fmt: skip


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, param), status_code=status)
