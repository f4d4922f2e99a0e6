"""The clock protocol's in-view stream (kdsync/core/clock_stream.py) alone:
members exchanging slots, acknowledgements and clock reports over links that
reorder and duplicate, with clocks that are skewed, drift and jump back and
forth.  Every member must deliver the same sequence, every batch exactly
once, in origin order, and a batch only once a majority holds it."""

import random

import pytest

from kdsync.core.batch import Batch
from kdsync.core.clock_stream import ClockStream
from kdsync.core.types import View

IDS = ("a", "b", "c", "d", "e")


def _view(ids):
    return View(view_id=1, members=tuple(ids), incarnations=tuple(1 for _ in ids), senders=tuple(ids), start_seq=0)


class Clock:
    """A member's physical clock (µs): offset, drift and jumps, never safety."""

    def __init__(self, rng: random.Random, faults: bool):
        self.offset = rng.randrange(-50_000, 50_000) if faults else 0
        self.drift = rng.uniform(0.9, 1.1) if faults else 1.0
        self.jumps = {rng.randrange(50, 400): rng.choice((-80_000, 80_000)) for _ in range(2)} if faults else {}

    def now(self, step: int) -> int:
        for at, by in self.jumps.items():
            if step >= at:
                self.offset += by
        self.jumps = {at: by for at, by in self.jumps.items() if step < at}
        return max(0, int(step * 1000 * self.drift) + self.offset)


def _run(seed: int, n: int, faults: bool, steps: int = 600):
    rng = random.Random(seed)
    ids = IDS[:n]
    view = _view(ids)
    streams = {m: ClockStream(view, m) for m in ids}
    clocks = {m: Clock(rng, faults) for m in ids}
    pending = {m: [] for m in ids}
    offsets = {m: 0 for m in ids}
    delivered = {m: [] for m in ids}
    queue = []  # (due step, tie, to, sender, kind, payload)
    held = {}  # (origin, first offset) -> members holding the batch
    majority = n // 2 + 1

    def send(step, frm, kind, payload):
        for to in ids:
            if to != frm:
                for _ in range(2 if rng.random() < 0.05 else 1):  # duplicates
                    queue.append((step + rng.randrange(1, 12), rng.random(), to, frm, kind, payload))

    for step in range(steps + 400):
        for m in ids:
            s = streams[m]
            now = clocks[m].now(step)
            if step < steps and rng.random() < 0.3:
                k = rng.randrange(1, 4)
                pending[m].append(Batch.of(m, 0, offsets[m], [b"x"] * k))
                offsets[m] += k
            first, slots = s.cut(pending[m], now, window=4, max_batch=8)
            for _, slot in slots:
                for b in slot:
                    held.setdefault((b.origin, b.first_offset), set()).add(m)
            if slots or rng.random() < 0.5:  # acks and clock reports, as ticks would send them
                send(step, m, "msg", (ids.index(m), first, tuple(slots), tuple(s.received), s.report(now)))
        queue.sort()
        while queue and queue[0][0] <= step:
            _, _, to, frm, kind, (k, first, slots, recv, (cut, clk)) = queue.pop(0)
            s = streams[to]
            if slots:
                s.add(k, first, slots)
                for _, slot in slots:
                    for b in slot:
                        held[(b.origin, b.first_offset)].add(to)
            s.ack(frm, recv)
            s.on_report(k, cut, clk)
        for m in ids:
            s = streams[m]
            for slot in s.deliverable():
                for b in slot:
                    assert len(held[(b.origin, b.first_offset)]) >= majority, "delivered before a majority held it"
                delivered[m].extend(slot)
    return ids, delivered, offsets


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("n", [3, 5])
def test_every_member_delivers_the_same_sequence_exactly_once_in_origin_order(seed, n):
    ids, delivered, offsets = _run(seed, n, faults=seed % 2 == 1)
    seqs = [[(b.origin, b.first_offset, b.count) for b in delivered[m]] for m in ids]
    assert all(s == seqs[0] for s in seqs), "members delivered different sequences"
    for m in ids:  # exactly once and in origin order: each origin's batches tile its offsets
        got = [(b.first_offset, b.count) for b in delivered[ids[0]] if b.origin == m]
        at = 0
        for first, count in got:
            assert first == at, f"origin {m}: batch at {first}, expected {at}"
            at += count
        assert at == offsets[m], f"origin {m}: {at} of {offsets[m]} records delivered"


def test_a_slot_waits_for_a_majority_and_for_every_senders_clock():
    view = _view(("a", "b", "c"))
    a, b = ClockStream(view, "a"), ClockStream(view, "b")
    first, slots = a.cut([Batch.of("a", 0, 0, [b"x"])], now=100, window=4, max_batch=8)
    assert (first, [ts for ts, _ in slots]) == (0, [100])
    b.add(0, first, slots)
    assert b.deliverable() == []  # c has said nothing: it may have stamped something below 100
    b.on_report(2, 0, 99)
    assert b.deliverable() == []  # c promises only up to 99
    b.on_report(2, 0, 100)
    assert len(b.deliverable()) == 1  # a and b hold it (a majority of 3); c's promise covers 100


def test_a_clock_report_counts_only_once_the_slots_before_it_arrived():
    view = _view(("a", "b", "c"))
    b = ClockStream(view, "b")
    c = ClockStream(view, "c")
    _, c_slots = c.cut([Batch.of("c", 0, 0, [b"y"])], now=50, window=4, max_batch=8)
    a = ClockStream(view, "a")
    _, a_slots = a.cut([Batch.of("a", 0, 0, [b"x"])], now=100, window=4, max_batch=8)
    b.add(0, 0, a_slots)
    b.ack("c", [1, 0, 1])  # c holds a's slot: a majority
    b.on_report(2, 1, 200)  # c's report counts its slot 0, which b has not received
    b.on_report(0, 1, 200)
    assert b.deliverable() == []  # c's slot (ts 50) may still come before a's (ts 100)
    b.add(2, 0, c_slots)
    b.ack("a", [1, 0, 1])
    out = b.deliverable()
    assert [bt.origin for slot in out for bt in slot] == ["c", "a"]


def test_timestamps_of_one_sender_increase_when_its_clock_jumps_back():
    view = _view(("a", "b", "c"))
    a = ClockStream(view, "a")
    _, s1 = a.cut([Batch.of("a", 0, 0, [b"x"])], now=1_000, window=4, max_batch=8)
    a.report(5_000)
    _, s2 = a.cut([Batch.of("a", 0, 1, [b"x"])], now=10, window=4, max_batch=8)  # the clock went back
    assert s1[0][0] == 1_000 and s2[0][0] > 5_000  # above what it promised


def test_a_hole_filled_up_to_a_limit_counts_no_held_slot_past_it():
    # the view change's leader fills its trim (limit 2) with a fetched slot while it
    # already holds later slots of that sender: its received count (which its
    # heartbeats acknowledge) must stop at the trim (swarm clock seed 1001180)
    view = _view(("a", "b", "c"))
    c = ClockStream(view, "c")
    _, slots = c.cut([Batch.of("c", 0, i, [b"e%d" % i]) for i in range(4)], now=100, window=8, max_batch=1)
    a = ClockStream(view, "a")
    a.add(2, 2, slots[2:])  # slots 0 and 1 lost: held out of order
    assert a.received[2] == 0
    assert a.add(2, 0, slots[:2], limit=2) and a.received[2] == 2
    assert a.add(2, 0, slots[:2]) and a.received[2] == 4  # without a limit the run goes on
