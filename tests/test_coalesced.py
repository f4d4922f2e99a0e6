"""kdsync.ticks.Coalesced: the member drains each node once for all the
peer messages that reached it in a loop iteration; kdsync.ticks.Pulse: a
long pass still beats (pings and writes) every period."""

import asyncio


def test_coalesced_runs_each_item_once_in_order_in_slices_and_survives_an_error():
    from kdsync.ticks import Coalesced

    async def main():
        loop = asyncio.get_running_loop()
        ran: list[str] = []

        def run(item: str) -> None:
            ran.append(item)
            if item == "bad":
                raise RuntimeError("a bug in one drain")

        errors: list[str] = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(str(ctx.get("exception"))))
        q = Coalesced(loop, run, budget_s=0.0)  # one item per slice
        for item in ["a", "b", "a", "bad", "c", "b"]:
            q.add(item)
        assert ran == []  # soon, not now: the messages of this iteration first
        other: list[int] = []
        loop.call_soon(lambda: other.append(len(ran)))
        while len(ran) < 4:
            await asyncio.sleep(0)
        assert ran == ["a", "b", "bad", "c"]  # once each, first added first
        assert other and 0 < other[0] < 4  # the loop ran other callbacks between slices
        assert errors == ["a bug in one drain"]
        q.add("a")  # once run, an item can be added again
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert ran[-1] == "a" and len(ran) == 5
    asyncio.run(main())


def test_a_pulse_beats_at_most_once_a_period_inside_a_long_pass():
    from kdsync.ticks import Pulse

    beats: list[int] = []
    clock = [0.0]
    pulse = Pulse(lambda: beats.append(len(beats)), 1 / 16, clock=lambda: clock[0])  # binary fractions: exact
    pulse()  # not started: no pass
    pulse.start()
    for _ in range(20):  # a pass of 20 steps of a quarter period
        clock[0] += 1 / 64
        pulse()
    assert len(beats) == 5  # every fourth step


def test_an_auto_pulse_times_each_pass_from_its_first_call():
    """`auto`: the first call of a pass arms the pulse, which beats once a
    period passed within that pass, and disarms when the loop gets back to
    its callbacks: the next pass starts counting afresh."""
    from kdsync.ticks import Pulse

    beats: list[float] = []
    clock = [0.0]
    pulse = Pulse(lambda: beats.append(clock[0]), 1 / 16, clock=lambda: clock[0], auto=True)
    pulse()  # no loop: nothing armed, nothing raised

    async def main():
        clock[0] = 1.0
        pulse()  # a pass begins
        clock[0] += 1 / 32
        pulse()
        assert beats == []
        clock[0] += 1 / 32
        pulse()  # a period into the pass
        assert beats == [1.0 + 1 / 16]
        await asyncio.sleep(0)  # the loop gets back to its callbacks
        await asyncio.sleep(0)
        clock[0] += 1.0  # long after, but a new pass
        pulse()
        assert len(beats) == 1
        clock[0] += 1 / 16
        pulse()
        assert len(beats) == 2

    asyncio.run(main())
