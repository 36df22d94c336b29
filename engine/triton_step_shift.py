"""Moving a graph step's rows on the device (engine.cuda_graphs.StepInputs.shift), in one kernel.

A verification planned ahead, and each draft made ahead of it, places its rows `offsets`
positions past where the host wrote them: the accepted drafts of the step before, which the host
has not read. Their positions, lengths and cache slots follow from the offsets and the block
tables. As torch ops that is nine small kernels, launched one after another between a speculative
step's graph replays (some 25 us on an H100, four times a verified step); here it is one.
"""

import torch
import triton
import triton.language as tl

__all__ = ["shift_rows"]

_ROWS = 256
"""Rows per program."""


def shift_rows(
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    offsets: torch.Tensor,
    block_size: int,
) -> None:
    """In place, for each of the n = len(offsets) first rows: positions += offsets, seq_lens =
    positions + 1, slots = the cache slot of the new position in the row's block table.
    positions, slots int64 and seq_lens int32 [>= n], contiguous; block_tables int32 [>= n,
    max_blocks], rows contiguous; offsets [n] integers, at any stride (a broadcast's 0:
    speculative.repeat_rows of one sequence)."""
    n = offsets.shape[0]
    assert positions.is_contiguous() and slots.is_contiguous() and seq_lens.is_contiguous()
    assert block_tables.stride(1) == 1
    if n:
        _shift_kernel[(triton.cdiv(n, _ROWS),)](
            positions, seq_lens, slots, block_tables, offsets, n, block_tables.stride(0),
            offsets.stride(0),
            BLOCK_SIZE=block_size, ROWS=_ROWS,
        )  # fmt: skip


@triton.jit
def _shift_kernel(
    positions_ptr,
    seq_lens_ptr,
    slots_ptr,
    tables_ptr,
    offsets_ptr,
    n,
    stride_table,
    stride_offsets,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < n
    position = tl.load(positions_ptr + rows, mask=live, other=0)
    position += tl.load(offsets_ptr + rows * stride_offsets, mask=live, other=0).to(position.dtype)
    tl.store(positions_ptr + rows, position, mask=live)
    tl.store(seq_lens_ptr + rows, (position + 1).to(tl.int32), mask=live)
    table = tables_ptr + rows.to(tl.int64) * stride_table
    block = tl.load(table + position // BLOCK_SIZE, mask=live)
    slot = block.to(tl.int64) * BLOCK_SIZE + position % BLOCK_SIZE
    tl.store(slots_ptr + rows, slot, mask=live)
