"""Admission of remotely prefilled KV, and the state of every request on the decode server.

Life of a request (RequestState), with a generation number per request id:

  reserve()           commit() by every sender        take()             its stream ends
  --------> RESERVED ------------------------> READY --------> RUNNING ----------------> FINISHED
               |                                 | abort, or    the engine owns its blocks and
               | deadline / abort / bad commit   | no Generate  its tokens; an abort stops the
               v                                 v (30 s)       engine, which ends the stream
            FAILED: blocks QUARANTINED until    FAILED: blocks freed at once (no writer is left)
            every sender committed or the
            deadline (+ grace) passed, since a
            remote writer may still be writing
            into them; then freed.

A failed ticket remembers why (a FailureKind and a message): a late Generate or Commit of it is
refused with the status its kind maps to. Commits of an older generation (a retried request id)
are refused and change nothing. Every waiter gets an explicit outcome by the deadline. After any
storm of failures, once the deadlines have passed, the pool's free count is back to its
baseline. A request id is live from reserve() until FINISHED or FAILED; a second reserve() of a
live id is refused.

With prefix caching (`prefix_cache`), reserve() gives a prompt the cached blocks it starts with
(engine/prefix_cache.py) and new blocks for the rest; its senders write only the rest
(`num_cached_tokens`, which the ticket carries).

A prompt the decode server prefills itself (admit_local(): no Reserve, no sender) starts READY
with no blocks, since the engine allocates its own as it prefills; from there it is any ticket.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from decode.failures import (
    UNCLAIMED,
    UNCLAIMED_S,
    AdmissionError,
    Failure,
    FailureKind,
    deadline_missed,
)
from engine.block_names import prompt_block_names
from engine.kv_cache import BlockPool
from engine.prefix_cache import PrefixCache

# Writers stop at the ticket's deadline (their transports enforce it); this much longer, a DMA
# already issued may still land, so quarantined blocks wait for it too.
QUARANTINE_GRACE_S = 1.0
REMEMBERED_REQUESTS = 65536
"""Request ids whose latest generation (and, if it failed, why) is remembered after they leave:
enough to refuse stale commits and to tell a late Generate why its ticket failed, bounded so a
long-running server does not grow with every request it ever saw."""


class RequestState(enum.Enum):
    RESERVED = "reserved"  # blocks allocated; waiting for every sender's commit
    READY = "ready"  # every sender committed; waiting for Generate to take it
    RUNNING = "running"  # the engine loop's (blocks and all) until its token stream ends
    FINISHED = "finished"  # its stream ended (stop, length, abort, engine failed): forgotten
    FAILED = "failed"  # failed before it ran (its Failure says why): blocks freed or quarantined


@dataclass
class Reservation:
    request_id: str
    generation: int
    prompt_ids: list[int]
    block_ids: list[int]
    num_senders: int
    """Sender ranks that must commit; 0 (reserved without a count) until the first commit
    names its prefill's."""
    max_tokens: int
    deadline: float
    """time.monotonic() by which every sender must have committed."""
    expected_bytes: int
    """KV bytes of the prompt's uncached tokens, all layers, every plane (K and V, or the MLA
    latent), summed over every sender."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV is in the first blocks already (found in the prefix cache)."""
    committed: dict[int, int] = field(default_factory=dict)
    """sender rank -> bytes it reported."""
    state: RequestState = RequestState.RESERVED
    failure: Failure | None = None
    """Why it FAILED."""
    quarantined_until: float | None = None
    claim_by: float | None = None
    """READY: when it fails unless Generate has taken it (last commit + UNCLAIMED_S)."""


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
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """`prefix_cache`: the engine's, if it caches prefixes (over the same pool)."""
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.block_size = block_size
        self.num_layers = num_layers
        """Layers every sender writes: the model's, and its speculative proposer's if any."""
        self.kv_bytes_per_token = kv_bytes_per_token
        self.max_model_len = max_model_len
        self.default_timeout_s = default_timeout_s
        self.clock = clock
        self._live: dict[str, Reservation] = {}
        """RESERVED, READY and RUNNING requests."""
        self._quarantine: list[Reservation] = []
        self._generations: OrderedDict[str, int] = OrderedDict()
        self._failures: OrderedDict[tuple[str, int], Failure] = OrderedDict()
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
        if num_senders < 0:
            raise AdmissionError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_senders: {num_senders} must be >= 1, or 0 (as the commits name)",
            )
        self._check_request(request_id, prompt_ids, max_tokens)
        # Hashed before the lock: a long prompt's names take milliseconds.
        names = prompt_block_names(prompt_ids, self.block_size) if self.prefix_cache else []
        with self._cond:
            self._check_not_live_locked(request_id)
            need = -(-len(prompt_ids) // self.block_size)
            cached = []
            if self.prefix_cache is not None:
                cached = self.prefix_cache.take_prompt(names, len(prompt_ids))
            blocks = self.pool.allocate(need - len(cached))
            if blocks is None:
                self.pool.free(cached)
                raise AdmissionError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{need - len(cached)} KV blocks needed for {len(prompt_ids)} tokens"
                    f"{f' ({len(cached)} more cached)' if cached else ''}, "
                    f"{self.pool.num_free} free of {self.pool.num_total}",
                )
            num_cached = len(cached) * self.block_size
            reservation = Reservation(
                request_id=request_id,
                generation=self._next_generation_locked(request_id),
                prompt_ids=list(prompt_ids),
                block_ids=cached + blocks,
                num_senders=num_senders,
                max_tokens=max_tokens,
                deadline=self.clock() + (timeout_s or self.default_timeout_s),
                expected_bytes=(len(prompt_ids) - num_cached) * self.kv_bytes_per_token,
                num_cached_tokens=num_cached,
            )
            self._live[request_id] = reservation
            self._cond.notify_all()  # wait_reserved
            return reservation

    def admit_local(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> Reservation:
        """A prompt this server prefills itself: READY at once, with no blocks and no sender
        (the engine allocates blocks as it prefills, waiting or preempting as for any other)."""
        self._check_request(request_id, prompt_ids, max_tokens)
        with self._cond:
            self._check_not_live_locked(request_id)
            now = self.clock()
            reservation = Reservation(
                request_id=request_id,
                generation=self._next_generation_locked(request_id),
                prompt_ids=list(prompt_ids),
                block_ids=[],
                num_senders=0,
                max_tokens=max_tokens,
                deadline=now,
                expected_bytes=0,
                state=RequestState.READY,
                claim_by=now + UNCLAIMED_S,
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
        num_senders: int = 0,
    ) -> tuple[int, int]:
        """Records one sender's commit; returns (committed senders, expected senders).
        num_senders: the sender ranks of its prefill, as it says (0: as the ticket says)."""
        with self._cond:
            self._expire_locked()
            self._release_quarantine_on_commit_locked(request_id, generation, rank, num_senders)
            res = self._find_locked(request_id, generation)
            done = (RequestState.READY, RequestState.RUNNING)
            if res.state in done and rank in res.committed:
                return len(res.committed), res.num_senders  # a repeated commit: idempotent
            if res.state is not RequestState.RESERVED:
                raise AdmissionError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"request {request_id!r} is {res.state.value}: no commit due",
                )
            self._settle_senders_locked(res, rank, num_senders)
            if not 0 <= rank < res.num_senders:
                raise AdmissionError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"sender_rank: {rank} not in [0, {res.num_senders})",
                )
            res.committed[rank] = nbytes  # a repeated commit of a rank replaces its own
            # Whatever it says, a sender that commits has stopped writing.
            if error:
                failure = Failure(FailureKind.SENDER_FAILED, f"sender {rank} failed: {error}")
                self._fail_locked(res, failure)
                return len(res.committed), res.num_senders
            problem = self._commit_problem_locked(res, rank, layers)
            if problem is not None:
                self._fail_locked(res, Failure(FailureKind.BAD_COMMIT, problem))
                raise AdmissionError(
                    grpc.StatusCode.INVALID_ARGUMENT, problem, FailureKind.BAD_COMMIT
                )
            if len(res.committed) == res.num_senders:
                res.state = RequestState.READY
                res.claim_by = self.clock() + UNCLAIMED_S
                self._cond.notify_all()
            return len(res.committed), res.num_senders

    def wait_ready(self, request_id: str, generation: int) -> Reservation:
        """Blocks until every sender committed; raises with the reason otherwise (by the
        ticket's deadline at the latest)."""
        with self._cond:
            res = self._find_locked(request_id, generation)
            while res.state is RequestState.RESERVED:
                left = res.deadline - self.clock()
                if left <= 0:
                    self._fail_locked(res, deadline_missed(res.num_senders, res.committed))
                    break
                self._cond.wait(timeout=left)
            if res.state is RequestState.FAILED:
                raise AdmissionError.failed(res.failure)
            if res.state is not RequestState.READY:
                raise AdmissionError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"request {request_id!r} is {res.state.value}: already generating",
                )
            return res

    def take(self, res: Reservation) -> list[int]:
        """READY -> RUNNING: the blocks now belong to the caller (the engine)."""
        with self._cond:
            if res.state is RequestState.FAILED:
                raise AdmissionError.failed(res.failure)
            if res.state is not RequestState.READY:
                raise AdmissionError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"request {res.request_id!r} is {res.state.value}, not ready",
                )
            res.state = RequestState.RUNNING
            return res.block_ids

    def finish(self, res: Reservation) -> None:
        """RUNNING -> FINISHED: its token stream has ended (the engine loop calls this as it
        ends it); the request id is free again."""
        with self._cond:
            assert res.state is RequestState.RUNNING, res.state
            res.state = RequestState.FINISHED
            del self._live[res.request_id]

    def abort(
        self,
        request_id: str,
        generation: int = 0,
        reason: str = "aborted",
        writers_possible: bool = True,
        kind: FailureKind = FailureKind.ABORTED,
    ) -> RequestState | None:
        """Fails a RESERVED or READY ticket (any generation if `generation` is 0). Returns the
        state it found the request in: RESERVED or READY (FAILED now), RUNNING (unchanged: the
        caller stops the engine), or None when no live request matched. `writers_possible=False`
        (the ticket never reached a sender) frees reserved blocks without quarantine."""
        with self._cond:
            res = self._live.get(request_id)
            if res is None or (generation and generation != res.generation):
                return None
            found = res.state
            if found is not RequestState.RUNNING:
                self._fail_locked(res, Failure(kind, reason), writers_possible)
            return found

    def live_state(self, request_id: str, generation: int = 0) -> RequestState | None:
        """The state of the live request (any generation if `generation` is 0); None when no
        live request matched. Changes nothing."""
        with self._cond:
            res = self._live.get(request_id)
            if res is None or (generation and generation != res.generation):
                return None
            return res.state

    # -- bookkeeping --------------------------------------------------------------------------

    def _check_request(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if not request_id:
            raise AdmissionError(invalid, "request_id: must not be empty")
        if not prompt_ids:
            raise AdmissionError(invalid, "prompt_token_ids: must not be empty")
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise AdmissionError(
                invalid,
                f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceeds the "
                f"context length {self.max_model_len}",
            )

    def _check_not_live_locked(self, request_id: str) -> None:
        self._expire_locked()
        if request_id in self._live:
            raise AdmissionError(
                grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already live"
            )

    def _next_generation_locked(self, request_id: str) -> int:
        generation = self._generations.get(request_id, 0) + 1
        _remember(self._generations, request_id, generation)
        return generation

    def expire(self) -> None:
        """Fails overdue tickets and frees quarantined blocks whose time has come."""
        with self._cond:
            self._expire_locked()

    @property
    def num_reserved(self) -> int:
        with self._cond:
            return self._num_reserved_locked()

    def wait_reserved(self, timeout: float) -> bool:
        """Blocks until some ticket awaits its commits, for at most `timeout` seconds; whether
        one does."""
        with self._cond:
            return self._cond.wait_for(self._num_reserved_locked, timeout)

    def _num_reserved_locked(self) -> int:
        return sum(r.state is RequestState.RESERVED for r in self._live.values())

    @property
    def num_live(self) -> int:
        """RESERVED, READY and RUNNING requests."""
        with self._cond:
            return len(self._live)

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
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"stale generation {generation} of {request_id!r} (latest: {latest})",
                )
            failure = self._failures.get((request_id, generation))
            if failure is not None:
                raise AdmissionError.failed(failure)
            raise AdmissionError(grpc.StatusCode.NOT_FOUND, f"no live request {request_id!r}")
        if generation != res.generation:
            raise AdmissionError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stale generation {generation} of {request_id!r} (live: {res.generation})",
            )
        return res

    def _settle_senders_locked(self, res: Reservation, rank: int, num_senders: int) -> None:
        """A ticket reserved without a sender count takes the first commit's (one, if that
        names none either); a commit naming another count than the ticket's fails it (the
        prefill runs another TP size)."""
        if res.num_senders == 0:
            res.num_senders = num_senders or 1
        elif num_senders and num_senders != res.num_senders:
            problem = (
                f"sender {rank} reports {num_senders} sender rank(s), the ticket expects "
                f"{res.num_senders}"
            )
            self._fail_locked(res, Failure(FailureKind.BAD_COMMIT, problem))
            raise AdmissionError(grpc.StatusCode.INVALID_ARGUMENT, problem, FailureKind.BAD_COMMIT)

    def _commit_problem_locked(self, res: Reservation, rank: int, layers: int) -> str | None:
        """Why the commit just recorded does not fit the ticket; None if it does."""
        if layers != self.num_layers:
            return f"sender {rank} wrote {layers} layers, this server has {self.num_layers}"
        total = sum(res.committed.values())
        if len(res.committed) == res.num_senders and total != res.expected_bytes:
            return (
                f"senders wrote {total} bytes of KV, the prompt's "
                f"{len(res.prompt_ids) - res.num_cached_tokens} uncached tokens need "
                f"{res.expected_bytes}"
            )
        return None

    def _release_quarantine_on_commit_locked(
        self, request_id: str, generation: int, rank: int, num_senders: int
    ) -> None:
        """A late commit of a failed ticket: that sender stopped writing. Once all have, its
        blocks are free at once; the sender learns that its request failed."""
        for res in self._quarantine:
            if res.request_id == request_id and res.generation == generation:
                expected = res.num_senders or num_senders or 1
                if 0 <= rank < expected:
                    res.committed[rank] = 0
                if len(res.committed) >= expected:
                    self._quarantine.remove(res)
                    self.pool.free(res.block_ids)
                raise AdmissionError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"request {request_id!r}: {res.failure.message}",
                    res.failure.kind,
                )

    def _fail_locked(
        self, res: Reservation, failure: Failure, writers_possible: bool = True
    ) -> None:
        if res.state is RequestState.FAILED:
            return
        assert res.state in (RequestState.RESERVED, RequestState.READY), res.state
        was_reserved = res.state is RequestState.RESERVED
        res.state = RequestState.FAILED
        res.failure = failure
        self._live.pop(res.request_id, None)
        _remember(self._failures, (res.request_id, res.generation), failure)
        # (A ticket whose sender count no commit has named yet may have any writer left.)
        if writers_possible and was_reserved and len(res.committed) < max(res.num_senders, 1):
            # A sender that has not committed may still be writing into these blocks.
            res.quarantined_until = res.deadline + QUARANTINE_GRACE_S
            self._quarantine.append(res)
        else:
            self.pool.free(res.block_ids)
        self._cond.notify_all()

    def _expire_locked(self) -> None:
        now = self.clock()
        for res in list(self._live.values()):
            if res.state is RequestState.RESERVED and now >= res.deadline:
                self._fail_locked(res, deadline_missed(res.num_senders, res.committed))
            elif res.state is RequestState.READY and now >= res.claim_by:
                self._fail_locked(res, UNCLAIMED)
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
