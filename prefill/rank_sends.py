"""Every tensor-parallel rank of tandem's prefill sends the KV heads it holds, and commits for
itself: the decode server admits a request once each sender rank has committed (the commits
name how many there are).

Each rank has its own transport agent (its share of the cache registered), KvSender and
KvPublisher (layer by layer, as on one device): `RankSender` builds them alike for rank 0 (in
the server) and for every other rank (`PrefillRankAgent`, in the rank's process, which rank 0
drives through engine.tp_workers in order with the steps: open a request's session, arm the
sessions whose prompt completes in the next forward, end them). A rank > 0 reports each
request's send in the ranks' store (`sent_key`); rank 0 waits for every report before it
answers the request and before its blocks may be reused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed as dist

from engine.kv_cache import KVCache
from engine.step_executor import StepExecutor
from prefill.kv_sender import KvSender
from prefill.publisher import KvPublisher, LayerwiseSend
from prefill.send_session import SendStats
from prefill.ticket import KvTransfer, rank_heads
from proto.tandem.v1 import layout_pb2
from transport.base import Transport
from transport.config import KvTransportConfig


@dataclass(frozen=True)
class RankSender:
    """What one rank sends with: its transport agent and its sender of its heads."""

    agent: Transport
    sender: KvSender

    @classmethod
    def build(
        cls,
        kv: KvTransportConfig,
        layout: layout_pb2.LayoutDescriptor,
        rank: int,
        cache: KVCache,
        proposer_cache: KVCache | None = None,
    ) -> RankSender:
        """Sender rank `rank`'s, over its cache (and the speculative proposer's, which rank 0
        alone has); `layout` is the prefill's (every sender's heads)."""
        regions = [c.region() for c in (cache, proposer_cache) if c is not None]
        agent = kv.create_registered(regions, str(cache.storage.device))
        model = layout.model
        sender = KvSender(
            agent, layout, sender_id=f"prefill-rank{rank}", rank=rank,
            heads=rank_heads(model.num_kv_heads, layout.tp_size, rank),
            token_bytes=model.head_dim * cache.storage.element_size(),
            timeout_s=kv.transfer_timeout_s,
        )  # fmt: skip
        return cls(agent, sender)

    def close(self) -> None:
        self.sender.close()
        self.agent.close()


def sent_key(request_id: str, rank: int) -> str:
    """Where rank `rank` reports the end of its send for the prefill's request `request_id`
    (its error, empty if none)."""
    return f"sent/{request_id}/{rank}"


def wait_for_ranks(store: dist.Store, request_id: str, num_ranks: int, deadline: float) -> str:
    """Waits for ranks 1.. to report their send of `request_id` until `deadline` (monotonic);
    the first error, one naming the ranks that did not report, or "" (the keys are removed)."""
    keys = [sent_key(request_id, rank) for rank in range(1, num_ranks)]
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys, 1) if not store.check([key])]
            return f"tensor-parallel rank(s) {missing} did not end their send by the deadline"
        time.sleep(0.001)
    errors = [(rank, store.get(key).decode()) for rank, key in enumerate(keys, 1)]
    for key in keys:
        store.delete_key(key)
    return next((f"rank {rank}: {error}" for rank, error in errors if error), "")


class PrefillRankAgent:
    """A prefill rank > 0 (engine.tp_workers.RankAgent): its sender, driven by rank 0. With KV
    heads replicated over `replicas` ranks, the first of each group sends (as sender rank
    rank // replicas); the others only report each request's end."""

    def __init__(
        self, kv: KvTransportConfig, layout: bytes, kv_send: str, replicas: int, rank: int
    ) -> None:
        self.kv = kv
        self.layout = layout_pb2.LayoutDescriptor.FromString(layout)
        self.rank = rank
        self.sends_kv = rank % replicas == 0
        self.sender_rank = rank // replicas
        self.publisher = KvPublisher(kv_send)
        self.sends: dict[str, LayerwiseSend] = {}
        self._rank_sender: RankSender | None = None
        self._store: dist.Store | None = None
        self._cache: KVCache | None = None

    def wrap_attention(self, backend):
        return self.publisher.wrap(backend)

    def ready(self, executor: StepExecutor, store: dist.Store) -> None:
        self._cache, self._store = executor.kv_cache, store
        self.publisher.bind(executor.kv_cache)
        if self.sends_kv:
            cache = executor.kv_cache
            self._rank_sender = RankSender.build(self.kv, self.layout, self.sender_rank, cache)

    def open(self, request_id: str, transfer: KvTransfer) -> None:
        """A session for the request's ticket (connecting in the background)."""
        if not self.sends_kv:
            return
        sender = self._rank_sender.sender
        self.sends[request_id] = LayerwiseSend(sender, sender.open(transfer), self._cache)

    def arm(self, armed: list[tuple[str, list[int], int, bool]], hooks: bool) -> None:
        """Before a forward: rank 0's LayerwiseSend.arm of each request it sends from (its
        blocks, the prompt's tokens computed after the forward, whether that completes it),
        and rank 0's KvPublisher.arm `hooks`."""
        if not self.sends_kv:
            return
        sends = [self.sends[rid] for rid, *piece in armed if self.sends[rid].arm(*piece)]
        self.publisher.arm(sends, hooks)

    def forward_done(self) -> None:
        """After the forward `arm` was for."""
        self.publisher.forward_done()

    def fail(self, request_id: str, error: str) -> None:
        if self.sends_kv:
            self._rank_sender.sender.fail(self.sends[request_id].session, error)
        self.finish(request_id)

    def finish(self, request_id: str) -> None:
        """Ends the request's send: its commit, then its report to rank 0."""
        key = sent_key(request_id, self.rank)
        if not self.sends_kv:
            self._store.set(key, "")
            return
        send = self.sends.pop(request_id)
        if self._rank_sender.sender.speculative is not None:
            send.proposer_ready()  # rank 0 alone holds the proposer: its layers, no writes
        done = self._rank_sender.sender.finish(send.session)
        done.add_done_callback(lambda f: self._report(key, f.result()))

    def _report(self, key: str, stats: SendStats) -> None:
        self._store.set(key, stats.error)

    def close(self) -> None:
        if self._rank_sender is not None:
            self._rank_sender.close()
