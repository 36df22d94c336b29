"""The connector's worker side sending an MLA model's latent cache, fed synthetic vLLM caches as
vLLM lays them out: CPU_MLA's [blocks, 1, block_size, 576] float32 rows, the GPU backends'
[blocks, block_size, 576] bf16 rows (a block padded), FlashMLA's 656-byte fp8_ds_mla rows. A
prompt prefilled in chunks is written over a real transport into a decode-shaped latent cache
(one plane a layer, another block size) and committed to a fake decode service running the
decode server's own Hello check; the landed latent must equal what vLLM cached, k_pe's
channels in the decode server's order (and fp8 dequantized to bf16). Under tensor parallelism
only rank 0 sends: the latent is replicated."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

import transport
from prefill.kv_writes import token_rows
from prefill.tests.fake_decode import FakeDecode
from prefill.ticket import DECODE_LAYOUT, dtype_name, layout_descriptor
from prefill.vllm_config import TandemConnectorConfig
from prefill.vllm_layouts import dequantize_fp8_ds_mla, latent_views, to_decode_rope_order
from prefill.vllm_metadata import SendPlan, TandemMetadata
from prefill.vllm_worker_side import WorkerFacts, WorkerSide
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2

LAYERS, KV_LORA, ROPE = 3, 512, 64
LATENT = KV_LORA + ROPE
VLLM_BLOCK, DECODE_BLOCK, VLLM_BLOCKS = 16, 8, 10  # 16: vLLM's CPU_MLA block size
PROMPT = 75
CHUNKS = [(0, 37), (37, 60), (60, PROMPT)]
SRC_BLOCKS = (5, 1, 3, 8, 0)  # vLLM block ids of the prompt, in token order
DST_BLOCKS = [9, 2, 3, 4, 12, 0, 7, 8, 11, 1]
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@contextlib.contextmanager
def _decode_side(kv_dtype: torch.dtype, kv_format: str = "mla-latent"):
    """A decode-shaped destination: its agent, latent cache [layer, block, 1, token, latent],
    fake service and address."""
    agent = transport.create("tcp")
    cache = torch.zeros(LAYERS, 16, 1, DECODE_BLOCK, LATENT, dtype=kv_dtype)
    agent.register(cache.data_ptr(), cache.numel() * cache.element_size())
    layout = layout_descriptor(
        model_name="m", num_layers=LAYERS, num_kv_heads=1, head_dim=LATENT,
        kv_dtype=dtype_name(kv_dtype), block_size=DECODE_BLOCK, layout=DECODE_LAYOUT,
        transport="tcp", kv_format=kv_format,
    )  # fmt: skip
    service = FakeDecode(layout)
    server = grpc.server(ThreadPoolExecutor(2))
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield agent, cache, service, f"127.0.0.1:{port}"
    finally:
        server.stop(None)
        agent.close()


def _ticket(agent, cache: torch.Tensor, layout: layout_pb2.LayoutDescriptor) -> bytes:
    """As the decode server issues it: one region a layer, the latent's, as `k`."""
    e = cache.element_size()
    regions = [
        layout_pb2.LayerRegions(
            k=layout_pb2.KvRegion(addr=cache[i].data_ptr(), nbytes=cache[i].numel() * e)
        )
        for i in range(LAYERS)
    ]
    endpoint = layout_pb2.TransportEndpoint(transport="tcp", metadata=agent.endpoint())
    return decode_pb2.Ticket(
        request_id="t1", generation=2, num_tokens=PROMPT, block_ids=DST_BLOCKS,
        block_stride_bytes=cache.stride(1) * e, head_stride_bytes=cache.stride(2) * e,
        shards=[decode_pb2.KvShard(rank=0, heads=layout_pb2.HeadRange(start=0, end=1),
                                   endpoint=endpoint, layers=regions)],
        layout=layout, num_senders=1, deadline_unix_ms=int((time.time() + 30) * 1000),
    ).SerializeToString()  # fmt: skip


def _worker(tp_rank: int = 0, tp_size: int = 1, staging_mb: float = 1.0) -> WorkerSide:
    config = TandemConnectorConfig(staging_mb=staging_mb, staging_slots=4)
    facts = WorkerFacts("m", 1, LATENT, VLLM_BLOCK, tp_rank, tp_size, "mla-latent", KV_LORA)
    return WorkerSide(config, facts, transport.create("tcp"))


