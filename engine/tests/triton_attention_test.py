"""Tests of engine.triton_attention against a float64 dense reference.

Modes: the same test functions run in one of two, fixed when this file is imported.
- Interpreter (CPU): when TRITON_INTERPRET=1, or when CUDA is unavailable (engine.tests.triton_mode
  then sets TRITON_INTERPRET=1, before engine.triton_attention imports triton), the kernels run on
  CPU tensors through Triton's interpreter. Cases are small and pairwise-covering.
    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 python -m pytest -q engine/tests/triton_attention_test.py
- CUDA: otherwise the kernels compile for the GPU; the shape grid is the full product, and the
  tests marked `cuda` (CUDA graph capture, Llama-3-8B shapes) run too. Bazel runs this file
  twice: `//engine:triton_attention_test` deselects those (`-m "not cuda"`), and
  `//engine:triton_attention_gpu_test` (tag `gpu`) runs everything on a GPU.
    python -m pytest -q engine/tests/triton_attention_test.py
The mode follows how the kernels were actually built. On CPU, running this file together with
tests that import triton first (HF models do) needs TRITON_INTERPRET=1 in the environment;
without it every test here errors, saying so.
"""

import dataclasses
import itertools

import pytest
import torch

from engine.tests import triton_mode  # before triton: picks the interpreter on CPU

# isort: split

from engine import attention, triton_attention, triton_attention_kernels
from engine.attention import AttentionMetadata
from engine.fp8 import FP8_DTYPE, FP8_MAX

INTERPRETED = triton_mode.interpreted(triton_attention_kernels.split_kernel)
DEVICE = triton_mode.device_of(triton_attention_kernels.split_kernel)
cuda = pytest.mark.cuda  # needs compiled kernels on a GPU
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}


@pytest.fixture(scope="module", autouse=True)
def _triton_mode():
    with triton_mode.runnable(triton_attention_kernels.split_kernel):
        yield


def _nan_filled(shape, dtype):
    """A cache whose every slot holds the all-ones bit pattern: a NaN in bf16, fp16, fp32 and
    e4m3."""
    cache = torch.empty(shape, dtype=dtype)
    cache.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[cache.element_size()]).fill_(-1)
    return cache


def _decode_case(
    context_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    seed=0,
    num_blocks=None,
    table_width=None,
    write_new=True,
    cache_dtype=None,
):
    """A decode batch over scattered blocks of a NaN-filled cache; device tensors, host contexts.
    An fp8 `cache_dtype`: K and V are drawn as e4m3 values (the reference's are those stored).

    The contexts before the new token are written directly; the new tokens through write_kv
    (or not, without `write_new`: their slots keep NaN, as the attention call must write them).
    Slots past each sequence's end keep their NaN. Tables are padded to `table_width` blocks.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = num_blocks or sum(needed) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    cache_dtype = cache_dtype or dtype
    k_cache, v_cache = _nan_filled(shape, cache_dtype), _nan_filled(shape, cache_dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-adjacent ids
    tables = [[free.pop() for _ in range(n)] for n in needed]
    ks, vs = (
        [
            torch.randn(n, num_kv_heads, head_dim, generator=gen).to(cache_dtype).to(dtype)
            for n in context_lens
        ]
        for _ in range(2)
    )
    for table, k, v in zip(tables, ks, vs, strict=True):
        pos = torch.arange(k.shape[0] - 1)
        blocks = torch.tensor(table, dtype=torch.int64)[pos // block_size]
        k_cache[blocks, :, pos % block_size] = k[:-1].to(cache_dtype)
        v_cache[blocks, :, pos % block_size] = v[:-1].to(cache_dtype)
    width = table_width or max(needed)
    tables = [t + [0] * (width - len(t)) for t in tables]
    batch = len(context_lens)
    meta = AttentionMetadata.build([1] * batch, context_lens, tables, block_size, DEVICE)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    new_k = torch.stack([k[-1] for k in ks]).to(DEVICE)
    new_v = torch.stack([v[-1] for v in vs]).to(DEVICE)
    if write_new:
        triton_attention.write_kv(k_cache, v_cache, new_k, new_v, meta.slot_mapping)
    # A strided q (row stride > heads * head_dim), as a slice of a fused projection would be.
    q = torch.randn(batch, num_heads + 1, head_dim, generator=gen).to(dtype)[:, :num_heads]
    return q.to(DEVICE), k_cache, v_cache, meta, ks, vs


def _reference(q, ks, vs, scale):
    """Dense float64 attention of each sequence's one query over its whole context."""
    out = []
    for query, k, v in zip(q.double().cpu(), ks, vs, strict=True):
        group = query.shape[0] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [n, heads, dim]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query, k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def _assert_matches(out, ref, dtype):
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.device.type == DEVICE
    assert not out.isnan().any()
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


