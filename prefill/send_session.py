"""One ticket's send, as the KvSender (prefill/kv_sender.py) keeps it: its state, where its
heads go, and what it reports once committed."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from prefill.kv_writes import BlockLayout
from prefill.ticket import KvTransfer
from proto.tandem.v1 import decode_pb2, layout_pb2
from transport.base import Peer, Transfer, WriteOp


class SessionState(enum.Enum):
    CONNECTING = "connecting"
    SENDING = "sending"
    FAILED = "failed"


@dataclass(frozen=True)
class Target:
    """Where some of this sender's heads go: one shard (decode rank) of the ticket."""

    shard: decode_pb2.KvShard
    peer: Peer
    heads: range
    """This sender's head indices (0 = its first head) that the shard stores."""
    dst_head_offset: int
    """Destination head = sender head - dst_head_offset."""

    def proposer_layer(self, layer: int) -> layout_pb2.LayerRegions | None:
        """The regions of the decode's speculative proposer cache's `layer` in this shard, or
        None if it holds none. The proposer runs on one rank: every head of it goes to the
        shard that lists its layers, at its own index."""
        layers = self.shard.speculative_layers
        return layers[layer] if layers else None


BuildOps = Callable[[Target], list[WriteOp]]
"""Builds one post's writes to one target (called on the poster thread)."""


@dataclass(frozen=True)
class SendStats:
    bytes_written: int
    """Valid KV bytes committed: the prompt's tokens, this sender's heads, every layer sent."""
    layers: int
    seconds: float
    """From the first post to the last write's completion."""
    error: str = ""
    prepare_seconds: float = 0.0
    """Building the write descriptors (the poster's Python work)."""
    post_seconds: float = 0.0
    """Handing them to the transport."""
    write_ops: int = 0
    """Descriptors posted, after coalescing."""
    posts: int = 0
    """Transport writes they went in (one per target each time the poster posts)."""
    wait_seconds: float = 0.0
    """From finish() to the last write's completion."""
    commit_seconds: float = 0.0
    """Sending the commit: the Commit RPC, or the transport notification that stands for it."""


@dataclass(eq=False)
class SendSession:
    transfer: KvTransfer
    deadline: float
    """On the sender's clock: min(its own timeout, the ticket's deadline)."""
    state: SessionState = SessionState.CONNECTING
    error: str = ""
    targets: list[Target] = field(default_factory=list)
    dst_layout: BlockLayout | None = None
    proposer_dst_layout: BlockLayout | None = None
    """The decode server's speculative proposer cache, when the layout has one."""
    writes_proposer: bool = True
    """Whether this sender writes the proposer's layers: the one rank holding the proposer
    does; every other completes them with no writes (and no bytes)."""
    src_blocks: list[int] = field(default_factory=list)
    """The adapter's: the request's blocks in its engine's cache, in token order."""
    connected: threading.Event = field(default_factory=threading.Event)
    """Set once the session is no longer CONNECTING."""
    # Owned by the poster thread.
    _deferred: list = field(default_factory=list)
    """Posts handed over while connecting, in order."""
    _finish: Future | None = None
    _finish_called: float = 0.0
    _transfers: list[Transfer] = field(default_factory=list)
    _layers_done: set[int] = field(default_factory=set)
    _started: float | None = None
    _prepare: float = 0.0
    _post: float = 0.0
    _ops: int = 0
    _posts: int = 0
    _unreachable: bool = False

    @property
    def ticket(self) -> decode_pb2.Ticket:
        return self.transfer.ticket


# What the engine thread queues for the poster thread (prefill.kv_sender).


@dataclass(frozen=True)
class Post:
    session: SendSession
    build: BuildOps
    ready: object | None
    """A torch.cuda.Event recorded after the KV was written (CUDA): waited for before posting."""
    completes_layer: int | None
    future: Future


@dataclass(frozen=True)
class Resume:
    """The session's connect ended (either way): post what waited for it."""

    session: SendSession


@dataclass(frozen=True)
class Finish:
    session: SendSession
    future: Future


def joins(first: Post, item: object) -> bool:
    """Whether `item` can be posted with `first`: the same sending session's next writes,
    computed by the time `first`'s are (the same event: a group of layers, one event after
    them all) or already (their event has completed), so that `first` waits for nothing more."""
    return (
        isinstance(item, Post)
        and item.session is first.session
        and first.session.state is SessionState.SENDING
        and not first.session._deferred
        and (item.ready is None or item.ready is first.ready or item.ready.query())
    )
