"""The instances a router sends requests to: which are registered, which are up, and how it
learns it.

Every PROBE_INTERVAL_S every instance is asked (a decode server's Stats, a prefill's health
check), the healthy ones too: one that answers and is not draining is up; one that does not, or
drains, is down. So one marked down comes back once it answers (e.g. restarted on its address),
and one that begins to drain leaves the rotation within PROBE_INTERVAL_S. A decode server
restarted on its address answers with another instance id: logged.

Instances come and go at runtime (router/admin_api.py, router/discovery.py). An instance that
deregisters itself before it drains (rpc/registration.py) is never sent a request it would
refuse: `remove_instance` stops new requests going to it, and `settle` returns once none is on
its way there any more (a decode server: a Reserve, or a Generate it prefills itself, not yet
answered; a prefill: a call not yet answered), so the instance can begin to refuse work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from router.clients import DecodeClient, PrefillClient
from router.errors import BackendError
from router.prefix_affinity import PlacedBlocks, choose

PROBE_INTERVAL_S = 2.0
SETTLE_POLL_S = 0.01

logger = logging.getLogger(__name__)


@dataclass
class PrefillInstance:
    url: str
    in_flight: int = 0
    """Calls sent and not answered yet."""
    healthy: bool = True


@dataclass
class DecodeInstance:
    address: str
    outstanding_tokens: int = 0
    active_tokens: int = 0
    """The KV tokens of the requests placed on it and not ended: prompt and maximum output
    each (router/prefix_affinity.py weighs it against the prompt tokens it holds)."""
    healthy: bool = True
    max_model_len: int = 0
    """The longest sequence it decodes, as its Stats said; 0 until it answered."""
    arriving: int = 0
    """Requests placed on it whose Reserve (or, prefilled there, whose Generate) it has not
    answered yet: what a deregistration waits for."""
    instance_id: str = ""
    """As its Stats said; another one at the same address is a restarted server."""
    prefix_caching: bool = False
    block_size: int = 0
    """Its KV blocks' tokens (0 until its Stats answered)."""
    placed: PlacedBlocks = field(default_factory=PlacedBlocks)
    """The prompt blocks placed on it, as far as the router knows (router/prefix_affinity.py)."""


class Membership:
    """The instance lists and their health; the Orchestrator's base."""

    prefills: list[PrefillInstance]
    decodes: list[DecodeInstance]
    prefill_client: PrefillClient
    decode_client: DecodeClient

    async def probe(self) -> None:
        """Asks every instance how it is, all at once; learns the decode servers' context
        lengths and instance ids."""
        await asyncio.gather(
            *(self._probe_decode(d) for d in self.decodes),
            *(self._probe_prefill(p) for p in self.prefills),
        )

    async def _probe_decode(self, decode: DecodeInstance) -> None:
        try:
            stats = await self.decode_client.stats(decode.address)
        except grpc.aio.AioRpcError:
            decode.healthy = False
            return
        decode.healthy = not stats.draining
        decode.max_model_len = stats.max_model_len
        if decode.instance_id and stats.instance_id != decode.instance_id:
            logger.info(
                "decode %s restarted (instance %s, was %s)",
                decode.address, stats.instance_id, decode.instance_id,
            )  # fmt: skip
            decode.placed = PlacedBlocks()  # its cache started empty
        decode.instance_id = stats.instance_id
        decode.prefix_caching = stats.prefix_caching
        decode.block_size = stats.layout.block_size
        decode.placed.capacity = stats.kv_blocks_total

    async def _probe_prefill(self, prefill: PrefillInstance) -> None:
        prefill.healthy = await self.prefill_client.health(prefill.url)

    async def probe_forever(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await self.probe()

    def add_instance(self, role: str, address: str) -> bool:
        """Registers a prefill URL or a decode address, marked down until a probe answers;
        False if it is registered already."""
        if role == "prefill":
            if any(p.url == address for p in self.prefills):
                return False
            self.prefills.append(PrefillInstance(address, healthy=False))
            return True
        if any(d.address == address for d in self.decodes):
            return False
        self.decodes.append(DecodeInstance(address, healthy=False))
        return True

    def remove_instance(self, role: str, address: str) -> PrefillInstance | DecodeInstance | None:
        """No new request goes to it (those it runs finish there); the instance removed, or
        None if it is unknown."""
        if role == "prefill":
            removed = [p for p in self.prefills if p.url == address]
            self.prefills = [p for p in self.prefills if p.url != address]
        else:
            removed = [d for d in self.decodes if d.address == address]
            self.decodes = [d for d in self.decodes if d.address != address]
        return removed[0] if removed else None

    async def settle(self, instance: PrefillInstance | DecodeInstance, timeout_s: float) -> bool:
        """Waits, up to timeout_s, until no request is on its way to a removed instance; False
        if one still was at the timeout."""
        deadline = time.monotonic() + timeout_s
        while _on_its_way(instance):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(SETTLE_POLL_S)
        return True

    def max_model_len(self, configured: int) -> int:
        """The context a request may fill: `configured` (the model's), or less where a decode
        server said it decodes less."""
        return min((d.max_model_len for d in self.decodes if d.max_model_len), default=configured)

    async def _pick_decode(self, prompt_ids: list[int]) -> tuple[DecodeInstance, list[bytes]]:
        """The decode instance that is up for a prompt (the least loaded; where some cache
        prefixes, the one with the fewest tokens in hand once it holds the prompt:
        router/prefix_affinity.py), and the prompt's block names there. With
        none up, the down ones are asked again first (one may be back since the last probe,
        e.g. restarted on its address)."""
        healthy = [d for d in self.decodes if d.healthy]
        if not healthy:
            await asyncio.gather(*(self._probe_decode(d) for d in self.decodes))
            healthy = [d for d in self.decodes if d.healthy]
        if not healthy:
            raise BackendError(503, "no decode instance is available")
        return choose(healthy, prompt_ids)

    def _prefill_order(self) -> list[PrefillInstance]:
        """The instances to try, at most two (a failure is retried once, on another): least in
        flight first, healthy ones before those marked down (which may be back already)."""
        ranked = sorted(self.prefills, key=lambda p: (not p.healthy, p.in_flight))
        return ranked[:2]

    def _listed(self, prefill: PrefillInstance) -> bool:
        """Whether `prefill` is still one of the instances (not removed since it was picked)."""
        return any(p is prefill for p in self.prefills)

    def _any_prefill_healthy(self) -> bool:
        return any(p.healthy for p in self.prefills)


def _on_its_way(instance: PrefillInstance | DecodeInstance) -> bool:
    if isinstance(instance, PrefillInstance):
        return instance.in_flight > 0
    return instance.arriving > 0
