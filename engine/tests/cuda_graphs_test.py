"""engine.cuda_graphs' host-side planning (capture and replay are covered by gpu_engine_test)."""

from engine.cuda_graphs import StepInputs, batch_buckets


def test_batch_buckets_end_at_max_batch_and_grow():
    assert batch_buckets(1) == [1]
    buckets = batch_buckets(100)
    assert buckets[:4] == [1, 2, 4, 8] and buckets[-1] == 100
    assert buckets == sorted(set(buckets))


def test_step_inputs_lay_out_rows_and_pad_the_rest():
    """The byte layout the captured copy moves: what the host writes is what the device views
    read, after one copy of the whole buffer (as the graph does)."""
    inputs = StepInputs(bucket=4, max_blocks=3, padding_block=9, block_size=16, device="cpu")
    inputs.write([101, 102], [16, 5], [[3, 7], [4]])
    inputs.device.copy_(inputs.host)
    assert inputs.input_ids.tolist() == [101, 102, 0, 0]
    assert inputs.positions.tolist() == [16, 5, 0, 0]
    assert inputs.slots.tolist() == [7 * 16 + 0, 4 * 16 + 5, 9 * 16, 9 * 16]
    assert inputs.seq_lens.tolist() == [17, 6, 1, 1]
    assert inputs.block_tables[:, 0].tolist() == [3, 4, 9, 9]
    assert inputs.block_tables[0, :2].tolist() == [3, 7]
    # A smaller batch later: the rows it no longer uses point at the padding block again.
    inputs.write([5], [0], [[2]])
    inputs.device.copy_(inputs.host)
    assert inputs.slots.tolist() == [2 * 16, 9 * 16, 9 * 16, 9 * 16]
    assert inputs.seq_lens.tolist() == [1, 1, 1, 1]
    assert inputs.block_tables[:, 0].tolist() == [2, 9, 9, 9]
