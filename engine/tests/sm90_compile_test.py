"""The decode step's Triton kernels compile for Hopper (sm_90), as their wrappers launch them.

No GPU is needed: Triton compiles to sm_90 machine code on any host (its ptxas), and the
interpreter tests never compile at all, so a kernel that runs correctly there can still fail to
compile on a GPU (a dot's operand shapes, a constexpr branch's types, more shared memory than an
SM has). Each case calls a wrapper (`triton_attention.attention`, `triton_linear.linear`, ...)
with CPU tensors of Llama-3-8B's or DeepSeek-V2-Lite's shapes, bf16 and fp8; every kernel
launch is compiled instead of run, with the decisions a GPU launch takes
(`triton_device.compiled` true: PDL on, no interpreter workarounds; an H100's or H200's 132
SMs for the split counts). What the kernels compute is the interpreter tests' business: the
outputs here are never read.

Runs without TRITON_INTERPRET (Bazel runs this file in its own process).
"""

import dataclasses
import os

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from engine import (
    triton_device,
    triton_gemv_rows,
    triton_linear,
    triton_mla_heads,
    triton_moe,
    triton_moe_gemv,
    triton_ops,
    triton_route,
)
from engine.attention import AttentionMetadata
from engine.cuda_graphs import StepInputs
from engine.fp8 import FP8_DTYPE, Fp8Weight
from engine.presets import PRESETS
from engine.triton_attention import attention, paged_attention, write_kv
from engine.triton_latent_store import store_latent
from engine.triton_mla import mla_decode

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY = 232448  # bytes a block of an sm_90 SM may take (227 KiB)
SMS = 132  # H100 SXM and H200


class _CompileOnly:
    """The driver calls a kernel launch makes before it compiles: device 0, the sm_90 target."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return HOPPER


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    """Kernel launches compiled for sm_90 instead of run; yields the list of (kernel name,
    shared memory bytes) compiled."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernels = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)  # compiles, never launches
        shared = kernel.metadata.shared
        assert shared <= SHARED_MEMORY, f"{self.__name__} takes {shared} B of shared memory"
        kernels.append((self.__name__, shared))
        return kernel

    monkeypatch.setattr(JITFunction, "run", compile_only)
    monkeypatch.setattr(triton_device, "compiled", lambda device: True)
    monkeypatch.setattr(triton_device, "sm_count", lambda device: SMS)
    # NOTE: restored as it was (None here: reset_active would look for a GPU driver).
    monkeypatch.setattr(driver, "_active", _CompileOnly())
    yield kernels


def _paged_case(rows_per_seq, batch, context, block_size):
    """Metadata of `batch` sequences of `context` tokens, each with rows_per_seq rows (a
    verification's, told apart by row_in_seq), and how many cache blocks they take."""
    blocks = -(-(context + rows_per_seq) // block_size)
    lens, tables, index = [], [], []
    for s in range(batch):
        for j in range(rows_per_seq):
            lens.append(context + j)
            tables.append(list(range(s * blocks, (s + 1) * blocks)))
            index.append(j)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size)
    if rows_per_seq > 1:
        in_seq = torch.tensor(index, dtype=torch.int32)
        meta = dataclasses.replace(
            meta, new_kv_first=True, row_in_seq=in_seq, max_rows_per_seq=rows_per_seq
        )
    return meta, batch * blocks


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "batch,context,rows_per_seq",
    [(1, 1024, 1), (8, 8192, 1), (64, 1024, 1), (1, 1024, 4), (8, 8192, 4)],
)
def test_llama_attention(compiled, batch, context, rows_per_seq, kv_dtype):
    """Llama-3-8B's heads (32 query, 8 KV, 128 dims): decode steps and verifications' rows."""
    meta, blocks = _paged_case(rows_per_seq, batch, context, 16)
    rows = batch * rows_per_seq
    k_cache, v_cache = (torch.empty(blocks, 8, 16, 128, dtype=kv_dtype) for _ in range(2))
    q, k, v = (torch.empty(rows, heads, 128, dtype=torch.bfloat16) for heads in (32, 8, 8))
    attention(q, k, v, k_cache, v_cache, meta, 0.088)
    paged_attention(q, k_cache, v_cache, meta, 0.088)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    names = {name for name, _ in compiled}
    assert {"split_kernel", "write_kv_kernel"} <= names
    assert ("combine_kernel" in names) == (batch < 64)  # bs=64: one split a sequence, no merge


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch,context", [(1, 1024), (8, 8192), (64, 1024)])
def test_mla_attention(compiled, batch, context, cache_dtype):
    """DeepSeek-V2-Lite's MLA decode: 16 heads over a 512 + 64 latent."""
    meta, blocks = _paged_case(1, batch, context, 64)
    cache = torch.empty(blocks, 1, 64, 576, dtype=cache_dtype)
    q_c = torch.empty(batch, 16, 512, dtype=torch.bfloat16)
    q_pe = torch.empty(batch, 16, 64, dtype=torch.bfloat16)
    mla_decode(q_c, q_pe, cache, meta.seq_lens, meta.block_tables, 0.1)
    kv_a = torch.empty(batch, 576, dtype=torch.bfloat16)
    cos = sin = torch.empty(batch, 32)
    store_latent(cache, kv_a, q_pe, torch.empty(512), 1e-6, cos, sin, True, meta.slot_mapping)
    if batch == 1:  # W_UK and W_UV by their kernels at one token
        kv_b = torch.empty(16 * 256, 512, dtype=torch.bfloat16)
        triton_mla_heads.absorb_query(torch.empty(1, 16, 128, dtype=torch.bfloat16), kv_b)
        triton_mla_heads.expand_output(q_c, kv_b, 128)
    assert len(compiled) >= 3