def _wait_for_commit(service: FakeDecode) -> decode_pb2.CommitRequest:
    deadline = time.monotonic() + 20
    while not service.commits and time.monotonic() < deadline:
        time.sleep(0.01)
    (commit,) = service.commits
    return commit


def _fp8_ds_mla_rows(latent: torch.Tensor) -> torch.Tensor:
    """[T, 656] bytes laid out as vLLM documents fp8_ds_mla (flashmla_sparse.py): 512 c_kv as
    float8_e4m3fn scaled by one float32 per 128 of them, those 4 scales, 64 k_pe as bfloat16."""
    nope = latent[:, :KV_LORA].float().view(-1, 4, 128)
    scales = nope.abs().amax(-1) / torch.finfo(torch.float8_e4m3fn).max
    fp8 = (nope / scales[..., None]).to(torch.float8_e4m3fn).view(-1, KV_LORA)
    rope = latent[:, KV_LORA:].to(torch.bfloat16)
    parts = (fp8.view(torch.uint8), scales.view(torch.uint8), rope.view(torch.uint8))
    return torch.cat(parts, dim=-1)


def _assert_dequantized(got: torch.Tensor, latent: torch.Tensor) -> None:
    """`got` [..., 576] (read back from fp8_ds_mla rows of `latent`): k_pe exact, c_kv within
    fp8's precision (3 mantissa bits) of its 128's scale, whatever that scale is."""
    got = got.float()
    assert torch.equal(got[..., KV_LORA:], latent[..., KV_LORA:].bfloat16().float())
    nope = got[..., :KV_LORA].unflatten(-1, (4, 128))
    want = latent[..., :KV_LORA].unflatten(-1, (4, 128))
    assert ((nope - want).abs() <= want.abs().amax(-1, keepdim=True) / 14).all()


