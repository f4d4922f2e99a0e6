"""The network model: directed links with latency, jitter, bandwidth, loss,
duplication and reordering; partitions and per-link faults over time.

Every message in flight is its own scheduled SimPy event (a timeout whose
callback hands the bytes to the receiver), so messages with different delays
overtake each other exactly as SimPy's latency example does with one process
per message; a bare timeout costs a third of a process and the simulator
sends hundreds of thousands of them.

Delay of one copy = queueing behind earlier messages on the same directed link
(bandwidth is a FIFO serialiser per direction) + size / bandwidth + latency +
jitter (normal, sd = jitter_ms, latency + jitter clipped at 0) + an extra
delay drawn from `extra_quantiles_ms` when given (one-sided, by inverse CDF:
what a delaying proxy's own scheduling adds on a busy box).  A link is
FIFO like a TCP connection: jitter delays a message but never lets it pass an
earlier one.  Reordering is its own knob: with probability `reorder` a copy
leaves the FIFO and is held back by up to two latencies, so later messages
overtake it; a duplicate copy (probability `duplicate`) arrives like that too.
Partitions and `loss` are decided when a message is sent; what is already on
the wire still arrives.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Callable

import simpy
from simpy.events import Timeout

from sim.quantiles import inverse_cdf
from sim.scenario import LinkSpec, NetworkSpec


@dataclass(frozen=True, slots=True)
class LinkProps:
    latency_s: float = 0.001
    jitter_s: float = 0.0
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    bytes_per_s: float = 1000e6 / 8
    extra_q: tuple[float, ...] = ()  # quantiles (s) of a one-sided extra delay per message


def _apply(base: LinkProps, spec: LinkSpec) -> LinkProps:
    changes = {}
    if spec.latency_ms is not None:
        changes["latency_s"] = spec.latency_ms / 1000.0
    if spec.jitter_ms is not None:
        changes["jitter_s"] = spec.jitter_ms / 1000.0
    for name in ("loss", "duplicate", "reorder"):
        v = getattr(spec, name)
        if v is not None:
            changes[name] = v
    if spec.bandwidth_mbps is not None:
        changes["bytes_per_s"] = spec.bandwidth_mbps * 1e6 / 8
    if spec.extra_quantiles_ms is not None:
        changes["extra_q"] = tuple(q / 1000.0 for q in spec.extra_quantiles_ms)
    return replace(base, **changes) if changes else base


class SimNetwork:
    """Directed links between every pair of members.

    `deliver(src, dst, data, channel)` is called at arrival time; the receiver
    decides what a crashed or paused destination does with it.
    """

    def __init__(
        self,
        env: simpy.Environment,
        members: tuple[str, ...],
        spec: NetworkSpec,
        seed: int,
        deliver: Callable[[str, str, bytes, int], None],
    ) -> None:
        self.env = env
        self.members = members
        self._deliver = deliver
        default = _apply(LinkProps(), spec.default)
        self._base: dict[tuple[str, str], LinkProps] = {}
        for a in members:
            for b in members:
                if a != b:
                    self._base[(a, b)] = default
        for o in spec.links:
            key = (o.from_, o.to)
            if key in self._base:
                self._base[key] = _apply(self._base[key], o)
        self._faults: dict[tuple[str, str], LinkSpec] = {}  # active link faults
        self._group: dict[str, int] | None = None  # member -> partition group
        self._props = dict(self._base)
        # one generator per directed link, so adding traffic on one link does
        # not change the random draws of another
        self._rng = {k: random.Random(f"{seed}/net/{k[0]}->{k[1]}") for k in sorted(self._base)}
        self._busy_until = {k: 0.0 for k in self._base}
        self._last_arrival = {k: 0.0 for k in self._base}
        self.sent = 0
        self.dropped = 0
        self.loopback = 0  # messages a node addressed to itself
        self.misaddressed = 0  # messages to a member that does not exist
        self.bytes = 0

    # ------------------------------------------------------------- fault state
    def set_partition(self, groups: list[list[str]] | None) -> object:
        """Cut every link between different groups (an unlisted member is a group
        of its own); None ends any partition.  Returns a token for end_partition."""
        if groups is None:
            self._group = None
            return None
        g = {m: i for i, grp in enumerate(groups) for m in grp}
        n = len(groups)
        for m in self.members:
            if m not in g:
                g[m] = n
                n += 1
        self._group = g
        return g

    def end_partition(self, token: object) -> bool:
        """End the partition `token` names, unless another one replaced it."""
        if token is not None and self._group is token:
            self._group = None
            return True
        return False

    def set_link_fault(self, src: str, dst: str, spec: LinkSpec | None) -> object:
        """Override the link src->dst with `spec` (None restores it); returns a token."""
        if spec is None:
            self._faults.pop((src, dst), None)
            self._props[(src, dst)] = self._base[(src, dst)]
            return None
        self._faults[(src, dst)] = spec
        self._props[(src, dst)] = _apply(self._base[(src, dst)], spec)
        return spec

    def end_link_fault(self, src: str, dst: str, token: object) -> bool:
        """End the link fault `token` names, unless another one replaced it."""
        if token is not None and self._faults.get((src, dst)) is token:
            self.set_link_fault(src, dst, None)
            return True
        return False

    def heal(self) -> None:
        self._group = None
        self._faults.clear()
        self._props = dict(self._base)

    def can_send(self, src: str, dst: str) -> bool:
        """True when the link src->dst carries anything at all now."""
        if self._group is not None and self._group[src] != self._group[dst]:
            return False
        return self._props[(src, dst)].loss < 1.0

    # ---------------------------------------------------------------- sending
    def send(self, src: str, dst: str, data: bytes, channel: int = 0) -> None:
        """Send `data` from src to dst; `channel` (a shard) travels with it to the receiver."""
        self.sent += 1
        key = (src, dst)
        if key not in self._props:
            if src == dst and src in self.members:  # to itself: loopback, at once
                self.loopback += 1
                Timeout(self.env, 0.0, (src, dst, data, channel)).callbacks.append(self._arrive)
            else:
                self.misaddressed += 1  # no such member: nowhere to go
            return
        if self._group is not None and self._group[src] != self._group[dst]:
            self.dropped += 1
            return
        p = self._props[key]
        rng = self._rng[key]
        if p.loss and rng.random() < p.loss:
            self.dropped += 1
            return
        now = self.env.now
        size = len(data)
        self.bytes += size
        start = self._busy_until[key]
        if start < now:
            start = now
        done = start + size / p.bytes_per_s
        self._busy_until[key] = done
        copies = 2 if (p.duplicate and rng.random() < p.duplicate) else 1
        for copy in range(copies):
            flight = p.latency_s
            if p.jitter_s:
                flight += rng.gauss(0.0, p.jitter_s)
                if flight < 0.0:
                    flight = 0.0
            if p.extra_q:  # the measured extra delay, by inverse CDF
                flight += inverse_cdf(p.extra_q, rng.random())
            delay = done - now + flight
            if copy == 0 and not (p.reorder and rng.random() < p.reorder):
                # a FIFO link (TCP-like): jitter delays, never reorders.  SimPy
                # adds the delay to `now`, so compare the sums it will compute:
                # equal times then keep send order (event id).
                last = self._last_arrival[key]
                if now + delay < last:
                    delay = last - now
                    while now + delay < last:
                        delay = math.nextafter(delay, math.inf)
                self._last_arrival[key] = now + delay
            else:
                # reordered copy / duplicate: held back, overtaken by later traffic
                delay += rng.random() * 2 * p.latency_s
            Timeout(self.env, delay, (src, dst, data, channel)).callbacks.append(self._arrive)

    def _arrive(self, ev) -> None:
        self._deliver(*ev.value)
