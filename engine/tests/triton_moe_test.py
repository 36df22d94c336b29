"""Tests of engine.triton_moe (the fused routed experts) against a float64 reference.

Runs like triton_attention_test: through Triton's CPU interpreter without CUDA, compiled on a GPU
otherwise, where the tests marked `cuda` (CUDA graph capture, DeepSeek-V2-Lite shapes) run too:
    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 python -m pytest -q engine/tests/triton_moe_test.py
    python -m pytest -q engine/tests/triton_moe_test.py

Every case fills the weights of the experts no token chose with NaN: were any of them read, the
output would not be finite.
"""

import pytest
import torch
import torch.nn.functional as F

from engine.tests import triton_mode  # before triton: picks the interpreter on CPU

# isort: split

from engine import triton_moe, triton_moe_gemv, triton_ops, triton_route
from engine.deepseek_config import MoeConfig
from engine.fp8 import Fp8Scheme, Fp8Weight, quantize
from engine.model import EAGER_OPS, NormInput, RMSNorm
from engine.moe import TORCH_KERNELS, MoE, route
from engine.presets import PRESETS

KERNEL = triton_moe._gate_up_kernel
INTERPRETED = triton_mode.interpreted(KERNEL)
DEVICE = triton_mode.device_of(KERNEL)
# Relative error (norm-wise) against float64 of the same rounded inputs. bf16: the projections'
# outputs, silu, the product and the weighted down output are each rounded to 8 bits; the torch
# path (engine.moe) measures the same, ~5e-3 bf16, ~6e-4 fp16, ~3e-7 fp32, on these cases.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


cuda = triton_mode.cuda_only


@pytest.fixture(scope="module", autouse=True)
def _triton_mode():
    with triton_mode.runnable(KERNEL):
        yield


def _case(num_tokens, top_k, num_experts, hidden, inter, dtype, seed=0, ids=None):
    """Inputs on DEVICE: each token picks top_k distinct random experts (or `ids`), weights of
    the unchosen experts are NaN."""
    gen = torch.Generator().manual_seed(seed)
    if ids is None:
        ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    h = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    unchosen = torch.ones(num_experts, dtype=torch.bool)
    unchosen[ids.flatten()] = False
    gate_up[unchosen] = float("nan")
    down[unchosen] = float("nan")
    return [t.to(DEVICE) for t in (h, weights, ids, gate_up, down)]


def _reference(h, weights, ids, gate_up, down) -> torch.Tensor:
    """engine.moe.gather_experts in float64: one gather and two matmuls per chosen expert."""
    out = torch.zeros(h.shape, dtype=torch.float64, device=h.device)
    for expert in ids.unique().tolist():
        tokens, slot = torch.where(ids == expert)
        gate, up = F.linear(h[tokens].double(), gate_up[expert].double()).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert].double())
        out.index_add_(0, tokens, y * weights[tokens, slot, None].double())
    return out


def _assert_matches(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "an unchosen expert's NaN weights were read"
    error = ((out.double() - ref).norm() / ref.norm()).item()
    assert error < TOLERANCE[dtype], error


# (tokens, k, experts, hidden, intermediate): I and H not multiples of the 32-column blocks
# (80, 40, 72), H not a multiple of the K step (72, 96: masked K), unchosen experts.
SHAPES = [
    (1, 1, 4, 64, 64),
    (1, 6, 64, 64, 80),  # T=1 at DeepSeek-V2-Lite's routing: 6 of 64 experts
    (1, 2, 4, 96, 48),
    (3, 2, 8, 96, 48),
    (17, 2, 8, 64, 96),
    (17, 6, 8, 72, 40),  # more rows than one 16-row tile for some experts
]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_k{}_E{}_H{}_I{}".format(*s))
def test_matches_float64_reference(shape, dtype):
    inputs = _case(*shape, dtype)
    _assert_matches(triton_moe.fused_experts(*inputs), _reference(*inputs), dtype)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=str)
