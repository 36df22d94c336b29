"""What the connector's scheduler side tells its worker side each engine step.

NOTE: TandemMetadata plays vLLM's KVConnectorMetadata without subclassing it: vLLM only carries
it (pickled to the worker processes) from build_connector_meta to bind_connector_metadata, and
importing vLLM would tie both sides, and their tests, to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SendPlan:
    """One ticketed request's part of one engine step.

    After this step's forward, prompt tokens [0, end) of the request are in vLLM's cache; the
    worker side sends [start, end) of every layer, each layer as soon as it is computed. Tokens
    [0, start) went in earlier steps; [0, num_computed_tokens) of a prompt that hit vLLM's
    prefix cache go in its first step, read from the request's blocks like the rest.
    """

    req_id: str
    start: int
    end: int
    block_ids: tuple[int, ...]
    """The request's vLLM blocks, in token order (scheduler block ids, vLLM's block size)."""
    final: bool
    """`end` is the prompt's length: the worker side commits once this step's writes landed."""
    ticket: bytes = b""
    """Serialized tandem.v1.Ticket; set in a request's first plan only."""
    decode_address: str = ""
    """host:port of the decode server's gRPC; with `ticket`."""
    error: str = ""
    """Set when the request cannot send (its ticket was refused, or it ended before its prompt
    was prefilled): the worker side commits this error instead of writing."""


@dataclass
class TandemMetadata:
    plans: list[SendPlan] = field(default_factory=list)
    """One per ticketed request that sends (or fails) in this step."""
