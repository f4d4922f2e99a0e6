"""kdsync.ticks.TickPasses (issue 26): a member's tick pass over its nodes
yields the loop between slices, and every node runs exactly the ticks the
member counted — in its slice, or before an input reaches it, never twice."""

import asyncio

import pytest

from kdsync.ticks import MAX_CATCH_UP, TickPasses


class Nodes:
    """Items visited by a TickPasses; each records the ticks it ran."""

    def __init__(self, n: int, budget: float = 0.0, fail_at: str | None = None):
        self.keys = [f"t{i}" for i in range(n)]
        self.ran = {k: 0 for k in self.keys}
        self.order: list[str] = []
        self.slices_seen = 0
        self.errors: list[Exception] = []
        self.fail_at = fail_at
        self.passes = TickPasses(asyncio.get_running_loop(), self.visit, on_slice=self.on_slice,
                                 on_error=self.errors.append, budget_s=budget)

    def on_slice(self) -> None:
        self.slices_seen += 1

    def visit(self, key: str) -> None:
        if key == self.fail_at:
            raise RuntimeError("a core bug")
        self.order.append(key)
        self.ran[key] += self.passes.owed(key)

    def items(self):
        return list(self.keys)


async def until_done(p: TickPasses) -> None:
    while p.running:
        await asyncio.sleep(0)


def test_a_pass_yields_the_loop_between_slices_and_visits_every_node_once():
    async def main():
        nodes = Nodes(6)
        other = []
        nodes.passes.add(1, nodes.items)  # budget 0: one node per slice, the first one now
        assert nodes.order == ["t0"] and nodes.passes.running
        asyncio.get_running_loop().call_soon(other.append, len(nodes.order))  # input between slices
        await until_done(nodes.passes)
        assert nodes.order == nodes.keys and nodes.slices_seen == 6
        assert 0 < other[0] < 6  # the loop ran other callbacks in the middle of the pass
    asyncio.run(main())


def test_every_node_runs_the_members_ticks_once_whatever_comes_mid_pass():
    async def main():
        nodes = Nodes(8)
        nodes.passes.add(1, nodes.items)  # nodes first seen: owed nothing yet
        await until_done(nodes.passes)
        assert set(nodes.ran.values()) == {0}
        start = nodes.passes.ticks
        nodes.passes.add(1, nodes.items)
        await asyncio.sleep(0)
        nodes.passes.add(2, nodes.items)  # mid-pass: no new pass, the rest of this one runs 3
        assert nodes.passes.passes == 2
        nodes.ran["t6"] += nodes.passes.owed("t6")  # an input reached t6 first: its owed ticks ran then
        await until_done(nodes.passes)
        nodes.passes.add(1, nodes.items)
        await until_done(nodes.passes)
        assert nodes.passes.passes == 3
        total = nodes.passes.ticks - start
        assert all(n == total for n in nodes.ran.values()), nodes.ran  # none lost, none run twice
    asyncio.run(main())


def test_a_node_runs_at_most_max_catch_up_ticks_at_once():
    async def main():
        nodes = Nodes(2, budget=1.0)
        nodes.passes.add(1, nodes.items)
        nodes.passes.add(MAX_CATCH_UP + 7, nodes.items)
        assert nodes.ran == {"t0": MAX_CATCH_UP, "t1": MAX_CATCH_UP}  # a long stall stretches the node's time
        assert nodes.passes.slices == 2  # a large budget: each pass in one slice
    asyncio.run(main())


def test_an_error_in_a_later_slice_is_reported_and_ends_the_pass():
    async def main():
        nodes = Nodes(4, fail_at="t2")
        nodes.passes.add(1, nodes.items)
        await until_done(nodes.passes)
        assert [str(e) for e in nodes.errors] == ["a core bug"] and nodes.order == ["t0", "t1"]
        with pytest.raises(RuntimeError):  # in the first slice it reaches the caller (TickClock reports it)
            Nodes(1, fail_at="t0").passes.add(1, lambda: ["t0"])
    asyncio.run(main())


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
