"""The simulator's side of the invariant checker (`kdsync.checker`).

The checks themselves, and their vocabulary, live in `kdsync.checker`; this
module collects what only the simulator can see while a run goes on — views
each member installed, deliveries a member made while no majority could
reach it (its two-way-connected component of up members was not larger than
half the configuration), positions handed over out of turn — and hands the
final global topics to `kdsync.checker.check`.  It never looks at a node's
own view of itself.  Kinds (scenario.md): `agreement`, `integrity`, `loss`,
`origin_order`, `split_brain`, plus `expect` for a scenario's own extra
assertions; each violation also names its finer anomaly.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from kdsync.checker import (
    AGREEMENT,
    KINDS,
    SPLIT_BRAIN,
    OffsetRanges,
    Recorder,
    Run,
    Violation,
    check,
    event_id,
    runs_from_events,
)
from kdsync.core import Delivery, Event

# kinds that the mirror baseline is allowed to show (it does not agree on an order)
MIRROR_TOLERATED = frozenset({AGREEMENT, SPLIT_BRAIN})

__all__ = ["KINDS", "MIRROR_TOLERATED", "Checker", "Violation", "event_id"]


def _delivery_runs(d: Delivery) -> list[Run]:
    return runs_from_events(d.events, d.first_seq)


class Checker(Recorder):
    """Collects what must be judged during the run; `finish()` judges."""

    def __init__(self, initial_members: Sequence[str] = ()) -> None:
        super().__init__()
        self.initial_members = tuple(initial_members)

    def on_deliveries(self, member: str, deliveries: Iterable[Delivery], in_majority: bool) -> None:
        """`member` handed these over; `in_majority`: could a majority reach it then?"""
        if in_majority:
            return
        for d in deliveries:
            self.on_minority(member, _delivery_runs(d))

    def finish(
        self,
        topics: dict[str, list[Event]],
        submitted: dict[tuple[str, int, int], Event],
        live: Iterable[str],
    ) -> list[Violation]:
        """Judge the final global topics.

        `topics`: member -> its durable global topic (index = seq), in rank order;
        `submitted`: every event a source cluster acknowledged, by id;
        `live`: members that are up at the end (after settle, all in the majority).
        Records are compared byte for byte with what was submitted.
        """

        def content(member: str, run: Run):
            topic = topics[member]
            o, p, off0 = run.origin, run.partition, run.first_offset
            bad = 0
            first = -1
            for i in range(run.count):
                want = submitted.get((o, p, off0 + i))
                if want is not None and want != topic[run.seq + i]:  # (not submitted at all: foreign)
                    bad += 1
                    if first < 0:
                        first = i
            return (bad, first) if bad else None

        return check(
            {m: runs_from_events(t) for m, t in topics.items()},
            submitted=OffsetRanges.from_keys(submitted),
            live=live,
            content=content,
            views=self.views,
            initial_members=self.initial_members,
            minority=self.minority,
            gaps=self.gaps,
        )
