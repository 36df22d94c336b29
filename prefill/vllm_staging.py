"""Staging memory for converted KV: one registered buffer cut into equal slots, used round
robin. A slot's life: taken (the engine thread gathers one layer's K and V of a token run into
it) -> its writes handed to the KvSender -> reused once they completed or failed. Taking a
slot whose writes are still in flight waits for them, which bounds the memory and the writes in
flight; writes not even posted yet (their session still connecting) are reported to
`on_stall` first, so that the caller can let them go instead of waiting on the network.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future

import torch

from transport.base import Transfer, Transport, TransportError

_ALIGN = 256  # bytes; every slot starts aligned for any element type and DMA engine


class StagingRing:
    def __init__(self, agent: Transport, nbytes: int, slots: int, device: torch.device) -> None:
        slot_bytes = nbytes // slots // _ALIGN * _ALIGN
        if slot_bytes <= 0:
            raise ValueError(f"staging: {nbytes} bytes cannot be cut into {slots} slots")
        self.slot_bytes = slot_bytes
        self.buffer = torch.empty(slot_bytes * slots, dtype=torch.uint8, device=device)
        agent.register(self.buffer.data_ptr(), self.buffer.numel(), str(device))
        self._slots = [self.buffer[i * slot_bytes : (i + 1) * slot_bytes] for i in range(slots)]
        self._posts: list[list[tuple[object, Future]]] = [[] for _ in range(slots)]
        self._next = 0

    def take(
        self, on_stall: Callable[[object], None]
    ) -> tuple[torch.Tensor, list[tuple[object, Future]]]:
        """The next slot, once the writes that read it have ended, and the list to which the
        caller adds (owner, Future) for each post it makes from the slot (the Future resolves
        with the post's Transfers once posted or skipped). Called from one thread (vLLM's engine
        thread); `on_stall(owner)` for each post of the slot that is not posted yet."""
        index = self._next
        self._next = (index + 1) % len(self._slots)
        for owner, future in self._posts[index]:
            if not future.done():
                on_stall(owner)
        for _, future in self._posts[index]:
            for transfer in future.result():
                _wait_quietly(transfer)
        self._posts[index] = []
        return self._slots[index], self._posts[index]


def _wait_quietly(transfer: Transfer) -> None:
    """The owner of the transfer reports its failure; here it only has to have ended."""
    with contextlib.suppress(TransportError):
        transfer.wait()
