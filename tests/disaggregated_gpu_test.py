"""The disaggregated path on CUDA: decode server (Triton attention, CUDA graphs, fused ops) and
prefill server on the GPU, KV moved VRAM to VRAM by NIXL, against one engine on the same GPU:
for the Llama family (K and V planes) and the DeepSeek-V3 family (one latent plane a layer,
Triton MLA decode and fused MoE).

Tagged `gpu`: `./bazelw test --config=gpu //tests:disaggregated_gpu_test` on a CUDA machine, or
there without Bazel: `PYTHONPATH=.devicepack:. python3 -m pytest tests/disaggregated_gpu_test.py`.
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from prefill.ticket import transfer_params
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from tests.servers import start

OPTIONS = ["--device", "cuda", "--dtype", "float32", "--block-size", "16"]
# The prefill takes 128 tokens a forward: the last prompt's last chunk is one token, alone a
# decode step, which replays a CUDA graph there and sends its layers once it is done.
CHUNK = 128
PROMPTS = [[5, 17, 3, 99, 4], list(range(1, 200)), [7] * 33, list(range(2, 3 + CHUNK))]
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=["random:tiny", "random:deepseek-tiny"])
def stack(request):
    model = request.param
    args = ["--model", model, *OPTIONS]
    decode, m = start(
        ["decode.server", *args, "--transport", "nixl", "--kv-cache-gb", "0.05"],
        r"serving gRPC on [\d.]+:(\d+)",
        timeout=300,
    )
    address = f"127.0.0.1:{m.group(1)}"
    chunked = ["--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "8"]
    prefill, m = start(
        ["prefill.server", *args, "--transport", "nixl", "--kv-cache-gb", "0.05", "--port", "0",
         *chunked],
        r"serving on (http://[\d.:]+)",
        timeout=300,
    )  # fmt: skip
    channel = grpc.insecure_channel(address)
    stub = decode_pb2_grpc.DecodeServiceStub(channel)
    yield stub, httpx.Client(base_url=m.group(1)), address, model
    channel.close()
    for proc in (prefill, decode):
        proc.terminate()
        proc.wait(timeout=30)


def test_tokens_equal_one_engine_on_the_same_gpu(stack):
    stub, http, address, model = stack
    engine = LLMEngine.build(
        EngineConfig(model=model, device="cuda", dtype="float32", block_size=16,
                     kv_cache_gb=0.05)
    )  # fmt: skip
    for i, prompt in enumerate(PROMPTS):
        [expected] = engine.generate(
            [prompt], SamplingParams(), StopConditions(max_tokens=NEW_TOKENS, ignore_eos=True)
        )
        ticket = stub.Reserve(decode_pb2.ReserveRequest(
            request_id=f"g{i}", prompt_token_ids=prompt, num_senders=1,
            max_tokens=NEW_TOKENS), timeout=30).ticket  # fmt: skip
        assert ticket.shards[0].layers[0].k.is_gpu
        params = transfer_params(ticket, address)
        reply = http.post("/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 1, "kv_transfer_params": params})  # fmt: skip
        assert reply.status_code == 200, reply.text
        first = reply.json()["kv_transfer_params"]["first_token_id"]
        stream = stub.Generate(decode_pb2.GenerateRequest(
            request_id=f"g{i}", generation=ticket.generation, first_token_id=first,
            max_tokens=NEW_TOKENS, ignore_eos=True), timeout=120)  # fmt: skip
        assert [t for m in stream for t in m.token_ids] == expected
    stats = stub.Stats(decode_pb2.StatsRequest())
    assert stats.kv_blocks_free == stats.kv_blocks_total