@pytest.mark.parametrize("shared_slot", [0, 1], ids=["one_expert_k1", "slot1_shared_k2"])
def test_many_tokens_choosing_one_expert(shared_slot, dtype):
    """All 40 tokens choose expert 3 in slot `shared_slot`, its rows spanning several M tiles.
    k=1 of 8 experts: 16-row tiles. k=2 of 4 experts: 20 pairs an expert give 32-row tiles and
    the 64-column blocks, wider than I (48)."""
    num_experts = 8 if shared_slot == 0 else 4
    shared = torch.full((40, 1), 3)
    if shared_slot == 0:
        ids = shared
    else:
        others = torch.randint(0, 3, (40, 1), generator=torch.Generator().manual_seed(3))
        ids = torch.cat([others, shared], dim=1)
    inputs = _case(40, ids.shape[1], num_experts, 64, 48, dtype, seed=1, ids=ids)
    _assert_matches(triton_moe.fused_experts(*inputs), _reference(*inputs), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_token_path_equals_tiled_path(dtype):
    """One token's GEMVs (engine.triton_moe_gemv) and the sorted, tiled kernels give the same
    result but for fp32's summation order (bf16: within one rounding)."""
    h, weights, ids, gate_up, down = _case(1, 6, 64, 64, 80, dtype, seed=4)
    gemv = triton_moe.fused_experts(h, weights, ids, gate_up, down)
    # The same token twice runs the tiled kernels (two tokens); its first row is the same sum.
    tiled = triton_moe.fused_experts(h.repeat(2, 1), weights.repeat(2, 1), ids.repeat(2, 1),
                                     gate_up, down)  # fmt: skip
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(gemv[0], tiled[0], **tolerance)


def test_deterministic_and_independent_of_slot_order():
    """The same pairs in another slot order give the same bits: no atomics, fp32 sums of k."""
    h, weights, ids, gate_up, down = _case(17, 6, 8, 64, 48, torch.bfloat16, seed=2)
    out = triton_moe.fused_experts(h, weights, ids, gate_up, down)
    assert torch.equal(out, triton_moe.fused_experts(h, weights, ids, gate_up, down))
    swapped = triton_moe.fused_experts(h, weights.flip(1), ids.flip(1), gate_up, down)
    torch.testing.assert_close(swapped, out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 17], ids=["one_token_gemv", "tiles"])
def test_residual_added_to_experts_sum(num_tokens, dtype):
    """fused_experts(residual=r) is r + the sum, rounded once: within the sum's tolerance of
    float64 (the residual adds no rounding of its own), on both paths."""
    h, weights, ids, gate_up, down = _case(num_tokens, 6, 8, 72, 40, dtype, seed=7)
    residual = torch.randn(h.shape, generator=torch.Generator().manual_seed(8)).to(h)
    out = triton_moe.fused_experts(h, weights, ids, gate_up, down, residual=residual)
    _assert_matches(out, _reference(h, weights, ids, gate_up, down) + residual.double(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k", [1, 6])
@pytest.mark.parametrize("with_residual", [False, True], ids=["sum", "sum_residual"])
def test_sum_pairs_matches_torch(with_residual, top_k, dtype):
    """The k rows of each token (and the residual) summed in fp32 and rounded once: the exact
    sum rounded, but for fp32's summation order (bf16: torch's default tolerance, ~1 ulp); H=300
    is not a multiple of the 256-column blocks."""
    gen = torch.Generator().manual_seed(top_k)
    per_pair = torch.randn(3, top_k, 300, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(3, 300, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    expected = per_pair.double().sum(1) + (0 if residual is None else residual.double())
    out = triton_moe._sum_pairs(per_pair, residual)
    assert out.dtype == dtype
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, expected.to(dtype), **tolerance)


# (tokens, experts, hidden): one expert a program at T=1, H past one 2048-column step and not a
# multiple of it; 4 experts a program at 16 tokens, E not a multiple of 4; two token blocks.
LOGIT_SHAPES = [(1, 64, 2048), (1, 16, 2600), (5, 9, 72), (17, 10, 96), (40, 160, 64)]


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=str)
@pytest.mark.parametrize("shape", LOGIT_SHAPES, ids=lambda s: "T{}_E{}_H{}".format(*s))
def test_router_logits_match_f_linear(shape, dtype):
    """As F.linear(h.float(), w): h is upcast exactly, so every dtype gets fp32's tolerance
    (summation order only: ~1e-7 relative a term)."""
    num_tokens, num_experts, hidden = shape
    gen = torch.Generator().manual_seed(num_tokens)
    h = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(num_experts, hidden, generator=gen) * hidden**-0.5).to(DEVICE)
    logits = triton_route.router_logits(h, weight)
    assert logits.dtype == torch.float32 and logits.shape == (num_tokens, num_experts)
    torch.testing.assert_close(logits, F.linear(h.float(), weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 96), (1, 4096), (5, 160)])
