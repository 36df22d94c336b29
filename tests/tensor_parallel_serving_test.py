"""Tensor parallelism in the served stack, with real processes on the CPU (gloo): a tiny random
Llama of 8 heads and 4 KV heads with SmolLM2's tokenizer, as a Hugging Face folder.
- tandem's prefill at TP 1 and 2 -> router -> decode at TP 1, 2 and 4 (P1->D2, P2->D1, P2->D2,
  P2->D4): each prefill rank writes the heads it holds into the decode ranks holding them and
  commits for itself (the TP 2 prefill chunkwise: a prompt of several 16-token chunks goes
  a chunk's blocks at a time from every rank); greedy completions (n=1, and n=2, whose second
  choice copies a partial block on every decode rank) equal one engine at TP 1; each sender
  rank's bytes counted under its rank; every block free afterwards.
- an MLA/MoE model (latent replicated on every rank): tandem's prefill at TP 1 and 2 (rank 0
  sends the latent) into decode at TP 2 (each rank receives it whole) equals one engine.
- 2 KV heads over 4 ranks (each head replicated on two): the first prefill rank of each pair
  sends it, to both decode ranks that hold it; output equal to one engine.
- a prefill rank killed mid-prefill: the request fails naming it, and the decode server has
  every block back within the ticket's deadline.
- a decode rank killed mid-stream: the client's stream ends with an error within 5 s, the
  server reports not serving, the next request fails fast instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from transformers import AutoTokenizer

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from prefill.vllm_launch import free_port
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from tests.servers import counter, decode_pool_free, stop
from tests.tiny_folders import write_tiny_kv4, write_tiny_mla
from tools.launch import start

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:",
    "Count with me: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve,"
    " thirteen, fourteen, fifteen, sixteen, seventeen",
]
MAX_TOKENS = 12
TRANSFER_TIMEOUT_S = 5
ARGS = ["--dtype", "float32", "--block-size", "16", "--kv-cache-gb", "0.05",
        "--transfer-timeout", str(TRANSFER_TIMEOUT_S)]  # fmt: skip
ROUTES = [(1, 2), (2, 1), (2, 2), (2, 4)]
"""(prefill TP, decode TP): each prefill rank writes its heads into the decode ranks that hold
them."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_kv4(tmp_path_factory.mktemp("tiny-kv4"))


@pytest.fixture(scope="module")
def stack(folder):
    """Prefills at TP 1 and 2, decodes at TP 1, 2 and 4, over tcp; a router per route
    (prefill TP, decode TP) of ROUTES."""
    model = ["--model", str(folder), *ARGS, "--transport", "tcp"]
    procs, decodes, prefills, prefill_procs, routes = [], {}, {}, {}, {}
    try:
        for tp in (1, 2, 4):
            proc, m = start(
                ["decode.server", *model, "--tensor-parallel-size", str(tp), "--grpc-port", "0",
                 "--metrics-port", "0"],
                r"serving gRPC on [\d.]+:(\d+), metrics on :(\d+)",
            )  # fmt: skip
            procs.append(proc)
            decodes[tp] = (
                proc,
                f"127.0.0.1:{m.group(1)}",
                f"http://127.0.0.1:{m.group(2)}/metrics",
            )
        for tp, kv_send in ((1, "layerwise"), (2, "chunkwise")):
            proc, m = start(
                ["prefill.server", *model, "--tensor-parallel-size", str(tp), "--port", "0",
                 "--max-num-batched-tokens", "16", "--max-num-seqs", "8", "--kv-send", kv_send],
                r"serving on (http://[\d.:]+)",
            )  # fmt: skip
            procs.append(proc)
            prefills[tp] = m.group(1)
            prefill_procs[tp] = proc
        for p_tp, d_tp in ROUTES:
            proc, m = start(
                ["router.server", "--model", str(folder), "--served-model-name", "tiny-kv4",
                 "--port", "0", "--prefill", prefills[p_tp], "--decode", decodes[d_tp][1],
                 "--no-decode-only-fallback"],
                r"serving on (http://[\d.:]+)",
            )  # fmt: skip
            procs.append(proc)
            routes[p_tp, d_tp] = m.group(1)
        yield {"routes": routes, "decodes": decodes, "prefill_procs": prefill_procs}
    finally:
        stop(*reversed(procs))


@pytest.fixture(scope="module")
def reference(folder) -> list[str]:
    """Greedy texts of one engine at TP 1."""
    return _one_engine(folder)


def _complete(url: str, prompt: str, n: int = 1, max_tokens: int = MAX_TOKENS, **extra):
    body = {"model": "tiny-kv4", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "n": n, **extra}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"prefill-tp{r[0]}-decode-tp{r[1]}")
