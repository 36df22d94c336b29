"""Models of other shapes than the bundled SmolLM2, served disaggregated over tcp (float32,
CPU): an MLA model (the random deepseek-tiny), whose layers' KV is one latent plane
("mla-latent") sent as one head of the latent width, a Llama and that model with fp8 weights
(the random tiny-fp8, deepseek-tiny-fp8), and a Llama with an fp8 KV cache on both sides (e4m3
bytes sent as they are). tandem's decode server and prefill server run in this process, driven
as the router drives them (Reserve -> POST /v1/completions with the ticket -> Generate).

Greedy tokens must equal one engine doing the whole request, for a prompt inside one block, one
over several and one the prefill computes in chunks; the commit counts the prompt's KV bytes and
the decode pool is all free afterwards. A sender describing another cache is refused at Hello,
naming both values.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from fastapi.testclient import TestClient

from decode.server import DecodeServerConfig
from engine import config as engine_config
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from prefill import ticket as ticket_module
from prefill.server import PrefillServer, PrefillServerConfig
from prefill.ticket import PREFILL_LAYOUT, layout_descriptor, transfer_params
from proto.tandem.v1 import decode_pb2
from tests.servers import decode_pool_free, serving_decode
from transport.config import KvTransportConfig

BLOCK = 16
CHUNK = 32
"""The prefill's token budget per forward: a longer prompt is prefilled in chunks."""
MODELS = {
    "mla": dict(model="random:deepseek-tiny"),
    "fp8": dict(model="random:tiny-fp8"),  # fp8 weights
    "mla_fp8": dict(model="random:deepseek-tiny-fp8"),  # and the experts' too
    "fp8_kv": dict(model="random:tiny", kv_cache_dtype="fp8"),  # an e4m3 KV cache, both sides
    "mla_fp8_kv": dict(model="random:deepseek-tiny", kv_cache_dtype="fp8"),  # e4m3 latents
}
LATENT = 32 + 8
"""deepseek-tiny's kv_lora_rank + qk_rope_head_dim."""
LAYERS = 3
PROMPTS = [
    [1, 17, 42, 99, 7, 3],  # inside one block
    list(range(10, 40)),  # two blocks
    [(7 * i) % 250 + 3 for i in range(50)],  # four blocks, prefilled in chunks of CHUNK
]
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=list(MODELS))
def engine_args(request):
    return dict(**MODELS[request.param], dtype="float32", block_size=BLOCK, kv_cache_gb=0.001)


@pytest.fixture(scope="module")
def decode(engine_args):
    kv = KvTransportConfig(backend="tcp", host="127.0.0.1")
    with serving_decode(DecodeServerConfig(EngineConfig(**engine_args), kv)) as served:
        yield served


@pytest.fixture(scope="module")
def prefill(engine_args):
    kv = KvTransportConfig(backend="tcp", host="127.0.0.1")
    engine = EngineConfig(**engine_args, max_num_batched_tokens=CHUNK, max_num_seqs=4)
    server = PrefillServer(PrefillServerConfig(engine, kv))
    yield server
    server.stop()


def test_the_descriptor_names_the_engines_cache_formats():
    assert ticket_module.KV_FORMAT_HND == engine_config.KV_FORMAT_HND
    assert ticket_module.KV_FORMAT_MLA_LATENT == engine_config.KV_FORMAT_MLA_LATENT


@pytest.mark.parametrize("engine_args", ["mla"], indirect=True)
@pytest.mark.parametrize(
    ("sender", "named"),
    [
        # deepseek-tiny's 4 query heads of RoPE width 8, as a per-head K/V cache would say.
        (dict(kv_format="hnd", num_kv_heads=4, head_dim=8),
         "kv_format: decode has 'mla-latent', sender has 'hnd'"),
        (dict(head_dim=LATENT + 8), f"head_dim (latent width): decode has {LATENT}, sender has 48"),
        (dict(kv_dtype="bfloat16"), "kv_dtype: decode has 'float32', sender has 'bfloat16'"),
    ],
)  # fmt: skip
def test_hello_refuses_another_cache_naming_both_values(decode, sender, named):
    fields = dict(
        model_name="deepseek-tiny", num_layers=LAYERS, num_kv_heads=1, head_dim=LATENT,
        kv_dtype="float32", block_size=BLOCK, layout=PREFILL_LAYOUT, transport="tcp",
        kv_format="mla-latent",
    )  # fmt: skip
    _assert_hello_refuses(decode[1], fields, sender, named)


