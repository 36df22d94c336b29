"""Paged attention: the per-step metadata contract and the CPU (torch) backend.

One forward packs the new tokens of B sequences into T rows: a sequence brings a whole prompt, a
chunk of one (the earlier part already in the cache), or one decode token. Sequence i's new tokens
are the *last* query_len_i tokens of its context of seq_len_i tokens, so its j-th new token sits
at position seq_len_i - query_len_i + j and attends to every context position up to its own.

The KV cache of one layer is K and V, each [num_blocks, num_kv_heads, block_size, head_dim]
("HND": one head of one block is one contiguous run, which the transport writes directly).

The model reaches attention only through an `AttentionBackend`, chosen by whoever builds the
model. This module is itself the CPU backend (`CausalLM(config, attention=engine.attention)`); a
GPU backend is another module or object with the same two functions.
"""

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from engine.fp8 import FP8_DTYPE, FP8_MAX
from engine.host_values import to_device


@dataclass(frozen=True)
class AttentionMetadata:
    """Where one forward's tokens come from and go to in the paged cache. B sequences, T tokens.

    Tensors live on the model's device. The two host ints let kernels size their launch grids
    without reading device memory.
    """

    slot_mapping: torch.Tensor  # [T] int64: slot (block_id * block_size + offset) per new token
    query_start_loc: torch.Tensor  # [B+1] int32: sequence i's new tokens are rows [q[i], q[i+1])
    seq_lens: torch.Tensor  # [B] int32: context length after this step, new tokens included
    # [B, max_blocks] int32: block ids of each context, in order; rows padded with 0 (any valid id
    # works: entries past a sequence's last block are never attended to).
    block_tables: torch.Tensor
    max_query_len: int  # largest number of new tokens of one sequence
    max_seq_len: int  # largest seq_lens entry
    # Host copies of query_start_loc and seq_lens where the builder had them: the eager batch
    # path reads lengths on the host once per layer, and a .tolist() each time is a device sync
    # per layer (which stalls the GPU whenever another thread holds the GIL at that moment).
    host_query_start_loc: tuple[int, ...] | None = None
    host_seq_lens: tuple[int, ...] | None = None
    # Decode rows (one new token each) that may be consecutive tokens of one sequence, each with
    # its own seq_len and the sequence's block table (speculative verification, a draft model's
    # catch-up, in CUDA graphs): every row's K/V is written before any row attends, where a
    # decode kernel would otherwise attend each row's own K/V from registers.
    new_kv_first: bool = False
    # With new_kv_first, where consecutive rows are tokens of one sequence: [B] int32, each
    # row's index among its sequence's rows (0 for its first; a row whose index is j belongs to
    # the sequence of the row j before it), and at most how many rows a sequence has (a host
    # int: kernels are compiled for it; no sequence may have more). A GPU backend then reads
    # each tile of the context once for all of a sequence's rows, and may write their K/V
    # itself; None: every row on its own, all K/V written first.
    row_in_seq: torch.Tensor | None = None
    max_rows_per_seq: int = 1

    def __post_init__(self) -> None:
        # Shape and dtype only: checking values would cost a device sync every step.
        _expect(self.slot_mapping, "slot_mapping", 1, torch.int64)
        _expect(self.query_start_loc, "query_start_loc", 1, torch.int32)
        _expect(self.seq_lens, "seq_lens", 1, torch.int32)
        _expect(self.block_tables, "block_tables", 2, torch.int32)
        batch = self.seq_lens.shape[0]
        if batch == 0:
            raise ValueError("seq_lens must hold at least one sequence")
        if self.query_start_loc.shape[0] != batch + 1:
            raise ValueError(
                f"query_start_loc has {self.query_start_loc.shape[0]} entries, expected B+1 = "
                f"{batch + 1}"
            )
        if self.block_tables.shape[0] != batch:
            raise ValueError(
                f"block_tables has {self.block_tables.shape[0]} rows, expected B = {batch}"
            )
        if self.row_in_seq is not None:
            _expect(self.row_in_seq, "row_in_seq", 1, torch.int32)
            if not self.new_kv_first or self.row_in_seq.shape[0] != batch:
                raise ValueError("row_in_seq needs new_kv_first and one entry per row")
            if self.max_rows_per_seq < 1:
                raise ValueError(f"max_rows_per_seq must be >= 1, got {self.max_rows_per_seq}")
        if not 1 <= self.max_query_len <= self.max_seq_len:
            raise ValueError(
                f"max_query_len ({self.max_query_len}) must be in [1, max_seq_len "
                f"({self.max_seq_len})]"
            )

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Metadata from per-sequence host lists: new-token counts, context lengths, block ids."""
        if not len(query_lens) == len(seq_lens) == len(block_tables):
            raise ValueError(
                f"query_lens, seq_lens and block_tables differ in length: {len(query_lens)}, "
                f"{len(seq_lens)}, {len(block_tables)}"
            )
        for i, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
            if not 1 <= q <= s:
                raise ValueError(f"query_lens[{i}] = {q} must be in [1, seq_lens[{i}] = {s}]")
            if len(table) * block_size < s:
                raise ValueError(
                    f"block_tables[{i}] has {len(table)} blocks of {block_size}, too few for "
                    f"seq_lens[{i}] = {s}"
                )
        width = max(len(table) for table in block_tables)
        tables = torch.tensor(
            [list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32
        )
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        s_lens = torch.tensor(seq_lens, dtype=torch.int64)
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        starts[1:] = q_lens.cumsum(0)
        seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
        positions = (
            torch.arange(int(starts[-1])) - starts[seq_of_row] + (s_lens - q_lens)[seq_of_row]
        )
        slots = (
            tables[seq_of_row, positions // block_size].long() * block_size + positions % block_size
        )
        return cls(
            slot_mapping=to_device(slots, device),
            query_start_loc=to_device(starts, device, torch.int32),
            seq_lens=to_device(s_lens, device, torch.int32),
            block_tables=to_device(tables, device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            host_query_start_loc=tuple(starts.tolist()),
            host_seq_lens=tuple(seq_lens),
        )


class AttentionBackend(Protocol):
    """What the model calls per layer is `attention`: `write_kv`, then `paged_attention`, which
    a backend may do in fewer kernels. A wrapper that acts in between calls the two."""

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores new tokens' k, v [T, num_kv_heads, head_dim] at their slots in the paged cache."""
    block_size = k_cache.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    # Two index tensors around a slice: the indexed view is [T, num_kv_heads, head_dim], like k.
    k_cache[blocks, :, offsets] = to_cache(k, k_cache.dtype)
    v_cache[blocks, :, offsets] = to_cache(v, v_cache.dtype)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype. An fp8 (e4m3, scale 1.0) cache stores x as vLLM's CPU kernels
    store it: saturated at +-448 (never NaN), rounded toward zero (a negative value too small
    for e4m3 becomes -0), an input zero stored as +0. So a decode continuing a cache that vLLM's
    CPU prefill wrote writes its own tokens as vLLM would have, and their greedy outputs agree."""
    if dtype == x.dtype:
        return x
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    f = x.float().clamp(-FP8_MAX, FP8_MAX)
    normal = (f.view(torch.int32) & ~0xFFFFF).view(torch.float32)  # e4m3's 3 mantissa bits
    subnormal = torch.trunc(f * 2**9) * 2**-9  # below 2^-6: steps of 2^-9
    y = torch.where(f.abs() < 2**-6, subnormal, normal)
    return torch.where(f == 0, 0.0, y).to(dtype)  # exact: y is on e4m3's grid


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`write_kv` of the new tokens' k, v, then `paged_attention` of q."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return paged_attention(q, k_cache, v_cache, meta, scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over each sequence's cached context.

    The new tokens' K/V must already be written (`write_kv`). Returns [T, num_heads, head_dim].
    """
    return attend_batch(q, k_cache, v_cache, meta, scale, _attend_single_tokens)


