"""A fake OpenAI streaming server for the benchmark client's tests (httpx.MockTransport: no
socket)."""

from __future__ import annotations

import asyncio
import io
import json

import httpx

from tools.bench.datasets import Endpoint
from tools.bench.progress import Progress
from tools.bench.runner import Load, RunResult, run, warm_up


class FakeServer:
    """An OpenAI streaming endpoint: replies `max_tokens` chunks "w0 w1 ..." with usage, and
    fails with 500 the requests whose `fail(body)` is true. Records every request body."""

    def __init__(self, fail=lambda body: False) -> None:
        self.bodies: list[dict] = []
        self._fail = fail

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if self._fail(body):
            return httpx.Response(500, json={"error": {"message": "boom"}})
        n = body["max_tokens"]
        chat = request.url.path == Endpoint.CHAT.value
        pieces = [
            {"delta": {"content": f"w{i} "}} if chat else {"text": f"w{i} "} for i in range(n)
        ]
        events = [{"choices": [piece]} for piece in pieces]
        events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async def serve(self, conversations, load: Load, warmups: int = 0) -> RunResult:
        """The benchmark's runner, its requests answered here."""
        transport = httpx.MockTransport(self.handle)
        async with httpx.AsyncClient(base_url="http://fake", transport=transport) as http:
            progress = Progress(sum(len(c.turns) for c in conversations), out=io.StringIO())
            await warm_up(http, conversations, {"model": "m"}, warmups)
            return await run(http, conversations, load, {"model": "m"}, progress)

    def run(self, conversations, load: Load, warmups: int = 0) -> RunResult:
        return asyncio.run(self.serve(conversations, load, warmups))
