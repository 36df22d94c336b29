import pytest
import torch

from engine import attention
from engine.attention import AttentionMetadata

BLOCK_SIZE = 4
NUM_BLOCKS = 40
HEAD_DIM = 8


def _reference(q, ks, vs, seqs, num_heads, scale):
    """Dense float64 attention: each new token attends to its context prefix."""
    out = []
    for (seq_len, query_len), k, v, q_seq in zip(
        seqs, ks, vs, q.split([n for _, n in seqs]), strict=True
    ):
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [seq_len, heads, dim]
        v = v.double().repeat_interleave(group, dim=1)
        for j, query in enumerate(q_seq.double()):
            end = seq_len - query_len + j + 1
            scores = torch.einsum("hd,thd->ht", query, k[:end]) * scale
            out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v[:end]))
    return torch.stack(out)


def _paged_case(seqs, num_heads, num_kv_heads, dtype, seed=0):
    """Random contexts scattered over a NaN-filled cache; the new tokens written by write_kv."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, num_kv_heads, BLOCK_SIZE, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # scattered, non-adjacent ids
    tables, ks, vs = [], [], []
    for seq_len, query_len in seqs:
        table = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        k = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        for pos in range(seq_len - query_len):  # the context cached by earlier steps
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            k_cache[block, :, offset] = k[pos]
            v_cache[block, :, offset] = v[pos]
        tables.append(table)
        ks.append(k)
        vs.append(v)
    meta = AttentionMetadata.build([n for _, n in seqs], [s for s, _ in seqs], tables, BLOCK_SIZE)
    new_k = torch.cat([k[s - n :] for k, (s, n) in zip(ks, seqs, strict=True)])
    new_v = torch.cat([v[s - n :] for v, (s, n) in zip(vs, seqs, strict=True)])
    attention.write_kv(k_cache, v_cache, new_k, new_v, meta.slot_mapping)
    tokens = sum(n for _, n in seqs)
    q = torch.randn(tokens, num_heads, HEAD_DIM, generator=gen).to(dtype)
    return q, k_cache, v_cache, meta, ks, vs


# (seq_len, query_len): whole prompts, prompt chunks after cached context, decode tokens.
MIXED = [(9, 9), (13, 1), (7, 3), (1, 1), (20, 1), (17, 5), (4, 4), (6, 2)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_paged_attention_matches_dense_reference(num_heads, num_kv_heads, dtype, tol):
    q, k_cache, v_cache, meta, ks, vs = _paged_case(MIXED, num_heads, num_kv_heads, dtype)
    scale = HEAD_DIM**-0.5
    out = attention.paged_attention(q, k_cache, v_cache, meta, scale)
    ref = _reference(q, ks, vs, MIXED, num_heads, scale)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("seqs", [[(5, 1), (11, 1), (3, 1)], [(10, 10)], [(12, 7)]])
def test_paged_attention_single_kind_batches(seqs):
    q, k_cache, v_cache, meta, ks, vs = _paged_case(seqs, 4, 2, torch.float64, seed=1)
    out = attention.paged_attention(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(out, _reference(q, ks, vs, seqs, 4, 0.3), rtol=1e-12, atol=1e-12)


def test_write_kv_touches_only_the_mapped_slots():
    k_cache = torch.zeros(6, 2, BLOCK_SIZE, HEAD_DIM)
    v_cache = torch.zeros(6, 2, BLOCK_SIZE, HEAD_DIM)
    k = torch.randn(3, 2, HEAD_DIM)
    v = torch.randn(3, 2, HEAD_DIM)
    attention.write_kv(k_cache, v_cache, k, v, torch.tensor([5, 6, 23]))
    assert torch.equal(k_cache[1, :, 1], k[0]) and torch.equal(v_cache[1, :, 1], v[0])
    assert torch.equal(k_cache[1, :, 2], k[1]) and torch.equal(v_cache[1, :, 2], v[1])
    assert torch.equal(k_cache[5, :, 3], k[2]) and torch.equal(v_cache[5, :, 3], v[2])
    assert int((k_cache != 0).sum()) == k.numel()
    assert int((v_cache != 0).sum()) == v.numel()


def test_build_computes_slots_and_offsets():
    meta = AttentionMetadata.build([3, 1, 2], [3, 6, 9], [[5], [2, 9], [7, 0, 4]], BLOCK_SIZE)
    # seq 0: positions 0-2 in block 5; seq 1: position 5 = block 9 offset 1;
    # seq 2: positions 7, 8 = block 0 offset 3, block 4 offset 0.
    assert meta.slot_mapping.tolist() == [20, 21, 22, 37, 3, 16]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6]
    assert meta.seq_lens.tolist() == [3, 6, 9]
    assert meta.block_tables.tolist() == [[5, 0, 0], [2, 9, 0], [7, 0, 4]]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 9)


@pytest.mark.parametrize(
    "query_lens,seq_lens,tables,match",
    [
        ([4], [3], [[0]], r"query_lens\[0\]"),
        ([1, 0], [2, 2], [[0], [1]], r"query_lens\[1\]"),
        ([1], [9], [[0, 1]], r"block_tables\[0\]"),
        ([1, 1], [1], [[0], [1]], "differ in length"),
    ],
)
def test_build_rejects_inconsistent_inputs(query_lens, seq_lens, tables, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)


def test_metadata_rejects_wrong_dtypes_and_shapes():
    good = AttentionMetadata.build([2, 1], [2, 5], [[0], [1, 2]], BLOCK_SIZE)
    fields = dict(
        slot_mapping=good.slot_mapping,
        query_start_loc=good.query_start_loc,
        seq_lens=good.seq_lens,
        block_tables=good.block_tables,
        max_query_len=2,
        max_seq_len=5,
    )
    bad = {
        "slot_mapping": good.slot_mapping.int(),
        "query_start_loc": good.query_start_loc[:2],
        "seq_lens": good.seq_lens.long(),
        "block_tables": good.block_tables[:1],
        "max_query_len": 0,
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            AttentionMetadata(**{**fields, name: value})
