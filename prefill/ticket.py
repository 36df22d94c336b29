"""What a prefill and a decode server agree on, in one place: the ticket as it travels in
`kv_transfer_params`, its parsing and checks, and the layout descriptor both sides build.

The router reserves a ticket on a decode server (tandem.v1.Ticket) and hands it to a prefill as

    kv_transfer_params = {"tandem_ticket": base64(Ticket), "decode_address": "host:port"}

(`transfer_params`); the prefill (tandem's own or vLLM's connector) parses it (`KvTransfer`).
Every side builds its LayoutDescriptor with `layout_descriptor`, and the decode server refuses
a sender whose descriptor does not fit its own (`mismatch`), naming both values.

Imports nothing but the generated protobuf code: the router and the vLLM plugin use it without
the engine or the decode server.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from proto.tandem.v1 import decode_pb2, layout_pb2

TICKET_KEY = "tandem_ticket"
"""kv_transfer_params key: base64 of a serialized tandem.v1.Ticket."""
DECODE_KEY = "decode_address"
"""kv_transfer_params key: host:port of the decode server's gRPC."""

DECODE_LAYOUT = "HND"
"""The decode server's cache: per layer, each plane [blocks, kv_heads, block_size, head_dim]."""
PREFILL_LAYOUT = "tandem-hnd"
"""tandem's prefill engine: the same memory layout as the decode server's."""
LAYOUT_VERSION = 1
KV_FORMAT_HND = "hnd"
"""ModelFingerprint.kv_format: per layer K and V, each per head (engine.config's names)."""
KV_FORMAT_MLA_LATENT = "mla-latent"
"""ModelFingerprint.kv_format: per layer one MLA latent plane, described as one head."""


PROPOSER_KV_METHODS = ("draft_model", "mtp", "eagle3")
"""Speculative methods whose proposer keeps a KV cache of its own, whose prompt rows a prefill
sends (n-gram lookup needs none)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}
"""Bytes per element of the KV dtypes a descriptor names (`dtype_name`)."""
COMMIT_NOTICE = b"tandem.commit.v1\n"
"""What begins a Commit sent as a transport notification (Ticket.commit_by_notification): the
serialized CommitRequest follows."""


@dataclass(frozen=True)
class SpeculativeKv:
    """A speculative proposer's prompt KV, which travels besides the model's
    (LayoutDescriptor.speculative_kv): a draft model's cache or the MTP layers' latent cache,
    with the model's block size and block ids, written as extra layers after the model's
    (KvShard.speculative_layers). As text "<method>:<kv_format>:<layers>x<heads>x<head
    dim>:<dtype>", e.g. "mtp:mla-latent:1x1x576:bfloat16"."""

    method: str
    kv_format: str
    num_layers: int
    num_heads: int
    head_dim: int
    dtype: str

    def __str__(self) -> str:
        shape = f"{self.num_layers}x{self.num_heads}x{self.head_dim}"
        return f"{self.method}:{self.kv_format}:{shape}:{self.dtype}"

    @classmethod
    def parse(cls, text: str) -> SpeculativeKv | None:
        """None for "" (the proposer needs nothing); ValueError for malformed text."""
        if not text:
            return None
        try:
            method, kv_format, shape, dtype = text.split(":")
            layers, heads, head_dim = (int(n) for n in shape.split("x"))
            DTYPE_BYTES[dtype]
        except (ValueError, KeyError):
            raise ValueError(
                f"speculative_kv: {text!r} is not <method>:<kv_format>:<L>x<H>x<D>:<dtype>"
            ) from None
        return cls(method, kv_format, layers, heads, head_dim, dtype)

    @property
    def planes(self) -> int:
        return 1 if self.kv_format == KV_FORMAT_MLA_LATENT else 2

    @property
    def token_bytes(self) -> int:
        """One token of one head."""
        return self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """One token, every layer, plane and head."""
        return self.num_layers * self.planes * self.num_heads * self.token_bytes


class TicketError(ValueError):
    """kv_transfer_params that carry no usable ticket (the client's mistake: a 400)."""


