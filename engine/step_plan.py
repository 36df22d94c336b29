"""What one forward runs: the sequences scheduled in it, each with the tokens it feeds
(engine/scheduler.py plans them; engine/model_runner.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int
    """Position of the first token fed this step."""
    num_new_tokens: int
    """Tokens fed this step, at positions [start, start + num_new_tokens)."""
    samples: bool
    """True when this step reaches the sequence's last token, so a new token is sampled."""
    draft_room: int = 0
    """Draft tokens this sequence may feed after its last one (its blocks hold them)."""
    draft: tuple[int, ...] = ()
    """Draft tokens fed after its last one, at positions start + 1 ..; num_new_tokens counts
    them. The target verifies them (engine/spec_verify.py); `Scheduler.update` keeps those it
    accepted."""


@dataclass(frozen=True)
class StepPlan:
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]
    shifted: bool = False
    """Planned ahead of a verification whose accepted drafts the host has not read: each
    item starts where it would if none had been accepted (the device adds the count) and
    feeds drafts made on the device (-1 here), until `Scheduler.resolve`."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_decode_only(self) -> bool:
        return all(s.num_new_tokens == 1 for s in self.scheduled)

    def with_drafts(self, drafts: dict[str, list[int]]) -> StepPlan:
        """This plan with draft tokens fed after the last token of the sequences in `drafts`
        (each at most its draft_room)."""
        items = []
        for item in self.scheduled:
            draft = drafts.get(item.seq.seq_id)
            if draft:
                assert item.num_new_tokens == 1 and len(draft) <= item.draft_room
                item = replace(item, num_new_tokens=1 + len(draft), draft=tuple(draft))
            items.append(item)
        return StepPlan(tuple(items), self.preempted)
