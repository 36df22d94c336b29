"""One token's routed experts on the GPU as GEMVs: engine.triton_moe's path at T=1 (bs=1 decode).

With one token the k chosen experts are distinct and each multiplies one row, so the fused
kernels' tl.dot tiles (16 rows, the expert's sorted pairs) are 15/16 padding and their sort is
moot. Here each program streams whole rows of one chosen expert's weights and multiplies them
elementwise in fp32, as engine.triton_linear's GEMV does, with the expert's id read from the
routing on the device (so no weight can be requested before the routing kernel ends: the
programs wait for it first).

- `_gate_up_kernel`, grid (slot, I / PAIRS): a program owns PAIRS gate rows of slot s's expert
  and the up rows paired with them, and stores silu(gate) * up into row s of [k, I].
- `_down_kernel`, grid (H / BLOCK_N,): a program owns BLOCK_N rows of every chosen expert's down
  projection and walks the k slots in order: each slot's output rounded, times its routing
  weight, rounded, summed in fp32 after the residual, rounded once. That is the sum over k that
  engine.triton_moe's third kernel does, done here in the epilogue: two kernels, not three.

Rounding is engine.triton_moe's: each projection's output, silu, the product and the weighted
down output are rounded to the input dtype as separate torch ops would round them.

`one_token_moe` also takes the layer's shared experts (`Shared`: the MLP every token goes
through, S experts of the routed ones' width I as one of width S * I) as S more slots of both
kernels, of weight 1, and stores the next norm's scaled input as engine.triton_linear's residual
epilogue does: a MoE layer in two kernels where the shared MLP took two more. The shared slots'
programs request their first weight tile before waiting for the routing, which they do not
read; the sum of S slots of width I equals the one MLP of width S * I up to the rounding of
each slot's down output.

FP8 stacks (engine.fp8.Fp8Weight [E, N, K] with scales [E, N, KB]) are streamed as stored and
scaled as engine.triton_fp8_scales does for the dense GEMV; `applies` is False for a scale block
the K steps cannot step by.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine import triton_fp8_scales, triton_pdl
from engine.fp8 import Fp8Weight, Matrix

__all__ = ["Shared", "applies", "one_token_experts", "one_token_moe"]

# (rows a program, largest K step, warps), the fastest of the pairs timed on an H200 at
# DeepSeek-V2-Lite's shapes (26 layers' routed experts in one CUDA graph: 3.26 TB/s, against
# 2.41 for the tiled kernels): gate_up 16 rows in K steps of 512 (1,056 programs at T=1), down
# 2 rows (1,024 programs; its I of 1,408 in two steps, the second masked).
_GATE_UP = (16, 512, 8)
_DOWN = (2, 1024, 4)


class Shared(NamedTuple):
    """A MoE layer's shared experts as slots: their MLP's gate_up [2 * S * I, H] (gate rows,
    then up rows) and down [H, S * I], of the routed experts' kind (tensors of the same dtype,
    or fp8 with the same scale blocks)."""

    gate_up: Matrix
    down: Matrix


def applies(h: torch.Tensor, gate_up: Matrix, down: Matrix, shared: Shared | None = None) -> bool:
    """Whether `one_token_experts` computes the experts of h [T, H]: one token, and scale blocks
    (of fp8 stacks) its K steps can step by; and, given `shared`, whether they fit as slots."""
    steps = ((gate_up, _step(_GATE_UP, gate_up)), (down, _step(_DOWN, down)))
    if h.shape[0] != 1 or any(triton_fp8_scales.scaling(w, k) is None for w, k in steps):
        return False
    return shared is None or _fits_as_slots(shared, steps)


def _fits_as_slots(shared: Shared, steps) -> bool:
    """The shared MLP's matrices stream as the routed stacks' do: rows of the same kind, scaled
    the same way by the same K steps, a slot's columns of down starting on a scale block."""
    (gate_up, gate_up_step), (down, down_step) = steps
    hidden, inter = down.shape[1], down.shape[2]
    width = shared.down.shape[-1]
    if width % inter or shared.gate_up.shape != (2 * width, hidden):
        return False
    if shared.down.shape != (hidden, width):
        return False
    for routed, mine, step in (
        (gate_up, shared.gate_up, gate_up_step),
        (down, shared.down, down_step),
    ):
        if isinstance(routed, Fp8Weight) != isinstance(mine, Fp8Weight):
            return False
        if isinstance(mine, Fp8Weight):
            if mine.weight.stride(-1) != 1:
                return False
        elif mine.dtype != routed.dtype or mine.stride(-1) != 1:
            return False
        mode = triton_fp8_scales.scaling(routed, step)
        if triton_fp8_scales.scaling(mine, step) != mode:
            return False
        if mode == triton_fp8_scales.BLOCK_SCALED and mine.block_k != routed.block_k:
            return False
    mode = triton_fp8_scales.scaling(down, down_step)
    return mode != triton_fp8_scales.BLOCK_SCALED or inter % down.block_k == 0


