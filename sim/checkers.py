"""Invariant checkers that look at the simulation from outside the nodes.

They judge only what each member's global topic holds (and, for split brain,
what a member handed over while it was cut off from the majority), never a
node's own view of itself.  Kinds (docs/scenario.md): `agreement`, `integrity`,
`loss`, `origin_order`, `split_brain`; plus `expect` for a scenario's own
extra assertions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kdsync.core import Delivery, Event

KINDS = ("agreement", "integrity", "loss", "origin_order", "split_brain", "expect")
# kinds that the mirror baseline is allowed to show (it does not agree on an order)
MIRROR_TOLERATED = frozenset({"agreement", "split_brain"})
_EXAMPLES = 3


@dataclass(frozen=True)
class Violation:
    kind: str
    detail: str

    def as_dict(self) -> dict:
        return {"kind": self.kind, "detail": self.detail}


def event_id(e: Event) -> str:
    """The id the trace and `kdsync audit` use: origin/partition/offset."""
    return f"{e.origin}/{e.partition}/{e.offset}"


class Checker:
    """Collects what must be judged during the run; `finish()` judges."""

    def __init__(self) -> None:
        # member -> [(seq, event)] handed over while outside the majority
        self.minority: dict[str, list[tuple[int, Event]]] = {}
        self.gaps: list[Violation] = []

    def on_deliveries(self, member: str, deliveries: Iterable[Delivery], in_majority: bool) -> None:
        if in_majority:
            return
        out = self.minority.setdefault(member, [])
        for d in deliveries:
            out.extend((d.first_seq + i, e) for i, e in enumerate(d.events()))

    def gap(self, member: str, expected: int, got: int) -> None:
        self.gaps.append(
            Violation("integrity", f"{member} was handed position {got} while its global topic ends at {expected}")
        )

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
        """
        out: list[Violation] = list(self.gaps[:_EXAMPLES])
        out += _agreement(topics)
        for m, topic in topics.items():
            out += _integrity(m, topic, submitted)
            out += _origin_order(m, topic)
        for m in live:
            if m in topics:
                out += _loss(m, topics[m], submitted)
        out += self._split_brain(topics)
        return out

    def _split_brain(self, topics: dict[str, list[Event]]) -> list[Violation]:
        out = []
        for m in sorted(self.minority):
            bad = []
            for seq, e in self.minority[m]:
                # what the majority side holds at that position
                ref = None
                for other, topic in topics.items():
                    if other != m and seq < len(topic) and not self._was_minority(other, seq):
                        ref = topic[seq]
                        break
                if ref is None or ref != e:
                    bad.append((seq, e, ref))
            if bad:
                seq, e, ref = bad[0]
                where = f"the majority has {event_id(ref)} there" if ref is not None else "the majority never filled it"
                out.append(
                    Violation(
                        "split_brain",
                        f"{m} delivered {len(bad)} position(s) while cut off from the majority; "
                        f"first: seq {seq} = {event_id(e)}, {where}",
                    )
                )
        return out

    def _was_minority(self, member: str, seq: int) -> bool:
        lst = self.minority.get(member)
        if not lst:
            return False
        if not hasattr(self, "_minority_sets"):
            self._minority_sets: dict[str, set[int]] = {}
        s = self._minority_sets.get(member)
        if s is None:
            s = self._minority_sets[member] = {q for q, _ in lst}
        return seq in s


def _key(e: Event) -> tuple[str, int, int]:
    return (e[0], e[1], e[2])  # origin, partition, offset (Event is a NamedTuple)


def _agreement(topics: dict[str, list[Event]]) -> list[Violation]:
    out = []
    names = list(topics)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            n = min(len(topics[a]), len(topics[b]))
            if topics[a][:n] == topics[b][:n]:  # same events (whole records) at every common position
                continue
            ka, kb = [_key(e) for e in topics[a][:n]], [_key(e) for e in topics[b][:n]]
            if ka == kb:
                k = next(k for k in range(n) if topics[a][k] != topics[b][k])
                out.append(Violation("agreement", f"{a} and {b} hold different records for the same event id at seq {k}"))
                continue
            diff = [k for k in range(n) if ka[k] != kb[k]]
            k = diff[0]
            out.append(
                Violation(
                    "agreement",
                    f"{a} and {b} differ at {len(diff)} of {n} common positions; first: seq {k} is "
                    f"{'/'.join(map(str, ka[k]))} at {a} but {'/'.join(map(str, kb[k]))} at {b}",
                )
            )
    return out


def _integrity(member: str, topic: list[Event], submitted: dict) -> list[Violation]:
    out = []
    if len(set(topic)) == len(topic) and all(submitted.get(_key(e)) == e for e in topic):
        return out  # the common case, without the bookkeeping below
    seen: dict[tuple, int] = {}
    dups, forged = [], []
    for seq, e in enumerate(topic):
        k = _key(e)
        if k in seen:
            dups.append((seq, seen[k], e))
        else:
            seen[k] = seq
        src = submitted.get(k)
        if src is None or src != e:
            forged.append((seq, e))
    if dups:
        seq, first, e = dups[0]
        out.append(
            Violation("integrity", f"{member} delivered {len(dups)} duplicate(s); first: {event_id(e)} at seq {first} and {seq}")
        )
    if forged:
        seq, e = forged[0]
        out.append(
            Violation(
                "integrity",
                f"{member} delivered {len(forged)} event(s) never submitted as such; first: {event_id(e)} at seq {seq}",
            )
        )
    return out


def _origin_order(member: str, topic: list[Event]) -> list[Violation]:
    last: dict[tuple[str, int], tuple[int, int]] = {}
    bad = []
    for seq, e in enumerate(topic):
        k = (e.origin, e.partition)
        prev = last.get(k)
        if prev is not None and e.offset < prev[0]:
            bad.append((seq, e, prev))
        if prev is None or e.offset > prev[0]:
            last[k] = (e.offset, seq)
    if not bad:
        return []
    seq, e, (poff, pseq) = bad[0]
    return [
        Violation(
            "origin_order",
            f"{member} delivered {len(bad)} event(s) out of origin order; first: {event_id(e)} at seq {seq} "
            f"after offset {poff} at seq {pseq}",
        )
    ]


def _loss(member: str, topic: list[Event], submitted: dict) -> list[Violation]:
    have = {_key(e) for e in topic}
    missing = [k for k in submitted if k not in have]
    if not missing:
        return []
    missing.sort()
    ex = ", ".join("/".join(map(str, k)) for k in missing[:_EXAMPLES])
    return [Violation("loss", f"{member} is missing {len(missing)} of {len(submitted)} acknowledged event(s) after settle; e.g. {ex}")]
