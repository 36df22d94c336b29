"""Routed experts on the GPU: a fused Triton mixture-of-experts for DeepSeek's MoE layer.

`fused_experts` computes what engine.moe's torch experts (`gather_experts`, Experts' kernel on
CPU) compute, each token's k experts' SwiGLU outputs, weighted and summed, without their
per-expert Python loop, which reads the chosen expert ids on the host (`ids.unique().tolist()`)
and so can be neither overlapped nor captured in a CUDA graph. Here launch grids and buffer
sizes depend only on shapes (T, k, experts, hidden, intermediate), never on the ids, and no
value comes back to the host.

A decode step at small batch is memory-bound on the experts' weights, and a token touches only
k of them: the kernels must stream the chosen experts' weights and no others. So the T * k
(token, slot) pairs are sorted by expert on the device (a stable sort, then each expert's
[start, end) of the sorted pairs by a binary search of the expert ids), and each kernel's grid is
(active expert, block of output columns). Active expert j is the j-th expert that some pair
chose, found by each program from the experts' bounds; at most min(experts, T * k) experts can
be chosen, so that is the grid's first dimension, and programs past the step's actual count exit
at once. At T=1 (DeepSeek-V2-Lite: k=6 of 64 experts) the grid holds only the six experts' blocks,
rather than 58 experts' worth of programs that would load their bounds and exit.

- `_gate_up_kernel`, grid (active expert, BLOCK_N intermediate columns): walks the expert's
  sorted pairs in tiles of BLOCK_M rows (tl.dot needs >= 16; at decode most rows are padding,
  free in a memory-bound loop), gathering each pair's token row of h, and the hidden dimension
  in BLOCK_K steps, with the gate and up products in two fp32 accumulators, so that one program
  owns matching gate and up columns. It stores silu(gate) * up to an intermediate [T * k, I] at
  the pairs' *sorted* positions, so that the down kernel reads each expert's rows contiguously.
- `_down_kernel`, grid (active expert, BLOCK_N hidden columns): the same walk over the
  intermediate rows; multiplies each row by its pair's routing weight (float32) and stores it
  at the pair's own row of a per-pair output [T * k, hidden].
- `_sum_pairs_kernel`, grid (token, BLOCK_SUM hidden columns): each token's k rows summed in
  fp32, in slot order, plus the optional residual (the layer's, so that MoE's separate add
  disappears), rounded once: no atomics, so the result does not depend on the order programs
  finish in.

Rounding follows the torch path: each projection's output is rounded to the input dtype, as
F.linear returns it, silu(gate) and its product with up are rounded as separate ops round them,
and the down output times the fp32 weight is rounded once. Only the sum over the k experts
differs: the torch path adds in the input dtype expert by expert, then the residual, this sums
all in fp32.

One token (bs=1 decode) goes to engine.triton_moe_gemv instead: GEMVs over its k experts, whose
down kernel also sums over k.

FP8 stacks (engine.fp8.Fp8Weight: e4m3 [E, N, K], float32 scales [E, N, KB] a row and block of
block_k columns): each weight tile is dequantized in registers, rounded to the compute dtype as
the torch path's dense matrix is, before its tl.dot; the K step is at most block_k and divides
it, so that a tile's column holds one scale. Activations are not quantized.

`KERNELS.route` is engine.triton_route's `route_tokens`: at decode sizes the router's logits in
one kernel, the routing and that sort in another.

On CUDA the kernels are launched with programmatic dependent launch (engine.triton_pdl). They
wait before their first load: which weights to read depends on the sort just before.
"""

import torch
import triton
import triton.language as tl

from engine import triton_fp8_scales, triton_moe_gemv, triton_pdl
from engine.fp8 import Fp8Weight, Matrix
from engine.moe import MoeKernels, Routing
from engine.triton_route import route_normed_tokens, route_tokens

__all__ = ["KERNELS", "fused_experts"]

