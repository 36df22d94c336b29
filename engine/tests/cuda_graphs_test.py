"""engine.cuda_graphs' host-side planning (capture and replay are covered by gpu_engine_test)."""

import torch

from engine.cuda_graphs import StepInputs, batch_buckets
from engine.speculative import repeat_rows


def test_batch_buckets_end_at_max_batch_and_grow():
    assert batch_buckets(1) == [1]
    buckets = batch_buckets(100)
    assert buckets[:4] == [1, 2, 4, 8] and buckets[-1] == 100
    assert buckets == sorted(set(buckets))


def test_step_inputs_lay_out_rows_and_pad_the_rest():
    """The byte layout of the step's copy: what the host writes is what the device views
    read, after one copy of the whole buffer (as each replay does)."""
    inputs = StepInputs(bucket=4, max_blocks=3, padding_block=9, block_size=16, device="cpu")
    inputs.upload([101, 102], [16, 5], [[3, 7], [4]])
    assert inputs.row_in_seq.tolist() == [0, 0, 0, 0]
    assert inputs.input_ids.tolist() == [101, 102, 0, 0]
    assert inputs.positions.tolist() == [16, 5, 0, 0]
    assert inputs.slots.tolist() == [7 * 16 + 0, 4 * 16 + 5, 9 * 16, 9 * 16]
    assert inputs.seq_lens.tolist() == [17, 6, 1, 1]
    assert inputs.block_tables[:, 0].tolist() == [3, 4, 9, 9]
    assert inputs.block_tables[0, :2].tolist() == [3, 7]
    # A smaller batch later: the rows it no longer uses point at the padding block again.
    inputs.upload([5], [0], [[2]])
    assert inputs.slots.tolist() == [2 * 16, 9 * 16, 9 * 16, 9 * 16]
    assert inputs.seq_lens.tolist() == [1, 1, 1, 1]
    assert inputs.block_tables[:, 0].tolist() == [2, 9, 9, 9]
    # The host buffers are used in turn: this one held the first batch's two rows.
    inputs.upload([6], [1], [[2]])
    assert inputs.slots.tolist() == [2 * 16 + 1, 9 * 16, 9 * 16, 9 * 16]
    assert inputs.block_tables[:, 0].tolist() == [2, 9, 9, 9]
    # A verification's rows: two of one sequence, then one of another; padding rows are 0.
    inputs.upload([7, 8, 9], [3, 4, 5], [[2], [2], [4]], row_in_seq=[0, 1, 0])
    assert inputs.row_in_seq.tolist() == [0, 1, 0, 0]
    assert inputs.seq_lens.tolist() == [4, 5, 6, 1]
    inputs.upload([6], [1], [[2]])
    assert inputs.row_in_seq.tolist() == [0, 0, 0, 0]


def test_step_inputs_leave_input_ids_to_the_device_when_fed():
    """A step planned ahead gets its input ids on the device (the step before's tokens): the
    host writes everything else."""
    inputs = StepInputs(bucket=2, max_blocks=2, padding_block=9, block_size=16, device="cpu")
    inputs.upload(None, [3, 20], [[1], [2, 5]])
    assert inputs.positions.tolist() == [3, 20]
    assert inputs.slots.tolist() == [1 * 16 + 3, 5 * 16 + 4]
    assert inputs.seq_lens.tolist() == [4, 21]


def test_step_inputs_shifted_on_the_device_equal_those_written_at_the_shifted_positions():
    """Rows whose positions follow from device values (drafts made ahead of a verification's
    accepted count): shifted after the copy, positions, slots and lengths are what the host
    would have written at those positions, across block boundaries; other rows untouched."""
    tables = [[3, 7, 8], [4, 6, 2], [5]]
    inputs = StepInputs(bucket=4, max_blocks=3, padding_block=9, block_size=16, device="cpu")
    inputs.upload([1, 2, 3], [14, 30, 2], tables)
    inputs.shift(2, torch.tensor([3, 0]))
    shifted = (inputs.positions.clone(), inputs.slots.clone(), inputs.seq_lens.clone())
    inputs.upload([1, 2, 3], [17, 30, 2], tables)
    assert [t.tolist() for t in shifted] == [
        inputs.positions.tolist(),
        inputs.slots.tolist(),
        inputs.seq_lens.tolist(),
    ]
    assert shifted[1].tolist() == [7 * 16 + 1, 6 * 16 + 14, 5 * 16 + 2, 9 * 16]


def test_one_sequences_rows_shift_by_a_broadcast_offset():
    """One sequence's k + 1 verification rows move by its one accepted count, given as a
    broadcast (speculative.repeat_rows: stride 0), as an index-built copy would move them."""
    tables = [[3, 7]] * 3
    inputs = StepInputs(bucket=4, max_blocks=2, padding_block=9, block_size=16, device="cpu")
    inputs.upload([1, 2, 3], [13, 14, 15], tables)
    offsets = repeat_rows(torch.tensor([2]), [3])
    assert offsets.stride() == (0,)
    inputs.shift(3, offsets)
    assert inputs.positions.tolist()[:3] == [15, 16, 17]
    assert inputs.slots.tolist()[:3] == [3 * 16 + 15, 7 * 16, 7 * 16 + 1]
    assert inputs.seq_lens.tolist()[:3] == [16, 17, 18]
