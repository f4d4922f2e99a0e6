"""The invariant checker: one vocabulary and one implementation for every driver.

The simulator (`sim/observer.py`), the in-memory testing network
(`kdsync.testing.network.check_invariants`) and `kdsync demo` judge what the
members delivered with the functions here; the Spark audit
(`kdsync.spark.analysis`) computes the same anomalies as DataFrames and
reports them under the same names.  Plain Python: no Spark, no simpy, no I/O.

Vocabulary
----------
Every `Violation` has an *anomaly* (fine-grained, named after Jepsen's Kafka
checker where the two overlap) and a *kind*, the coarse invariant of
scenario.md that `summary.json` reports as `violations[].kind`:

=======================  =============  ==============================================
anomaly                  kind           meaning
=======================  =============  ==============================================
inconsistent-offsets     agreement      two members hold different events at one position
duplicate                integrity      an event is at two positions of one member's topic
foreign                  integrity      an event no source cluster acknowledged
corrupt                  integrity      right event id, but not the submitted record's bytes
gap                      integrity      a member was handed a position that is not the
                                        end of its global topic (or kdsync.seq != offset)
malformed                integrity      a global record without kdsync headers (audit)
lost-write               loss           an acknowledged event missing at a live member
nonmonotonic             origin_order   an event delivered after a higher offset of
                                        its origin partition
view-conflict            split_brain    one view id installed with different members,
                                        incarnations or start position
view-without-majority    split_brain    a view without a strict majority of the
                                        members of the view before it
minority-divergent       split_brain    a member cut off from every majority delivered
                                        a position whose event differs from the final
                                        agreed order
minority-only            split_brain    a member cut off from every majority delivered
                                        a position the rest of the group never holds
expect                   expect         a scenario's own extra assertion failed
=======================  =============  ==============================================

Runs, not events
----------------
A member's global topic is given as a sequence of `Run`s (seq, origin,
partition, first_offset, count): `count` consecutive positions from `seq`
holding offsets first_offset.. of one origin partition.  Per-event inputs are
runs of one (`runs_from_events` builds them).  Two members may split the same
content differently, so runs are normalised (adjacent contiguous runs merged)
before they are compared.  What was acknowledged is an `OffsetRanges` (per
origin partition, disjoint [lo, hi) offset intervals).  Agreement, duplicate,
foreign, loss and origin order then cost O(runs log runs) whatever the run
lengths.  Content (the bytes of each record) is checked only where the
driver has them, through a `ContentCheck` it supplies.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

# The trace schema (docs/outputs.md): one row per (member, delivered event); the
# simulator writes it, `kdsync audit` reads it (and builds it from real clusters).
TRACE_COLUMNS = (
    "run_id",
    "member",
    "event_id",
    "origin",
    "origin_partition",
    "origin_offset",
    "seq",
    "submit_ts",
    "deliver_ts",
)

# kinds (scenario.md `violations[].kind`)
AGREEMENT = "agreement"
INTEGRITY = "integrity"
LOSS = "loss"
ORIGIN_ORDER = "origin_order"
SPLIT_BRAIN = "split_brain"
EXPECT = "expect"
KINDS = (AGREEMENT, INTEGRITY, LOSS, ORIGIN_ORDER, SPLIT_BRAIN, EXPECT)

# anomalies
INCONSISTENT_OFFSETS = "inconsistent-offsets"
DUPLICATE = "duplicate"
FOREIGN = "foreign"
CORRUPT = "corrupt"
GAP = "gap"
MALFORMED = "malformed"
LOST_WRITE = "lost-write"
NONMONOTONIC = "nonmonotonic"
VIEW_CONFLICT = "view-conflict"
VIEW_WITHOUT_MAJORITY = "view-without-majority"
MINORITY_DIVERGENT = "minority-divergent"
MINORITY_ONLY = "minority-only"

KIND_OF: dict[str, str] = {
    INCONSISTENT_OFFSETS: AGREEMENT,
    DUPLICATE: INTEGRITY,
    FOREIGN: INTEGRITY,
    CORRUPT: INTEGRITY,
    GAP: INTEGRITY,
    MALFORMED: INTEGRITY,
    LOST_WRITE: LOSS,
    NONMONOTONIC: ORIGIN_ORDER,
    VIEW_CONFLICT: SPLIT_BRAIN,
    VIEW_WITHOUT_MAJORITY: SPLIT_BRAIN,
    MINORITY_DIVERGENT: SPLIT_BRAIN,
    MINORITY_ONLY: SPLIT_BRAIN,
    EXPECT: EXPECT,
}
ANOMALIES = tuple(KIND_OF)

EXAMPLES = 3  # examples named in one violation's detail


@dataclass(frozen=True)
class Violation:
    """One anomaly found, with a one-line human `detail`.

    `member` names the member it is about (None when it is about a pair or the
    group); `count` is how many events/positions/views it covers."""

    anomaly: str
    detail: str
    member: str | None = None
    count: int = 1

    def __post_init__(self) -> None:
        if self.anomaly not in KIND_OF:
            raise ValueError(f"unknown anomaly {self.anomaly!r} (known: {', '.join(ANOMALIES)})")

    @property
    def kind(self) -> str:
        """The invariant it breaks (scenario.md kinds)."""
        return KIND_OF[self.anomaly]

    def as_dict(self) -> dict:
        """{"kind", "anomaly", "detail"} (+ "member" when it names one): summary.json's violations[]."""
        d = {"kind": self.kind, "anomaly": self.anomaly, "detail": self.detail}
        if self.member is not None:
            d["member"] = self.member
        return d

    def __str__(self) -> str:
        return f"{self.kind}: {self.anomaly}: {self.detail}"