# (num_heads, num_kv_heads): GQA groups 1, 3 (SmolLM2's 9/3), 4 and 8.
HEADS = [(2, 2), (9, 3), (8, 2), (8, 1)]
HEAD_DIMS = [64, 128]
BLOCK_SIZES = [16, 64]
DTYPES = [torch.bfloat16, torch.float32]
if INTERPRETED:
    # Pairwise covering: every pair of (group, head_dim, block_size, dtype) values occurs.
    SHAPES = [
        (HEADS[0], 64, 16, torch.bfloat16),
        (HEADS[0], 128, 64, torch.float32),
        (HEADS[1], 64, 64, torch.bfloat16),
        (HEADS[1], 128, 16, torch.float32),
        (HEADS[2], 64, 16, torch.float32),
        (HEADS[2], 128, 64, torch.bfloat16),
        (HEADS[3], 64, 64, torch.float32),
        (HEADS[3], 128, 16, torch.bfloat16),
    ]
else:
    SHAPES = list(itertools.product(HEADS, HEAD_DIMS, BLOCK_SIZES, DTYPES))
SHAPES.append(((4, 2), 80, 16, torch.bfloat16))  # a head_dim that is not a power of two


def _shape_id(shape):
    (num_heads, num_kv_heads), head_dim, block_size, dtype = shape
    return f"h{num_heads}/{num_kv_heads}-d{head_dim}-bs{block_size}-{_dtype_id(dtype)}"


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("heads,head_dim,block_size,dtype", SHAPES, ids=map(_shape_id, SHAPES))
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_matches_dense_reference(heads, head_dim, block_size, dtype, num_splits):
    # Ragged contexts: one token, a few, exactly four blocks, long and not a block multiple.
    contexts = [1, 3, 4 * block_size, 2113, 700]
    q, k_cache, v_cache, meta, ks, vs = _decode_case(
        contexts, *heads, head_dim, block_size, dtype, table_width=2113 // block_size + 3
    )
    assert k_cache.isnan().any() and v_cache.isnan().any()  # slots past the ends are poisoned
    scale = head_dim**-0.5
    out = triton_attention.paged_attention(q, k_cache, v_cache, meta, scale, num_splits=num_splits)
    assert out.shape == q.shape
    _assert_matches(out, _reference(q, ks, vs, scale), dtype)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=_dtype_id)
def test_split_count_changes_nothing(dtype):
    block_size = 16
    # 7 splits is more than the longest context has tiles: some splits get no blocks at all.
    q, k_cache, v_cache, meta, ks, vs = _decode_case([1, 40, 333, 64], 8, 2, 64, block_size, dtype)
    one = triton_attention.paged_attention(q, k_cache, v_cache, meta, 0.125, num_splits=1)
    _assert_matches(one, _reference(q, ks, vs, 0.125), dtype)
    # Each split rounds p to bf16/fp16 against its own running max: agreement to rounding only.
    tol = 1e-5 if dtype == torch.float32 else TOLERANCE[dtype]
    for num_splits in [2, 7, 12]:  # 12: more than _FEW_TILES_SPLITS
        many = triton_attention.paged_attention(
            q, k_cache, v_cache, meta, 0.125, num_splits=num_splits
        )
        torch.testing.assert_close(many, one, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_zero_length_rows_give_zeros(num_splits):
    """A padded batch row (seq_len 0, e.g. filling a captured graph's batch) yields 0, not NaN."""
    q, k_cache, v_cache, meta, ks, vs = _decode_case([5, 9], 4, 2, 64, 16, torch.float32)
    padded = AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=meta.query_start_loc,
        seq_lens=torch.tensor([0, 9], dtype=torch.int32, device=DEVICE),
        block_tables=meta.block_tables,
        max_query_len=1,
        max_seq_len=9,
    )
    out = triton_attention.paged_attention(
        q, k_cache, v_cache, padded, 0.125, num_splits=num_splits
    )
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
    ref = _reference(q[1:], ks[1:], vs[1:], 0.125)
    torch.testing.assert_close(out[1:].double().cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=_dtype_id)
