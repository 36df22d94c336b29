"""DeepSeek's MoE routing on the GPU, with the sort of the (token, slot) pairs by expert that
engine.triton_moe's fused_experts needs: at decode sizes the router's logits in one kernel, then
the routing and the sort in one Triton program.

`router_logits` computes F.linear(h.float(), gate.weight) in float32 in one kernel, where torch
takes three (h.float()'s copy, then cuBLAS's fp32 GEMV and its reduction).

`route_and_sort` computes engine.moe.route's choice and weights (sigmoid or softmax scores, the
correction bias, the group limit of noaux_tc and group_limited_greedy, top-k, norm_topk_prob,
routed_scaling_factor) for every token, then counts each expert's pairs and writes every pair
to its sorted place: one kernel where torch takes ~10 (scores, top-k's two, gathers, the sort,
the bounds' search), each a dependent launch in a decode step's CUDA graph. Launched with
programmatic dependent launch (engine.triton_pdl).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine import triton_pdl
from engine.deepseek_config import MoeConfig
from engine.moe import Routing, route
from engine.triton_ops import rms_normalized

_NUM_WARPS = 4
# route_and_sort's one program: at most this many (token, slot) pairs (decode batches), and
# [BLOCK_T, experts] tiles of at most _ROUTE_TILE scores.
_MAX_ROUTED_PAIRS = 1024
_MAX_ROUTED_EXPERTS = 256
_ROUTE_TILE = 4096
# router_logits' kernel up to this many tokens (decode batches); F.linear past it. Its programs
# hold [BLOCK_T, BLOCK_E, BLOCK_H] products of at most _LOGITS_TILE, and read h in steps of at
# most _MAX_LOGITS_BLOCK_H columns.
_MAX_LOGITS_TOKENS = 128
_LOGITS_TILE = 8192
_MAX_LOGITS_BLOCK_H = 2048


def route_tokens(
    h: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, moe: MoeConfig
) -> Routing:
    """engine.moe.MoeKernels.route on CUDA: route_and_sort of router_logits(h, weight)."""
    return route_and_sort(router_logits(h, weight), correction_bias, moe)


def route_normed_tokens(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    moe: MoeConfig,
) -> tuple[torch.Tensor, Routing] | None:
    """engine.moe.MoeKernels.norm_and_route on CUDA: h = the RMSNorm of x [T, H] (rounded as
    engine.triton_ops.rms_norm rounds it) computed inside the router's logits kernel, which
    stores it, and the routing of h: (h, Routing). One kernel less than norm, logits, routing;
    None past the logits kernel's sizes."""
    num_tokens = x.shape[0]
    if num_tokens > _MAX_LOGITS_TOKENS or num_tokens == 0 or x.stride(-1) != 1:
        return None
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    logits = router_logits(x, weight, (norm_weight, eps, h))
    return h, route_and_sort(logits, correction_bias, moe)