_MIN_DOT = 16  # tl.dot needs every dimension >= 16
# (BLOCK_N, BLOCK_K) when an expert's rows fit one 16-row tile (decode): narrow column blocks,
# so that T=1 at DeepSeek-V2-Lite's shapes gives 264 gate_up and 384 down programs for the
# H200's 132 SMs, each streaming long K steps of its expert's weights. Untuned: a starting
# point, not a measured optimum.
_DECODE_BLOCKS = (32, 128)
# With more rows an expert (prefill), wider column blocks re-read fewer rows of h.
_PREFILL_BLOCKS = (64, 64)
_MAX_BLOCK_M = 64
_NUM_WARPS = 4
_NUM_STAGES = 3
_BLOCK_SUM = 256  # _sum_pairs_kernel's columns per program: 8 a token at DeepSeek-V2-Lite's H


def fused_experts(
    h: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: Matrix,
    down: Matrix,
    sorted_pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum over each token's experts e of weight * down_e(silu(gate_e(h)) * up_e(h)) -> [T, H].

    h [T, H]; weights [T, k] float32; ids [T, k] integer expert ids (distinct within a row, as
    routing picks them; repeats would also be summed); gate_up [E, 2 * I, H] (gate rows first,
    then up); down [E, H, I]: tensors of h's dtype, or fp8 stacks (Fp8Weight); accumulation is
    fp32.
    sorted_pairs: (order, bounds) of the pairs as Routing holds them (route_and_sort), else
    sorted here. residual [T, H] (h's dtype): added to the sum, in fp32 with one rounding.
    """
    num_tokens, hidden = h.shape
    top_k = ids.shape[1]
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    assert weights.shape == ids.shape and ids.shape[0] == num_tokens, (weights.shape, ids.shape)
    assert gate_up.shape == (num_experts, 2 * inter, hidden), gate_up.shape
    assert down.shape == (num_experts, hidden, inter), down.shape
    for w in (gate_up, down):
        values = w.weight if isinstance(w, Fp8Weight) else w
        assert isinstance(w, Fp8Weight) or w.dtype == h.dtype, (h.dtype, w.dtype)
        assert values.stride(-1) == 1, "weights' rows must be contiguous"
    assert weights.dtype == torch.float32, weights.dtype
    h = h if h.stride(-1) == 1 else h.contiguous()
    if triton_moe_gemv.applies(h, gate_up, down):  # one token: GEMVs, no sort, no tiles
        return triton_moe_gemv.one_token_experts(h, weights, ids, gate_up, down, residual)
    pairs = num_tokens * top_k
    active = min(num_experts, pairs)  # the most experts a step's pairs can choose
    if active == 0:
        return torch.zeros_like(h) if residual is None else residual.clone()
    if sorted_pairs is None:
        sorted_pairs = _sort_pairs(ids.reshape(pairs), num_experts)
    order, bounds = sorted_pairs
    block_n, max_block_k, common = _launch_config(pairs, num_experts, h.device, h.dtype)

    activated = torch.empty(pairs, inter, dtype=h.dtype, device=h.device)
    block_k = _block_k(hidden, max_block_k, gate_up)
    w, scale = triton_fp8_scales.operands(gate_up)
    _gate_up_kernel[(active, triton.cdiv(inter, block_n))](
        h, w, scale, order, bounds, activated,
        hidden, inter, top_k,
        h.stride(0), w.stride(0), w.stride(1), scale.stride(0), scale.stride(1),
        activated.stride(0),
        BLOCK_K=block_k, EVEN_K=hidden % block_k == 0, SCALE_K=_scale_k(gate_up), **common,
    )  # fmt: skip

    per_pair = torch.empty(pairs, hidden, dtype=h.dtype, device=h.device)
    block_k = _block_k(inter, max_block_k, down)
    w, scale = triton_fp8_scales.operands(down)
    _down_kernel[(active, triton.cdiv(hidden, block_n))](
        activated, w, scale, order, bounds, weights.reshape(pairs), per_pair,
        inter, hidden,
        activated.stride(0), w.stride(0), w.stride(1), scale.stride(0), scale.stride(1),
        per_pair.stride(0),
        BLOCK_K=block_k, EVEN_K=inter % block_k == 0, SCALE_K=_scale_k(down), **common,
    )  # fmt: skip
    return _sum_pairs(per_pair.view(num_tokens, top_k, hidden), residual)


def _scale_k(weight: Matrix) -> int:
    """The SCALE_K constexpr: columns a scale covers, 0 for a weight tensor (no scales)."""
    return weight.block_k if isinstance(weight, Fp8Weight) else 0


def _sum_pairs(per_pair: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """per_pair [T, k, H] summed over k, plus residual [T, H] if given, in fp32 -> [T, H]."""
    num_tokens, top_k, hidden = per_pair.shape
    if residual is not None:
        assert residual.shape == (num_tokens, hidden), residual.shape
        assert residual.dtype == per_pair.dtype, (residual.dtype, per_pair.dtype)
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    out = torch.empty(num_tokens, hidden, dtype=per_pair.dtype, device=per_pair.device)
    pdl = triton_pdl.enabled(per_pair.device)
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden, _BLOCK_SUM))](
        per_pair, out if residual is None else residual, out,
        hidden, per_pair.stride(0), per_pair.stride(1),
        0 if residual is None else residual.stride(0), out.stride(0),
        K=top_k, HAS_RESIDUAL=residual is not None, BLOCK_N=_BLOCK_SUM,
        PDL=pdl, num_warps=_NUM_WARPS, launch_pdl=pdl,
    )  # fmt: skip
    return out


def _sort_pairs(flat_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T * k]: the pairs' indices sorted by expert, stable; bounds [E + 1] int32: expert
    e's pairs are order[bounds[e]:bounds[e + 1]]), on the device, with no host sync."""
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    experts = torch.arange(num_experts + 1, dtype=sorted_ids.dtype, device=flat_ids.device)
    return order, torch.searchsorted(sorted_ids, experts, out_int32=True)


def _launch_config(pairs: int, num_experts: int, device: torch.device, dtype: torch.dtype):
    """(BLOCK_N, largest BLOCK_K, the launch arguments both kernels share), from shapes only:
    BLOCK_M fits an expert's rows if they were spread evenly, in [16, _MAX_BLOCK_M]."""
    rows_per_expert = -(-pairs // num_experts)
    block_m = min(_MAX_BLOCK_M, max(_MIN_DOT, triton.next_power_of_2(rows_per_expert)))
    block_n, max_block_k = _DECODE_BLOCKS if block_m == _MIN_DOT else _PREFILL_BLOCKS
    pdl = triton_pdl.enabled(device)
    common = dict(
        NUM_EXPERTS=num_experts,
        EXPERTS_PAD=triton.next_power_of_2(num_experts),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # NOTE: tl.dot defaults to tf32 for fp32 operands, ~3 decimal digits; bf16/fp16 ignore it.
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        PDL=pdl,
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
        launch_pdl=pdl,
    )
    return block_n, max_block_k, common


def _block_k(k: int, max_block_k: int, weight: Matrix) -> int:
    """The K step: an fp8 stack's divides its scale blocks (or one block spans K)."""
    step = min(max_block_k, max(_MIN_DOT, triton.next_power_of_2(k)))
    if isinstance(weight, Fp8Weight) and weight.block_k < k:
        while weight.block_k % step:
            step //= 2
        if step < _MIN_DOT:
            raise ValueError(
                f"fp8 experts: a scale block of {weight.block_k} columns is not a multiple of "
                f"{_MIN_DOT} (tl.dot's smallest K step)"
            )
    return step


def _experts(
    h: torch.Tensor,
    routing: Routing,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    sorted_pairs = None if routing.order is None else (routing.order, routing.bounds)
    return fused_experts(h, routing.weights, routing.ids, gate_up, down, sorted_pairs, residual)


def _experts_and_shared(
    h: torch.Tensor,
    routing: Routing,
    gate_up: Matrix,
    down: Matrix,
    shared_gate_up: Matrix,
    shared_down: Matrix,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One token's layer with the shared experts as slots of the GEMV kernels; None for more
    tokens (the tiled kernels do not take them) or matrices that do not fit as slots."""
    shared = triton_moe_gemv.Shared(shared_gate_up, shared_down)
    if not triton_moe_gemv.applies(h, gate_up, down, shared) or not h.is_contiguous():
        return None
    return triton_moe_gemv.one_token_moe(
        h, routing.weights, routing.ids, gate_up, down, shared, residual, norm_weight
    )


KERNELS = MoeKernels(
    route=route_tokens,
    experts=_experts,
    experts_and_shared=_experts_and_shared,
    norm_and_route=route_normed_tokens,
)
"""engine.moe.MoE's kernels on CUDA."""


@triton.jit
def _active_expert(bounds_ptr, slot, NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr):
    """The slot-th expert (by id) that some pair chose, and its [start, end) of the sorted
    pairs; start == end past the last such expert."""
    experts = tl.arange(0, EXPERTS_PAD)
    real = experts < NUM_EXPERTS
    starts = tl.load(bounds_ptr + experts, mask=real, other=0)
    ends = tl.load(bounds_ptr + experts + 1, mask=real, other=0)
    chosen = ends > starts
    this = chosen & (tl.cumsum(chosen.to(tl.int32), 0) == slot + 1)
    expert = tl.sum(tl.where(this, experts, 0), 0)
    return expert, tl.sum(tl.where(this, starts, 0), 0), tl.sum(tl.where(this, ends, 0), 0)


@triton.jit
def _load_x(x_rows, valid, ks, K, EVEN_K: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] of one K step from rows x_rows, zeros where not valid or past K."""
    if EVEN_K:
        return tl.load(x_rows[:, None] + ks[None, :], mask=valid[:, None], other=0.0)
    return tl.load(
        x_rows[:, None] + ks[None, :], mask=valid[:, None] & (ks < K)[None, :], other=0.0
    )


@triton.jit
def _load_w(
    w_cols, s_cols, k, ks, K, dtype: tl.constexpr, EVEN_K: tl.constexpr, SCALE_K: tl.constexpr
):
    """The weight tile [BLOCK_K, BLOCK_N] of one K step in `dtype`: rows w_cols (K-contiguous),
    zero past K; SCALE_K > 0: fp8, times the scales of the step's block (s_cols: the rows' scale
    pointers), rounded to dtype."""
    if EVEN_K:
        w = tl.load(w_cols[None, :] + ks[:, None])
    else:
        w = tl.load(w_cols[None, :] + ks[:, None], mask=(ks < K)[:, None], other=0.0)
    if SCALE_K > 0:
        w = (w.to(tl.float32) * tl.load(s_cols + k // SCALE_K)[None, :]).to(dtype)
    return w


@triton.jit
def _gate_up_kernel(
    h_ptr,  # [T, H]
    w_ptr,  # [E, 2 * I, H]: gate rows, then up rows
    s_ptr,  # [E, 2 * I, KB] float32: an fp8 stack's scales (read if SCALE_K)
    order_ptr,  # [T * k]: pair index (token * k + slot) of each sorted position
    bounds_ptr,  # [E + 1] int32: expert e's sorted positions are [bounds[e], bounds[e + 1])
    out_ptr,  # [T * k, I]: silu(gate) * up, by sorted position
    H,
    I,  # noqa: E741 (the intermediate size, as in the papers)
    TOP_K,
    stride_ht,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALE_K: tl.constexpr,  # columns a scale covers; 0: a weight tensor, no scales
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    triton_pdl.await_previous_kernel(PDL)
    expert, start, end = _active_expert(bounds_ptr, tl.program_id(0), NUM_EXPERTS, EXPERTS_PAD)
    if start == end:  # fewer experts chosen than the grid allows for
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past I re-read the last one: weight loads stay unpredicated, within the expert's
    # gate and up rows; only the store is masked.
    safe_cols = tl.minimum(cols, I - 1)
    gate_cols = w_ptr + expert.to(tl.int64) * stride_we + safe_cols * stride_wn
    up_cols = gate_cols + I * stride_wn
    gate_scales = s_ptr + expert.to(tl.int64) * stride_se + safe_cols * stride_sn
    up_scales = gate_scales + I * stride_sn
    dtype = out_ptr.dtype.element_ty
    for m in range(start, end, BLOCK_M):
        rows = m + tl.arange(0, BLOCK_M)
        valid = rows < end
        pairs = tl.load(order_ptr + rows, mask=valid, other=0)
        x_rows = h_ptr + (pairs // TOP_K) * stride_ht
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, H, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            x = _load_x(x_rows, valid, ks, H, EVEN_K)
            w = _load_w(gate_cols, gate_scales, k, ks, H, dtype, EVEN_K, SCALE_K)
            gate = tl.dot(x, w, gate, input_precision=PRECISION)
            w = _load_w(up_cols, up_scales, k, ks, H, dtype, EVEN_K, SCALE_K)
            up = tl.dot(x, w, up, input_precision=PRECISION)
        # Rounded as F.linear's output, then F.silu's, then the product's.
        g32 = gate.to(dtype).to(tl.float32)
        silu = (g32 / (1.0 + tl.exp(-g32))).to(dtype).to(tl.float32)
        out = (silu * up.to(dtype).to(tl.float32)).to(dtype)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
        tl.store(out_ptrs, out, mask=valid[:, None] & (cols < I)[None, :])


@triton.jit
def _down_kernel(
    x_ptr,  # [T * k, I]: the gate_up kernel's output, by sorted position
    w_ptr,  # [E, H, I]
    s_ptr,  # [E, H, KB] float32: an fp8 stack's scales (read if SCALE_K)
    order_ptr,  # [T * k]
    bounds_ptr,  # [E + 1] int32
    weights_ptr,  # [T * k] float32: routing weight of each pair
    out_ptr,  # [T * k, H]: weight * down(x), by pair
    I,  # noqa: E741
    H,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALE_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    triton_pdl.await_previous_kernel(PDL)
    expert, start, end = _active_expert(bounds_ptr, tl.program_id(0), NUM_EXPERTS, EXPERTS_PAD)
    if start == end:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_cols = tl.minimum(cols, H - 1)
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + safe_cols * stride_wn
    s_cols = s_ptr + expert.to(tl.int64) * stride_se + safe_cols * stride_sn
    dtype = out_ptr.dtype.element_ty
    for m in range(start, end, BLOCK_M):
        rows = m + tl.arange(0, BLOCK_M)
        valid = rows < end
        pairs = tl.load(order_ptr + rows, mask=valid, other=0)
        x_rows = x_ptr + rows.to(tl.int64) * stride_xt
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, I, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            x = _load_x(x_rows, valid, ks, I, EVEN_K)
            w = _load_w(w_cols, s_cols, k, ks, I, dtype, EVEN_K, SCALE_K)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
        # F.linear's output, rounded, times the fp32 weight, rounded once (as the torch path).
        out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
        out_ptrs = out_ptr + pairs[:, None] * stride_ot + cols[None, :]
        tl.store(out_ptrs, out, mask=valid[:, None] & (cols < H)[None, :])


@triton.jit
def _sum_pairs_kernel(
    pairs_ptr,  # [T, k, H]: the down kernel's output
    residual_ptr,  # [T, H] (read only if HAS_RESIDUAL)
    out_ptr,  # [T, H]
    H,
    stride_pt,
    stride_pk,
    stride_rt,
    stride_ot,
    K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    triton_pdl.await_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = cols < H
    acc = tl.zeros([BLOCK_N], tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + token * stride_rt + cols, mask=live, other=0.0).to(tl.float32)
    for slot in tl.static_range(K):
        row = pairs_ptr + token * stride_pt + slot * stride_pk
        acc += tl.load(row + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=live)