def _assert_hello_refuses(stub, fields: dict, sender: dict, named: str) -> None:
    """Hello with `fields` changed by `sender` is refused naming `named`; with `fields` as
    they are, accepted."""
    layout = layout_descriptor(**{**fields, **sender})
    with pytest.raises(grpc.RpcError) as err:
        stub.Hello(decode_pb2.HelloRequest(sender_layout=layout, sender_id="test"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert named in err.value.details()
    accepted = layout_descriptor(**fields)
    stub.Hello(decode_pb2.HelloRequest(sender_layout=accepted, sender_id="test"), timeout=10)


@pytest.mark.parametrize("engine_args", ["fp8_kv"], indirect=True)
@pytest.mark.parametrize(
    ("sender", "named"),
    [
        (dict(kv_dtype="float32", kv_scale=0.0),
         "kv_dtype: decode has 'fp8_e4m3', sender has 'float32'"),
        (dict(kv_scale=0.5), "kv_scale: decode has 1.0, sender has 0.5"),
    ],
)  # fmt: skip
def test_hello_refuses_another_fp8_cache_naming_both_values(decode, sender, named):
    """An fp8 decode cache takes only fp8 KV of its own scale: bytes of another element type
    or scale would be misread, never converted."""
    fields = dict(
        model_name="tiny", num_layers=2, num_kv_heads=2, head_dim=16, kv_dtype="fp8_e4m3",
        kv_scale=1.0, block_size=BLOCK, layout=PREFILL_LAYOUT, transport="tcp",
    )  # fmt: skip
    _assert_hello_refuses(decode[1], fields, sender, named)


def test_disaggregated_greedy_equals_one_engine(engine_args, decode, prefill):
    server = decode[0]
    address = f"127.0.0.1:{server.port}"
    model = server.engine.model_config
    token_bytes = model.kv_bytes_per_token(server.engine.kv_cache.dtype)
    mla = model.mla is not None
    itemsize = 1 if engine_args.get("kv_cache_dtype") == "fp8" else 4
    assert token_bytes == (LAYERS * LATENT * itemsize if mla else 2 * 2 * 2 * 16 * itemsize)
    forwards = _record_forwards(prefill)
    outs = _serve(decode, prefill, PROMPTS, "r")
    assert forwards[-2:] == [[CHUNK], [len(PROMPTS[2]) - CHUNK]]  # the last prompt, chunked
    assert outs == _one_engine(engine_args, PROMPTS)
    assert decode_pool_free(address) is not None


def test_chunkwise_sends_each_chunks_blocks_as_computed(engine_args, decode):
    """--kv-send chunkwise: a prompt of two chunks and one token more goes in three pieces of
    every layer (each chunk's whole blocks as its forward computes them, then the rest), the
    layers counted once; every token's KV lands as the prefill computed it, greedy output
    equals one engine, the pool is free."""
    long = [(5 * i) % 250 + 3 for i in range(2 * CHUNK + 1)]
    kv = KvTransportConfig(backend="tcp", host="127.0.0.1")
    engine = EngineConfig(**engine_args, max_num_batched_tokens=CHUNK, max_num_seqs=4)
    prefill = PrefillServer(PrefillServerConfig(engine, kv, kv_send="chunkwise"))
    try:
        forwards, posts, sources = _record_forwards(prefill), [], {}
        post = prefill.sender.post

        def recording_post(session, build, ready=None, completes_layer=None):
            posts.append(completes_layer)
            sources[session.ticket.request_id] = build.args[-1]  # the piece's source blocks
            return post(session, build, ready, completes_layer)

        def landed(ticket):
            n, src_blocks = ticket.num_tokens, sources[ticket.request_id]
            src, dst = prefill.engine.kv_cache.kv_caches, decode[0].engine.kv_cache.kv_caches
            for src_planes, dst_planes in zip(src, dst, strict=True):
                for a, b in zip(src_planes, dst_planes, strict=True):
                    assert torch.equal(_rows(a, src_blocks, n), _rows(b, ticket.block_ids, n))

        prefill.sender.post = recording_post
        outs = _serve(decode, prefill, [long, PROMPTS[0]], "c", landed)
    finally:
        prefill.stop()
    assert forwards == [[CHUNK], [CHUNK], [1], [len(PROMPTS[0])]]
    layers = list(range(decode[0].engine.model_config.num_layers))
    assert posts == [None] * len(layers) * 2 + layers + layers  # the short prompt: one piece
    assert outs == _one_engine(engine_args, [long, PROMPTS[0]])
    assert decode_pool_free(f"127.0.0.1:{decode[0].port}") is not None


def test_after_forward_sends_every_layer_once_the_forward_is_done(engine_args, decode):
    """--kv-send after-forward: no layer is posted while the engine steps; each prompt's
    layers are posted once, after the forward that completes it; greedy output equals one
    engine, the pool is free."""
    kv = KvTransportConfig(backend="tcp", host="127.0.0.1")
    engine = EngineConfig(**engine_args, max_num_batched_tokens=CHUNK, max_num_seqs=4)
    prefill = PrefillServer(PrefillServerConfig(engine, kv, kv_send="after-forward"))
    try:
        stepping, posts = [False], []
        step, post = prefill.engine.step, prefill.sender.post

        def flagged_step(before_run=None):
            stepping[0] = True
            try:
                return step(before_run=before_run)
            finally:
                stepping[0] = False

        def recording_post(session, build, ready=None, completes_layer=None):
            posts.append((completes_layer, stepping[0]))
            return post(session, build, ready, completes_layer)

        prefill.engine.step, prefill.sender.post = flagged_step, recording_post
        outs = _serve(decode, prefill, PROMPTS[:2], "a")
    finally:
        prefill.stop()
    layers = list(range(decode[0].engine.model_config.num_layers))
    assert posts == [(layer, False) for layer in layers + layers]
    assert outs == _one_engine(engine_args, PROMPTS[:2])
    assert decode_pool_free(f"127.0.0.1:{decode[0].port}") is not None


def _serve(decode, prefill: PrefillServer, prompts, tag: str, landed=None) -> list[list[int]]:
    """Each prompt as the router serves it: Reserve, the prefill with the ticket (which must
    commit every layer and the prompt's bytes; then `landed(ticket)`), Generate; the tokens
    generated."""
    server, stub = decode
    address = f"127.0.0.1:{server.port}"
    model = server.engine.model_config
    token_bytes = model.kv_bytes_per_token(server.engine.kv_cache.dtype)
    mla = model.mla is not None
    client = TestClient(prefill.app)
    outs = []
    for i, prompt in enumerate(prompts):
        ticket = stub.Reserve(
            decode_pb2.ReserveRequest(
                request_id=f"{tag}{i}", prompt_token_ids=prompt, num_senders=1,
                max_tokens=NEW_TOKENS,
            ),
            timeout=10,
        ).ticket  # fmt: skip
        # MLA: one region a layer, the latent's, as `k`; one head. Else K and V of 2 heads.
        layers = ticket.shards[0].layers
        assert [layer.HasField("v") for layer in layers] == [not mla] * model.num_layers
        assert (ticket.shards[0].heads.start, ticket.shards[0].heads.end) == (0, 1 if mla else 2)
        reply = client.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 1,
                  "kv_transfer_params": transfer_params(ticket, address)},
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        kv = reply.json()["kv_transfer_params"]
        assert kv["layers"] == model.num_layers
        assert kv["bytes_written"] == len(prompt) * token_bytes
        if landed is not None:
            landed(ticket)
        stream = stub.Generate(
            decode_pb2.GenerateRequest(
                request_id=ticket.request_id, generation=ticket.generation,
                first_token_id=kv["first_token_id"], max_tokens=NEW_TOKENS, ignore_eos=True,
            ),
            timeout=60,
        )  # fmt: skip
        outs.append([t for message in stream for t in message.token_ids])
    return outs


def _rows(plane: torch.Tensor, blocks, n: int) -> torch.Tensor:
    """[heads, n, channels]: tokens [0, n) of a cache plane [blocks, heads, block_size, ...]."""
    picked = plane[torch.as_tensor(list(blocks))]  # [b, heads, block_size, channels]
    return picked.transpose(0, 1).flatten(1, 2)[:, :n]


def _one_engine(engine_args: dict, prompts: list[list[int]]) -> list[list[int]]:
    return LLMEngine.build(EngineConfig(**engine_args)).generate(
        prompts, SamplingParams(), StopConditions(NEW_TOKENS, ignore_eos=True)
    )


def _record_forwards(server: PrefillServer) -> list[list[int]]:
    """Each forward of the prefill engine from now on, as its sequences' new-token counts."""
    forwards: list[list[int]] = []
    step = server.engine.step

    def recording_step(before_run=None):
        def arm(plan):
            forwards.append([item.num_new_tokens for item in plan.scheduled])
            return before_run is not None and before_run(plan)

        return step(before_run=arm)

    server.engine.step = recording_step
    return forwards
