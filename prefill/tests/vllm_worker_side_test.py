"""The connector's worker side alone, fed synthetic vLLM GPU caches (FlashAttention's layouts:
vLLM cannot run on a GPU here, so this is where the GPU path is checked): a chunked prompt is
converted to the decode layout (other block size, one tensor-parallel rank's heads), written
over a real transport into a decode-shaped cache, and committed to a fake decode service that
runs the decode server's own layout check. The landed KV must equal a reference gather. A
speculative drafter's layers land in the decode's proposer cache after the model's; a step
whose drafter did not run fails the request naming it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

import transport
from prefill.kv_writes import valid_bytes
from prefill.tests.fake_decode import FakeDecode
from prefill.ticket import SpeculativeKv
from prefill.vllm_config import TandemConnectorConfig
from prefill.vllm_layouts import cache_views
from prefill.vllm_metadata import SendPlan, TandemMetadata
from prefill.vllm_worker_side import ProposerLayers, WorkerFacts, WorkerSide
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2

LAYERS, HEADS, DIM = 3, 4, 8  # HEADS: the model's KV heads; the sender is rank 1 of 2
VLLM_BLOCK, KERNEL_BLOCK, DECODE_BLOCK = 32, 16, 8  # one vLLM block id = two kernel blocks
PROMPT = 75
CHUNKS = [(0, 37), (37, 60), (60, PROMPT)]
SRC_BLOCKS = (5, 1, 3)  # vLLM block ids of the prompt, in token order
DST_BLOCKS = [9, 2, 3, 4, 12, 0, 7, 8, 11, 1]


def _flash_kv_first(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[2, blocks, block_size, heads, head_dim], from logical [blocks, heads, block_size, dim]."""
    return torch.stack([k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)]).contiguous()