def test_write_kv_matches_the_torch_index_write(dtype):
    """K and V taken as views of one qkv tensor (strided, as the model passes them), written to
    scattered slots across and within blocks; every other slot keeps its bits."""
    gen = torch.Generator().manual_seed(5)
    heads, head_dim, block_size, num_blocks = 2, 24, 4, 6  # head_dim not a power of two
    qkv = torch.randn(7, 3 * heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    slots = torch.tensor([0, 3, 5, 22, 9, 16, 23], device=DEVICE)
    caches = {
        name: [
            _nan_filled((num_blocks, heads, block_size, head_dim), dtype).to(DEVICE)
            for _ in range(2)
        ]
        for name in ("triton", "torch")
    }
    triton_attention.write_kv(*caches["triton"], k, v, slots)
    attention.write_kv(*caches["torch"], k, v, slots)
    for ours, theirs in zip(caches["triton"], caches["torch"], strict=True):
        assert torch.equal(ours.cpu().view(torch.uint8), theirs.cpu().view(torch.uint8))


def test_prefill_and_mixed_batches_match_the_torch_path():
    """Decode rows take the decode kernel, prefill chunks flash attention (SDPA)."""
    # (seq_len, query_len): a whole prompt, a decode token, a chunk after cached context.
    seqs = [(9, 9), (13, 1), (20, 6)]
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(12, 2, 4, 16, generator=gen).to(DEVICE)
    v_cache = torch.randn(12, 2, 4, 16, generator=gen).to(DEVICE)
    tables = [[0, 5, 2], [7, 1, 9, 3], [4, 6, 8, 10, 11]]
    meta = AttentionMetadata.build([n for _, n in seqs], [s for s, _ in seqs], tables, 4, DEVICE)
    q = torch.randn(16, 4, 16, generator=gen).to(DEVICE)
    out = triton_attention.paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out, attention.paged_attention(q, k_cache, v_cache, meta, 0.25))


@pytest.mark.parametrize(
    "batch,num_kv_heads,max_tiles,sm_count,expected",
    [
        (1, 8, 1000, 132, 33),  # 264 programs: two waves of 132 SMs
        (3, 3, 1000, 132, 30),  # rounded up: ceil(264 / 9)
        (1, 8, 4, 132, 4),  # capped by the longest possible context's tiles
        (64, 8, 1000, 132, 1),  # the batch alone fills the GPU
        (2, 1, 1000, 1, 1),
    ],
)
def test_choose_num_splits(batch, num_kv_heads, max_tiles, sm_count, expected):
    assert triton_attention.choose_num_splits(batch, num_kv_heads, max_tiles, sm_count) == expected