def test_norm_in_the_router_kernel_equals_the_norm_kernel_then_routing(num_tokens, hidden, dtype):
    """route_normed_tokens: the RMSNorm computed by the logits kernel's programs (hidden in one
    K step, masked, or in two) is the norm kernel's output bit for bit, and routes as torch."""
    moe = ROUTERS["v2_lite"]
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(num_tokens, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    norm_weight = torch.rand(hidden, generator=gen).add(0.5).to(dtype).to(DEVICE)
    weight = (torch.randn(64, hidden, generator=gen) * hidden**-0.5).to(DEVICE)
    h, routing = triton_route.route_normed_tokens(x, norm_weight, 1e-6, weight, None, moe)
    torch.testing.assert_close(h, triton_ops.rms_norm(x, norm_weight, 1e-6), atol=0, rtol=0)
    logits = triton_route.router_logits(h, weight)
    _assert_routes_as_torch(routing, logits, None, moe)


def test_router_logits_leave_large_batches_to_f_linear():
    h = torch.randn(triton_route._MAX_LOGITS_TOKENS + 1, 32).bfloat16().to(DEVICE)
    weight = torch.randn(8, 32).to(DEVICE)
    assert torch.equal(triton_route.router_logits(h, weight), F.linear(h.float(), weight))


def _moe(experts, k, n_group, topk_group, method, scoring, norm=True, scale=2.5) -> MoeConfig:
    return MoeConfig(
        n_routed_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=8,
        n_shared_experts=1,
        n_group=n_group,
        topk_group=topk_group,
        topk_method=method,
        scoring_func=scoring,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
        first_k_dense_replace=0,
    )


ROUTERS = {
    "v3": _moe(256, 8, 8, 4, "noaux_tc", "sigmoid"),
    "v2_lite": _moe(64, 6, 1, 1, "greedy", "softmax", norm=False, scale=1.0),
    "v2": _moe(160, 6, 8, 3, "group_limited_greedy", "softmax", norm=False, scale=16.0),
    "v3_unnormed": _moe(16, 3, 4, 2, "noaux_tc", "sigmoid", norm=False),
}


def _router_inputs(moe: MoeConfig, num_tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, moe.n_routed_experts, generator=gen) * 2
    bias = None
    if moe.topk_method == "noaux_tc":
        bias = torch.randn(moe.n_routed_experts, generator=gen) * 0.1
    return logits.to(DEVICE), None if bias is None else bias.to(DEVICE)


def _assert_routes_as_torch(routing, logits, bias, moe):
    """Same expert sets per token, and their weights, as engine.moe.route; order and bounds sort
    the pairs by expert, stably."""
    weights, ids = route(logits, bias, moe)
    by_id, got_by_id = ids.sort(dim=1), routing.ids.long().sort(dim=1)
    assert torch.equal(got_by_id.values, by_id.values)
    torch.testing.assert_close(
        routing.weights.gather(1, got_by_id.indices), weights.gather(1, by_id.indices)
    )
    flat = routing.ids.flatten().long()
    expected_order = torch.sort(flat, stable=True).indices
    assert torch.equal(routing.order.long(), expected_order)
    counts = torch.bincount(flat, minlength=moe.n_routed_experts)
    expected_bounds = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    assert torch.equal(routing.bounds.long(), expected_bounds)


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_route_and_sort_matches_torch_route(router, num_tokens):
    """One program routes and sorts; 40 tokens of 256 experts take three 16-token blocks."""
    moe = ROUTERS[router]
    logits, bias = _router_inputs(moe, num_tokens, seed=num_tokens)
    routing = triton_route.route_and_sort(logits, bias, moe)
    assert routing.order is not None
    _assert_routes_as_torch(routing, logits, bias, moe)


def test_route_and_sort_leaves_large_batches_to_torch():
    """Past _MAX_ROUTED_PAIRS pairs (prefill): torch's route, and fused_experts sorts."""
    moe = ROUTERS["v2_lite"]
    logits, bias = _router_inputs(moe, triton_route._MAX_ROUTED_PAIRS // 6 + 1)
    routing = triton_route.route_and_sort(logits, bias, moe)
    weights, ids = route(logits, bias, moe)
    assert routing.order is None and torch.equal(routing.ids, ids)
    assert torch.equal(routing.weights, weights)


def test_experts_with_routed_sort_match_own_sort():
    moe = _moe(8, 2, 1, 1, "greedy", "softmax")
    h, _, _, gate_up, down = _case(17, 2, 8, 64, 48, torch.bfloat16, seed=5, ids=None)
    gate_up = torch.nan_to_num(gate_up, nan=0.01)
    down = torch.nan_to_num(down, nan=0.01)
    logits, bias = _router_inputs(moe, 17)
    routing = triton_route.route_and_sort(logits, bias, moe)
    out = triton_moe.KERNELS.experts(h, routing, gate_up, down, None)
    own = triton_moe.fused_experts(h, routing.weights, routing.ids, gate_up, down)
    torch.testing.assert_close(out, own, atol=0, rtol=0)


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_moe_layer_with_triton_kernels_matches_torch_kernels(num_tokens):
    """engine.moe.MoE (deepseek-tiny: noaux_tc, 8 experts, a shared one) through KERNELS and
    through TORCH_KERNELS, with the same weights: one token with the shared expert as a slot of
    the GEMV kernels (its output's `scaled` for the next norm too), several with the tiles."""
    config = PRESETS["deepseek-tiny"]
    gen = torch.Generator().manual_seed(6)
    layers = [MoE(config, EAGER_OPS, kernels) for kernels in (triton_moe.KERNELS, TORCH_KERNELS)]
    with torch.no_grad():
        for param in layers[0].parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
        layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(num_tokens, config.hidden_size, generator=gen)
    norm = RMSNorm(config.hidden_size, 1e-6, EAGER_OPS)
    norm.weight.data.uniform_(0.5, 1.5, generator=gen)
    norm = norm.to(DEVICE)
    outs = [layer.to(DEVICE)(NormInput(x.to(DEVICE), None, norm.weight, 1e-6), norm)
            for layer in layers]  # fmt: skip
    streams = [out.x if out.residual is None else out.x + out.residual for out in outs]
    torch.testing.assert_close(streams[0], streams[1], rtol=1e-5, atol=1e-5)
    fused = outs[0].scaled is not None
    assert fused == (num_tokens == 1)
    if fused:
        torch.testing.assert_close(outs[0].scaled, outs[0].x * norm.weight)


def _fp8_stack(stack: torch.Tensor, scheme: Fp8Scheme) -> Fp8Weight:
    """[E, N, K] quantized expert by expert, NaN experts (unchosen) kept NaN, scales too."""
    values, scales = [], []
    for matrix in stack:
        if torch.isnan(matrix).all():
            q = torch.full(matrix.shape, float("nan")).to(torch.float8_e4m3fn)
            scale = torch.full((matrix.shape[0], scheme.k_blocks(matrix.shape[1])), float("nan"))
        else:
            q, checkpoint_scale = quantize(matrix.float(), scheme)
            scale = scheme.expand_scale(checkpoint_scale, matrix.shape[0]).contiguous()
        values.append(q)
        scales.append(scale)
    return scheme.matrix(torch.stack(values).to(DEVICE), torch.stack(scales).to(DEVICE))


# (tokens, scale block): one token (the GEMV path where it can step by the block), several
# (the tiled path); blocks of 32 columns (several a row), 48 (not a power of two: the GEMV
# cannot step by it, the tiled kernels step by 16), and one scale per expert matrix.
FP8_CASES = [(1, 32), (1, 48), (1, None), (5, 32), (17, 48), (5, None)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "block"), FP8_CASES, ids=lambda v: str(v))
def test_fp8_experts_match_the_dequantized_experts(num_tokens, block, dtype):
    """fp8 stacks (e4m3 values, float32 scales per row and block) give the experts of the
    matrices they dequantize to, in the compute dtype (as the torch path computes them), on
    both paths; unchosen experts (NaN values and scales) are never read."""
    h, weights, ids, gate_up, down = _case(num_tokens, 2, 8, 96, 80, dtype, seed=5)
    scheme = Fp8Scheme(block, block)
    gate_up, down = (_fp8_stack(w.cpu(), scheme) for w in (gate_up, down))
    one_token = triton_moe_gemv.applies(h, gate_up, down)
    assert one_token == (num_tokens == 1 and block != 48)
    out = triton_moe.fused_experts(h, weights, ids, gate_up, down)
    dense = [w.dense(dtype) for w in (gate_up, down)]
    _assert_matches(out, _reference(h, weights, ids, *dense), dtype)


def test_fp8_experts_refuse_a_block_the_tiles_cannot_step_by():
    h, weights, ids, gate_up, down = _case(3, 2, 4, 64, 48, torch.float32, seed=2)
    gate_up, down = (_fp8_stack(w.cpu(), Fp8Scheme(24, 24)) for w in (gate_up, down))
    with pytest.raises(ValueError, match="scale block of 24 columns is not a multiple of 16"):
        triton_moe.fused_experts(h, weights, ids, gate_up, down)


def _shared_case(num_shared, hidden, inter, dtype, seed):
    """A shared MLP of num_shared experts of width inter: gate_up [2 * S * I, H] (gate rows,
    then up rows), down [H, S * I], a residual and a norm weight, on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    width = num_shared * inter
    gate_up = torch.randn(2 * width, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(hidden, width, generator=gen) * width**-0.5
    residual, norm_weight = torch.randn(2, 1, hidden, generator=gen)
    return [t.to(dtype).to(DEVICE) for t in (gate_up, down, residual, norm_weight[0])]


def _fp8_matrix(matrix: torch.Tensor, scheme: Fp8Scheme) -> Fp8Weight:
    q, checkpoint_scale = quantize(matrix.float().cpu(), scheme)
    scale = scheme.expand_scale(checkpoint_scale, matrix.shape[0]).contiguous()
    return scheme.matrix(q.to(DEVICE), scale.to(DEVICE))


# (shared experts, scale block): DeepSeek-V3's one shared expert and V2-Lite's two, in the
# compute dtype, in fp8 with blocks of 16 columns (a slot's down columns start on a block) and
# with one scale a row (each slot's columns under the same scale).
SHARED_CASES = [(1, None), (2, None), (2, 16), (2, "row")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_shared", "block"), SHARED_CASES, ids=lambda v: str(v))
def test_shared_experts_as_slots_add_their_mlp_and_scale_the_output(num_shared, block, dtype):
    """one_token_moe: residual + the routed experts + the shared MLP of width S * I, the shared
    experts computed as S more slots of the routed kernels; and that times the norm weight."""
    h, weights, ids, gate_up, down = _case(1, 3, 8, 96, 48, dtype, seed=7)
    shared_gate_up, shared_down, residual, norm_weight = _shared_case(num_shared, 96, 48, dtype, 8)
    if block is not None:
        scheme = Fp8Scheme(*(2 * [None if block == "row" else block]))
        gate_up, down = (_fp8_stack(w.cpu(), scheme) for w in (gate_up, down))
        shared_gate_up, shared_down = (
            _fp8_matrix(w, scheme) for w in (shared_gate_up, shared_down)
        )
    shared = triton_moe_gemv.Shared(shared_gate_up, shared_down)
    assert triton_moe_gemv.applies(h, gate_up, down, shared)
    out, scaled = triton_moe_gemv.one_token_moe(
        h, weights, ids, gate_up, down, shared, residual, norm_weight
    )
    dense = [w.dense(dtype) if isinstance(w, Fp8Weight) else w
             for w in (gate_up, down, shared_gate_up, shared_down)]  # fmt: skip
    gate, up = F.linear(h.double(), dense[2].double()).chunk(2, dim=-1)
    mlp = F.linear(F.silu(gate) * up, dense[3].double())
    ref = residual.double() + _reference(h, weights, ids, *dense[:2]) + mlp
    _assert_matches(out, ref, dtype)
    torch.testing.assert_close(scaled, (out.float() * norm_weight.float()).to(dtype))


def test_shared_experts_that_do_not_fit_as_slots_are_left_to_their_own_ops():
    """A shared MLP whose width is not a multiple of the routed experts', or of another dtype,
    is not taken as slots; nor are several tokens (the tiled kernels take no shared slots)."""
    h, _, _, gate_up, down = _case(1, 2, 4, 64, 48, torch.float32, seed=3)
    shared_gate_up, shared_down, _, _ = _shared_case(1, 64, 72, torch.float32, 3)
    assert not triton_moe_gemv.applies(h, gate_up, down, triton_moe_gemv.Shared(
        shared_gate_up, shared_down))  # fmt: skip
    shared_gate_up, shared_down, _, _ = _shared_case(2, 64, 48, torch.float32, 3)
    fits = triton_moe_gemv.Shared(shared_gate_up, shared_down)
    assert triton_moe_gemv.applies(h, gate_up, down, fits)
    assert not triton_moe_gemv.applies(torch.cat([h, h]), gate_up, down, fits)
    other = triton_moe_gemv.Shared(shared_gate_up.double(), shared_down.double())
    assert not triton_moe_gemv.applies(h, gate_up, down, other)


def _capture(step):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@cuda
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_cuda_graph_replay_with_new_ids(num_tokens):
    """Captured once, replayed with other experts chosen: nothing about ids is baked in."""
    shape = (num_tokens, 6, 64, 512, 192)
    h, weights, ids, gate_up, down = _case(*shape, torch.bfloat16, seed=0)
    h2, weights2, ids2, _, _ = _case(*shape, torch.bfloat16, seed=1)
    gate_up = torch.randn_like(gate_up, dtype=torch.float32).mul_(512**-0.5).bfloat16()
    down = torch.randn_like(down, dtype=torch.float32).mul_(192**-0.5).bfloat16()
    graph, out = _capture(lambda: triton_moe.fused_experts(h, weights, ids, gate_up, down))
    for static, new in [(h, h2), (weights, weights2), (ids, ids2)]:
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager = triton_moe.fused_experts(h2, weights2, ids2, gate_up, down)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    _assert_matches(out, _reference(h2, weights2, ids2, gate_up, down), torch.bfloat16)


@cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_deepseek_v2_lite_shapes(num_tokens):
    """64 experts, 6 a token, hidden 2048, intermediate 1408, bf16: decode and prefill sizes."""
    inputs = _case(num_tokens, 6, 64, 2048, 1408, torch.bfloat16, seed=4)
    _assert_matches(triton_moe.fused_experts(*inputs), _reference(*inputs), torch.bfloat16)


@cuda
@pytest.mark.parametrize("router", ["v3", "v2_lite"])
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_cuda_graph_replay_of_route_and_sort(router, num_tokens):
    """Routing and sorting captured once, replayed with new logits."""
    moe = ROUTERS[router]
    logits, bias = _router_inputs(moe, num_tokens, seed=0)
    logits2, _ = _router_inputs(moe, num_tokens, seed=1)
    graph, routing = _capture(lambda: triton_route.route_and_sort(logits, bias, moe))
    logits.copy_(logits2)
    graph.replay()
    torch.cuda.synchronize()
    _assert_routes_as_torch(routing, logits2, bias, moe)


@cuda
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_cuda_graph_replay_of_moe_kernels(num_tokens):
    """KERNELS.route (logits, routing and sort) and KERNELS.experts with a residual, captured
    once at DeepSeek-V2-Lite's routing, replayed with new hidden states and residual."""
    moe = ROUTERS["v2_lite"]
    shape = (num_tokens, 6, 64, 512, 192)
    h, _, _, gate_up, down = _case(*shape, torch.bfloat16, seed=0)
    h2 = _case(*shape, torch.bfloat16, seed=1)[0]
    gate_up = torch.randn_like(gate_up, dtype=torch.float32).mul_(512**-0.5).bfloat16()
    down = torch.randn_like(down, dtype=torch.float32).mul_(192**-0.5).bfloat16()
    weight = torch.randn(64, 512, device=DEVICE) * 512**-0.5
    residual, residual2 = torch.randn(2, *h.shape, device=DEVICE).bfloat16()

    def step(h, residual):
        routing = triton_moe.KERNELS.route(h, weight, None, moe)
        return triton_moe.KERNELS.experts(h, routing, gate_up, down, residual)

    graph, out = _capture(lambda: step(h, residual))
    h.copy_(h2)
    residual.copy_(residual2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, step(h2, residual2), atol=0, rtol=0)
    torch.testing.assert_close(
        triton_route.router_logits(h2, weight), F.linear(h2.float(), weight), rtol=1e-5, atol=1e-5
    )
