"""The one fake of each interface the router's tests need: FakePrefill (a PrefillClient),
FakeDecode (a DecodeClient) and CharTokenizer (the slice of a Hugging Face tokenizer the router
uses). Each records what it was asked and answers as scripted; unscripted calls succeed. Router:
the HTTP app over them, in-process."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass

import grpc
import httpx

from prefill.ticket import KvTransfer
from proto.tandem.v1 import decode_pb2, layout_pb2
from router.clients import PrefillCallError, PrefillReply
from router.openai_api import create_app
from router.orchestrator import Orchestrator
from router.prompts import PromptTokenizer
from router.requests import ServedModel
from router.tokenization import SegmentTokenizer


def ids(text: str) -> list[int]:
    """CharTokenizer's token ids of `text` (one per character: its code point)."""
    return [ord(c) for c in text]


class CharTokenizer:
    """One token per character, its code point; no special tokens. Chat: "role: content" lines,
    then "assistant: " as the generation prompt."""

    all_special_tokens = ()

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": ids(text)}

    def decode(self, token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(map(chr, token_ids))

    def apply_chat_template(
        self, messages, tokenize=False, add_generation_prompt=True, tools=None, **variables
    ) -> str:
        """Tools, as "tools: name, ..." first; template variables are ignored."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if tools:
            text = f"tools: {', '.join(t['function']['name'] for t in tools)}\n{text}"
        return text + ("assistant: " if add_generation_prompt else "")


def answer(status: int, json: dict | None = None) -> PrefillReply:
    """An HTTP answer from a prefill instance."""
    return PrefillReply(status, json, str(json) if json is not None else f"status {status}")


def refused() -> PrefillCallError:
    """A prefill instance that cannot be connected to (nothing was sent)."""
    return PrefillCallError("ConnectError('connection refused')", sent=False, down=True)


def dropped() -> PrefillCallError:
    """A prefill instance whose connection broke after the request was sent."""
    return PrefillCallError("ReadError('connection reset')", sent=True, down=True)


@dataclass(frozen=True)
class Prefilled:
    url: str
    prompt_ids: list[int]
    transfer: KvTransfer
    """The ticket as the prefill parses it from kv_transfer_params."""
    sampling: decode_pb2.SamplingParams
    structured: decode_pb2.StructuredOutput | None = None
    n: int = 1


class FakePrefill:
    """A PrefillClient. `script(url, ...)` queues the answers (PrefillReply) and failures
    (PrefillCallError, raised) of that instance's next calls; unscripted, `complete` answers
    200 with `first_token` (or, if `stall`, waits until cancelled: `prefilling` is set once it
    waits), `tokenize` 200 with `tokens`, `health` with `up[url]` (True)."""

    def __init__(self) -> None:
        self.first_token = 7
        self.tokens = [1, 2, 3]
        self.up: dict[str, bool] = defaultdict(lambda: True)
        self.calls: list[tuple[str, str]] = []
        """(method, url) of every call, in order."""
        self.prefilled: list[Prefilled] = []
        self.stall = False
        self.prefilling = asyncio.Event()
        self.gate: asyncio.Event | None = None
        """When set: `complete` answers only once the event is set."""
        self._script: dict[str, list[PrefillReply | PrefillCallError]] = defaultdict(list)

    def script(self, url: str, *outcomes: PrefillReply | PrefillCallError) -> None:
        self._script[url].extend(outcomes)

    async def complete(
        self, url, prompt_ids, transfer_params, sampling, structured=None, n=1
    ) -> PrefillReply:
        self.calls.append(("complete", url))
        prefilled = Prefilled(url, prompt_ids, KvTransfer.parse(transfer_params), sampling,
                              structured, n)  # fmt: skip
        self.prefilled.append(prefilled)
        if self.stall:
            self.prefilling.set()
            await asyncio.Event().wait()
        if self.gate is not None:
            await self.gate.wait()
        choices = []
        for index in range(n):  # choice i's first token: first_token + i
            token = self.first_token + index
            choice = {"index": index, "text": chr(token), "token_ids": [token],
                      "finish_reason": "length"}  # fmt: skip
            if sampling.HasField("logprobs"):
                choice["logprobs"] = vllm_logprobs(token, sampling.logprobs)
            if sampling.HasField("prompt_logprobs"):
                top_n = sampling.prompt_logprobs
                choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_ids, top_n)
            choices.append(choice)
        reply = {"choices": choices, "kv_transfer_params": {"first_token_id": self.first_token}}
        timed = PrefillReply(200, reply, str(reply), {"queue": 0.2, "forward": 3.0, "send": 1.0})
        return self._next(url) or timed

    async def tokenize(self, url: str, body: dict) -> PrefillReply:
        self.calls.append(("tokenize", url))
        return self._next(url) or answer(200, {"tokens": self.tokens, "count": len(self.tokens)})

    async def health(self, url: str) -> bool:
        self.calls.append(("health", url))
        return self.up[url]

    async def close(self) -> None:
        pass

    def _next(self, url: str) -> PrefillReply | None:
        if not self._script[url]:
            return None
        outcome = self._script[url].pop(0)
        if isinstance(outcome, PrefillCallError):
            raise outcome
        return outcome


def logprob_of(token_id: int) -> decode_pb2.TokenLogprobs:
    """The fakes' log-probabilities of `token_id` (sampled, not the most likely): -1 - its
    value / 1024 (exact in float32); the likelier alternatives are the two tokens after it."""
    return decode_pb2.TokenLogprobs(logprob=-1 - token_id / 1024,
                                    top_token_ids=[token_id + 1, token_id + 2],
                                    top_logprobs=[-0.25, -0.5])  # fmt: skip


def prompt_logprob_of(token_id: int, top_n: int) -> decode_pb2.TokenLogprobs:
    """logprob_of(token_id) as a prompt token's: ranked 3rd, `top_n` alternatives."""
    lp = logprob_of(token_id)
    return decode_pb2.TokenLogprobs(logprob=lp.logprob, rank=3,
                                    top_token_ids=lp.top_token_ids[:top_n],
                                    top_logprobs=lp.top_logprobs[:top_n])  # fmt: skip


def vllm_prompt_logprobs(prompt_ids: list[int], top_n: int) -> list:
    """prompt_logprob_of each prompt token but the first, as vLLM's `prompt_logprobs`."""
    field: list = [None]
    for token in prompt_ids[1:]:
        lp = prompt_logprob_of(token, top_n)
        entry = {str(token): {"logprob": lp.logprob, "rank": 3, "decoded_token": chr(token)}}
        for rank, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
            entry[str(t)] = {"logprob": v, "rank": rank, "decoded_token": chr(t)}
        field.append(entry)
    return field


def vllm_logprobs(token_id: int, top_n: int) -> dict:
    """logprob_of(token_id), cut to `top_n` alternatives, as vLLM's completions write it for
    a request with return_tokens_as_token_ids."""
    lp = logprob_of(token_id)
    top = {f"token_id:{t}": v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
    top = dict(list(top.items())[:top_n]) | {f"token_id:{token_id}": lp.logprob}
    return {"tokens": [f"token_id:{token_id}"], "token_logprobs": [lp.logprob],
            "top_logprobs": [top], "text_offset": [0]}  # fmt: skip


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeDecode:
    """A DecodeClient. Reserve hands out a ticket; Generate streams `tokens` for each choice
    (one message per list and choice; with logprobs when asked: the first token's as the
    request carries them, the others' `logprob_of`; a local_prefill's all `logprob_of`, and
    its prompt's `prompt_logprob_of` on choice 0's first message when asked), then,
    in this order of precedence: waits until cancelled if `stall`, raises `stream_error` if set,
    finishes each choice with `finish` if set, else just ends. `fail(rpc, address, error)` makes
    that RPC's next call on that address raise; addresses in `unavailable` answer every RPC with
    UNAVAILABLE; those in `draining` say so in Stats.

    `live()` is the leak check: reservations the fake's server side still holds (neither
    generated to the end of the stream, failed, nor aborted)."""

    def __init__(self) -> None:
        self.tokens: list[list[int]] = [ids("P"), ids("ar"), ids("is")]
        self.finish: int | None = decode_pb2.FINISH_REASON_LENGTH
        self.stall = False
        self.stream_error: grpc.aio.AioRpcError | None = None
        self.unavailable: set[str] = set()
        self.draining: set[str] = set()
        self.max_model_len = 0
        """What Stats reports."""
        self.instance_id = "decode-instance-1"
        """What Stats reports of every address."""
        self.prefix_caching = False
        """What Stats reports of every address, with 16-token blocks, 1,000 of them."""
        self.reserve_gate: asyncio.Event | None = None
        """When set: Reserve answers only once the event is set."""
        self.reserving = asyncio.Event()
        """Set once a Reserve has reserved (its answer then waits on `reserve_gate`, if set)."""
        self.generating = asyncio.Event()
        """Set once a Generate stream has sent its tokens."""
        self.calls: list[tuple[str, str, object]] = []
        """(rpc, address, request) of every call, in order."""
        self.reserved: dict[str, str] = {}
        """request id -> address of every reservation."""
        self.ended: set[str] = set()
        self._errors: dict[tuple[str, str], list[grpc.aio.AioRpcError]] = defaultdict(list)
        self._generation = 0

    def fail(self, rpc: str, address: str, error: grpc.aio.AioRpcError) -> None:
        self._errors[rpc, address].append(error)

    def live(self) -> set[str]:
        return set(self.reserved) - self.ended

    def aborts(self) -> list[decode_pb2.AbortRequest]:
        return [request for rpc, _, request in self.calls if rpc == "Abort"]

    async def reserve(self, address, request) -> decode_pb2.ReserveResponse:
        self._call("Reserve", address, request)
        self._generation += 1
        # The server's side is done here; only its answer waits on the gate.
        self.reserved[request.request_id] = address
        self.reserving.set()
        if self.reserve_gate is not None:
            await self.reserve_gate.wait()
        ticket = decode_pb2.Ticket(
            request_id=request.request_id,
            generation=self._generation,
            num_tokens=len(request.prompt_token_ids),
            shards=[decode_pb2.KvShard(rank=0)],
            num_senders=request.num_senders,
        )
        return decode_pb2.ReserveResponse(ticket=ticket)

    async def generate(self, address, request):
        local = request.HasField("local_prefill")
        if local:  # no Reserve came: the server holds the request from this call on
            self.reserved[request.request_id] = address
        try:
            self._call("Generate", address, request)
        except grpc.aio.AioRpcError:
            self.ended.add(request.request_id)
            raise
        starts = [request.first_token_logprobs,
                  *(c.first_token_logprobs for c in request.other_choices)]  # fmt: skip
        if local:  # every token's logprobs are the server's own
            starts = [None] * (request.local_prefill.n or 1)
        for position, token_ids in enumerate(self.tokens):
            for index, first_logprobs in enumerate(starts):  # the choices' messages interleave
                message = decode_pb2.GenerateResponse(token_ids=token_ids, index=index)
                if request.sampling.HasField("logprobs"):
                    message.logprobs.extend(logprob_of(t) for t in token_ids)
                    if position == 0 and first_logprobs is not None:
                        message.logprobs[0].CopyFrom(first_logprobs)
                asks = request.sampling.HasField("prompt_logprobs")
                if local and asks and position == index == 0:
                    prompt = request.local_prefill.prompt_token_ids
                    top_n = request.sampling.prompt_logprobs
                    message.prompt_logprobs.extend(prompt_logprob_of(t, top_n) for t in prompt[1:])
                yield message
        self.generating.set()
        if self.stall:
            await asyncio.Event().wait()
        self.ended.add(request.request_id)  # however the stream ends now, the server is done
        if self.stream_error is not None:
            raise self.stream_error
        if self.finish is not None:
            completion = sum(map(len, self.tokens))
            usage = decode_pb2.Usage(prompt_tokens=0, completion_tokens=completion)
            for index in range(len(starts)):
                yield decode_pb2.GenerateResponse(finish_reason=self.finish, usage=usage,
                                                  index=index)  # fmt: skip

    async def abort(self, address, request) -> decode_pb2.AbortResponse:
        self._call("Abort", address, request)
        if not request.choices:  # stopping some choices leaves the request live
            self.ended.add(request.request_id)
        return decode_pb2.AbortResponse(aborted=True)

    async def stats(self, address) -> decode_pb2.StatsResponse:
        self._call("Stats", address, decode_pb2.StatsRequest())
        return decode_pb2.StatsResponse(
            max_model_len=self.max_model_len,
            draining=address in self.draining,
            instance_id=self.instance_id,
            prefix_caching=self.prefix_caching,
            layout=layout_pb2.LayoutDescriptor(block_size=16),
            kv_blocks_total=1000,
        )

    async def close(self) -> None:
        pass

    def _call(self, rpc: str, address: str, request) -> None:
        self.calls.append((rpc, address, request))
        if address in self.unavailable:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{address} is down")
        if self._errors[rpc, address]:
            raise self._errors[rpc, address].pop(0)


def cancel_once(event: asyncio.Event, generation) -> None:
    """Runs the coroutine `generation` until a fake sets `event` (`prefilling`, `generating`),
    cancels it there, and checks that it ended cancelled."""

    async def run() -> None:
        task = asyncio.create_task(generation)
        await event.wait()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return
        raise AssertionError("the generation ended without being cancelled")

    asyncio.run(run())


MODEL = "tiny"
P0, D0 = "http://prefill-0:8100", "decode-0:50051"


class Router:
    """An app over the fakes, and an HTTP client for it."""

    def __init__(self, api_key: str | None = None, max_queue: int = 0) -> None:
        self.prefill, self.decode = FakePrefill(), FakeDecode()
        self.orchestrator = Orchestrator([P0], [D0], self.prefill, self.decode)
        self.prompts = PromptTokenizer(SegmentTokenizer(CharTokenizer()), self.orchestrator)
        served = ServedModel(MODEL, max_model_len=64, vocab_size=0x110000)  # code points
        self.app = create_app(self.orchestrator, self.prompts, served, api_key, max_queue)
        transport = httpx.ASGITransport(self.app)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://r")

    async def post(self, path: str, body: dict, **kwargs) -> httpx.Response:
        return await self.client.post(path, json=body, **kwargs)
