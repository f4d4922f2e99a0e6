"""kdsync.eventloop: the member loop's coalesced wake-ups ([member] coalesce_us)."""

from __future__ import annotations

import asyncio
import selectors
import socket

from kdsync.eventloop import CoalescingSelector, run


class FakeTime:
    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(round(s, 6))
        self.now += s


def _selector(gap: float) -> tuple[CoalescingSelector, FakeTime]:
    """A selector on fake time, watching a socket that is always readable (no select blocks)."""
    t = FakeTime()
    sel = CoalescingSelector(gap, sleep=t.sleep, clock=t.clock)
    a, b = socket.socketpair()
    a.send(b"x")
    sel.register(b, selectors.EVENT_READ)
    sel.keep = (a, b)  # closed with the test process
    return sel, t


def test_a_blocking_select_rests_until_the_gap_since_the_last_wake():
    sel, t = _selector(0.004)
    sel.select(0)  # woke at 100.0
    t.now += 0.001  # the iteration's work
    sel.select(None)  # would block: rests the 3 ms left of the gap first
    assert t.slept == [0.003]
    t.now += 0.010  # handled for longer than the gap: no rest
    sel.select(1.0)
    assert t.slept == [0.003]
    sel.close()


def test_ready_work_is_never_delayed_and_a_rest_never_passes_the_next_timer():
    sel, t = _selector(0.004)
    sel.select(0)
    for _ in range(3):  # callbacks queued: timeout 0, selected at once
        sel.select(0)
    assert t.slept == []
    sel.select(0.0015)  # the loop's next timer is due in 1.5 ms: rest 1.5 ms, then poll
    assert t.slept == [0.0015]
    sel.close()


def test_input_arriving_during_the_rest_is_seen_in_the_same_select():
    t = FakeTime()
    a, b = socket.socketpair()

    def rest(s: float) -> None:
        a.send(b"x")  # arrives while the loop rests
        t.sleep(s)

    sel = CoalescingSelector(0.004, sleep=rest, clock=t.clock)
    try:
        sel.register(b, selectors.EVENT_READ)
        assert sel.select(0) == []
        ready = sel.select(None)
        assert [k.fileobj for k, _ in ready] == [b] and t.slept == [0.004]
    finally:
        sel.close()
        a.close()
        b.close()


def test_run_uses_a_coalescing_loop_only_when_asked():
    async def selector_kind() -> str:
        return type(asyncio.get_running_loop()._selector).__name__  # noqa: SLF001

    assert run(selector_kind(), 2000) == "CoalescingSelector"
    assert run(selector_kind(), 0) != "CoalescingSelector"