@dataclass(frozen=True)
class KvTransfer:
    """A parsed ticket and where to commit it."""

    ticket: decode_pb2.Ticket
    decode_address: str

    @classmethod
    def parse(cls, params: dict) -> KvTransfer:
        """From kv_transfer_params; raises TicketError naming what is wrong."""
        try:
            ticket = decode_pb2.Ticket.FromString(base64.b64decode(params[TICKET_KEY]))
            address = str(params[DECODE_KEY])
        except (KeyError, ValueError, TypeError) as e:
            raise TicketError(f"kv_transfer_params: malformed tandem ticket ({e})") from None
        if not ticket.request_id or not ticket.shards:
            raise TicketError("kv_transfer_params: ticket has no request id or shards")
        return cls(ticket, address)

    def deadline(self, timeout_s: float, clock=time.monotonic, wall=time.time) -> float:
        """When every write for this ticket must have ended, on `clock`: the sender's own
        timeout from now, but never past the ticket's deadline. NOTE: the decode server frees
        a ticket's blocks (to other requests) soon after its deadline, so a write after it
        could corrupt another request's KV; the local timeout only ever shortens it."""
        left = self.ticket.deadline_unix_ms / 1000 - wall()
        return clock() + min(timeout_s, left)


def carries_ticket(params: dict | None) -> bool:
    return bool(params) and TICKET_KEY in params


def transfer_params(ticket: decode_pb2.Ticket, decode_address: str) -> dict:
    """kv_transfer_params handing `ticket` to a prefill (the inverse of KvTransfer.parse)."""
    return {
        TICKET_KEY: base64.b64encode(ticket.SerializeToString()).decode(),
        DECODE_KEY: decode_address,
    }


def ticket_problem(ticket: decode_pb2.Ticket, num_layers: int, token_bytes: int) -> str | None:
    """Why a sender whose layers hold `token_bytes` per token and head cannot fill `ticket`;
    None if it can. The ticket's planes per layer are those of its layout's kv_format."""
    block_size = ticket.layout.block_size
    if ticket.head_stride_bytes != block_size * token_bytes:
        return (
            f"ticket {ticket.request_id}: head stride {ticket.head_stride_bytes} bytes is not "
            f"one HND block ({block_size} tokens x {token_bytes} bytes)"
        )
    if len(ticket.block_ids) * block_size < ticket.num_tokens:
        return (
            f"ticket {ticket.request_id}: {len(ticket.block_ids)} blocks of {block_size} "
            f"tokens cannot hold {ticket.num_tokens} tokens"
        )
    cached = ticket.num_cached_tokens
    if cached % block_size or (cached and cached >= ticket.num_tokens):
        return (
            f"ticket {ticket.request_id}: {cached} cached tokens is not a whole number of "
            f"blocks of {block_size} below its {ticket.num_tokens} tokens"
        )
    if any(len(shard.layers) != num_layers for shard in ticket.shards):
        return f"ticket {ticket.request_id}: not {num_layers} layers in every shard"
    planes = kv_planes(ticket.layout.model)
    if any(layer.HasField("v") != (planes == 2) for s in ticket.shards for layer in s.layers):
        return (
            f"ticket {ticket.request_id}: layer regions do not hold the {planes} plane(s) of "
            f"a {ticket.layout.model.kv_format!r} cache"
        )
    return _speculative_problem(ticket)


def _speculative_problem(ticket: decode_pb2.Ticket) -> str | None:
    """Why the ticket's proposer regions do not fit its layout's speculative_kv; None if they
    do (or there is none)."""
    try:
        spec = SpeculativeKv.parse(ticket.layout.speculative_kv)
    except ValueError as e:
        return f"ticket {ticket.request_id}: {e}"
    if spec is None:
        return None
    if ticket.speculative_head_stride_bytes != ticket.layout.block_size * spec.token_bytes:
        return (
            f"ticket {ticket.request_id}: proposer head stride "
            f"{ticket.speculative_head_stride_bytes} bytes is not one HND block "
            f"({ticket.layout.block_size} tokens x {spec.token_bytes} bytes)"
        )
    # The proposer runs whole on one decode rank: one shard lists all its layers.
    holders = [shard.speculative_layers for shard in ticket.shards if shard.speculative_layers]
    if len(holders) != 1 or len(holders[0]) != spec.num_layers:
        return (
            f"ticket {ticket.request_id}: not the proposer's {spec.num_layers} layers in one shard"
        )
    layers = holders[0]
    if any(layer.HasField("v") != (spec.planes == 2) for layer in layers):
        return f"ticket {ticket.request_id}: proposer regions do not hold {spec.planes} plane(s)"
    return None


def kv_planes(model: layout_pb2.ModelFingerprint) -> int:
    """Planes a layer of this cache holds: 2 (K and V) or 1 (the MLA latent)."""
    return 1 if model.kv_format == KV_FORMAT_MLA_LATENT else 2


FP8_KV_DTYPE = "fp8_e4m3"


