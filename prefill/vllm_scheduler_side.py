"""The connector's scheduler side: which requests send KV, and which tokens in which step.

A ticketed request's life here (any request without a tandem ticket is never tracked):
  update_state_after_alloc -> tracked (ticket parsed and checked against the prompt)
  -> build_meta, each step it is scheduled in: a SendPlan for the prompt tokens that step
     completes (chunked prefill: one per chunk; the prefix-cache hit goes with the first)
  -> its last prompt chunk: the plan is `final` (the worker side commits after its writes)
  -> finished: request_finished returns the first token as kv_transfer_params.
A request that finishes before its final plan (aborted, preempted for good) gets an error plan
in the next step, so the decode server fails its ticket at once instead of at the deadline.

One ticket, one sender. vLLM runs OpenAI's n > 1 as n child requests ("{i}_{parent id}"), each
with the parent's kv_transfer_params, so n requests carry the same ticket; the decode server
wants the prompt's KV once. The first request tracked for a ticket (its request id and
generation) sends; any later one is a rider, whether the sender is still live or has finished
(tickets claimed are remembered, the last _CLAIMED_TICKETS of them): a rider never plans,
sends nor fails the ticket. Every child, sender or rider, returns its own first token from
`finished`: vLLM puts only one child's kv_transfer_params into the reply (whichever finishes
the parent last), and the router reads each choice's first token from its token_ids.

The worker side commits asynchronously: vLLM hands a finished request's kv_transfer_params to
the client before the worker side reports back, so the reply carries the first token and what
will be committed, and the decode server's Generate waits for the commit itself.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefill.ticket import KvTransfer, TicketError, carries_ticket
from prefill.vllm_metadata import SendPlan, TandemMetadata

logger = logging.getLogger(__name__)

_CLAIMED_TICKETS = 65536
"""Tickets remembered as claimed by a sender. NOTE: far more than requests live at once, so a
child scheduled only after its sender finished still finds its ticket claimed."""


@dataclass
class _Tracked:
    request: Any
    """vLLM's Request: request_id, kv_transfer_params, num_prompt_tokens, num_computed_tokens,
    output_token_ids, is_finished()."""
    transfer: KvTransfer
    error: str = ""
    sent: int = 0
    """Prompt tokens planned in earlier steps (or in the decode server's prefix cache)."""
    announced: bool = False
    """The worker side has had this request's ticket."""
    final: bool = False


class SchedulerSide:
    def __init__(self, num_senders: int, block_ids_of: Callable[[str], list[int]] | None = None):
        self.num_senders = num_senders
        """vLLM's tensor-parallel degree: every rank commits its own heads."""
        self.block_ids_of = block_ids_of
        """request id -> its blocks in token order; bound once vLLM's cache manager exists."""
        self._tracked: dict[str, _Tracked] = {}
        """Senders, by request id."""
        self._riders: set[str] = set()
        """Requests whose ticket another request sends (vLLM's n > 1 children), by id."""
        self._claimed: OrderedDict[tuple[str, int], None] = OrderedDict()
        """(ticket request id, generation) of the tickets a sender has claimed, oldest first."""
        self._ended: list[SendPlan] = []

    @property
    def num_tracked(self) -> int:
        return len(self._tracked) + len(self._riders)

    def track(self, request) -> None:
        """Starts tracking `request` if it carries a tandem ticket (idempotent): as its sender
        if no request has claimed the ticket yet, else as a rider."""
        params = request.kv_transfer_params
        req_id = request.request_id
        if req_id in self._tracked or req_id in self._riders or not carries_ticket(params):
            return
        try:
            transfer = KvTransfer.parse(params)
        except TicketError as e:
            # No ticket to fail on the decode side: the router sees the missing first token.
            logger.error("request %s: %s", req_id, e)
            return
        ticket, error = transfer.ticket, ""
        key = (ticket.request_id, ticket.generation)
        if key in self._claimed:
            self._claimed.move_to_end(key)
            self._riders.add(req_id)
            return
        self._claimed[key] = None
        if len(self._claimed) > _CLAIMED_TICKETS:
            self._claimed.popitem(last=False)
        if ticket.num_tokens != request.num_prompt_tokens:
            error = (
                f"ticket {ticket.request_id} is for {ticket.num_tokens} prompt tokens, the "
                f"request has {request.num_prompt_tokens}"
            )
        elif ticket.num_senders not in (0, self.num_senders):  # 0: as the commits name
            error = (
                f"ticket {ticket.request_id} expects {ticket.num_senders} sender rank(s), vLLM "
                f"runs {self.num_senders} tensor-parallel rank(s)"
            )
        self._tracked[req_id] = _Tracked(request, transfer, error, ticket.num_cached_tokens)

    def build_meta(self, num_scheduled_tokens: dict[str, int]) -> TandemMetadata:
        """This step's plans; `num_scheduled_tokens` is SchedulerOutput's (request id -> tokens
        this step computes), read before vLLM advances num_computed_tokens past them."""
        plans, self._ended = self._ended, []
        for req_id, scheduled in num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.final:
                continue
            request = tracked.request
            end = min(request.num_computed_tokens + scheduled, request.num_prompt_tokens)
            if end <= tracked.sent:
                continue  # recomputing, after a preemption, tokens that were already sent
            final = end == request.num_prompt_tokens
            plans.append(
                self._plan(tracked, tracked.sent, end, tuple(self.block_ids_of(req_id)), final)
            )
            tracked.sent, tracked.final = end, final
        return TandemMetadata(plans)

    def finished(self, request) -> tuple[bool, dict | None]:
        """request_finished: the blocks are never held (the worker side has copied what it sends
        by the end of each step); kv_transfer_params for a sender that planned its whole prompt,
        and for a rider, once it has a first token."""
        if request.request_id in self._riders:
            self._riders.remove(request.request_id)
            return False, _first_token(request)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        if not tracked.final:
            error = tracked.error or "the request ended before its prompt was prefilled"
            self._ended.append(self._plan(tracked, tracked.sent, tracked.sent, (), True, error))
            return False, None
        return False, _first_token(request)

    def has_pending_work(self) -> bool:
        """Error plans wait for a step: keep vLLM's loop stepping until they are delivered."""
        return bool(self._ended)

    def _plan(self, tracked, start, end, block_ids, final, error=None) -> SendPlan:
        first = not tracked.announced
        tracked.announced = True
        return SendPlan(
            req_id=tracked.request.request_id,
            start=start,
            end=end,
            block_ids=block_ids,
            final=final,
            ticket=tracked.transfer.ticket.SerializeToString() if first else b"",
            decode_address=tracked.transfer.decode_address if first else "",
            error=tracked.error if error is None else error,
        )


def _first_token(request) -> dict | None:
    """kv_transfer_params naming the request's first token; None before it has one."""
    if not request.output_token_ids:
        return None
    return {"first_token_id": request.output_token_ids[0], "kv_tokens": request.num_prompt_tokens}
