"""Admission of remotely prefilled KV: the blocks of each ticket, from reservation to decoding.

Life cycle of a ticket (TicketState), with a generation number per request id:

  reserve()                commit() by every sender        take()
  ---------> RESERVED ---------------------------------> READY ------> handed to the engine
                 |                                          |            (blocks owned by it)
                 | deadline passed / abort / bad commit     | abort
                 v                                          v
              FAILED: blocks QUARANTINED until every       FAILED: blocks freed at once
              sender committed or the deadline (+ grace)   (no writer is left)
              passed, since a remote writer may still
              be writing into them; then freed.

Commits of an older generation (a retried request id) are refused and change nothing. Every
waiter gets an explicit outcome by the deadline. After any storm of failures, once the
deadlines have passed, the pool's free count is back to its baseline.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache import BlockPool

# Writers stop at the ticket's deadline (their transports enforce it); this much longer, a DMA
# already issued may still land, so quarantined blocks wait for it too.
QUARANTINE_GRACE_S = 1.0
DEADLINE_MISSED = "not every sender committed by the deadline"
REMEMBERED_REQUESTS = 65536
"""Request ids whose latest generation (and, if it failed, why) is remembered after they leave:
enough to refuse stale commits and to tell a late Generate why its ticket failed, bounded so a
long-running server does not grow with every request it ever saw."""


class AdmissionError(Exception):
    """A request refused; `code` names the gRPC status to return."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class TicketState(enum.Enum):
    RESERVED = "reserved"
    READY = "ready"
    TAKEN = "taken"
    FAILED = "failed"


@dataclass
class Reservation:
    request_id: str
    generation: int
    prompt_ids: list[int]
    block_ids: list[int]
    num_senders: int
    max_tokens: int
    deadline: float
    """time.monotonic() by which every sender must have committed."""
    expected_bytes: int
    """KV bytes of the prompt, all layers, K and V, summed over every sender."""
    committed: dict[int, int] = field(default_factory=dict)
    """sender rank -> bytes it reported."""
    state: TicketState = TicketState.RESERVED
    error: str | None = None
    quarantined_until: float | None = None