def test_greedy_output_equals_one_engine_whatever_the_tp_sizes(stack, reference, route):
    url = stack["routes"][route]
    _, address, metrics = stack["decodes"][route[1]]
    sent = {r: _sent_bytes(metrics, r) for r in (0, 1)}
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        reply = _complete(url, prompt)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
    # Both choices of n=2 (the prompt's partial last block copied on each decode rank); top_k
    # 1: both greedy.
    reply = _complete(url, PROMPTS[0], n=2, temperature=1.0, top_k=1)
    assert reply.status_code == 200, reply.text
    assert [c["text"] for c in reply.json()["choices"]] == [reference[0]] * 2
    # Every prefill rank sent its heads and committed for itself.
    for rank in range(route[0]):
        assert _sent_bytes(metrics, rank) > sent[rank], rank
    assert decode_pool_free(address) is not None


def _sent_bytes(metrics: str, rank: int) -> float:
    return counter(metrics, f'tandem_decode_transfer_bytes_total{{sender_rank="{rank}"}}')


@pytest.fixture(scope="module")
def mla_stack(tmp_path_factory):
    """An MLA/MoE model: prefills at TP 1 and 2 (rank 0 sends the latent, which every rank
    holds whole) -> routers -> one decode server at TP 2 (each rank gets the whole latent)."""
    folder = write_tiny_mla(tmp_path_factory.mktemp("tiny-mla"))
    model = ["--model", str(folder), *ARGS, "--transport", "tcp"]
    procs, urls = [], {}
    try:
        decode, m = start(
            ["decode.server", *model, "--tensor-parallel-size", "2", "--grpc-port", "0",
             "--metrics-port", "0"],
            r"serving gRPC on [\d.]+:(\d+), metrics on :(\d+)",
        )  # fmt: skip
        procs.append(decode)
        address, metrics = f"127.0.0.1:{m.group(1)}", f"http://127.0.0.1:{m.group(2)}/metrics"
        for tp in (1, 2):
            prefill, m = start(
                ["prefill.server", *model, "--tensor-parallel-size", str(tp), "--port", "0"],
                r"serving on (http://[\d.:]+)",
            )  # fmt: skip
            router, r = start(
                ["router.server", "--model", str(folder), "--served-model-name", "tiny-mla",
                 "--port", "0", "--prefill", m.group(1), "--decode", address,
                 "--no-decode-only-fallback"],
                r"serving on (http://[\d.:]+)",
            )  # fmt: skip
            procs += [prefill, router]
            urls[tp] = r.group(1)
        yield folder, urls, address, metrics
    finally:
        stop(*reversed(procs))


