"""Commits that arrive as notifications of the KV transport (Ticket.commit_by_notification).

A sender whose writes have all completed sends its CommitRequest as a notification to the
transport endpoint of rank 0 (prefill.ticket.commit_notice) instead of calling Commit: one
message instead of an RPC round trip on the first token's path. This thread reads the server
transport's notifications and hands each commit to the same method the Commit RPC calls
(DecodeServicer.commit), so both ways are one behaviour.

The transports offer no blocking wait for notifications, so the thread polls them every
`poll_s` while some ticket awaits its commits (asking admission whether one still does every
RECHECK_S), and sleeps on admission otherwise: an idle server does not spin. A commit has
reached the decode server by the time the prefill replies; the router's Generate then needs one
more hop, against which a poll of 0.5 ms is short.
A refused commit (its ticket expired or was aborted, a wrong byte count) has no one to answer:
it is logged, and the ticket fails in admission as it would after a refused RPC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from decode.admission import Admission
from decode.failures import AdmissionError
from prefill.ticket import parse_commit_notice
from proto.tandem.v1 import decode_pb2
from transport.base import Transport, TransportError

POLL_S = 0.0005
RECHECK_S = 0.05
"""While tickets await commits, admission is asked again this often, not at every poll: its
count walks every live request under the lock that the RPCs take."""
IDLE_S = 0.5
"""With no ticket awaiting commits, the transport is still read this often: a commit of a ticket
that has since failed is logged instead of waiting in the transport."""
_log = logging.getLogger(__name__)


class CommitNotices:
    """Reads `transport`'s notifications on a thread of its own until closed."""

    def __init__(
        self,
        transport: Transport,
        admission: Admission,
        commit: Callable[[decode_pb2.CommitRequest], object],
        poll_s: float = POLL_S,
    ) -> None:
        self._transport = transport
        self._admission = admission
        self._commit = commit
        self._poll_s = poll_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commit-notices", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=IDLE_S + 5)

    def _run(self) -> None:
        while not self._closed.is_set():
            if not self._admission.wait_reserved(IDLE_S):
                self._read()
                continue
            recheck = time.monotonic() + RECHECK_S
            while time.monotonic() < recheck and not self._closed.wait(self._poll_s):
                self._read()

    def _read(self) -> None:
        try:
            payloads = self._transport.notifications()
        except TransportError as e:
            _log.warning("commit notices: cannot read the transport's notifications: %s", e)
            return
        for payload in payloads:
            request = parse_commit_notice(payload)
            if request is None:
                _log.warning("commit notices: a notification that is not a commit (%d bytes)",
                             len(payload))  # fmt: skip
                continue
            try:
                self._commit(request)
            except AdmissionError as e:
                _log.warning(
                    "commit notices: the commit of %r (generation %d, sender %d) refused: %s",
                    request.request_id, request.generation, request.sender_rank, e,
                )  # fmt: skip
