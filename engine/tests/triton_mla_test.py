"""Tests of engine.triton_mla (paged MLA decode) against a float64 dense reference.

Runs like triton_attention_test: through Triton's CPU interpreter when TRITON_INTERPRET=1 or
without CUDA (tiny latents: kv_lora_rank 64 or 32, rope 16), compiled on a GPU otherwise, where
the tests marked `cuda` (DeepSeek-V2-Lite shapes, CUDA graph replay) run too:
    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 python -m pytest -q engine/tests/triton_mla_test.py
    python -m pytest -q engine/tests/triton_mla_test.py
"""

import pytest
import torch

from engine.tests import triton_mode  # before triton: picks the interpreter on CPU

# isort: split

from engine import mla, triton_mla, triton_mla_heads
from engine.attention import AttentionMetadata
from engine.fp8 import FP8_DTYPE

KERNEL = triton_mla._split_kernel
INTERPRETED = triton_mode.interpreted(KERNEL)
DEVICE = triton_mode.device_of(KERNEL)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}


cuda = triton_mode.cuda_only


@pytest.fixture(scope="module", autouse=True)
def _triton_mode():
    with triton_mode.runnable(KERNEL):
        yield


def _nan_filled(shape, dtype):
    """A tensor whose every element holds the all-ones bit pattern: a NaN in bf16, fp16, fp32."""
    out = torch.empty(shape, dtype=dtype)
    out.view({2: torch.int16, 4: torch.int32}[out.element_size()]).fill_(-1)
    return out