def test_rows_of_one_sequence_with_new_kv_first_match_a_chunk():
    """Speculative verification's layout: a sequence's 4 new tokens as 4 decode rows (each its
    own position, the sequence's block table), K/V all written before any row attends, give
    the output of the same tokens fed as one chunk of 4."""
    gen = torch.Generator().manual_seed(5)
    tables = [[3, 0, 5], [1, 4]]
    contexts = [(11, 4), (6, 2)]  # (context after the step, new tokens)
    q = torch.randn(6, 4, 16, generator=gen).to(DEVICE)
    k = torch.randn(6, 2, 16, generator=gen).to(DEVICE)
    v = torch.randn(6, 2, 16, generator=gen).to(DEVICE)
    outs = []
    for rows in (False, True):
        k_cache = torch.randn(6, 2, 4, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        v_cache = torch.randn(6, 2, 4, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        if rows:
            lens = [s - n + j + 1 for s, n in contexts for j in range(n)]
            row_tables = [t for t, (_, n) in zip(tables, contexts, strict=True) for _ in range(n)]
            meta = AttentionMetadata.build([1] * 6, lens, row_tables, 4, DEVICE)
            meta = dataclasses.replace(meta, new_kv_first=True)
        else:
            meta = AttentionMetadata.build([n for _, n in contexts],
                                           [s for s, _ in contexts], tables, 4, DEVICE)  # fmt: skip
        outs.append(triton_attention.attention(q, k, v, k_cache, v_cache, meta, 0.25))
    torch.testing.assert_close(outs[1], outs[0])


# (num_heads, num_kv_heads, dtype): 4 rows of GQA group 4 fill the dot's 16 rows; of group 3, 12.
GROUPED = [(8, 2, torch.bfloat16), (9, 3, torch.float32)]


@pytest.mark.parametrize("fused", [False, True], ids=["paged_attention", "attention"])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 12])  # 12: more than _FEW_TILES_SPLITS
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "dtype"), GROUPED)
def test_rows_of_a_sequence_attend_its_context_in_one_program(
    monkeypatch, num_splits, num_heads, num_kv_heads, dtype, fused
):
    """Verification rows with row_in_seq: a sequence's rows attend the context, each up to its
    own token, as the float64 reference and as the rows attended one by one do; through
    `attention` the rows' own K/V (NaN in the cache before the call) are stored by the kernel
    and attended from registers. Slots past each context and the split buffers hold NaN, so
    that a read of one shows."""
    contexts, rows_per_seq, max_rows = [300, 2, 130, 257], [4, 1, 2, 3], 4
    _, k_cache, v_cache, meta, ks, vs = _decode_case(
        contexts, num_heads, num_kv_heads, 64, 16, dtype, seed=7
    )
    lens, tables, index, row_k, row_v, new_k, new_v = [], [], [], [], [], [], []
    for s, (n, table) in enumerate(zip(rows_per_seq, meta.block_tables.tolist(), strict=True)):
        for j in range(n):
            lens.append(contexts[s] - n + 1 + j)
            tables.append(table)
            index.append(j)
            row_k.append(ks[s][: lens[-1]])
            row_v.append(vs[s][: lens[-1]])
            new_k.append(ks[s][lens[-1] - 1])
            new_v.append(vs[s][lens[-1] - 1])
    rows = AttentionMetadata.build([1] * len(lens), lens, tables, 16, DEVICE)
    rows = dataclasses.replace(rows, new_kv_first=True)
    grouped = dataclasses.replace(
        rows,
        row_in_seq=torch.tensor(index, dtype=torch.int32, device=DEVICE),
        max_rows_per_seq=max_rows,
    )
    q = torch.randn(len(lens), num_heads, 64, generator=torch.Generator().manual_seed(8))
    q = q.to(dtype).to(DEVICE)
    one_by_one = triton_attention.paged_attention(
        q, k_cache, v_cache, rows, 0.125, num_splits=num_splits
    )
    new_k, new_v = torch.stack(new_k).to(DEVICE), torch.stack(new_v).to(DEVICE)
    blocks, offsets = rows.slot_mapping // 16, rows.slot_mapping % 16
    if fused:  # the rows' own slots not written yet
        k_cache[blocks, :, offsets] = float("nan")
        v_cache[blocks, :, offsets] = float("nan")
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_empty)
    if fused:
        out = triton_attention.attention(
            q, new_k, new_v, k_cache, v_cache, grouped, 0.125, num_splits=num_splits
        )
        assert torch.equal(k_cache[blocks, :, offsets], new_k)
        assert torch.equal(v_cache[blocks, :, offsets], new_v)
    else:
        out = triton_attention.paged_attention(
            q, k_cache, v_cache, grouped, 0.125, num_splits=num_splits
        )
    _assert_matches(out, _reference(q, row_k, row_v, 0.125), dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, one_by_one, atol=tol, rtol=tol)


def test_row_in_seq_needs_new_kv_first():
    meta = AttentionMetadata.build([1, 1], [3, 4], [[0], [0]], 16, DEVICE)
    index = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="row_in_seq needs new_kv_first"):
        dataclasses.replace(meta, row_in_seq=index, max_rows_per_seq=2)