def _flash_nhd(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Logical [blocks, heads, block_size, 2 * dim] over NHD memory [blocks, block_size, heads,
    2 * dim]: the FlashAttention cache as vLLM >= the KVCacheLayout rework allocates it."""
    memory = torch.cat([k, v], dim=-1).permute(0, 2, 1, 3).contiguous()
    return memory.permute(0, 2, 1, 3)


@pytest.fixture
def decode_side():
    """A decode-shaped destination: its transport agent, HND cache and fake service."""
    agent = transport.create("tcp")
    cache = torch.zeros(LAYERS, 2, 16, HEADS, DECODE_BLOCK, DIM)
    agent.register(cache.data_ptr(), cache.numel() * cache.element_size())
    layout = layout_pb2.LayoutDescriptor(
        model=layout_pb2.ModelFingerprint(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                                          kv_dtype="float32", kv_format="hnd"),
        block_size=DECODE_BLOCK, layout="HND", layout_version=1, tp_size=1,
        head_ranges=[layout_pb2.HeadRange(start=0, end=HEADS)], transport="tcp",
    )  # fmt: skip
    service = FakeDecode(layout)
    server = grpc.server(ThreadPoolExecutor(2))
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield agent, cache, service, f"127.0.0.1:{port}"
    server.stop(None)
    agent.close()


def _ticket(agent, cache: torch.Tensor) -> decode_pb2.Ticket:
    e = cache.element_size()
    nbytes = cache[0, 0].numel() * e
    regions = [
        layout_pb2.LayerRegions(
            k=layout_pb2.KvRegion(addr=cache[i, 0].data_ptr(), nbytes=nbytes),
            v=layout_pb2.KvRegion(addr=cache[i, 1].data_ptr(), nbytes=nbytes),
        )
        for i in range(LAYERS)
    ]
    endpoint = layout_pb2.TransportEndpoint(transport="tcp", metadata=agent.endpoint())
    return decode_pb2.Ticket(
        request_id="t1", generation=4, num_tokens=PROMPT, block_ids=DST_BLOCKS,
        block_stride_bytes=cache.stride(2) * e, head_stride_bytes=cache.stride(3) * e,
        shards=[decode_pb2.KvShard(rank=0, heads=layout_pb2.HeadRange(start=0, end=HEADS),
                                   endpoint=endpoint, layers=regions)],
        layout=layout_pb2.LayoutDescriptor(block_size=DECODE_BLOCK), num_senders=2,
        deadline_unix_ms=int((time.time() + 30) * 1000),
    )  # fmt: skip


def _worker(staging_mb: float) -> WorkerSide:
    config = TandemConnectorConfig(staging_mb=staging_mb, staging_slots=4)
    facts = WorkerFacts("m", HEADS, DIM, VLLM_BLOCK, tp_rank=1, tp_size=2)
    return WorkerSide(config, facts, transport.create("tcp"))


def _wait_for_commit(service: FakeDecode) -> decode_pb2.CommitRequest:
    deadline = time.monotonic() + 20
    while not service.commits and time.monotonic() < deadline:
        time.sleep(0.01)
    (commit,) = service.commits
    return commit


def _kernel_blocks() -> list[int]:
    split = VLLM_BLOCK // KERNEL_BLOCK
    return [b * split + i for b in SRC_BLOCKS for i in range(split)]


@pytest.mark.parametrize("make_cache", [_flash_kv_first, _flash_nhd])
# A slot of the smaller staging holds 3 decode blocks of K and V (4 slots of 3 KiB).
@pytest.mark.parametrize("staging_mb", [1.0, 4 * 3 * 1024 / (1 << 20)])
def test_chunked_prompt_lands_as_a_reference_gather_in_the_decode_layout(
    decode_side, make_cache, staging_mb
):
    agent, dst, service, address = decode_side
    torch.manual_seed(0)
    local = HEADS // 2
    logical = torch.randn(LAYERS, 2, 16, local, KERNEL_BLOCK, DIM)  # [layer, K|V, block, ...]
    garbage = torch.full_like(logical, float("nan"))  # rows not computed yet
    caches = [make_cache(garbage[i, 0], garbage[i, 1]) for i in range(LAYERS)]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker = _worker(staging_mb)
    worker.register(list(zip(names, caches, strict=True)), "FLASH_ATTN")
    ticket = _ticket(agent, dst)
    kernel_blocks = _kernel_blocks()
    for start, end in CHUNKS:
        for t in range(start, end):  # this step's forward writes its tokens' KV
            block, row = kernel_blocks[t // KERNEL_BLOCK], t % KERNEL_BLOCK
            garbage[:, :, block, :, row] = logical[:, :, block, :, row]
        for i in range(LAYERS):
            caches[i].copy_(make_cache(garbage[i, 0], garbage[i, 1]))
        first = start == 0
        worker.bind(TandemMetadata([SendPlan(
            "vllm-1", start, end, SRC_BLOCKS, final=end == PROMPT,
            ticket=ticket.SerializeToString() if first else b"",
            decode_address=address if first else "",
        )]))  # fmt: skip
        for name in names:
            worker.save_layer(name)
        worker.step_done()
    commit = _wait_for_commit(service)
    assert (commit.request_id, commit.generation, commit.sender_rank) == ("t1", 4, 1)
    assert commit.error == "" and commit.layers_written == LAYERS
    assert commit.bytes_written == valid_bytes(PROMPT, local, DIM * 4, LAYERS)
    for t in range(PROMPT):  # the reference gather, token by token
        block, row = kernel_blocks[t // KERNEL_BLOCK], t % KERNEL_BLOCK
        want = logical[:, :, block, :, row]  # [layer, K|V, local head, dim]
        got = dst[:, :, DST_BLOCKS[t // DECODE_BLOCK], :, t % DECODE_BLOCK]
        assert torch.equal(got[:, :, local:], want), f"token {t}"
        assert not got[:, :, :local].any(), "rank 0's heads are not this sender's to write"
    assert worker.num_sessions == 0
    worker.close()


def test_a_decode_server_of_another_dtype_is_refused_by_name_and_nothing_is_written(decode_side):
    agent, dst, service, address = decode_side
    service.layout.model.kv_dtype = "bfloat16"
    cache = _flash_kv_first(*torch.randn(2, 16, HEADS // 2, KERNEL_BLOCK, DIM))
    worker = _worker(1.0)
    worker.register([("model.layers.0.self_attn.attn", cache)] * LAYERS, "FLASH_ATTN")
    ticket = _ticket(agent, dst).SerializeToString()
    plan = SendPlan("vllm-1", 0, PROMPT, SRC_BLOCKS, True, ticket, address)
    worker.bind(TandemMetadata([plan]))
    worker.save_layer("model.layers.0.self_attn.attn")
    worker.step_done()
    commit = _wait_for_commit(service)
    assert "kv_dtype: decode has 'bfloat16', sender has 'float32'" in commit.error
    assert commit.bytes_written == 0 and not dst.any()
    worker.close()


def test_a_request_ending_mid_prompt_commits_the_scheduler_sides_error(
    decode_side,
):
    agent, dst, service, address = decode_side
    cache = _flash_kv_first(*torch.randn(2, 16, HEADS // 2, KERNEL_BLOCK, DIM))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker = _worker(1.0)
    worker.register([(name, cache) for name in names], "FLASH_ATTN")
    ticket = _ticket(agent, dst).SerializeToString()
    worker.bind(TandemMetadata([SendPlan("vllm-1", 0, 37, SRC_BLOCKS, False, ticket, address)]))
    for name in names:
        worker.save_layer(name)
    worker.step_done()
    assert worker.num_sessions == 1 and not service.commits
    # The scheduler side's next step: the request was aborted before its last chunk.
    worker.bind(TandemMetadata([SendPlan("vllm-1", 37, 37, (), True, error="aborted")]))
    worker.step_done()
    commit = _wait_for_commit(service)
    assert commit.error == "aborted" and commit.layers_written == 0
    assert worker.num_sessions == 0
    worker.close()


def test_a_ticket_with_too_few_blocks_is_refused_by_name_and_nothing_is_written(decode_side):
    agent, dst, service, address = decode_side
    cache = _flash_kv_first(*torch.randn(2, 16, HEADS // 2, KERNEL_BLOCK, DIM))
    worker = _worker(1.0)
    worker.register([(f"model.layers.{i}.self_attn.attn", cache) for i in range(LAYERS)],
                    "FLASH_ATTN")  # fmt: skip
    ticket = _ticket(agent, dst)
    del ticket.block_ids[3:]
    worker.bind(TandemMetadata([SendPlan("vllm-1", 0, PROMPT, SRC_BLOCKS, True,
                                         ticket.SerializeToString(), address)]))  # fmt: skip
    worker.save_layer("model.layers.0.self_attn.attn")
    worker.step_done()
    commit = _wait_for_commit(service)
    assert "3 blocks of 8 tokens cannot hold 75 tokens" in commit.error
    assert not dst.any()
    worker.close()


def test_kv_heads_that_do_not_split_over_the_ranks_are_refused_at_start_up():
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the model's 4"):
        WorkerFacts("m", HEADS, DIM, VLLM_BLOCK, tp_rank=0, tp_size=3)
    assert WorkerFacts("m", HEADS, DIM, VLLM_BLOCK, tp_rank=1, tp_size=2).heads == range(2, 4)


def _proposer_stack(decode_side):
    """A rank-1-of-1 worker with a draft model of 1 layer and 2 KV heads (FlashAttention's
    layout) besides the model's; a ticket whose shard lists a proposer cache for it."""
    agent, dst, service, address = decode_side
    spec = SpeculativeKv("draft_model", "hnd", 1, 2, DIM, "float32")
    service.layout.speculative_kv = str(spec)
    proposer_dst = torch.zeros(1, 2, 16, 2, DECODE_BLOCK, DIM)
    agent.register(proposer_dst.data_ptr(), proposer_dst.numel() * 4)
    ticket = _ticket(agent, dst)
    ticket.num_senders = 1
    ticket.layout.speculative_kv = str(spec)
    ticket.speculative_block_stride_bytes = proposer_dst.stride(2) * 4
    ticket.speculative_head_stride_bytes = proposer_dst.stride(3) * 4
    region = lambda plane: layout_pb2.KvRegion(  # noqa: E731
        addr=proposer_dst[0, plane].data_ptr(), nbytes=proposer_dst[0, 0].numel() * 4
    )
    ticket.shards[0].endpoint.metadata = agent.endpoint()
    ticket.shards[0].speculative_layers.append(layout_pb2.LayerRegions(k=region(0), v=region(1)))
    torch.manual_seed(1)
    model = torch.randn(LAYERS, 2, 16, HEADS, KERNEL_BLOCK, DIM)
    draft = torch.randn(1, 2, 16, 2, KERNEL_BLOCK, DIM)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    caches = [_flash_kv_first(model[i, 0], model[i, 1]) for i in range(LAYERS)]
    draft_cache = _flash_kv_first(draft[0, 0], draft[0, 1])
    views = [cache_views("FLASH_ATTN", draft_cache, 2, DIM)]
    proposer = ProposerLayers("draft_model", ["draft_model.model.layers.0.self_attn.attn"],
                              views, "hnd", 2, DIM)  # fmt: skip
    config = TandemConnectorConfig(staging_mb=1.0, staging_slots=4)
    worker = WorkerSide(config, WorkerFacts("m", HEADS, DIM, VLLM_BLOCK, 0, 1),
                        transport.create("tcp"))  # fmt: skip
    worker.register(list(zip(names, caches, strict=True)), "FLASH_ATTN", proposer=proposer)
    plan = SendPlan("vllm-1", 0, PROMPT, SRC_BLOCKS, final=True,
                    ticket=ticket.SerializeToString(), decode_address=address)  # fmt: skip
    return worker, plan, names + proposer.names, draft, proposer_dst, service


def test_the_drafters_layers_go_after_the_models_into_the_proposer_cache(decode_side):
    worker, plan, names, draft, proposer_dst, service = _proposer_stack(decode_side)
    worker.bind(TandemMetadata([plan]))
    for name in [*names, names[-1]]:  # a deeper draft runs the drafter's layer again
        worker.save_layer(name)
    worker.step_done()
    commit = _wait_for_commit(service)
    assert commit.error == "" and commit.layers_written == LAYERS + 1
    model_bytes = valid_bytes(PROMPT, HEADS, DIM * 4, LAYERS)
    assert commit.bytes_written == model_bytes + valid_bytes(PROMPT, 2, DIM * 4, 1)
    kernel_blocks = _kernel_blocks()
    for t in range(PROMPT):
        src = draft[0, :, kernel_blocks[t // KERNEL_BLOCK], :, t % KERNEL_BLOCK]
        landed = proposer_dst[0, :, DST_BLOCKS[t // DECODE_BLOCK], :, t % DECODE_BLOCK]
        assert torch.equal(landed, src), t
    worker.close()


def test_a_step_whose_drafter_did_not_run_fails_the_request_naming_it(decode_side):
    worker, plan, names, _, _, service = _proposer_stack(decode_side)
    worker.bind(TandemMetadata([plan]))
    for name in names[:-1]:  # vLLM skipped its drafter for this step
        worker.save_layer(name)
    worker.step_done()
    commit = _wait_for_commit(service)
    assert "drafter wrote none of its layers [3]" in commit.error, commit.error
    worker.close()