class Admission:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        num_layers: int,
        kv_bytes_per_token: int,
        max_model_len: int,
        default_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.num_layers = num_layers
        self.kv_bytes_per_token = kv_bytes_per_token
        self.max_model_len = max_model_len
        self.default_timeout_s = default_timeout_s
        self.clock = clock
        self._live: dict[str, Reservation] = {}
        self._quarantine: list[Reservation] = []
        self._generations: OrderedDict[str, int] = OrderedDict()
        self._failures: OrderedDict[tuple[str, int], str] = OrderedDict()
        """(request id, generation) -> why that ticket failed."""
        self._cond = threading.Condition()

    # -- RPC-facing operations ----------------------------------------------------------------

    def reserve(
        self,
        request_id: str,
        prompt_ids: list[int],
        num_senders: int,
        max_tokens: int,
        timeout_s: float = 0.0,
    ) -> Reservation:
        if not request_id:
            raise AdmissionError("INVALID_ARGUMENT", "request_id: must not be empty")
        if not prompt_ids:
            raise AdmissionError("INVALID_ARGUMENT", "prompt_token_ids: must not be empty")
        if num_senders < 1:
            raise AdmissionError("INVALID_ARGUMENT", f"num_senders: {num_senders} must be >= 1")
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise AdmissionError(
                "INVALID_ARGUMENT",
                f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceeds the "
                f"context length {self.max_model_len}",
            )
        with self._cond:
            self._expire_locked()
            if request_id in self._live:
                raise AdmissionError("ALREADY_EXISTS", f"request {request_id!r} is already live")
            need = -(-len(prompt_ids) // self.block_size)
            blocks = self.pool.allocate(need)
            if blocks is None:
                raise AdmissionError(
                    "RESOURCE_EXHAUSTED",
                    f"{need} KV blocks needed for {len(prompt_ids)} tokens, "
                    f"{self.pool.num_free} free of {self.pool.num_total}",
                )
            generation = self._generations.get(request_id, 0) + 1
            _remember(self._generations, request_id, generation)
            reservation = Reservation(
                request_id=request_id,
                generation=generation,
                prompt_ids=list(prompt_ids),
                block_ids=blocks,
                num_senders=num_senders,
                max_tokens=max_tokens,
                deadline=self.clock() + (timeout_s or self.default_timeout_s),
                expected_bytes=len(prompt_ids) * self.kv_bytes_per_token,
            )
            self._live[request_id] = reservation
            return reservation

    def commit(
        self,
        request_id: str,
        generation: int,
        rank: int,
        nbytes: int,
        layers: int,
        error: str = "",
    ) -> tuple[int, int]:
        """Records one sender's commit; returns (committed senders, expected senders)."""
        with self._cond:
            self._expire_locked()
            self._release_quarantine_on_commit_locked(request_id, generation, rank)
            res = self._find_locked(request_id, generation)
            if res.state is TicketState.READY and rank in res.committed:
                return len(res.committed), res.num_senders  # a repeated commit: idempotent
            if res.state is not TicketState.RESERVED:
                raise AdmissionError(
                    "FAILED_PRECONDITION",
                    f"request {request_id!r} is {res.state.value}: {res.error or 'no commit due'}",
                )
            if not 0 <= rank < res.num_senders:
                raise AdmissionError(
                    "INVALID_ARGUMENT",
                    f"sender_rank: {rank} not in [0, {res.num_senders})",
                )
            res.committed[rank] = nbytes  # a repeated commit of a rank replaces its own
            # Whatever it says, a sender that commits has stopped writing.
            if error:
                self._fail_locked(res, f"sender {rank} failed: {error}")
                return len(res.committed), res.num_senders
            if layers != self.num_layers:
                reason = f"sender {rank} wrote {layers} layers, the model has {self.num_layers}"
                self._fail_locked(res, reason)
                raise AdmissionError("INVALID_ARGUMENT", reason)
            if len(res.committed) == res.num_senders:
                total = sum(res.committed.values())
                if total != res.expected_bytes:
                    reason = (
                        f"senders wrote {total} bytes of KV, the prompt's {len(res.prompt_ids)} "
                        f"tokens need {res.expected_bytes}"
                    )
                    self._fail_locked(res, reason)
                    raise AdmissionError("INVALID_ARGUMENT", reason)
                res.state = TicketState.READY
                self._cond.notify_all()
            return len(res.committed), res.num_senders

    def wait_ready(self, request_id: str, generation: int) -> Reservation:
        """Blocks until every sender committed; raises with the reason otherwise (by the
        ticket's deadline at the latest)."""
        with self._cond:
            res = self._find_locked(request_id, generation)
            while res.state is TicketState.RESERVED:
                left = res.deadline - self.clock()
                if left <= 0:
                    self._fail_locked(res, DEADLINE_MISSED)
                    break
                self._cond.wait(timeout=left)
            if res.state is TicketState.FAILED:
                raise AdmissionError(_failure_code(res.error), res.error)
            if res.state is TicketState.TAKEN:
                raise AdmissionError("FAILED_PRECONDITION", f"{request_id!r} already generating")
            return res

    def take(self, res: Reservation) -> list[int]:
        """READY -> TAKEN: the blocks now belong to the caller (the engine)."""
        with self._cond:
            if res.state is not TicketState.READY:
                raise AdmissionError("ABORTED", res.error or f"request is {res.state.value}")
            res.state = TicketState.TAKEN
            del self._live[res.request_id]
            return res.block_ids

    def abort(
        self,
        request_id: str,
        generation: int = 0,
        reason: str = "aborted",
        writers_possible: bool = True,
    ) -> bool:
        """Fails a reserved or ready ticket; False if none matched. `writers_possible=False`
        (the ticket never reached a sender) frees reserved blocks without quarantine."""
        with self._cond:
            res = self._live.get(request_id)
            if res is None or (generation and generation != res.generation):
                return False
            self._fail_locked(res, reason, writers_possible)
            return True

    # -- bookkeeping --------------------------------------------------------------------------

    def expire(self) -> None:
        """Fails overdue tickets and frees quarantined blocks whose time has come."""
        with self._cond:
            self._expire_locked()

    @property
    def num_reserved(self) -> int:
        with self._cond:
            return sum(r.state is TicketState.RESERVED for r in self._live.values())

    @property
    def num_quarantined_blocks(self) -> int:
        with self._cond:
            return sum(len(r.block_ids) for r in self._quarantine)

    def _find_locked(self, request_id: str, generation: int) -> Reservation:
        res = self._live.get(request_id)
        if res is None:
            latest = self._generations.get(request_id)
            if latest is not None and generation < latest:
                raise AdmissionError(
                    "FAILED_PRECONDITION",
                    f"stale generation {generation} of {request_id!r} (latest: {latest})",
                )
            reason = self._failures.get((request_id, generation))
            if reason is not None:
                raise AdmissionError(_failure_code(reason), reason)
            raise AdmissionError("NOT_FOUND", f"no live request {request_id!r}")
        if generation != res.generation:
            raise AdmissionError(
                "FAILED_PRECONDITION",
                f"stale generation {generation} of {request_id!r} (live: {res.generation})",
            )
        return res

    def _release_quarantine_on_commit_locked(
        self, request_id: str, generation: int, rank: int
    ) -> None:
        """A late commit of a failed ticket: that sender stopped writing. Once all have, its
        blocks are free at once; the sender learns that its request failed."""
        for res in self._quarantine:
            if res.request_id == request_id and res.generation == generation:
                if 0 <= rank < res.num_senders:
                    res.committed[rank] = 0
                if len(res.committed) >= res.num_senders:
                    self._quarantine.remove(res)
                    self.pool.free(res.block_ids)
                raise AdmissionError("FAILED_PRECONDITION", f"request {request_id!r}: {res.error}")

    def _fail_locked(self, res: Reservation, reason: str, writers_possible: bool = True) -> None:
        if res.state is TicketState.FAILED:
            return
        was_reserved = res.state is TicketState.RESERVED
        res.state = TicketState.FAILED
        res.error = reason
        self._live.pop(res.request_id, None)
        _remember(self._failures, (res.request_id, res.generation), reason)
        if writers_possible and was_reserved and len(res.committed) < res.num_senders:
            # A sender that has not committed may still be writing into these blocks.
            res.quarantined_until = res.deadline + QUARANTINE_GRACE_S
            self._quarantine.append(res)
        else:
            self.pool.free(res.block_ids)
        self._cond.notify_all()

    def _expire_locked(self) -> None:
        now = self.clock()
        for res in list(self._live.values()):
            if res.state is TicketState.RESERVED and now >= res.deadline:
                self._fail_locked(res, DEADLINE_MISSED)
        keep = []
        for res in self._quarantine:
            if now >= res.quarantined_until:
                self.pool.free(res.block_ids)
            else:
                keep.append(res)
        self._quarantine = keep


def _remember(recent: OrderedDict, key, value) -> None:
    recent[key] = value
    recent.move_to_end(key)
    if len(recent) > REMEMBERED_REQUESTS:
        recent.popitem(last=False)


def _failure_code(reason: str) -> str:
    return "DEADLINE_EXCEEDED" if reason == DEADLINE_MISSED else "ABORTED"