# (q rows [n, heads, dim], k_cache, v_cache, seq_lens [n] int32, block_tables [n, w] int32,
#  scale) -> out [n, heads, dim]: attention of one new token per row.
DecodeRows = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def attend_batch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_rows: DecodeRows,
) -> torch.Tensor:
    """Any batch, eagerly (it reads lengths on the host): the one-token rows together through the
    backend's `decode_rows`, each longer query (a prompt or a chunk of one) through
    `attend_chunk`, one sequence at a time, since padding every query to the longest would cost
    B * max_query_len * max_seq_len of mask."""
    out = torch.empty_like(q)
    starts = meta.host_query_start_loc or meta.query_start_loc.tolist()
    seq_lens = meta.host_seq_lens or meta.seq_lens.tolist()
    query_lens = [end - start for start, end in itertools.pairwise(starts)]
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    if decodes:
        index = to_device(decodes, q.device)
        rows = to_device([starts[i] for i in decodes], q.device)
        out[rows] = decode_rows(
            q[rows], k_cache, v_cache, meta.seq_lens[index], meta.block_tables[index], scale
        )
    block_size = k_cache.shape[2]
    for i, n in enumerate(query_lens):
        if n == 1:
            continue
        start, seq_len = starts[i], seq_lens[i]
        table = meta.block_tables[i, : -(-seq_len // block_size)].long()
        k_blocks, v_blocks = (cache[table].to(q.dtype) for cache in (k_cache, v_cache))
        out[start : start + n] = attend_chunk(
            q[start : start + n], k_blocks, v_blocks, seq_len, scale
        )
    return out


def attend_chunk(
    q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    """q [n, heads, dim], the context's blocks [blocks, kv_heads, bs, dim] -> out [n, heads, dim];
    the n queries are the context's last n tokens (`causal_attention` over its K and V, each KV
    head repeated for its group: the kernels asked for there take no GQA)."""
    heads = q.shape[1]
    group = heads // k_blocks.shape[1]

    def context(blocks: torch.Tensor) -> torch.Tensor:  # [heads, seq_len, dim]
        kv = blocks.transpose(0, 1).flatten(1, 2)[:, :seq_len]
        return kv.repeat_interleave(group, dim=0) if group > 1 else kv

    return causal_attention(q, context(k_blocks), context(v_blocks), scale)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, heads, dim] against k [heads, S, dim], v [heads, S, v_dim] -> [n, heads, v_dim],
    causally: the n queries are the last n of the S tokens.

    NOTE: on CUDA, SDPA's default choice here (cuDNN) builds a plan per new shape, which costs
    ~100 ms each time a prompt length is first seen: the flash and memory-efficient kernels are
    asked for instead, and they need 4-D inputs ([1, heads, tokens, dim]; with 3-D ones SDPA
    falls back to the math path, which materializes the whole score matrix) and no GQA.
    """
    n, seq_len = q.shape[0], k.shape[1]
    # SDPA's is_causal aligns the mask top-left, right only when queries == keys.
    mask = None if n == seq_len else causal_lower_right(n, seq_len)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
        )
    return o[0].transpose(0, 1)


def _attend_single_tokens(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Single-token queries need no causal mask, so they batch into one padded SDPA call."""
    block_size = k_cache.shape[2]
    width = -(-int(seq_lens.max()) // block_size)
    tables = block_tables[:, :width].long()
    # [n, kv_heads, width * bs, dim], in q's dtype (an fp8 cache's scale is 1.0)
    k, v = _gather(k_cache, tables).to(q.dtype), _gather(v_cache, tables).to(q.dtype)
    mask = torch.arange(width * block_size, device=q.device)[None, :] < seq_lens[:, None]
    # NOTE: slots past a sequence's end may hold anything a sender wrote (NaN bit patterns too),
    # and a masked-out NaN still poisons softmax (NaN - inf is NaN): zero them.
    valid = mask[:, None, :, None]
    k, v = k.masked_fill(~valid, 0), v.masked_fill(~valid, 0)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return o.squeeze(2)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, heads, bs, dim] cache, [n, w] block ids -> [n, heads, w * bs, dim] contexts."""
    blocks = cache[tables]  # [n, w, heads, bs, dim]
    n, w, heads, bs, dim = blocks.shape
    return blocks.transpose(1, 2).reshape(n, heads, w * bs, dim)


def _expect(t: torch.Tensor, name: str, ndim: int, dtype: torch.dtype) -> None:
    if t.dim() != ndim or t.dtype != dtype:
        raise ValueError(f"{name} must be a {ndim}-D {dtype} tensor, got {t.dim()}-D {t.dtype}")