def one_token_experts(
    h: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: Matrix,
    down: Matrix,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """engine.triton_moe.fused_experts for one token: h [1, H], weights [1, k] float32, ids [1, k]
    distinct expert ids, gate_up [E, 2 * I, H], down [E, H, I], residual [1, H] | None -> [1, H]."""
    out, _ = _launch(h, weights, ids, gate_up, down, residual, None, None)
    return out


def one_token_moe(
    h: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: Matrix,
    down: Matrix,
    shared: Shared,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's output for one token: residual + its routed experts (as one_token_experts)
    + its shared experts, and that times the next norm's weight [H] (engine.model.NormInput's
    `scaled`): ([1, H], [1, H])."""
    return _launch(h, weights, ids, gate_up, down, residual, shared, norm_weight)


def _launch(h, weights, ids, gate_up, down, residual, shared, norm_weight):
    _, hidden = h.shape
    top_k = ids.shape[1]
    inter = down.shape[2]
    assert applies(h, gate_up, down, shared) and h.is_contiguous(), h.shape
    ids = ids if ids.is_contiguous() else ids.contiguous()
    weights = weights if weights.is_contiguous() else weights.contiguous()
    pdl = triton_pdl.enabled(h.device)
    num_shared = 0 if shared is None else shared.down.shape[-1] // inter
    shared = shared or Shared(gate_up, down)  # never read with no shared slot

    activated = torch.empty(top_k + num_shared, inter, dtype=h.dtype, device=h.device)
    rows, _, warps = _GATE_UP
    block_k = _step(_GATE_UP, gate_up)
    w, scale = triton_fp8_scales.operands(gate_up)
    sw, sscale = triton_fp8_scales.operands(shared.gate_up)
    scales = triton_fp8_scales.constexprs(gate_up, block_k)
    _gate_up_kernel[(top_k + num_shared, triton.cdiv(inter, rows // 2))](
        h, w, scale, ids, activated, hidden, inter, w.stride(0), w.stride(1),
        scale.stride(0), scale.stride(1), scale.shape[-1],
        sw, sscale, sw.stride(0), sscale.stride(0), num_shared * inter,
        TOP_K=top_k, PAIRS=rows // 2, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0, **scales,
        PDL=pdl, num_warps=warps, num_stages=1, launch_pdl=pdl,
    )  # fmt: skip

    out = torch.empty_like(h)
    if residual is not None:
        assert residual.shape == h.shape and residual.dtype == h.dtype, residual.shape
        residual = residual if residual.is_contiguous() else residual.contiguous()
    scaled = None if norm_weight is None else torch.empty_like(h)
    rows, _, warps = _DOWN
    block_k = _step(_DOWN, down)
    w, scale = triton_fp8_scales.operands(down)
    sw, sscale = triton_fp8_scales.operands(shared.down)
    scales = triton_fp8_scales.constexprs(down, block_k)
    _down_kernel[(triton.cdiv(hidden, rows),)](
        activated, w, scale, ids, weights, out if residual is None else residual, out,
        hidden, inter, w.stride(0), w.stride(1), scale.stride(0), scale.stride(1),
        scale.shape[-1], sw, sscale, sw.stride(0), sscale.stride(0),
        out if norm_weight is None else norm_weight, out if scaled is None else scaled,
        TOP_K=top_k, SHARED=num_shared, BLOCK_N=rows, BLOCK_K=block_k,
        EVEN_K=inter % block_k == 0, **scales, HAS_RESIDUAL=residual is not None,
        NORM_OUT=scaled is not None, PDL=pdl, num_warps=warps, num_stages=1, launch_pdl=pdl,
    )  # fmt: skip
    return out, scaled


def _step(config: tuple[int, int, int], weight: Matrix) -> int:
    """The K step of a stack [E, N, K]: the config's, or all of K if shorter (a power of two)."""
    return min(config[1], triton.next_power_of_2(weight.shape[-1]))


@triton.jit
def _load_w(w_rows, k, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The weight tile of rows w_rows ([BLOCK_N, 1] pointers, K-contiguous) at K step k."""
    cols = k + tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
    return tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)


@triton.jit
def _load_x(x_ptr, k, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    cols = k + tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(x_ptr + cols).to(tl.float32)
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _row_dots(
    x_ptr, w_rows, s_rows, first_w, K, KB,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SCALES: tl.constexpr, SCALE_K: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N] fp32: the rows w_rows dotted with x [K], given their first tile (`_load_w` at
    k = 0, loaded by the caller: possibly before waiting for the kernel that writes x); s_rows:
    the rows' scale pointers [BLOCK_N] (read if SCALES)."""
    acc = triton_fp8_scales.scaled_products(
        first_w, _load_x(x_ptr, 0, K, BLOCK_K, EVEN_K), s_rows, 0, KB,
        SCALES, BLOCK_N, BLOCK_K, SCALE_K,
    )  # fmt: skip
    for k in range(BLOCK_K, K, BLOCK_K):
        w = _load_w(w_rows, k, K, BLOCK_K, EVEN_K)
        acc += triton_fp8_scales.scaled_products(
            w, _load_x(x_ptr, k, K, BLOCK_K, EVEN_K), s_rows, k, KB,
            SCALES, BLOCK_N, BLOCK_K, SCALE_K,
        )  # fmt: skip
    y = tl.sum(acc, 1)
    if SCALES == 1:  # ROW_SCALED
        y *= tl.load(s_rows)
    return y


@triton.jit
def _gate_up_kernel(
    h_ptr,  # [1, H]
    w_ptr,  # [E, 2 * I, H]: gate rows, then up rows
    s_ptr,  # [E, 2 * I, KB] float32: SCALES' scales
    ids_ptr,  # [k]: the token's experts
    out_ptr,  # [k + S, I]: silu(gate) * up, by slot
    H,
    I,  # noqa: E741 (the intermediate size, as in the papers)
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    KB,
    sw_ptr,  # [2 * S * I, H]: the shared experts' gate rows, then their up rows
    ss_ptr,  # [2 * S * I, KB] float32: their scales
    stride_swn,
    stride_ssn,
    SHARED_ROWS,  # S * I: from a shared slot's gate rows to its up rows
    TOP_K: tl.constexpr,
    PAIRS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALES: tl.constexpr,
    SCALE_K: tl.constexpr,
    PDL: tl.constexpr,
):
    slot = tl.program_id(0)
    # Row j of the tile is the gate (j even) or up (j odd) row of column j // 2, so that a
    # [PAIRS, 2] reshape splits them; columns past I re-read the last one (the store masks).
    cols = tl.program_id(1) * PAIRS + tl.arange(0, 2 * PAIRS) // 2
    up = tl.arange(0, 2 * PAIRS) % 2
    if slot < TOP_K:
        # The down kernel reads the routing before its own wait: released only once every
        # program here has waited for the routing kernel.
        triton_pdl.await_previous_kernel_then_release(PDL)
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        rows = (tl.minimum(cols, I - 1) + up * I).to(tl.int64)
        w_rows = w_ptr + expert * stride_we + rows[:, None] * stride_wn
        s_rows = s_ptr + expert * stride_se + rows * stride_sn
        first_w = _load_w(w_rows, 0, H, BLOCK_K, EVEN_K)
    else:  # a shared expert: its weights do not depend on the routing
        rows = ((slot - TOP_K) * I + tl.minimum(cols, I - 1) + up * SHARED_ROWS).to(tl.int64)
        w_rows = sw_ptr + rows[:, None] * stride_swn
        s_rows = ss_ptr + rows * stride_ssn
        first_w = _load_w(w_rows, 0, H, BLOCK_K, EVEN_K)
        triton_pdl.await_previous_kernel_then_release(PDL)
    dtype = out_ptr.dtype.element_ty
    y = _row_dots(h_ptr, w_rows, s_rows, first_w, H, KB, 2 * PAIRS, BLOCK_K, EVEN_K,
                  SCALES, SCALE_K).to(dtype)  # fmt: skip
    gate, up_out = tl.split(tl.reshape(y, [PAIRS, 2]))
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(dtype).to(tl.float32)
    out_cols = tl.program_id(1) * PAIRS + tl.arange(0, PAIRS)
    tl.store(
        out_ptr + slot * I + out_cols, (silu * up_out.to(tl.float32)).to(dtype), mask=out_cols < I
    )


@triton.jit
def _down_kernel(
    x_ptr,  # [k + S, I]: the gate_up kernel's output
    w_ptr,  # [E, H, I]
    s_ptr,  # [E, H, KB] float32: SCALES' scales
    ids_ptr,  # [k]
    weights_ptr,  # [k] float32: the routing weights
    residual_ptr,  # [1, H] (read only if HAS_RESIDUAL)
    out_ptr,  # [1, H]
    H,
    I,  # noqa: E741
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    KB,
    sw_ptr,  # [H, S * I]: the shared experts' down projection, slot s's columns [s * I, ...)
    ss_ptr,  # [H, S * I / SCALE_K] float32: its scales
    stride_swn,
    stride_ssn,
    norm_w_ptr,  # [H]: NORM_OUT's next norm weight
    scaled_ptr,  # [1, H]: NORM_OUT's output times norm_w
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,  # shared slots after the routed ones, of weight 1
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALES: tl.constexpr,
    SCALE_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    NORM_OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < H
    safe_rows = tl.minimum(rows, H - 1).to(tl.int64)
    # The routing is complete when this kernel starts (the gate_up kernel releases it only
    # after waiting for it): the first slot's first weight tile streams while gate_up ends.
    first_w = _load_w(w_ptr + tl.load(ids_ptr).to(tl.int64) * stride_we
                      + safe_rows[:, None] * stride_wn, 0, I, BLOCK_K, EVEN_K)  # fmt: skip
    triton_pdl.await_previous_kernel(PDL)
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    if HAS_RESIDUAL:
        total += tl.load(residual_ptr + rows, mask=live, other=0.0).to(tl.float32)
    for slot in tl.static_range(TOP_K + SHARED):
        if slot < TOP_K:
            expert = tl.load(ids_ptr + slot).to(tl.int64)
            w_rows = w_ptr + expert * stride_we + safe_rows[:, None] * stride_wn
            s_rows = s_ptr + expert * stride_se + safe_rows * stride_sn
        else:  # the slot's columns of the shared down projection, on a scale block's start
            first = (slot - TOP_K) * I
            w_rows = sw_ptr + safe_rows[:, None] * stride_swn + first
            s_rows = ss_ptr + safe_rows * stride_ssn
            if SCALES == 2:  # BLOCK_SCALED (a row's one scale covers every slot otherwise)
                s_rows += first // SCALE_K
        if slot > 0:
            first_w = _load_w(w_rows, 0, I, BLOCK_K, EVEN_K)
        y = _row_dots(x_ptr + slot * I, w_rows, s_rows, first_w, I, KB, BLOCK_N, BLOCK_K,
                      EVEN_K, SCALES, SCALE_K)  # fmt: skip
        if slot < TOP_K:
            # F.linear's output, rounded, times the fp32 weight, rounded once (as the torch path).
            y = (y.to(dtype).to(tl.float32) * tl.load(weights_ptr + slot)).to(dtype)
        total += y.to(dtype).to(tl.float32)
    out = total.to(dtype)
    tl.store(out_ptr + rows, out, mask=live)
    if NORM_OUT:
        norm_w = tl.load(norm_w_ptr + rows, mask=live, other=0.0).to(tl.float32)
        tl.store(scaled_ptr + rows, (out.to(tl.float32) * norm_w).to(dtype), mask=live)