# ------------------------------------------------------------------- runs


class Run(NamedTuple):
    """`count` consecutive positions from `seq` holding offsets
    `first_offset`.. of origin partition (origin, partition)."""

    seq: int
    origin: str
    partition: int
    first_offset: int
    count: int

    @property
    def end_seq(self) -> int:
        return self.seq + self.count

    @property
    def end_offset(self) -> int:
        return self.first_offset + self.count


def event_id(origin: str, partition: int, offset: int) -> str:
    """The id the trace and `kdsync audit` use: origin/partition/offset."""
    return f"{origin}/{partition}/{offset}"


def _key(e) -> tuple[str, int, int]:
    """(origin, partition, offset) of an Event-like value (NamedTuple or attributes)."""
    if isinstance(e, tuple) and len(e) >= 3 and not hasattr(e, "first_offset"):
        return e[0], e[1], e[2]
    return e.origin, e.partition, e.offset


def runs_from_events(events: Iterable, start_seq: int = 0) -> list[Run]:
    """Runs of a per-event sequence (Event-like values or (origin, partition,
    offset) tuples at positions start_seq, start_seq+1, ...), already normalised."""
    out: list[Run] = []
    seq = start_seq
    o = p = None
    first = cnt = 0
    s0 = seq
    for e in events:
        eo, ep, eoff = _key(e)
        if cnt and eo == o and ep == p and eoff == first + cnt:
            cnt += 1
        else:
            if cnt:
                out.append(Run(s0, o, p, first, cnt))
            o, p, first, cnt, s0 = eo, ep, eoff, 1, seq
        seq += 1
    if cnt:
        out.append(Run(s0, o, p, first, cnt))
    return out


def runs_from_batches(batches: Iterable, start_seq: int = 0) -> list[Run]:
    """Runs of a topic held as consecutive batches (core `Batch`es or anything
    with origin, partition, first_offset and count) from position start_seq."""
    out: list[Run] = []
    add, new = out.append, tuple.__new__  # hot (one run per delivered batch): no Python frame per run
    seq = start_seq
    for b in batches:
        n = b.count
        add(new(Run, (seq, b.origin, b.partition, b.first_offset, n)))
        seq += n
    return out


def normalise(runs: Iterable) -> list[Run]:
    """Runs sorted by position, empty ones dropped, and adjacent runs that
    continue one another (next position, same origin partition, next offset)
    merged.  Accepts any values with the Run fields (a core Batch too)."""
    items = sorted((Run(r.seq, r.origin, r.partition, r.first_offset, r.count) if not isinstance(r, Run) else r)
                   for r in runs if r.count > 0)
    out: list[Run] = []
    for r in items:
        if out:
            last = out[-1]
            if (last.seq + last.count == r.seq and last.origin == r.origin and last.partition == r.partition
                    and last.first_offset + last.count == r.first_offset):
                out[-1] = last._replace(count=last.count + r.count)
                continue
        out.append(r)
    return out