@pytest.mark.parametrize("num_splits", [1, 3, 12])  # 12: more than _FEW_TILES_SPLITS
@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.bfloat16, 32), (torch.float32, 24)]
)  # 24: padded dims
def test_attention_writes_the_new_tokens_and_attends_to_them(num_splits, dtype, head_dim):
    """The decode path of `attention`: the new tokens' slots hold NaN before the call; after it
    they hold k and v (given as strided views, as of a fused qkv projection), every other slot
    is as it was, and the output matches the float64 reference."""
    contexts = [1, 37, 64, 130]
    q, k_cache, v_cache, meta, ks, vs = _decode_case(
        contexts, 4, 2, head_dim, 16, dtype, seed=3, write_new=False
    )
    fused = torch.cat([torch.stack([k[-1] for k in ks]), torch.stack([v[-1] for v in vs])], 1)
    new_k, new_v = fused.to(DEVICE).split(2, dim=1)  # [batch, kv heads, dim] views, strided
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = triton_attention.attention(
        q, new_k, new_v, k_cache, v_cache, meta, 0.2, num_splits=num_splits
    )
    _assert_matches(out, _reference(q, ks, vs, 0.2), dtype)
    slots = meta.slot_mapping
    blocks, offsets = slots // 16, slots % 16
    assert torch.equal(k_cache[blocks, :, offsets], new_k)
    assert torch.equal(v_cache[blocks, :, offsets], new_v)
    k_cache[blocks, :, offsets] = before_k[blocks, :, offsets]
    v_cache[blocks, :, offsets] = before_v[blocks, :, offsets]
    for cache, before in ((k_cache, before_k), (v_cache, before_v)):  # NaN == NaN bitwise
        assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("num_splits", [6, 12])
@pytest.mark.parametrize("new_kv", [False, True], ids=["paged_attention", "attention"])
def test_combine_reads_only_the_splits_with_tiles(monkeypatch, new_kv, num_splits):
    """With more than _FEW_TILES_SPLITS splits, those past a sequence's tiles exit without
    storing: the combine must count them as the split kernel does. The split buffers start out
    NaN here, so a read of one shows."""
    assert (num_splits > triton_attention._FEW_TILES_SPLITS) == (num_splits == 12)
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    # 4 tiles of 64 tokens at most (contexts 1 to 256): most splits are empty.
    contexts = [1, 2, 65, 256]
    q, k_cache, v_cache, meta, ks, vs = _decode_case(
        contexts, 8, 2, 64, 16, torch.float32, seed=5, write_new=not new_kv
    )
    new_k = torch.stack([k[-1] for k in ks]).to(DEVICE)
    new_v = torch.stack([v[-1] for v in vs]).to(DEVICE)
    monkeypatch.setattr(torch, "empty", nan_empty)
    if new_kv:
        out = triton_attention.attention(
            q, new_k, new_v, k_cache, v_cache, meta, 0.125, num_splits=num_splits
        )
    else:
        out = triton_attention.paged_attention(
            q, k_cache, v_cache, meta, 0.125, num_splits=num_splits
        )
    _assert_matches(out, _reference(q, ks, vs, 0.125), torch.float32)


