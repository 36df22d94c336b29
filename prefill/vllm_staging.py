"""Staging memory for converted KV: one registered buffer cut into equal slots, used round
robin. A slot's life: taken (the engine thread gathers one layer's K and V of a token run into
it) -> its write posted -> reused once that write completed or failed. Taking a slot whose
write is still in flight waits for it, which bounds the memory and the writes in flight.
"""

from __future__ import annotations

import contextlib
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
        self._writes: list[list[Future]] = [[] for _ in range(slots)]
        self._next = 0

    def take(self) -> tuple[torch.Tensor, list[Future]]:
        """The next slot, once the writes that read it have ended, and the list to which the
        caller adds one Future per write it posts from the slot (resolved with the Transfer, or
        None when posting failed). Called from one thread (vLLM's engine thread)."""
        index = self._next
        self._next = (index + 1) % len(self._slots)
        for future in self._writes[index]:
            _wait_quietly(future.result())
        self._writes[index] = []
        return self._slots[index], self._writes[index]


def _wait_quietly(transfer: Transfer | None) -> None:
    """The owner of the transfer reports its failure; here it only has to have ended."""
    if transfer is not None:
        with contextlib.suppress(TransportError):
            transfer.wait()