def watermarks(delivered: Iterable, into: dict | None = None) -> dict[tuple[str, int], int]:
    """Highest origin offset per (origin, partition) of a delivered sequence.

    `delivered` holds runs (anything with origin, partition, first_offset,
    count — a core Batch too) or events (Event-like values); `into` is
    updated in place and returned when given (incremental upkeep)."""
    wm: dict[tuple[str, int], int] = {} if into is None else into
    for x in delivered:
        if hasattr(x, "first_offset"):
            if x.count <= 0:
                continue
            k, top = (x.origin, x.partition), x.first_offset + x.count - 1
        else:
            o, p, top = _key(x)
            k = (o, p)
        if top > wm.get(k, -1):
            wm[k] = top
    return wm


class OffsetRanges:
    """Per origin partition, disjoint sorted [lo, hi) intervals of offsets:
    what the source clusters acknowledged."""

    def __init__(self) -> None:
        self._iv: dict[tuple[str, int], list[list[int]]] = {}
        self._dirty: set[tuple[str, int]] = set()

    @classmethod
    def from_keys(cls, keys: Iterable) -> OffsetRanges:
        """From (origin, partition, offset) tuples or Event-like values."""
        r = cls()
        per: dict[tuple[str, int], list[int]] = {}
        for k in keys:
            o, p, off = _key(k)
            per.setdefault((o, p), []).append(off)
        for (o, p), offs in per.items():
            offs.sort()
            lo = prev = offs[0]
            for x in offs[1:]:
                if x > prev + 1:
                    r.add(o, p, lo, prev + 1)
                    lo = x
                prev = x
            r.add(o, p, lo, prev + 1)
        return r

    @classmethod
    def from_runs(cls, runs: Iterable) -> OffsetRanges:
        r = cls()
        for x in runs:
            r.add(x.origin, x.partition, x.first_offset, x.first_offset + x.count)
        return r

    def add(self, origin: str, partition: int, lo: int, hi: int) -> None:
        """Add offsets [lo, hi) of (origin, partition)."""
        if hi <= lo:
            return
        k = (origin, partition)
        self._iv.setdefault(k, []).append([lo, hi])
        self._dirty.add(k)

    def _merged(self, k) -> list[list[int]]:
        iv = self._iv.get(k, [])
        if k in self._dirty:
            iv.sort()
            out: list[list[int]] = []
            for lo, hi in iv:
                if out and lo <= out[-1][1]:
                    out[-1][1] = max(out[-1][1], hi)
                else:
                    out.append([lo, hi])
            self._iv[k] = iv = out
            self._dirty.discard(k)
        return iv

    def partitions(self) -> list[tuple[str, int]]:
        return sorted(self._iv)

    def intervals(self, origin: str, partition: int) -> list[tuple[int, int]]:
        return [(lo, hi) for lo, hi in self._merged((origin, partition))]

    def total(self) -> int:
        """How many offsets in all."""
        return sum(hi - lo for k in self._iv for lo, hi in self._merged(k))

    def outside(self, origin: str, partition: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Sub-intervals of [lo, hi) not covered."""
        iv = self._merged((origin, partition))
        out = []
        i = max(0, bisect.bisect_right(iv, [lo, float("inf")]) - 1)
        cur = lo
        while cur < hi and i < len(iv):
            a, b = iv[i]
            if b <= cur:
                i += 1
                continue
            if a >= hi:
                break
            if a > cur:
                out.append((cur, a))
            cur = max(cur, b)
            i += 1
        if cur < hi:
            out.append((cur, hi))
        return out

    def __contains__(self, key) -> bool:
        o, p, off = key
        return not self.outside(o, p, off, off + 1)


# A driver that has the records' bytes checks them: called with a member and
# one run of its normalised topic, it returns None when every record there is
# byte-for-byte the submitted one, else (how many differ, index in the run of
# the first that differs).  It may also have a `whole(member)` method: True
# when every record of that member's topic is the submitted one (checked at
# once, without a call per run); False sends the check through the runs.
ContentCheck = Callable[[str, Run], "tuple[int, int] | None"]


class ViewRecord(NamedTuple):
    """A view some member installed (as the core's `View` reports it)."""

    member: str
    view_id: int
    members: tuple[str, ...]
    incarnations: tuple[int, ...]
    start_seq: int

    @classmethod
    def of(cls, member: str, v) -> ViewRecord:
        """From a core View (anything with view_id, members, incarnations, start_seq)."""
        return cls(member, v.view_id, tuple(v.members), tuple(v.incarnations), v.start_seq)


# ------------------------------------------------------------- the checks


def _rid(r: Run, i: int = 0) -> str:
    return event_id(r.origin, r.partition, r.first_offset + i)


def _walk(a: list[Run], b: list[Run]):
    """Segments (lo, hi, ra, rb) of positions both normalised topics hold."""
    i = j = 0
    while i < len(a) and j < len(b):
        ra, rb = a[i], b[j]
        lo = max(ra.seq, rb.seq)
        hi = min(ra.end_seq, rb.end_seq)
        if lo < hi:
            yield lo, hi, ra, rb
        if ra.end_seq <= rb.end_seq:
            i += 1
        else:
            j += 1


def _same(ra: Run, rb: Run) -> bool:
    """Do two runs hold the same events where they overlap?  (Offsets grow one
    per position in both, so they agree everywhere or nowhere.)"""
    return (ra.origin == rb.origin and ra.partition == rb.partition
            and ra.first_offset - ra.seq == rb.first_offset - rb.seq)


def _compare(a: list[Run], b: list[Run]):
    """(common positions, differing positions, first differing segment or None)."""
    common = differ = 0
    first = None
    for lo, hi, ra, rb in _walk(a, b):
        common += hi - lo
        if not _same(ra, rb):
            differ += hi - lo
            if first is None:
                first = (lo, ra, rb)
    return common, differ, first


def check_agreement(topics: Mapping[str, list[Run]]) -> list[Violation]:
    """inconsistent-offsets: one violation per pair of members whose topics
    hold different events at a common position (normalised runs in)."""
    names = list(topics)
    if len(names) < 2:
        return []
    # the common case in O(members x runs): everyone agrees with the longest topic
    ref = max(names, key=lambda m: (topics[m][-1].end_seq if topics[m] else 0))
    if all(topics[m] == topics[ref] or _compare(topics[ref], topics[m])[1] == 0 for m in names if m != ref):
        return []
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            common, differ, first = _compare(topics[a], topics[b])
            if not differ:
                continue
            k, ra, rb = first
            out.append(Violation(
                INCONSISTENT_OFFSETS,
                f"{a} and {b} differ at {differ} of {common} common positions; first: seq {k} is "
                f"{_rid(ra, k - ra.seq)} at {a} but {_rid(rb, k - rb.seq)} at {b}",
                count=differ,
            ))
    return out


def _by_partition(runs: list[Run]) -> dict[tuple[str, int], list[Run]]:
    out: dict[tuple[str, int], list[Run]] = {}
    for r in runs:
        out.setdefault((r.origin, r.partition), []).append(r)
    return out


def check_duplicates(member: str, runs: list[Run]) -> list[Violation]:
    """duplicate: events at more than one position of one topic (count = rows - distinct)."""
    dups = 0
    first = None  # (offset, seq a, seq b, origin, partition)
    for (o, p), rs in _by_partition(runs).items():
        if len(rs) < 2:
            continue
        rs = sorted(rs, key=lambda r: (r.first_offset, r.seq))
        cover = rs[0]  # the run reaching furthest so far
        for r in rs[1:]:
            top = cover.end_offset
            if r.first_offset < top:
                hi = min(r.end_offset, top)
                dups += hi - r.first_offset
                off = r.first_offset
                ex = (off, cover.seq + off - cover.first_offset, r.seq, o, p)
                if first is None or min(ex[1], ex[2]) < min(first[1], first[2]):
                    first = ex
            if r.end_offset > top:
                cover = r
    if not dups:
        return []
    off, sa, sb, o, p = first
    return [Violation(
        DUPLICATE,
        f"{member} delivered {dups} duplicate(s); first: {event_id(o, p, off)} at seq {min(sa, sb)} and {max(sa, sb)}",
        member, dups,
    )]


def check_foreign(member: str, runs: list[Run], submitted: OffsetRanges) -> list[Violation]:
    """foreign: events no source cluster acknowledged."""
    n = 0
    first = None
    for r in runs:
        for lo, hi in submitted.outside(r.origin, r.partition, r.first_offset, r.end_offset):
            n += hi - lo
            seq = r.seq + lo - r.first_offset
            if first is None or seq < first[0]:
                first = (seq, event_id(r.origin, r.partition, lo))
    if not n:
        return []
    return [Violation(FOREIGN, f"{member} delivered {n} event(s) never submitted; first: {first[1]} at seq {first[0]}",
                      member, n)]


def check_content(member: str, runs: list[Run], content: ContentCheck) -> list[Violation]:
    """corrupt: the driver's content check found records that are not the submitted bytes."""
    whole = getattr(content, "whole", None)
    if whole is not None and whole(member):
        return []  # the driver compared the member's whole topic at once: every record is the one submitted
    n = 0
    first = None
    for r in runs:
        res = content(member, r)
        if res is None:
            continue
        bad, idx = res
        if bad:
            n += bad
            if first is None:
                first = (r.seq + idx, _rid(r, idx))
    if not n:
        return []
    return [Violation(
        CORRUPT,
        f"{member} delivered {n} event(s) never submitted as such (same id, other bytes); "
        f"first: {first[1]} at seq {first[0]}",
        member, n,
    )]


def check_origin_order(member: str, runs: list[Run]) -> list[Violation]:
    """nonmonotonic: events delivered after a higher offset of their origin
    partition (in position order; equal offsets are duplicates, not this)."""
    top: dict[tuple[str, int], tuple[int, int]] = {}  # (origin, partition) -> (highest offset, its seq)
    bad = 0
    first = None
    for r in runs:  # normalised: in position order
        k = (r.origin, r.partition)
        prev = top.get(k)
        if prev is not None and r.first_offset < prev[0]:
            n = min(r.end_offset, prev[0]) - r.first_offset
            bad += n
            if first is None:
                first = (r, prev)
        last = r.end_offset - 1
        if prev is None or last > prev[0]:
            top[k] = (last, r.end_seq - 1)
    if not bad:
        return []
    r, (poff, pseq) = first
    return [Violation(
        NONMONOTONIC,
        f"{member} delivered {bad} event(s) out of origin order; first: {_rid(r)} at seq {r.seq} "
        f"after offset {poff} at seq {pseq}",
        member, bad,
    )]


def check_loss(member: str, runs: list[Run], submitted: OffsetRanges) -> list[Violation]:
    """lost-write: acknowledged events the member does not hold."""
    have = OffsetRanges.from_runs(runs)
    missing = 0
    examples: list[tuple[str, int, int]] = []
    for o, p in submitted.partitions():
        for lo, hi in submitted.intervals(o, p):
            for a, b in have.outside(o, p, lo, hi):
                missing += b - a
                examples.extend((o, p, x) for x in range(a, min(b, a + EXAMPLES)))
    if not missing:
        return []
    examples.sort()
    ex = ", ".join(event_id(*k) for k in examples[:EXAMPLES])
    return [Violation(
        LOST_WRITE,
        f"{member} is missing {missing} of {submitted.total()} acknowledged event(s) after settle; e.g. {ex}",
        member, missing,
    )]


def _view_sig(v: ViewRecord) -> tuple:
    return (v.members, v.incarnations, v.start_seq)


def _fmt_view(v: ViewRecord) -> str:
    incs = ",".join(map(str, v.incarnations))
    return f"[{', '.join(v.members)}] (incarnations {incs}) from seq {v.start_seq}"


def check_views(views: Iterable[ViewRecord], initial_members: Sequence[str] | None = None) -> list[Violation]:
    """view-conflict: one view id installed with different members,
    incarnations or start position; view-without-majority: a view that keeps
    no strict majority of the members of the view before it (the highest
    lower id anyone installed; `initial_members`, the configuration, before
    the first)."""
    by_id: dict[int, dict[tuple, ViewRecord]] = {}  # view id -> signature -> first record
    out = []
    for v in views:
        sigs = by_id.setdefault(v.view_id, {})
        sig = _view_sig(v)
        if sig not in sigs:
            if len(sigs) == 1:  # report each view id once
                seen = next(iter(sigs.values()))
                out.append(Violation(
                    VIEW_CONFLICT,
                    f"view {v.view_id} installed as {_fmt_view(seen)} by {seen.member} and as {_fmt_view(v)} "
                    f"by {v.member}",
                ))
            sigs[sig] = v
    prev_members = tuple(initial_members) if initial_members is not None else None
    prev_id = None
    for vid in sorted(by_id):
        versions = list(by_id[vid].values())
        for v in versions if prev_members else ():
            kept = len(set(v.members) & set(prev_members))
            if 2 * kept <= len(prev_members):
                before = f"view {prev_id}" if prev_id is not None else "the configuration"
                out.append(Violation(
                    VIEW_WITHOUT_MAJORITY,
                    f"view {vid} [{', '.join(v.members)}] (installed by {v.member}) keeps {kept} of the "
                    f"{len(prev_members)} members of {before} [{', '.join(prev_members)}]: no majority",
                ))
        prev_members, prev_id = versions[0].members, vid
    return out


def _walk_from(run: Run, topic: list[Run], seqs: list[int]):
    """_walk of one run against a long normalised topic (`seqs`: its runs' first positions)."""
    i = max(0, bisect.bisect_right(seqs, run.seq) - 1)
    for lo, hi, ra, rb in _walk([run], topic[i:]):
        yield lo, hi, ra, rb
        if hi >= run.end_seq:
            return


def check_minority(
    minority: Mapping[str, Sequence[Run]],
    topics: Mapping[str, list[Run]],
    live: Iterable[str],
) -> list[Violation]:
    """Deliveries a member made while cut off from every majority, judged by
    content against the final agreed order: the (normalised) topics of the
    other live members.  A position is fine when none of them holds another
    event there and a strict majority of them hold the same one (a position
    that was stable before the cut is delivered identically everywhere).
    minority-divergent: one of them holds another event there;
    minority-only: fewer than a majority of them hold it at the end.

    A delivery counts once it reached the member's global topic: one lost
    with the process before it was durable was seen by nobody (after a total
    outage the group resumes at the highest durable position, and such
    positions are ordered again), and a witness has no topic at all — its
    view changes are judged by `check_views`."""
    seqs = {m: [r.seq for r in topics[m]] for m in topics}
    live = [m for m in live if m in topics]
    out = []
    for m in sorted(minority):
        if m not in topics:
            continue
        runs = [Run(lo, r.origin, r.partition, r.first_offset + lo - r.seq, hi - lo)
                for r in normalise(minority[m])
                for lo, hi, ra, rb in _walk_from(r, topics[m], seqs[m]) if _same(ra, rb)]
        refs = [r for r in live if r != m]
        if not runs or not refs:
            continue
        need = len(refs) // 2 + 1
        div = only = 0
        first_div = first_only = None
        for run in runs:
            marks: list[tuple[int, int, int]] = []  # (position, +1/-1 same holders, +1/-1 other holders)
            others: list[tuple[int, int, str, Run]] = []
            for ref in refs:
                for lo, hi, _, rb in _walk_from(run, topics[ref], seqs[ref]):
                    if _same(run, rb):
                        marks += [(lo, 1, 0), (hi, -1, 0)]
                    else:
                        marks += [(lo, 0, 1), (hi, 0, -1)]
                        others.append((lo, hi, ref, rb))
            marks.sort()
            points = sorted({run.seq, run.end_seq, *(x[0] for x in marks)})
            same = diff = i = 0
            for x, y in zip(points, points[1:]):
                while i < len(marks) and marks[i][0] <= x:
                    same += marks[i][1]
                    diff += marks[i][2]
                    i += 1
                if diff:
                    div += y - x
                    if first_div is None:
                        ref, rb = next((ref, rb) for lo, hi, ref, rb in others if lo <= x < hi)
                        first_div = (x, _rid(run, x - run.seq), ref, _rid(rb, x - rb.seq))
                elif same < need:
                    only += y - x
                    if first_only is None:
                        first_only = (x, _rid(run, x - run.seq), same)
        if div:
            pos, e, ref, other = first_div
            out.append(Violation(
                MINORITY_DIVERGENT,
                f"{m} delivered {div} position(s) while cut off from the majority that differ from the agreed "
                f"order; first: seq {pos} = {e}, {ref} has {other} there",
                m, div,
            ))
        if only:
            pos, e, same = first_only
            out.append(Violation(
                MINORITY_ONLY,
                f"{m} delivered {only} position(s) while cut off from the majority that the rest of the group "
                f"does not hold; first: seq {pos} = {e}, held by {same} of the {len(refs)} other live member(s)",
                m, only,
            ))
    return out


def check(
    topics: Mapping[str, Iterable],
    *,
    submitted: OffsetRanges | None = None,
    live: Iterable[str] | None = None,
    agreement: bool = True,
    content: ContentCheck | None = None,
    views: Iterable[ViewRecord] = (),
    initial_members: Sequence[str] | None = None,
    minority: Mapping[str, Sequence[Run]] | None = None,
    gaps: Iterable[Violation] = (),
) -> list[Violation]:
    """Judge a run; returns every violation found (empty when correct).

    `topics`: member -> its global topic as runs (any split; normalised here);
    `submitted`: what the source clusters acknowledged (None: skip foreign and
    loss); `live`: members that must hold everything acknowledged (default:
    every member in `topics`); `agreement=False` skips inconsistent-offsets
    (the mirror baseline in unit tests); `content`: the driver's byte check;
    `views`: every view installed, by whom; `initial_members`: the
    configuration (view 0); `minority`: member -> runs it delivered while cut
    off from every majority; `gaps`: gap violations the driver recorded.
    Raises nothing for bad content: it is reported.
    """
    norm = {m: normalise(r) for m, r in topics.items()}
    live = list(norm) if live is None else [m for m in live if m in norm]
    out: list[Violation] = list(gaps)
    if agreement:
        out += check_agreement(norm)
    clean: list[list[Run]] = []  # topics found free of duplicates, foreign events and disorder
    for m, runs in norm.items():
        # those three checks are functions of the runs alone: the same runs as a clean topic, no findings
        same = any(runs == c for c in clean)
        found = [] if same else check_duplicates(m, runs)
        if submitted is not None and not same:
            found += check_foreign(m, runs, submitted)
        out += found
        if content is not None:  # the bytes are each member's own: always checked
            out += check_content(m, runs, content)
        if not same:
            order = check_origin_order(m, runs)
            out += order
            if not found and not order:
                clean.append(runs)
    if submitted is not None:
        whole: list[list[Run]] = []  # topics found to hold everything acknowledged
        for m in live:
            if any(norm[m] == w for w in whole):
                continue
            lost = check_loss(m, norm[m], submitted)
            if not lost:
                whole.append(norm[m])
            out += lost
    out += check_views(views, initial_members)
    if minority:
        out += check_minority(minority, norm, live)
    return out


def gap(member: str, expected: int, got: int) -> Violation:
    """The gap violation for a member handed position `got` while its topic ends at `expected`."""
    return Violation(GAP, f"{member} was handed position {got} while its global topic ends at {expected}", member)


class Recorder:
    """What a driver collects while a run goes on, for `check()`: installed
    views, deliveries made while cut off from every majority, gaps."""

    def __init__(self) -> None:
        self.views: list[ViewRecord] = []
        self.minority: dict[str, list[Run]] = {}
        self.gaps: list[Violation] = []

    def on_views(self, member: str, views: Iterable) -> None:
        """`member` installed these core Views (in order)."""
        self.views.extend(ViewRecord.of(member, v) for v in views)

    def on_minority(self, member: str, runs: Iterable) -> None:
        """`member` delivered these runs while no majority could reach it."""
        self.minority.setdefault(member, []).extend(runs)

    def gap(self, member: str, expected: int, got: int) -> None:
        """`member` was handed position `got` while its topic ends at `expected`."""
        if len(self.gaps) < EXAMPLES:
            self.gaps.append(gap(member, expected, got))


__all__ = [
    "ANOMALIES", "KINDS", "KIND_OF", "TRACE_COLUMNS", "ContentCheck", "OffsetRanges", "Recorder", "Run", "Violation",
    "ViewRecord", "check", "event_id", "gap", "normalise", "runs_from_batches", "runs_from_events", "watermarks",
]
