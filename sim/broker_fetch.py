"""The broker's side of a member's source consumer: the fetch model.

With `kafka.fetch_wait_ms > 0` each member's consumer keeps one fetch
outstanding per broker, as librdkafka does; a fetch that finds nothing new is
held by the broker until data arrives or the wait is over (`fetch`).  With
`kafka.poll_ms > 0` the consume loop hands over a batch every poll_ms
instead (`poller`).  The Simulation owns the clock, the clusters and the
members; this model only decides when a fetch is answered.  What it uses of
the simulation is `FetchHost`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from simpy.events import Timeout

if TYPE_CHECKING:
    import simpy

    from sim.members import SimMember

__all__ = ["FetchHost", "FetchModel"]


class FetchHost(Protocol):
    """What the fetch model uses of the simulation: its clock, its fetch
    settings (seconds), how far each member's workload is written, and a timer."""

    env: simpy.Environment
    shards: int
    fetch_wait_s: float
    fetch_check_s: float
    fetch_overhead_s: float
    poll_s: float
    written_until: dict[str, float]

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any) -> None: ...


class FetchModel:
    """The fetch loops of one simulation's members (module doc)."""

    def __init__(self, sim: FetchHost) -> None:
        self.sim = sim

    def fetch(self, m: SimMember, issued: float | None = None) -> None:
        """kafka.fetch_wait_ms > 0: one fetch of member `m`'s consumer reaches the
        broker now.  Data already there: the response leaves at once.  Nothing
        new: the broker holds it, looking every fetch_check_s, and answers at the
        first look that finds data or at fetch_wait_s.  The response (snapshot at
        that instant) reaches the member fetch_overhead_s later, and the next
        fetch goes out then (librdkafka keeps one fetch outstanding per broker)."""
        now = self.sim.env.now
        issued = now if issued is None else issued  # a held fetch looked at again (below)
        last = m.fetched_upto
        c = m.cluster
        parts = c.source[m.shard::self.sim.shards] if c is not None else []
        first = min((p.next_ack_after(last) for p in parts), default=float("inf"))
        wait, check = self.sim.fetch_wait_s, self.sim.fetch_check_s
        known = self.sim.written_until.get(m.id, math.inf)  # the workload is written this far ahead
        if first > known and issued + wait > known:
            # what arrives after `known` is not written yet: look again once it is
            self.sim.after(known - now, self.fetch_again, (m, issued))
            return
        answer = self._answer(issued, first, wait, check)
        m.fetched_upto = answer
        self.sim.after(answer - now + self.sim.fetch_overhead_s, self._fetched, (m, answer))

    def fetch_again(self, arg) -> None:
        self.fetch(*arg)

    @staticmethod
    def _answer(now: float, first: float, wait: float, check: float) -> float:
        """When the broker answers a fetch that reached it at `now`, the first
        new batch being acknowledged at `first`."""
        if first <= now + 1e-12:
            answer = now
        elif first >= now + wait:
            answer = now + wait
        elif check <= 0.0:
            answer = first
        else:
            answer = min(now + wait, now + check * math.ceil((first - now) / check - 1e-9))
        return answer

    def _fetched(self, arg) -> None:
        m, horizon = arg
        m.poll(horizon)
        self.fetch(m)

    def poller(self, ev) -> None:
        """kafka.poll_ms > 0: each member's consume loop hands over a batch every poll_ms."""
        m = ev.value
        Timeout(self.sim.env, self.sim.poll_s, m).callbacks.append(self.poller)
        m.poll()