def test_fp8_ds_mla_rows_are_sent_dequantized_to_bfloat16():
    torch.manual_seed(0)
    latent = torch.randn(7, LATENT) * torch.tensor([0.01, 3.0, 50.0, 0.2]).repeat_interleave(144)
    rows = _fp8_ds_mla_rows(latent)
    assert rows.shape == (7, 656)
    slots = torch.tensor([9, 0, 5, 11, 1, 2, 3])  # scattered over 3 blocks of 4
    cache = torch.zeros(3, 1, 4, 656, dtype=torch.uint8)
    cache.view(-1, 656)[slots] = rows
    fp8 = cache.view(torch.float8_e4m3fn)
    views = latent_views("FLASHMLA_SPARSE", fp8, KV_LORA, ROPE, "fp8_ds_mla")
    assert (views.layout, views.dtype, views.block_size) == ("vllm-mla-fp8-ds", torch.bfloat16, 4)
    got = views.convert(token_rows(views.k, slots // 4, slots % 4))
    assert got.shape == (7, 1, LATENT) and got.dtype == torch.bfloat16
    _assert_dequantized(dequantize_fp8_ds_mla(rows), latent)  # vLLM's channel order
    assert torch.equal(got[:, 0], to_decode_rope_order(dequantize_fp8_ds_mla(rows), KV_LORA))


class _VllmCache:
    """One kind of vLLM latent cache, every layer: `tensors` as register_kv_caches hands them
    over, `rows` [layer, block, token, row] the same memory as the kernel writes it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "fp8_ds_mla":  # FlashMLA: [blocks, 1, block_size, 656] bytes
            memory = torch.full((LAYERS, VLLM_BLOCKS, 1, VLLM_BLOCK, 656), 255, dtype=torch.uint8)
            self.tensors = list(memory)  # 255 is float8_e4m3fn's NaN: not computed yet
            self.rows = memory[:, :, 0]
        elif kind == "bf16":  # GPU MLA backends: [blocks, block_size, 576], blocks padded
            memory = torch.full((LAYERS, VLLM_BLOCKS, VLLM_BLOCK + 3, LATENT), float("nan"))
            memory = memory.to(torch.bfloat16)
            self.tensors = [layer[:, :VLLM_BLOCK] for layer in memory]
            self.rows = memory[:, :, :VLLM_BLOCK]
        else:  # CPU_MLA: [blocks, 1, block_size, 576] float32
            memory = torch.full((LAYERS, VLLM_BLOCKS, 1, VLLM_BLOCK, LATENT), float("nan"))
            self.tensors = list(memory)
            self.rows = memory[:, :, 0]

    @property
    def backend_and_dtype(self) -> tuple[str, str]:
        return {"fp8_ds_mla": ("FLASHMLA_SPARSE", "fp8_ds_mla"), "bf16": ("FLASHMLA", "auto"),
                "float32": ("CPU_MLA", "auto")}[self.kind]  # fmt: skip

    @property
    def sent_dtype(self) -> torch.dtype:
        return torch.float32 if self.kind == "float32" else torch.bfloat16

    def store(self, block: int, row: int, latent: torch.Tensor) -> None:
        """The kernel's write of one token's latent [layer, 576]."""
        if self.kind == "fp8_ds_mla":
            self.rows[:, block, row] = _fp8_ds_mla_rows(latent)
        else:
            self.rows[:, block, row] = latent.to(self.rows.dtype)


def _prefill(worker: WorkerSide, vllm: _VllmCache, truth: torch.Tensor, ticket: bytes, address):
    """vLLM's steps over CHUNKS: each forward stores its tokens' latent, then the connector's
    hooks run as vLLM calls them."""
    for start, end in CHUNKS:
        for t in range(start, end):
            vllm.store(SRC_BLOCKS[t // VLLM_BLOCK], t % VLLM_BLOCK, truth[:, t])
        first = start == 0
        worker.bind(TandemMetadata([SendPlan(
            "vllm-1", start, end, SRC_BLOCKS, final=end == PROMPT,
            ticket=ticket if first else b"", decode_address=address if first else "",
        )]))  # fmt: skip
        for name in NAMES:
            worker.save_layer(name)
        worker.step_done()


def _landed(dst: torch.Tensor) -> torch.Tensor:
    """[layer, token, latent] of the prompt, from the decode cache."""
    tokens = torch.arange(PROMPT)
    blocks = torch.tensor(DST_BLOCKS)[tokens // DECODE_BLOCK]
    return dst[:, blocks, 0, tokens % DECODE_BLOCK].float()


@pytest.mark.parametrize("kind", ["float32", "bf16", "fp8_ds_mla"])
# A slot of the smaller staging holds 3 decode blocks of a float32 latent (4 slots of 54 KiB).
@pytest.mark.parametrize("staging_mb", [1.0, 4 * 3 * DECODE_BLOCK * LATENT * 4 / (1 << 20)])
def test_a_chunked_prompts_latent_lands_in_the_decode_blocks(kind, staging_mb):
    torch.manual_seed(0)
    truth = torch.randn(LAYERS, PROMPT, LATENT)  # what the model computes, per layer and token
    vllm = _VllmCache(kind)
    with _decode_side(vllm.sent_dtype) as (agent, dst, service, address):
        worker = _worker(staging_mb=staging_mb)
        backend, kv_cache_dtype = vllm.backend_and_dtype
        worker.register(list(zip(NAMES, vllm.tensors, strict=True)), backend,
                        kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        _prefill(worker, vllm, truth, _ticket(agent, dst, service.layout), address)
        commit = _wait_for_commit(service)
        assert (commit.request_id, commit.generation, commit.sender_rank) == ("t1", 2, 0)
        assert commit.error == "" and commit.layers_written == LAYERS
        element = vllm.sent_dtype.itemsize
        assert commit.bytes_written == LAYERS * PROMPT * LATENT * element
        landed = _landed(dst)
        want = to_decode_rope_order(truth, KV_LORA)  # k_pe's channels as the decode server's
        if kind == "fp8_ds_mla":
            _assert_dequantized(landed, want)
        else:
            assert torch.equal(landed, want.to(vllm.sent_dtype).float())
        assert not dst[:, [b for b in range(16) if b not in DST_BLOCKS]].any()
        assert worker.num_sessions == 0
        worker.close()


def test_under_tensor_parallelism_only_rank_0_sends_the_replicated_latent():
    """Both ranks hold the whole latent and run the same steps; the ticket names one sender."""
    torch.manual_seed(1)
    truth = torch.randn(LAYERS, PROMPT, LATENT)
    vllm = _VllmCache("float32")
    with _decode_side(torch.float32) as (agent, dst, service, address):
        ranks = [_worker(tp_rank=rank, tp_size=2) for rank in (0, 1)]
        for worker in ranks:
            worker.register(list(zip(NAMES, vllm.tensors, strict=True)), "CPU_MLA")
        assert ranks[1].sender is None
        ticket = _ticket(agent, dst, service.layout)
        for start, end in CHUNKS:
            for t in range(start, end):
                vllm.store(SRC_BLOCKS[t // VLLM_BLOCK], t % VLLM_BLOCK, truth[:, t])
            for worker in ranks:
                worker.bind(TandemMetadata([SendPlan(
                    "vllm-1", start, end, SRC_BLOCKS, final=end == PROMPT,
                    ticket=ticket if start == 0 else b"", decode_address=address,
                )]))  # fmt: skip
                for name in NAMES:
                    worker.save_layer(name)
                worker.step_done()
        assert ranks[1].num_sessions == 0
        commit = _wait_for_commit(service)  # exactly one commit: rank 0's
        assert commit.sender_rank == 0 and commit.error == ""
        assert commit.bytes_written == LAYERS * PROMPT * LATENT * 4
        time.sleep(0.2)
        assert len(service.commits) == 1 and service.hellos == 1
        assert torch.equal(_landed(dst), to_decode_rope_order(truth, KV_LORA))
        for worker in ranks:
            worker.close()


@pytest.mark.parametrize(
    ("kind", "decode_dtype", "decode_format", "named"),
    [
        ("fp8_ds_mla", torch.float32, "mla-latent",
         "kv_dtype: decode has 'float32', sender has 'bfloat16'"),
        ("float32", torch.float32, "hnd", "kv_format: decode has 'hnd', sender has 'mla-latent'"),
    ],
)  # fmt: skip
def test_a_decode_server_of_another_cache_is_refused_by_name_and_nothing_is_written(
    kind, decode_dtype, decode_format, named
):
    vllm = _VllmCache(kind)
    with _decode_side(decode_dtype, decode_format) as (agent, dst, service, address):
        worker = _worker()
        backend, kv_cache_dtype = vllm.backend_and_dtype
        worker.register(list(zip(NAMES, vllm.tensors, strict=True)), backend,
                        kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        _prefill(worker, vllm, torch.randn(LAYERS, PROMPT, LATENT),
                 _ticket(agent, dst, service.layout), address)  # fmt: skip
        commit = _wait_for_commit(service)
        assert named in commit.error, commit.error
        assert commit.bytes_written == 0 and not dst.any()
        worker.close()


def test_staging_too_small_for_one_decode_block_of_latent_fails_the_request_by_name():
    vllm = _VllmCache("float32")
    with _decode_side(torch.float32) as (agent, dst, service, address):
        worker = _worker(staging_mb=4 * 16384 / (1 << 20))  # slots of 16 KiB < 8 x 576 x 4
        worker.register(list(zip(NAMES, vllm.tensors, strict=True)), "CPU_MLA")
        _prefill(worker, vllm, torch.randn(LAYERS, PROMPT, LATENT),
                 _ticket(agent, dst, service.layout), address)  # fmt: skip
        commit = _wait_for_commit(service)
        assert "cannot hold one decode block of the latent (18432 bytes)" in commit.error
        assert not dst.any()
        worker.close()


def test_latent_facts_are_one_head_whatever_the_tensor_parallel_size():
    facts = WorkerFacts("m", 1, LATENT, VLLM_BLOCK, 3, 4, "mla-latent", KV_LORA)
    assert (facts.heads, facts.sends, facts.num_senders) == (range(1), False, 1)
    with pytest.raises(ValueError, match="an MLA latent is one head, not 128"):
        WorkerFacts("m", 128, LATENT, VLLM_BLOCK, 0, 1, "mla-latent", KV_LORA)
    with pytest.raises(ValueError, match="kv_lora_rank: 511 must leave an even k_pe"):
        WorkerFacts("m", 1, LATENT, VLLM_BLOCK, 0, 1, "mla-latent", 511)