def router_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
) -> torch.Tensor:
    """F.linear(h.float(), weight) -> [T, E] float32: h [T, H] (any float dtype, upcast
    exactly), weight [E, H] float32. At decode sizes one kernel with a program per (BLOCK_E
    experts, BLOCK_T tokens): at T=1 a program per expert (64 programs at DeepSeek-V2-Lite's
    512 KB of weights, 256 at V3's 7 MB), each streaming its expert's row; wider tiles as T
    grows, so that each weight is read once per BLOCK_T tokens. Untuned.
    norm: (norm weight [H], eps, out [T, H]): h is the norm's input, normalized by every
    program for its dots (a first pass over the row for its mean square) and stored into `out`
    by the first program of each token block."""
    num_tokens, hidden = h.shape
    num_experts = weight.shape[0]
    if num_tokens > _MAX_LOGITS_TOKENS or num_tokens == 0:
        assert norm is None, "route_normed_tokens keeps to the kernel's sizes"
        return F.linear(h.float(), weight)
    norm_weight, eps, normed = norm if norm is not None else (h, 0.0, h)
    assert weight.dtype == torch.float32 and weight.shape[1] == hidden, (weight.dtype, weight.shape)
    assert weight.stride(-1) == 1, weight.stride()
    h = h if h.stride(-1) == 1 else h.contiguous()
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=h.device)
    block_t = min(triton.next_power_of_2(num_tokens), 16)
    block_e = max(1, block_t // 4)
    block_h = min(
        triton.next_power_of_2(hidden), _MAX_LOGITS_BLOCK_H, _LOGITS_TILE // (block_t * block_e)
    )
    pdl = triton_pdl.enabled(h.device)
    _logits_kernel[(triton.cdiv(num_experts, block_e), triton.cdiv(num_tokens, block_t))](
        h, weight, logits, norm_weight, normed, eps,
        num_tokens, num_experts, hidden, h.stride(0), weight.stride(0), logits.stride(0),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h, EVEN_H=hidden % block_h == 0,
        NORM=norm is not None, PDL=pdl, num_warps=_NUM_WARPS, launch_pdl=pdl,
    )  # fmt: skip
    return logits


@triton.jit
def _logits_kernel(
    h_ptr,  # [T, H] any float dtype (NORM: the norm's input)
    w_ptr,  # [E, H] float32
    out_ptr,  # [T, E] float32
    norm_w_ptr,  # [H]: NORM's weight
    normed_ptr,  # [T, H] contiguous: NORM's output, stored by the programs of expert block 0
    eps,
    T,
    E,
    H,
    stride_ht,
    stride_we,
    stride_ot,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    # Rows past T and E re-read the last one: loads stay unpredicated but on H; only the store
    # is masked.
    x_rows = h_ptr + tl.minimum(tokens, T - 1).to(tl.int64) * stride_ht
    w_rows = w_ptr + tl.minimum(experts, E - 1).to(tl.int64) * stride_we
    # The router's weights are no kernel's output: the first tile is requested while the
    # kernel before (which writes h) ends.
    w = _row_tile(w_rows, 0, H, BLOCK_H, EVEN_H)
    triton_pdl.await_previous_kernel(PDL)
    inv_rms = tl.zeros([BLOCK_T], tl.float32)
    if NORM:  # engine.triton_ops.rms_norm's mean square, the whole row first
        squares = tl.zeros([BLOCK_T], tl.float32)
        for k in range(0, H, BLOCK_H):
            x32 = _row_tile(x_rows, k, H, BLOCK_H, EVEN_H).to(tl.float32)
            squares += tl.sum(x32 * x32, 1)
        inv_rms = tl.rsqrt(squares / H + eps)
    x = _normed_tile(x_rows, norm_w_ptr, normed_ptr, inv_rms, tokens, 0, T, H,
                     BLOCK_H, EVEN_H, NORM)  # fmt: skip
    acc = tl.sum(x[:, None, :] * w[None, :, :], 2)
    for k in range(BLOCK_H, H, BLOCK_H):
        w = _row_tile(w_rows, k, H, BLOCK_H, EVEN_H)
        x = _normed_tile(x_rows, norm_w_ptr, normed_ptr, inv_rms, tokens, k, T, H,
                         BLOCK_H, EVEN_H, NORM)  # fmt: skip
        acc += tl.sum(x[:, None, :] * w[None, :, :], 2)
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + experts[None, :]
    tl.store(out_ptrs, acc, mask=(tokens < T)[:, None] & (experts < E)[None, :])


@triton.jit
def _normed_tile(
    x_rows, norm_w_ptr, normed_ptr, inv_rms, tokens, k, T, H,
    BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """Columns [k, k + BLOCK_H) of the tokens' rows in float32, normalized (NORM: rounded to
    their dtype as the norm's output, which expert block 0's programs store)."""
    x = _row_tile(x_rows, k, H, BLOCK_H, EVEN_H)
    if not NORM:
        return x.to(tl.float32)
    ks = k + tl.arange(0, BLOCK_H)
    norm_w = tl.load(norm_w_ptr + ks, mask=ks < H, other=0.0)
    h = rms_normalized(x, inv_rms[:, None], norm_w[None, :]).to(normed_ptr.dtype.element_ty)
    if tl.program_id(0) == 0:
        mask = (tokens < T)[:, None] & (ks < H)[None, :]
        tl.store(normed_ptr + tokens.to(tl.int64)[:, None] * H + ks[None, :], h, mask=mask)
    return h.to(tl.float32)


@triton.jit
def _row_tile(rows, k, H, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr):
    """Columns [k, k + BLOCK_H) of the rows at `rows` ([R] pointers), zero past H."""
    ks = k + tl.arange(0, BLOCK_H)
    if EVEN_H:
        return tl.load(rows[:, None] + ks[None, :])
    return tl.load(rows[:, None] + ks[None, :], mask=(ks < H)[None, :], other=0.0)


def route_and_sort(
    logits: torch.Tensor, correction_bias: torch.Tensor | None, moe: MoeConfig
) -> Routing:
    """engine.moe.route's choice and weights, with the pairs sorted by expert for
    fused_experts: for decode batches in one Triton program (one kernel for what takes torch
    ~10), otherwise torch's route (prefill, outside CUDA graphs), fused_experts sorting.

    NOTE: ties between scores go to the lower expert id; torch.topk leaves their order
    unspecified. Float32 scores of a trained (or random) router tie only for equal logits.
    """
    num_tokens, num_experts = logits.shape
    top_k = moe.num_experts_per_tok
    pairs = num_tokens * top_k
    if pairs > _MAX_ROUTED_PAIRS or num_experts > _MAX_ROUTED_EXPERTS or pairs == 0:
        return Routing(*route(logits, correction_bias, moe))
    device = logits.device
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1, (logits.dtype, logits.stride())
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    rank = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    order = torch.empty(pairs, dtype=torch.int32, device=device)
    bounds = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    experts_pad = triton.next_power_of_2(num_experts)
    group_size = num_experts // moe.n_group
    grouped = moe.topk_method != "greedy" and moe.n_group > 1
    pdl = triton_pdl.enabled(device)
    _route_sort_kernel[(1,)](
        logits, logits if correction_bias is None else correction_bias,
        weights, ids, rank, order, bounds,
        num_tokens, logits.stride(0), moe.routed_scaling_factor,
        E=num_experts, E_PAD=experts_pad, K=top_k, K_PAD=triton.next_power_of_2(top_k),
        N_GROUP=moe.n_group if grouped else 1,
        G_PAD=triton.next_power_of_2(moe.n_group), TOPK_GROUP=moe.topk_group,
        TOP2=moe.topk_method == "noaux_tc" and group_size > 1,
        MASK_FILL=float("-inf") if moe.topk_method == "noaux_tc" else 0.0,
        SIGMOID=moe.scoring_func == "sigmoid", HAS_BIAS=correction_bias is not None,
        NORM=moe.norm_topk_prob,
        BLOCK_T=min(triton.next_power_of_2(num_tokens), max(1, _ROUTE_TILE // experts_pad)),
        PDL=pdl, num_warps=_NUM_WARPS, launch_pdl=pdl,
    )  # fmt: skip
    return Routing(weights, ids, order, bounds)


@triton.jit
def _route_sort_kernel(
    logits_ptr,  # [T, E] float32
    bias_ptr,  # [E] float32 correction bias (read only if HAS_BIAS)
    weights_ptr,  # [T, k] float32 out
    ids_ptr,  # [T, k] int32 out
    rank_ptr,  # [T, k] int32 scratch: each pair's place among its expert's pairs
    order_ptr,  # [T * k] int32 out: pair indices sorted by expert (stable)
    bounds_ptr,  # [E + 1] int32 out
    T,
    stride_lt,
    scale,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr,  # 1: no group limit
    G_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP2: tl.constexpr,  # groups scored by their two best (noaux_tc), else by their best
    MASK_FILL: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: routes BLOCK_T tokens at a time, counting each expert's pairs and each
    pair's rank among them (pairs in index order), then places every pair at bounds[expert] +
    rank once all counts are known."""
    triton_pdl.await_previous_kernel(PDL)
    experts = tl.arange(0, E_PAD)
    slots = tl.arange(0, K_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for t0 in range(0, T, BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        live = tokens < T
        scores, choice = _scores(
            logits_ptr, bias_ptr, tokens, live, stride_lt, experts, E, SIGMOID, HAS_BIAS
        )
        if N_GROUP > 1:
            choice = _limit_groups(choice, experts, E, N_GROUP, G_PAD, TOPK_GROUP, TOP2, MASK_FILL)
        ids, weights, chosen = _top_k(scores, choice, experts, slots, K, E_PAD)
        chosen = tl.where(live[:, None], chosen, 0)
        if NORM:
            weights = weights / (tl.sum(weights, 1)[:, None] + 1e-20)
        # Pairs of earlier tokens (this block's, then all before it) that chose each expert.
        before = tl.cumsum(chosen, 0) - chosen + counts[None, :]
        rank = tl.zeros([BLOCK_T, K_PAD], tl.int32)
        for j in tl.static_range(K):
            expert_j = tl.sum(tl.where(slots[None, :] == j, ids, 0), 1)
            rank_j = tl.sum(tl.where(experts[None, :] == expert_j[:, None], before, 0), 1)
            rank = tl.where(slots[None, :] == j, rank_j[:, None], rank)
        counts += tl.sum(chosen, 0)
        pairs = tokens[:, None] * K + slots[None, :]
        mask = live[:, None] & (slots < K)[None, :]
        tl.store(weights_ptr + pairs, weights * scale, mask=mask)
        tl.store(ids_ptr + pairs, ids, mask=mask)
        tl.store(rank_ptr + pairs, rank, mask=mask)
    tl.store(bounds_ptr + 1 + experts, tl.cumsum(counts, 0), mask=experts < E)
    tl.store(bounds_ptr + experts, 0, mask=experts == 0)
    tl.debug_barrier()  # the stores above, by all threads, before any thread reads them
    for t0 in range(0, T, BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        pairs = tokens[:, None] * K + slots[None, :]
        mask = (tokens < T)[:, None] & (slots < K)[None, :]
        ids = tl.load(ids_ptr + pairs, mask=mask, other=0)
        start = tl.load(bounds_ptr + ids, mask=mask, other=0)
        rank = tl.load(rank_ptr + pairs, mask=mask, other=0)
        tl.store(order_ptr + start + rank, pairs, mask=mask)


@triton.jit
def _scores(logits_ptr, bias_ptr, tokens, live, stride_lt, experts, E, SIGMOID, HAS_BIAS):
    """(scores, choice: the scores biased, -inf past E), [BLOCK_T, E_PAD] float32."""
    real = experts < E
    x = tl.load(
        logits_ptr + tokens[:, None] * stride_lt + experts[None, :],
        mask=live[:, None] & real[None, :],
        other=0.0,
    )
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        x = tl.where(real[None, :], x, float("-inf"))
        e = tl.exp(x - tl.max(x, 1)[:, None])
        scores = e / tl.sum(e, 1)[:, None]
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=real, other=0.0)[None, :]
    return scores, tl.where(real[None, :], choice, float("-inf"))


@triton.jit
def _limit_groups(choice, experts, E, N_GROUP, G_PAD, TOPK_GROUP, TOP2, MASK_FILL):
    """choice with experts outside each token's TOPK_GROUP best groups set to MASK_FILL."""
    group_of = experts // (E // N_GROUP)
    groups = tl.arange(0, G_PAD)
    group_scores = tl.full([choice.shape[0], G_PAD], float("-inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        in_group = (group_of == g)[None, :]
        best = tl.max(tl.where(in_group, choice, float("-inf")), 1)
        if TOP2:
            first = tl.min(tl.where(in_group & (choice == best[:, None]), experts, E), 1)
            second = in_group & (experts[None, :] != first[:, None])
            best += tl.max(tl.where(second, choice, float("-inf")), 1)
        group_scores = tl.where(groups[None, :] == g, best[:, None], group_scores)
    keep = tl.zeros(choice.shape, tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(group_scores, 1)
        group = tl.min(tl.where(group_scores == best[:, None], groups, G_PAD), 1)
        keep |= group_of[None, :] == group[:, None]
        group_scores = tl.where(groups[None, :] == group[:, None], float("-inf"), group_scores)
    return tl.where(keep, choice, tl.where(experts < E, MASK_FILL, float("-inf"))[None, :])


@triton.jit
def _top_k(scores, choice, experts, slots, K: tl.constexpr, E_PAD: tl.constexpr):
    """(ids [BLOCK_T, K_PAD] int32 of the K best choices, best first; their unbiased scores;
    chosen [BLOCK_T, E_PAD] int32: 1 where an expert was chosen)."""
    ids = tl.zeros([choice.shape[0], slots.shape[0]], tl.int32)
    weights = tl.zeros([choice.shape[0], slots.shape[0]], tl.float32)
    chosen = tl.zeros(choice.shape, tl.int32)
    for j in tl.static_range(K):
        best = tl.max(choice, 1)
        expert = tl.min(tl.where(choice == best[:, None], experts[None, :], E_PAD), 1)
        this = experts[None, :] == expert[:, None]
        ids = tl.where(slots[None, :] == j, expert[:, None], ids)
        weights = tl.where(
            slots[None, :] == j, tl.sum(tl.where(this, scores, 0.0), 1)[:, None], weights
        )
        chosen = tl.where(this, 1, chosen)
        choice = tl.where(this, float("-inf"), choice)
    return ids, weights, chosen