def dtype_name(dtype) -> str:
    """The name a descriptor carries for a torch dtype: torch's own ("bfloat16"), vLLM's for an
    fp8 cache ("fp8_e4m3")."""
    name = str(dtype).removeprefix("torch.")
    return FP8_KV_DTYPE if name == "float8_e4m3fn" else name


def kv_dtype_fields(dtype, fp8_scale: float) -> dict[str, str | float]:
    """layout_descriptor's kv_dtype and kv_scale for a cache of torch dtype `dtype` (fp8_scale:
    an fp8 cache's scale, unused otherwise)."""
    name = dtype_name(dtype)
    return dict(kv_dtype=name, kv_scale=fp8_scale if name == FP8_KV_DTYPE else 0.0)


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads tensor-parallel rank `rank` of `tp_size` holds; ValueError when the heads
    do not split evenly."""
    if num_kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size: {tp_size} does not divide the model's {num_kv_heads} KV "
            "heads (replicated heads are not supported)"
        )
    per_rank = num_kv_heads // tp_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def layout_descriptor(
    *,
    model_name: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    block_size: int,
    layout: str,
    transport: str,
    kv_format: str = KV_FORMAT_HND,
    kv_scale: float = 0.0,
    tp_size: int = 1,
    layout_version: int = LAYOUT_VERSION,
    speculative_kv: str = "",
) -> layout_pb2.LayoutDescriptor:
    """An engine's KV layout, its heads split evenly over `tp_size` ranks. For
    KV_FORMAT_MLA_LATENT, num_kv_heads is 1 and head_dim the latent width (engine's
    ModelConfig.kv_planes gives both for either format)."""
    return layout_pb2.LayoutDescriptor(
        model=layout_pb2.ModelFingerprint(
            name=model_name,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            kv_dtype=kv_dtype,
            kv_format=kv_format,
            kv_scale=kv_scale,
        ),
        block_size=block_size,
        layout=layout,
        layout_version=layout_version,
        tp_size=tp_size,
        head_ranges=[
            layout_pb2.HeadRange(start=heads.start, end=heads.stop)
            for heads in (rank_heads(num_kv_heads, tp_size, r) for r in range(tp_size))
        ],
        transport=transport,
        speculative_kv=speculative_kv,
    )


def mismatch(ours: layout_pb2.LayoutDescriptor, theirs: layout_pb2.LayoutDescriptor) -> str | None:
    """Why a sender with layout `theirs` cannot write into ours (a decode server's), naming both
    values; None if it can. Block size, layout name and TP split may differ: converting is the
    sender's job."""
    problems = []
    latent = ours.model.kv_format == KV_FORMAT_MLA_LATENT
    for field in ("kv_format", "num_layers", "num_kv_heads", "head_dim", "kv_dtype", "kv_scale"):
        a, b = getattr(ours.model, field), getattr(theirs.model, field)
        if a != b:
            name = "head_dim (latent width)" if latent and field == "head_dim" else field
            problems.append(f"{name}: decode has {a!r}, sender has {b!r}")
    if ours.transport != theirs.transport:
        problems.append(
            f"transport: decode uses {ours.transport!r}, sender uses {theirs.transport!r}"
        )
    if ours.speculative_kv != theirs.speculative_kv:
        problems.append(
            f"speculative_kv: decode's proposer needs {ours.speculative_kv or 'none'!r}, sender "
            f"writes {theirs.speculative_kv or 'none'!r} (a draft model's or MTP layers' prompt "
            "KV comes from a prefill run with the same --speculative-config; or decode with an "
            "n-gram proposer, which needs none)"
        )
    covered = sorted((r.start, r.end) for r in theirs.head_ranges)
    heads = theirs.model.num_kv_heads
    if theirs.tp_size != len(covered) or not _tiles(covered, heads):
        problems.append(
            f"head_ranges: sender's {covered} (tp_size {theirs.tp_size}) do not split "
            f"[0, {heads}) into one range per rank"
        )
    return "; ".join(problems) or None


def _tiles(ranges: list[tuple[int, int]], heads: int) -> bool:
    position = 0
    for start, end in ranges:
        if start != position or end <= start:
            return False
        position = end
    return position == heads


def commit_notice(request: decode_pb2.CommitRequest) -> bytes:
    """A commit as the payload of a transport notification."""
    return COMMIT_NOTICE + request.SerializeToString()


def parse_commit_notice(payload: bytes) -> decode_pb2.CommitRequest | None:
    """The commit a notification carries; None for a payload that is not one."""
    if not payload.startswith(COMMIT_NOTICE):
        return None
    try:
        return decode_pb2.CommitRequest.FromString(payload[len(COMMIT_NOTICE) :])
    except DecodeError:
        return None