def test_mla_moe_through_tp2_prefill_and_decode_equals_one_engine(mla_stack):
    folder, urls, address, metrics = mla_stack
    expected = _one_engine(folder)
    for tp, url in urls.items():
        for prompt, text in zip(PROMPTS, expected, strict=True):
            body = {"model": "tiny-mla", "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == text, tp
    assert _sent_bytes(metrics, 0) > 0 and _sent_bytes(metrics, 1) == 0  # one latent sender
    assert decode_pool_free(address) is not None


def test_kv_heads_replicated_over_ranks_are_sent_once_and_received_by_each(tmp_path):
    # 2 KV heads, prefill and decode at TP 4: each head lives on two ranks of each; the first
    # prefill rank of each pair sends it (sender ranks 0 and 1), to both decode ranks holding it.
    folder = write_tiny_kv4(tmp_path / "kv2", num_kv_heads=2)
    with _stack(folder, "--tensor-parallel-size", "4") as (url, address, metrics):
        reply = _complete(url, PROMPTS[0])
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == _one_engine(folder)[0]
        assert _sent_bytes(metrics, 0) > 0 and _sent_bytes(metrics, 1) > 0
        assert _sent_bytes(metrics, 2) == 0  # two senders: one per distinct head
        assert decode_pool_free(address) is not None


@pytest.mark.parametrize("method", ["draft_model", "mtp"])
def test_a_proposer_through_tp2_prefill_and_decode_equals_one_engine(
    folder, reference, tmp_path, method
):
    # The proposer runs whole on rank 0 of each server, its KV cache there: the model drafting
    # for itself (every proposal accepted), or an MLA model's MTP layer. The prefill's rank 0
    # computes the proposer's prompt KV and sends it into the decode's rank 0, whose proposals
    # the decode ranks verify together.
    if method == "mtp":
        folder = write_tiny_mla(tmp_path, mtp=True)
        reference = _one_engine(folder)
        spec = {"method": "mtp", "num_speculative_tokens": 2}
    else:
        spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
    args = ("--tensor-parallel-size", "2", "--speculative-config", json.dumps(spec))
    with _stack(folder, *args) as (url, address, metrics):
        for prompt, expected in zip(PROMPTS, reference, strict=True):
            reply = _complete(url, prompt)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == expected
        drafted = counter(metrics, "tandem_decode_spec_draft_tokens_total")
        assert drafted > 0
        if method == "draft_model":
            assert counter(metrics, "tandem_decode_spec_accepted_tokens_total") == drafted
        assert decode_pool_free(address) is not None


@contextlib.contextmanager
def _stack(folder: Path, *args: str):
    """A decode server and a prefill of `folder`, both with `args`, over tcp, and a router in
    front: (the router's URL, the decode server's address, its metrics URL)."""
    model = ["--model", str(folder), *ARGS, "--transport", "tcp", *args]
    procs = []
    try:
        decode, m = start(
            ["decode.server", *model, "--grpc-port", "0", "--metrics-port", "0"],
            r"serving gRPC on [\d.]+:(\d+), metrics on :(\d+)",
        )  # fmt: skip
        procs.append(decode)
        address, metrics = f"127.0.0.1:{m.group(1)}", f"http://127.0.0.1:{m.group(2)}/metrics"
        prefill, m = start(["prefill.server", *model, "--port", "0"], r"serving on (http://\S+)")
        procs.append(prefill)
        router, m = start(
            ["router.server", "--model", str(folder), "--served-model-name", "tiny-kv4",
             "--port", "0", "--prefill", m.group(1), "--decode", address,
             "--no-decode-only-fallback"],
            r"serving on (http://[\d.:]+)",
        )  # fmt: skip
        procs.append(router)
        yield m.group(1), address, metrics
    finally:
        stop(*reversed(procs))


def _one_engine(folder: Path) -> list[str]:
    """Greedy texts of one engine at TP 1, without speculation."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = LLMEngine.build(EngineConfig(model=str(folder), dtype="float32", block_size=16))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    stop_at = StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [tokenizer.decode(out) for out in engine.generate(prompts, SamplingParams(), stop_at)]


def test_tools_serve_runs_the_stack_tensor_parallel(folder, reference):
    proc, m = start(
        ["tools.serve", "--model", str(folder), "--decode-tp", "2", "--prefill-tp", "2",
         "--kv-cache-gb", "0.05", "--port", str(free_port("127.0.0.1"))],
        r"tandem ready: (http://\S+)",
    )  # fmt: skip
    try:
        body = {"model": folder.name, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        reply = httpx.post(f"{m.group(1)}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == reference[0]
    finally:
        stop(proc)


def test_a_prefill_rank_killed_mid_prefill_fails_the_request_and_frees_the_decode_blocks(stack):
    # After the routes' test: it leaves the TP 2 prefill failed.
    url, (_, address, metrics) = stack["routes"][2, 1], stack["decodes"][1]
    long_prompt = list(range(1000, 2800))  # 113 steps of 16-token chunks
    body = {"model": "tiny-kv4", "prompt": long_prompt, "max_tokens": 4, "temperature": 0}
    replies: list[httpx.Response] = []
    request = threading.Thread(
        target=lambda: replies.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))
    )
    request.start()
    deadline = time.monotonic() + 10
    while counter(metrics, "tandem_decode_reserved") == 0:  # reserved: the prefill follows
        assert time.monotonic() < deadline, "never reserved"
        time.sleep(0.005)
    _kill(_child(stack["prefill_procs"][2].pid))
    request.join(timeout=TRANSFER_TIMEOUT_S + 10)
    assert replies and replies[0].status_code >= 500, replies
    assert "tensor-parallel rank 1" in replies[0].text
    # Blocks back within the ticket's deadline (and the quarantine's grace after it).
    assert decode_pool_free(address, within=TRANSFER_TIMEOUT_S + 2) is not None


def test_a_decode_rank_killed_mid_stream_ends_the_stream_and_the_server_serves_no_more(stack):
    # Last in this module: it leaves the decode server failed.
    decode, address, _ = stack["decodes"][2]
    rank = _child(decode.pid)
    body = {"model": "tiny-kv4", "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    killed, chunks, error = [], 0, None
    url = stack["routes"][1, 2]
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += 1
            if "error" in json.loads(line[6:]):
                error = json.loads(line[6:])["error"]
            if chunks == 5:
                threading.Thread(target=lambda: killed.append(_kill(rank))).start()
    assert error is not None and "tensor-parallel rank 1" in error["message"], error
    assert time.monotonic() - killed[0] < 5
    stub = decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(address))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Stats(decode_pb2.StatsRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    started = time.monotonic()
    assert _complete(url, PROMPTS[1]).status_code == 503
    assert time.monotonic() - started < 10


def _child(pid: int) -> int:
    """The one child process of `pid` (the decode server's rank 1)."""
    children = subprocess.run(
        ["pgrep", "-P", str(pid)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(children) == 1, children
    return int(children[0])


def _kill(pid: int) -> float:
    subprocess.run(["kill", "-9", str(pid)], check=True)
    return time.monotonic()