def _matrix(n, k, fp8, experts=()):
    """[*experts, n, k] bf16, or fp8 with 128x128 blocks' scales."""
    if not fp8:
        return torch.empty(*experts, n, k, dtype=torch.bfloat16)
    scales = torch.empty(*experts, -(-n // 128), -(-k // 128))
    return Fp8Weight(torch.empty(*experts, n, k, dtype=FP8_DTYPE), scales, 128)


# Llama-3-8B's projections: qkv, o_proj, gate_up, down_proj (N out, K in).
QKV, O_PROJ, GATE_UP, DOWN = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)


@pytest.mark.parametrize("rows", [1, 4, 16, 32, 64])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_llama_projections(compiled, monkeypatch, rows, fp8):
    """A decoder layer's products with their epilogues (the norm before, RoPE, SwiGLU, the
    residual add), as one-row GEMVs and as the few-row kernel (taking every matrix here) or the fp8
    GEMM."""
    monkeypatch.setattr(triton_linear, "ROWS_KERNEL_MAX_ROWS", triton_gemv_rows.MAX_ROWS)
    monkeypatch.setattr(triton_linear, "ROWS_KERNEL_VERY_TALL", True)
    h = torch.empty(rows, 4096, dtype=torch.bfloat16)
    norm = triton_linear.Prenorm(h, 1e-5)
    cos = sin = torch.empty(rows, 64)
    qkv, o_proj, gate_up, down = (_matrix(n, k, fp8) for n, k in (QKV, O_PROJ, GATE_UP, DOWN))
    if triton_linear.fuses(h, qkv):
        triton_linear.linear_rope(h, qkv, None, cos, sin, 128, 5120, norm=norm)
        triton_linear.linear_residual(h, o_proj, torch.empty_like(h), torch.empty(4096))
        triton_linear.linear_silu(h, gate_up, norm=norm)
    else:  # fp8 matrices at several rows: the fp8 GEMM, no epilogues
        triton_linear.linear(h, qkv)
    triton_linear.linear(torch.empty(rows, 14336, dtype=torch.bfloat16), down)
    assert len(compiled) >= 2


@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_deepseek_moe(compiled, tokens, fp8):
    """DeepSeek-V2-Lite's MoE layer: the router (norm, logits, top-k, sort) and the experts, as
    one token's GEMVs with the shared experts as slots or as the tiled kernels."""
    moe = PRESETS["deepseek-v2-lite"].moe
    hidden, inter, experts = 2048, moe.moe_intermediate_size, moe.n_routed_experts
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    h, routing = triton_route.route_normed_tokens(
        x, torch.empty(hidden), 1e-6, torch.empty(experts, hidden), None, moe
    )
    gate_up = _matrix(2 * inter, hidden, fp8, (experts,))
    down = _matrix(hidden, inter, fp8, (experts,))
    ids = routing.ids
    if tokens == 1:
        width = moe.n_shared_experts * inter
        shared = triton_moe_gemv.Shared(
            _matrix(2 * width, hidden, fp8), _matrix(hidden, width, fp8)
        )
        assert triton_moe_gemv.applies(h, gate_up, down, shared)
        scaled = torch.empty(hidden, dtype=torch.bfloat16)
        triton_moe_gemv.one_token_moe(h, routing.weights, ids, gate_up, down, shared, x, scaled)
    else:
        pairs = (routing.order, routing.bounds) if routing.order is not None else None
        triton_moe.fused_experts(h, routing.weights, ids, gate_up, down, pairs, residual=x)
    assert len(compiled) >= 3


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_elementwise_kernels(compiled, rows):
    """The norms, SwiGLU, RoPE and greedy sampling at Llama-3-8B's sizes; a speculative
    step's rows moved on the device."""
    x = torch.empty(rows, 4096, dtype=torch.bfloat16)
    triton_ops.rms_norm(x, torch.empty(4096, dtype=torch.bfloat16), 1e-5)
    triton_ops.add_rms_norm(x, torch.empty_like(x), torch.empty(4096, dtype=torch.bfloat16), 1e-5)
    triton_ops.silu_and_mul(torch.empty(rows, 28672, dtype=torch.bfloat16))
    qkv = torch.empty(rows, 48, 128, dtype=torch.bfloat16)
    triton_ops.rope(qkv[:, :32], qkv[:, 32:40], torch.empty(rows, 64), torch.empty(rows, 64))
    triton_ops.greedy_tokens(torch.empty(rows, 128256))
    inputs = StepInputs(bucket=rows, max_blocks=64, padding_block=0, block_size=16, device="cpu")
    inputs.shift(rows, torch.empty(rows, dtype=torch.int64))
    assert "_shift_kernel" in {name for name, _ in compiled}
    assert len({name for name, _ in compiled}) >= 6