def _decode_case(
    seq_lens, num_heads, rank, rope, block_size, dtype, seed=0, table_width=None, num_blocks=None
):
    """A decode batch over scattered blocks of a NaN-filled latent plane: q (a strided view),
    the plane, metadata (device tensors) and each sequence's latent rows (host).

    Slots past each sequence's end keep their NaN. Tables are padded to `table_width` blocks."""
    gen = torch.Generator().manual_seed(seed)
    latent_dim = rank + rope
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = num_blocks or sum(needed) + 3
    cache = _nan_filled((num_blocks, 1, block_size, latent_dim), dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-adjacent ids
    tables = [[free.pop() for _ in range(n)] for n in needed]
    latents = [torch.randn(n, latent_dim, generator=gen).to(dtype) for n in seq_lens]
    for table, rows in zip(tables, latents, strict=True):
        pos = torch.arange(rows.shape[0] - 1)
        cache[torch.tensor(table)[pos // block_size], 0, pos % block_size] = rows[:-1]
    width = table_width or max(needed)
    tables = [t + [0] * (width - len(t)) for t in tables]
    batch = len(seq_lens)
    meta = AttentionMetadata.build([1] * batch, seq_lens, tables, block_size, DEVICE)
    cache = cache.to(DEVICE)
    new_rows = torch.stack([rows[-1] for rows in latents]).to(DEVICE)
    mla.write_latent(cache, new_rows, meta.slot_mapping)
    # A strided q (row stride > heads * latent_dim), as a slice of a wider tensor would be.
    q = torch.randn(batch, num_heads + 1, latent_dim, generator=gen).to(dtype)[:, :num_heads]
    return q.to(DEVICE), cache, meta, latents


def _reference(q, latents, scale, rank):
    """Dense float64 attention of each sequence's query heads over its latent rows."""
    out = []
    for query, rows in zip(q.double().cpu(), latents, strict=True):
        rows = rows.double()
        probs = (query @ rows.T * scale).softmax(-1)  # [heads, seq_len]
        out.append(probs @ rows[:, :rank])
    return torch.stack(out)


def _split_query(q, rank):
    """q [n, heads, latent_dim] as the model hands it to mla_decode: q_c copied into a [heads,
    n, rank] tensor (the absorbing GEMM's output), q_pe a strided view."""
    q_c = q[..., :rank].transpose(0, 1).contiguous().transpose(0, 1)
    return q_c, q[..., rank:]


def _decode(q, cache, meta, scale, rank, num_splits, seq_lens=None):
    lens = meta.seq_lens if seq_lens is None else seq_lens
    q_c, q_pe = _split_query(q, rank)
    out = triton_mla.mla_decode(
        q_c, q_pe, cache, lens, meta.block_tables, scale, num_splits=num_splits
    )
    # [heads, n, rank] in memory: W_UV's batched GEMM reads it without a copy.
    assert out.transpose(0, 1).is_contiguous()
    return out


def _assert_matches(out, ref, dtype):
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.device.type == DEVICE
    assert not out.isnan().any()
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


# (heads, (kv_lora_rank, rope), block_size, dtype), pairwise covering. 20 heads: a head block
# and a partial one. Tiles of these tiny latents are min(64, block_size) rows; in blocks of 128,
# two tiles a block.
SHAPES = [
    (1, (64, 16), 16, torch.bfloat16),
    (1, (32, 16), 64, torch.float32),
    (16, (64, 16), 64, torch.float32),
    (16, (32, 16), 16, torch.bfloat16),
    (20, (64, 16), 16, torch.float32),
    (20, (32, 16), 64, torch.bfloat16),
    (16, (64, 16), 128, torch.bfloat16),
]


def _shape_id(shape):
    heads, (rank, rope), block_size, dtype = shape
    return f"h{heads}-r{rank}+{rope}-bs{block_size}-{_dtype_id(dtype)}"


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("heads,latent,block_size,dtype", SHAPES, ids=map(_shape_id, SHAPES))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_dense_reference(heads, latent, block_size, dtype, num_splits):
    # Ragged: one row, a few, exactly two blocks, and lengths not a multiple of the tile.
    seq_lens = [1, 3, 2 * block_size, 150, 77]
    rank, rope = latent
    q, cache, meta, latents = _decode_case(
        seq_lens, heads, rank, rope, block_size, dtype, table_width=150 // block_size + 3
    )
    # Every sequence's last block holds NaN past its end (where the tile reads masked rows).
    tables = meta.block_tables.tolist()
    ends = [t[(n - 1) // block_size] for t, n in zip(tables, seq_lens, strict=True)]
    offsets = [(n - 1) % block_size + 1 for n in seq_lens]
    assert any(o < block_size for o in offsets)
    for block, offset in zip(ends, offsets, strict=True):
        assert cache[block, 0, offset:].isnan().all()
    scale = (rank + rope) ** -0.5
    out = _decode(q, cache, meta, scale, rank, num_splits)
    assert out.shape == (len(seq_lens), heads, rank)
    _assert_matches(out, _reference(q, latents, scale, rank), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_dtype_id)
def test_split_count_changes_nothing(dtype):
    # 16-row tiles (blocks of 16), ten at most: 12 splits leave some empty in every sequence.
    q, cache, meta, latents = _decode_case([1, 40, 150, 64], 16, 32, 16, 16, dtype)
    one = _decode(q, cache, meta, 0.2, 32, 1)
    _assert_matches(one, _reference(q, latents, 0.2, 32), dtype)
    # Each split rounds p to bf16/fp16 against its own running max: agreement to rounding only.
    tol = 1e-5 if dtype == torch.float32 else TOLERANCE[dtype]
    for num_splits in [2, 7, 12]:
        many = _decode(q, cache, meta, 0.2, 32, num_splits)
        torch.testing.assert_close(many, one, atol=tol, rtol=tol)


def test_combine_reads_only_the_splits_with_tiles(monkeypatch):
    """Splits past a sequence's tiles exit without storing: the combine must count them as the
    split kernel does. The split buffers start out NaN here, so a read of one shows."""
    q, cache, meta, latents = _decode_case([1, 65, 200], 4, 32, 16, 16, torch.float32, seed=5)
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_empty)
    out = _decode(q, cache, meta, 0.2, 32, 6)
    _assert_matches(out, _reference(q, latents, 0.2, 32), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_zero_length_rows_give_zeros(num_splits):
    """A padded batch row (seq_len 0, filling a captured graph's batch) yields 0, not NaN."""
    q, cache, meta, latents = _decode_case([5, 70], 16, 32, 16, 16, torch.float32)
    seq_lens = torch.tensor([0, 70], dtype=torch.int32, device=DEVICE)
    out = _decode(q, cache, meta, 0.2, 32, num_splits, seq_lens=seq_lens)
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
    _assert_matches(out[1:], _reference(q[1:], latents[1:], 0.2, 32), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_decode_over_an_fp8_plane_attends_to_its_rows_widened(dtype):
    """An fp8 plane (e4m3, scale 1.0) is read as stored and widened to q's dtype: the output is
    the dense attention over the rows as the plane holds them; NaN past each end stays unread."""
    seq_lens = [1, 3, 40, 77]
    q, cache, meta, latents = _decode_case(seq_lens, 16, 64, 16, 16, dtype, seed=3)
    plane = cache.to(FP8_DTYPE)
    held = [rows.to(FP8_DTYPE).to(dtype) for rows in latents]
    for num_splits in (1, 3):
        out = _decode(q, plane, meta, 0.125, 64, num_splits)
        _assert_matches(out, _reference(q, held, 0.125, 64), dtype)


def test_store_latent_into_an_fp8_plane_rounds_to_nearest_and_saturates():
    """The rows as a bf16 plane would hold them, then rounded to the nearest e4m3 (saturated at
    +-448, as vLLM's CUDA cache write stores them): the bytes of the torch rounding."""
    cache, args, slots = _store_case(torch.bfloat16)
    kv_a, *rest = args
    kv_a = kv_a * 300  # rope'd values beyond e4m3's 448 (the normalized ones stay inside)
    wide = cache.clone()
    plane = cache.to(FP8_DTYPE)
    triton_mla.store_latent(wide, kv_a, *rest, False, slots)
    triton_mla.store_latent(plane, kv_a, *rest, False, slots)
    slots = slots.cpu()
    expected = wide.cpu()[slots // 4, 0, slots % 4].float().clamp(-448, 448)
    assert expected.abs().max() == 448
    stored = plane.cpu()[slots // 4, 0, slots % 4]
    assert torch.equal(stored.view(torch.uint8), expected.to(FP8_DTYPE).view(torch.uint8))


def _store_case(dtype, heads=3, rank=40, rope=16, tokens=7, seed=5):
    """Inputs of store_latent: kv_a and q_pe strided views (of wider projections), a NaN-filled
    plane of blocks of 4, scattered slots across and within blocks."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    kv_a = randn(tokens, rank + rope + 8)[:, 8:]
    q_pe = randn(tokens, heads, rope + 24)[..., 24:]
    norm_weight = randn(rank)
    angles = torch.rand(tokens, rope // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    slots = torch.tensor([0, 3, 5, 22, 9, 16, 23][:tokens], device=DEVICE)
    cache = _nan_filled((6, 1, 4, rank + rope), dtype).to(DEVICE)
    return cache, (kv_a, q_pe, norm_weight, 1e-6, cos, sin), slots


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_dtype_id)
def test_store_latent_matches_the_torch_path(dtype, interleaved):
    """Norm, RoPE and store in one kernel against engine.mla's torch ops: the rows at their
    slots and q_pe equal up to rounding (the torch RoPE rounds each product), and every other
    slot keeps its bits."""
    cache, args, slots = _store_case(dtype)
    theirs = cache.clone()
    q_ours = triton_mla.store_latent(cache, *args, interleaved, slots)
    q_theirs = mla.store_latent(theirs, *args, interleaved, slots)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q_ours, q_theirs, atol=tol, rtol=tol)
    assert q_ours.is_contiguous()
    written = torch.zeros(cache.shape[0] * cache.shape[2], dtype=torch.bool)
    written[slots.cpu()] = True
    rows, rows_theirs = (c.cpu().view(-1, c.shape[3]) for c in (cache, theirs))
    assert torch.equal(rows[~written].view(torch.uint8), rows_theirs[~written].view(torch.uint8))
    torch.testing.assert_close(rows[written], rows_theirs[written], atol=tol, rtol=tol)


def test_store_latent_of_no_tokens():
    cache, args, slots = _store_case(torch.float32, tokens=0)
    before = cache.clone()
    q_pe = triton_mla.store_latent(cache, *args, False, slots)
    assert q_pe.shape == (0, 3, 16)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def _kv_b(heads, nope, v, rank, dtype, seed=5):
    """kv_b_proj's weight [heads * (nope + v), rank]: W_UK's rows, then W_UV's, head by head."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(heads * (nope + v), rank, generator=gen) * rank**-0.5).to(dtype)


def _q_nope(n, heads, nope, dtype, seed=6):
    """q_nope as the model splits it from q: a strided view of [n, heads, nope + rope]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, nope + 16, generator=gen).to(dtype).to(DEVICE)[..., :nope]


# (heads, nope, v, rank): nope and v not powers of two (masked K and outputs); DeepSeek's.
HEAD_SHAPES = [(20, 24, 40, 32), (16, 128, 128, 512)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=lambda s: "h{}_nope{}_v{}_rank{}".format(*s))
def test_one_token_projections_match_float64(shape, dtype):
    """W_UK and W_UV for one token (engine.triton_mla_heads' kernel): each output rounded once
    from the exact product, as the batched GEMM of engine.mla rounds it."""
    heads, nope, v, rank = shape
    kv_b = _kv_b(heads, nope, v, rank, dtype).to(DEVICE)
    q_nope = _q_nope(1, heads, nope, dtype)
    w = kv_b.double().cpu().view(heads, nope + v, rank)
    q_c = triton_mla_heads.absorb_query(q_nope, kv_b)
    expected = torch.einsum("nhi,hir->nhr", q_nope.double().cpu(), w[:, :nope])
    # fp32: summation order only; bf16: within one rounding of the exact product rounded.
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(q_c.cpu(), expected.to(dtype), **tolerance)
    o = torch.randn(1, heads, rank, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = triton_mla_heads.expand_output(o.to(DEVICE), kv_b, nope)
    assert out.shape == (1, heads, v) and out.is_contiguous()
    expected = torch.einsum("nhr,hvr->nhv", o.double(), w[:, nope:])
    torch.testing.assert_close(out.cpu(), expected.to(dtype), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
@pytest.mark.parametrize("seq_lens", [[130], [9, 130, 1]], ids=["one_token", "batch"])
def test_decode_attention_matches_the_torch_backend(seq_lens, dtype):
    """The LatentBackend form, as MlaAttention calls it: lengths and tables from the metadata,
    splits chosen, W_UK and W_UV by engine.triton_mla_heads (one token) or batched GEMMs."""
    heads, nope, v, rank = HEAD_SHAPES[0]
    q, cache, meta, _ = _decode_case(seq_lens, heads, rank, 16, 64, dtype)
    kv_b = _kv_b(heads, nope, v, rank, dtype).to(DEVICE)
    q_nope = _q_nope(len(seq_lens), heads, nope, dtype)
    ours = triton_mla.decode_attention(q_nope, q[..., rank:], cache, meta, kv_b, 0.2)
    theirs = mla.decode_attention(q_nope, q[..., rank:], cache, meta, kv_b, 0.2)
    assert ours.shape == (len(seq_lens), heads, v) and ours.is_contiguous()
    assert not ours.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)


def test_backends_agree_on_a_decode_step():
    """store_latent then decode_attention, as MlaAttention calls them, in Triton and in torch."""
    _, cache, meta, _ = _decode_case([9, 30, 1], 4, 40, 16, 16, torch.float32)
    _, args, _ = _store_case(torch.float32, heads=4, tokens=3)
    kv_b = _kv_b(4, 24, 32, 40, torch.float32).to(DEVICE)
    q_nope = _q_nope(3, 4, 24, torch.float32)
    theirs = cache.clone()
    outs = []
    for backend, plane in [(triton_mla, cache), (mla, theirs)]:
        q_pe = backend.store_latent(plane, *args, True, meta.slot_mapping)
        outs.append(backend.decode_attention(q_nope, q_pe, plane, meta, kv_b, 0.2))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_rejects_a_rank_outside_the_latent():
    q, cache, meta, _ = _decode_case([3], 1, 32, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        _decode(q, cache, meta, 0.2, 48, None)


@pytest.mark.parametrize(
    "batch,head_blocks,max_tiles,sm_count,expected",
    [
        (1, 1, 1000, 132, 132),  # DeepSeek-V2-Lite, bs=1: one program per SM
        (8, 1, 1000, 132, 17),  # rounded up: ceil(132 / 8)
        (1, 8, 1000, 132, 17),  # V3's 128 heads: eight head blocks
        (1, 1, 32, 132, 32),  # capped by the longest possible context's tiles
        (256, 1, 1000, 132, 1),  # the batch alone fills the GPU
        (2, 1, 1000, 1, 1),
    ],
)
def test_choose_num_splits(batch, head_blocks, max_tiles, sm_count, expected):
    assert triton_mla.choose_num_splits(batch, head_blocks, max_tiles, sm_count) == expected


# DeepSeek-V2-Lite: 16 heads, kv_lora_rank 512 + rope 64, scale 1/sqrt(128 + 64).
V2_LITE = dict(heads=16, rank=512, rope=64, scale=192**-0.5)


def _device_case(seq_lens, block_size=64, dtype=torch.bfloat16, seed=0, table_width=None):
    """A DeepSeek-V2-Lite decode batch built on the device, NaN past each sequence's end."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    heads, latent_dim = V2_LITE["heads"], V2_LITE["rank"] + V2_LITE["rope"]
    needed = [-(-n // block_size) for n in seq_lens]
    width = table_width or max(needed)
    num_blocks = sum(needed) + 1
    cache = torch.randn(num_blocks, 1, block_size, latent_dim, generator=gen, device=DEVICE).to(
        dtype
    )
    free = torch.randperm(num_blocks, generator=gen, device=DEVICE)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=DEVICE)
    taken = 0
    for i, n in enumerate(needed):
        tables[i, :n] = free[taken : taken + n]
        taken += n
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    pos = torch.arange(width * block_size, device=DEVICE)
    past_end = pos[None, :] >= lens[:, None]
    past_end &= (pos // block_size)[None, :] < torch.tensor(needed, device=DEVICE)[:, None]
    blocks = tables.long().gather(1, (pos // block_size).expand(len(seq_lens), -1))
    cache[blocks[past_end], 0, (pos % block_size).expand_as(blocks)[past_end]] = float("nan")
    q = torch.randn(len(seq_lens), heads, latent_dim, generator=gen, device=DEVICE).to(dtype)
    return q, cache, lens, tables


def _absorbed_reference(q, cache, seq_lens, tables, rows_a_call=8):
    """engine.mla.attend_absorbed in fp32, with W_UK and W_UV identities: its latent output.
    A few rows a call: SDPA's math path expands the latent context to every head."""
    heads, rank = V2_LITE["heads"], V2_LITE["rank"]
    eye = torch.eye(rank, device=q.device)
    kv_b_weight = torch.cat([eye, eye]).repeat(heads, 1)  # [heads * (nope + v), rank]
    out = []
    for rows in torch.arange(q.shape[0], device=q.device).split(rows_a_call):
        contexts = mla.gather_latents(cache, tables[rows], torch.float32)
        q_nope, q_pe = q[rows].float().split([rank, q.shape[2] - rank], dim=-1)
        lens = seq_lens[rows]
        scale = V2_LITE["scale"]
        out.append(mla.attend_absorbed(q_nope, q_pe, contexts, lens, kv_b_weight, scale))
    return torch.cat(out)


@cuda
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("context", [1024, 8192])
def test_deepseek_v2_lite_shapes(context, batch):
    seq_lens = [context - 37 * i % 1000 for i in range(batch)]  # ragged: tiles end mid-way
    q, cache, lens, tables = _device_case(seq_lens)
    q_c, q_pe = _split_query(q, V2_LITE["rank"])
    out = triton_mla.mla_decode(q_c, q_pe, cache, lens, tables, V2_LITE["scale"])
    ref = _absorbed_reference(q, cache, lens, tables)
    assert out.shape == ref.shape and not out.isnan().any()
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


def _new_token_inputs(batch, seed):
    """store_latent's inputs after the cache and slots, DeepSeek-V2-Lite's shapes, bf16."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    heads, rank, rope = V2_LITE["heads"], V2_LITE["rank"], V2_LITE["rope"]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(torch.bfloat16)

    angles = torch.rand(batch, rope // 2, generator=gen, device=DEVICE) * 6
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    return [randn(batch, rank + rope), randn(batch, heads, rope), randn(rank), 1e-6, cos, sin]


@cuda
@pytest.mark.parametrize("num_splits", [None, 1])
def test_cuda_graph_replay_matches_eager(num_splits):
    """store_latent + mla_decode captured once, replayed on new contents of the same tensors,
    with longer contexts than the captured ones: nothing about lengths may be in the graph."""
    q, _, lens, tables = _device_case([5, 70, 1, 300], seed=0, table_width=40)
    q2, cache2, lens2, tables2 = _device_case([2500, 2, 64, 1000], seed=1, table_width=40)
    scale, rank = V2_LITE["scale"], V2_LITE["rank"]
    q_c, _ = _split_query(q, rank)
    inputs = _new_token_inputs(4, seed=2)
    slots = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    cache = torch.zeros(80, 1, 64, q.shape[2], dtype=q.dtype, device=DEVICE)

    def step(cache, q_c, inputs, lens, tables, slots):
        q_pe = triton_mla.store_latent(cache, *inputs, True, slots)
        return triton_mla.mla_decode(q_c, q_pe, cache, lens, tables, scale, num_splits=num_splits)

    args = (cache, q_c, inputs, lens, tables, slots)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*args)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*args)

    # The new tokens' slots hold NaN until the replay writes them, so attention that read them
    # before store_latent stored them shows.
    last = (lens2 - 1).long()
    slots2 = tables2.long().gather(1, (last // 64)[:, None])[:, 0] * 64 + last % 64
    cache2.view(-1, cache2.shape[3])[slots2] = float("nan")
    cache[: cache2.shape[0]].copy_(cache2)
    inputs2 = _new_token_inputs(4, seed=3)
    for static, new in [(q_c, q2[..., :rank]), (lens, lens2), (tables, tables2), (slots, slots2)]:
        static.copy_(new)
    for static, new in zip(inputs, inputs2, strict=True):
        if isinstance(static, torch.Tensor):
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    q_c2, _ = _split_query(q2, rank)
    eager = step(cache2, q_c2, inputs2, lens2, tables2, slots2)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    q_pe2 = triton_mla.store_latent(cache2, *inputs2, True, slots2)
    ref = _absorbed_reference(torch.cat((q2[..., :rank], q_pe2), -1), cache2, lens2, tables2)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)