@cuda
@pytest.mark.parametrize("fused", [False, True], ids=["write_kv_then_attend", "attention"])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_cuda_graph_replay_matches_eager(num_splits, fused):
    """write_kv + paged_attention captured once, replayed on new contents of the same tensors.

    The replayed batch has longer contexts than the captured one: nothing about lengths may be
    baked into the graph.
    """
    shape = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=64)
    case = dict(dtype=torch.bfloat16, num_blocks=80, table_width=40)
    captured = _decode_case([5, 70, 1, 300], **shape, **case, seed=0)
    replayed = _decode_case([2500, 2, 64, 1000], **shape, **case, seed=1)
    q, k_cache, v_cache, meta, _, _ = captured
    new_k = torch.zeros(4, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    new_v = torch.zeros_like(new_k)

    def step():
        if fused:
            return triton_attention.attention(
                q, new_k, new_v, k_cache, v_cache, meta, 0.1, num_splits=num_splits
            )
        triton_attention.write_kv(k_cache, v_cache, new_k, new_v, meta.slot_mapping)
        return triton_attention.paged_attention(
            q, k_cache, v_cache, meta, 0.1, num_splits=num_splits
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    q2, k_cache2, v_cache2, meta2, ks2, vs2 = replayed
    for static, new in [
        (q, q2),
        (k_cache, k_cache2),
        (v_cache, v_cache2),
        (meta.slot_mapping, meta2.slot_mapping),
        (meta.seq_lens, meta2.seq_lens),
        (meta.block_tables, meta2.block_tables),
        (new_k, torch.stack([k[-1] for k in ks2])),
        (new_v, torch.stack([v[-1] for v in vs2])),
    ]:
        static.copy_(new)
    # The new tokens' slots hold NaN until the replay writes them: attention that read them
    # before write_kv stored them (a race under programmatic dependent launch), or the fused
    # kernel reading them from the cache instead of its registers, would give NaN.
    slots = meta2.slot_mapping
    for cache in (k_cache, v_cache):
        cache[slots // 64, :, slots % 64] = float("nan")
    graph.replay()
    torch.cuda.synchronize()
    if fused:  # the new tokens' slots already hold k and v: written again, the same
        new_k2, new_v2 = torch.stack([k[-1] for k in ks2]), torch.stack([v[-1] for v in vs2])
        eager = triton_attention.attention(
            q2, new_k2.to(DEVICE), new_v2.to(DEVICE), k_cache2, v_cache2, meta2, 0.1,
            num_splits=num_splits,
        )  # fmt: skip
    else:
        eager = triton_attention.paged_attention(
            q2, k_cache2, v_cache2, meta2, 0.1, num_splits=num_splits
        )
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    _assert_matches(out, _reference(q2, ks2, vs2, 0.1), torch.bfloat16)


@cuda
def test_llama3_8b_decode_shapes():
    """32 query / 8 kv heads, head_dim 128, a larger batch of long, ragged contexts."""
    gen = torch.Generator().manual_seed(7)
    contexts = torch.randint(1, 8000, (16,), generator=gen).tolist()
    q, k_cache, v_cache, meta, ks, vs = _decode_case(contexts, 32, 8, 128, 64, torch.bfloat16)
    out = triton_attention.paged_attention(q, k_cache, v_cache, meta, 128**-0.5)
    _assert_matches(out, _reference(q, ks, vs, 128**-0.5), torch.bfloat16)


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_decode_reads_an_fp8_cache(dtype, num_splits):
    """An e4m3 cache (scale 1.0) read by both decode paths, attended in q's dtype."""
    contexts = [1, 40, 333, 64]
    for fused in (False, True):
        q, k_cache, v_cache, meta, ks, vs = _decode_case(
            contexts, 8, 2, 64, 16, dtype, seed=2, write_new=not fused, cache_dtype=FP8_DTYPE
        )
        if fused:
            new_k = torch.stack([k[-1] for k in ks]).to(DEVICE)
            new_v = torch.stack([v[-1] for v in vs]).to(DEVICE)
            args = (q, new_k, new_v, k_cache, v_cache, meta, 0.125)
            out = triton_attention.attention(*args, num_splits=num_splits)
        else:
            out = triton_attention.paged_attention(
                q, k_cache, v_cache, meta, 0.125, num_splits=num_splits
            )
        _assert_matches(out, _reference(q, ks, vs, 0.125), dtype)


@pytest.mark.parametrize("fused", [False, True], ids=["write_kv", "attention"])
def test_fp8_writes_round_to_nearest_and_saturate(fused):
    """New K/V that e4m3 cannot hold (ties, values past 448) are stored rounded to nearest even
    and saturated, as vLLM's CUDA cache write stores them, and attended as stored."""
    contexts = [5, 70]
    q, k_cache, v_cache, meta, ks, vs = _decode_case(
        contexts, 4, 2, 32, 16, torch.float32, seed=4, write_new=False, cache_dtype=FP8_DTYPE
    )
    gen = torch.Generator().manual_seed(9)
    new_k, new_v = (torch.randn(2, 2, 32, generator=gen) * 60 for _ in range(2))
    new_k[0, 0, :4] = torch.tensor([84.0, -31.875, 1000.0, -2000.0])  # a tie, near one, > 448
    if fused:
        out = triton_attention.attention(
            q, new_k.to(DEVICE), new_v.to(DEVICE), k_cache, v_cache, meta, 0.1
        )
    else:
        triton_attention.write_kv(
            k_cache, v_cache, new_k.to(DEVICE), new_v.to(DEVICE), meta.slot_mapping
        )
        out = triton_attention.paged_attention(q, k_cache, v_cache, meta, 0.1)
    slots = meta.slot_mapping.cpu()
    stored_k = k_cache.cpu()[slots // 16, :, slots % 16]
    expected_k = new_k.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    assert torch.equal(stored_k.view(torch.uint8), expected_k.view(torch.uint8))
    assert stored_k[0, 0, :4].float().tolist() == [80.0, -32.0, 448.0, -448.0]
    stored_v = v_cache.cpu()[slots // 16, :, slots % 16]
    rounded_k = [torch.cat([k[:-1], stored_k[i : i + 1].float()]) for i, k in enumerate(ks)]
    rounded_v = [torch.cat([v[:-1], stored_v[i : i + 1].float()]) for i, v in enumerate(vs)]
    _assert_matches(out, _reference(q, rounded_k, rounded_v, 0.1), torch.float32)
