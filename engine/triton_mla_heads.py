"""MLA's per-head projections around the latent decode kernel, for one token: W_UK and W_UV.

A decode token's query enters latent space through W_UK (engine.mla.absorb_query) and its
latent attention output leaves it through W_UV (engine.mla.expand_output): per head a [nope,
rank] and a [v, rank] slice of kv_b_proj's weight. For a batch these are cuBLAS batched GEMMs;
for one token they are a GEMV per head, small (2 MiB each for DeepSeek-V2-Lite's 16 heads) and
latency-bound, where a cuBLAS kernel cannot start before the kernel ahead of it ends. The Triton
kernel here requests its whole weight tile before waiting for the kernel ahead of it (weights do
not depend on it: engine.triton_pdl), so both projections cost little more than their reads.

`_head_gemv_kernel`, grid (head, BLOCK_O outputs): one program loads its [BLOCK_O, K] slice of
the head's matrix at once (K is nope or kv_lora_rank: 128 or 512), multiplies by the head's
input in fp32 and stores BLOCK_O outputs rounded once, as the batched GEMM rounds them. For
W_UK the reduction runs over the slice's rows (q_c = q_nope W_UK), for W_UV over its
contiguous columns (o W_UV^T).
"""

import torch
import triton
import triton.language as tl

from engine import mla, triton_pdl

__all__ = ["absorb_query", "expand_output"]

# Outputs a program: W_UK's slice [nope, 64] and W_UV's [16, rank], 16 KiB each in bf16 for
# DeepSeek (128 programs at 16 heads). Untuned: the one size tried.
_ABSORB_OUTPUTS = 64
_EXPAND_OUTPUTS = 16
_NUM_WARPS = 4


def absorb_query(q_nope: torch.Tensor, kv_b_weight: torch.Tensor) -> torch.Tensor:
    """engine.mla.absorb_query: q_nope [n, heads, nope] (contiguous channels) -> q_c [n, heads,
    kv_lora_rank]; one token by this module's kernel, more by engine.mla's batched GEMM."""
    if q_nope.shape[0] != 1 or q_nope.stride(-1) != 1:
        return mla.absorb_query(q_nope, kv_b_weight)
    _, heads, nope = q_nope.shape
    rank = kv_b_weight.shape[1]
    w = kv_b_weight.view(heads, -1, rank)  # [heads, nope + v, rank]; W_UK: its first nope rows
    out = q_nope.new_empty(1, heads, rank)
    _launch(q_nope, w, out, outputs=rank, k=nope, reduce_rows=True, block=_ABSORB_OUTPUTS)
    return out


def expand_output(o: torch.Tensor, kv_b_weight: torch.Tensor, nope: int) -> torch.Tensor:
    """engine.mla.expand_output: o [n, heads, kv_lora_rank] (contiguous channels) -> [n, heads,
    v_head_dim] contiguous; one token by this module's kernel, more by engine.mla's."""
    if o.shape[0] != 1 or o.stride(-1) != 1:
        return mla.expand_output(o, kv_b_weight, nope)
    _, heads, rank = o.shape
    w_uv = kv_b_weight.view(heads, -1, rank)[:, nope:]  # [heads, v, rank]
    out = o.new_empty(1, heads, w_uv.shape[1])
    _launch(o, w_uv, out, outputs=w_uv.shape[1], k=rank, reduce_rows=False, block=_EXPAND_OUTPUTS)
    return out


def _launch(x, w, out, outputs: int, k: int, reduce_rows: bool, block: int) -> None:
    """out[0, h] = x[0, h] W_h (reduce_rows: W_h [k, outputs]) or W_h x[0, h] (W_h [outputs, k]),
    W_h = w[h], rows w.stride(1) apart, contiguous within a row."""
    assert w.stride(2) == 1 and x.dtype == w.dtype == out.dtype, (w.stride(), x.dtype, w.dtype)
    heads = x.shape[1]
    block = min(block, triton.next_power_of_2(outputs))
    pdl = triton_pdl.enabled(x.device)
    _head_gemv_kernel[(heads, triton.cdiv(outputs, block))](
        x, w, out, x.stride(1), w.stride(0), w.stride(1), out.stride(1),
        OUTPUTS=outputs, K=k, K_PAD=triton.next_power_of_2(k), BLOCK_O=block,
        REDUCE_ROWS=reduce_rows, PDL=pdl, num_warps=_NUM_WARPS, launch_pdl=pdl,
    )  # fmt: skip


@triton.jit
def _head_gemv_kernel(
    x_ptr,  # [1, heads, K], heads stride_xh apart
    w_ptr,  # [heads, rows, cols], rows contiguous: [K, OUTPUTS] if REDUCE_ROWS else [OUTPUTS, K]
    out_ptr,  # [1, heads, OUTPUTS]
    stride_xh,
    stride_wh,
    stride_wr,
    stride_oh,
    OUTPUTS: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_O: tl.constexpr,
    REDUCE_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    ks = tl.arange(0, K_PAD)
    w_head = w_ptr + head * stride_wh
    # The weight slice first: it does not depend on the kernel ahead (see the docstring).
    if REDUCE_ROWS:
        mask = (ks < K)[:, None] & (outs < OUTPUTS)[None, :]
        w = tl.load(w_head + ks[:, None] * stride_wr + outs[None, :], mask=mask, other=0.0)
    else:
        mask = (outs < OUTPUTS)[:, None] & (ks < K)[None, :]
        w = tl.load(w_head + outs[:, None] * stride_wr + ks[None, :], mask=mask, other=0.0)
    triton_pdl.await_previous_kernel(PDL)
    x = tl.load(x_ptr + head * stride_xh + ks, mask=ks < K, other=0.0).to(tl.float32)
    if REDUCE_ROWS:
        y = tl.sum(w.to(tl.float32) * x[:, None], 0)
    else:
        y = tl.sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(out_ptr + head * stride_oh + outs, y.to(out_ptr.dtype.element_ty), mask=outs < OUTPUTS)
