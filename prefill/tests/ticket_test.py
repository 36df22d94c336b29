"""The speculative proposer's part of a descriptor and a ticket: `SpeculativeKv` as text and
back, its sizes, malformed text refused by name, and a ticket whose proposer regions do not
fit its layout's speculative_kv refused before any write."""

from __future__ import annotations

import pytest

from prefill.ticket import DECODE_LAYOUT, SpeculativeKv, layout_descriptor, ticket_problem
from proto.tandem.v1 import decode_pb2, layout_pb2

MTP = "mtp:mla-latent:1x1x576:bfloat16"
DRAFT = "draft_model:hnd:30x3x64:float32"
BLOCK = 16


def test_speculative_kv_round_trips_and_sizes():
    mtp, draft = SpeculativeKv.parse(MTP), SpeculativeKv.parse(DRAFT)
    assert (str(mtp), str(draft)) == (MTP, DRAFT)
    assert (mtp.planes, mtp.token_bytes, mtp.bytes_per_token) == (1, 1152, 1152)
    assert (draft.planes, draft.token_bytes, draft.bytes_per_token) == (2, 256, 30 * 2 * 3 * 256)
    assert SpeculativeKv.parse("") is None


@pytest.mark.parametrize(
    "text", ["mtp:1x1x576:bfloat16", "mtp:mla-latent:1x1:bfloat16", "mtp:hnd:1x1x8:int4"]
)
def test_malformed_speculative_kv_is_refused_by_name(text):
    with pytest.raises(ValueError, match="is not <method>:<kv_format>"):
        SpeculativeKv.parse(text)


def _ticket(speculative_kv: str, layers: int, head_stride: int) -> decode_pb2.Ticket:
    layout = layout_descriptor(
        model_name="m", num_layers=2, num_kv_heads=3, head_dim=64, kv_dtype="float32",
        block_size=BLOCK, layout=DECODE_LAYOUT, transport="tcp", speculative_kv=speculative_kv,
    )  # fmt: skip
    region = layout_pb2.KvRegion(addr=4096, nbytes=1 << 20)
    pair = layout_pb2.LayerRegions(k=region, v=region)
    shard = decode_pb2.KvShard(layers=[pair, pair], speculative_layers=[pair] * layers)
    return decode_pb2.Ticket(
        request_id="r", num_tokens=20, block_ids=[0, 1], head_stride_bytes=BLOCK * 256,
        speculative_head_stride_bytes=head_stride, shards=[shard], layout=layout,
    )  # fmt: skip


def test_a_ticket_with_the_proposers_layers_passes():
    assert ticket_problem(_ticket(DRAFT, 30, BLOCK * 256), 2, 256) is None
    assert ticket_problem(_ticket("", 0, 0), 2, 256) is None


def test_a_ticket_whose_proposer_regions_do_not_fit_is_refused():
    assert "not the proposer's 30 layers" in ticket_problem(_ticket(DRAFT, 29, BLOCK * 256), 2, 256)
    stride = ticket_problem(_ticket(DRAFT, 30, BLOCK * 128), 2, 256)
    assert "proposer head stride 2048 bytes is not one HND block" in stride
    latent = "mtp:mla-latent:1x1x64:float32"  # one plane: a region pair does not fit
    assert "do not hold 1 plane(s)" in ticket_problem(_ticket(latent, 1, BLOCK * 256), 2, 256)
