"""Why a request failed on the decode server, and the gRPC status each failure answers with
(decode/admission.py keeps them per request)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

UNCLAIMED_S = 30.0
"""How long a READY ticket waits for its Generate after its last commit. A router that prefilled
it and then went away (its client gone, or the router itself) would otherwise hold its blocks
for good."""


class FailureKind(enum.Enum):
    """Why a ticket failed; `status` is what a late Generate of it is answered with."""

    DEADLINE_MISSED = "deadline missed"  # not every sender committed by the ticket's deadline
    ABORTED = "aborted"  # by the router, a client, or the Generate's client going away
    SENDER_FAILED = "sender failed"  # a sender committed with an error
    BAD_COMMIT = "bad commit"  # a commit whose layers or bytes do not fit the ticket
    BAD_REQUEST = "bad request"  # Generate's parameters were refused
    UNCLAIMED = "unclaimed"  # READY, but no Generate came for it within UNCLAIMED_S

    @property
    def status(self) -> grpc.StatusCode:
        if self in (FailureKind.DEADLINE_MISSED, FailureKind.UNCLAIMED):
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.ABORTED


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    message: str


def deadline_missed(num_senders: int, committed: Iterable[int]) -> Failure:
    """A ticket whose senders did not all commit by its deadline: which did, of how many."""
    ranks = sorted(committed)
    expected = num_senders or "an unknown number (no commit named it)"
    return Failure(
        FailureKind.DEADLINE_MISSED,
        f"not every sender committed by the deadline: {len(ranks)} of {expected} "
        f"(committed ranks: {ranks})",
    )


UNCLAIMED = Failure(
    FailureKind.UNCLAIMED, f"no Generate came within {UNCLAIMED_S:g} s of the commit"
)


class AdmissionError(Exception):
    """A request refused: `code` is the gRPC status to answer with; `kind` says why the ticket
    failed, when it did (None for a refusal that left the ticket as it was)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, kind: FailureKind | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.kind = kind

    @classmethod
    def failed(cls, failure: Failure) -> AdmissionError:
        return cls(failure.kind.status, failure.message, failure.kind)
