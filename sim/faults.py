"""The fault player of a simulation: the scenario's `faults:` applied at
their times (crash, clean stop, restart, partition, heal, link faults, clock
pauses), in
file order on ties, each followed by the majority bookkeeping of the host
(`Simulation.topology_changed`).  Format: docs/scenario.md.

What the player uses of the simulation is `FaultHost` (sim.runner's
Simulation provides it): the clock, the network, the scenario, the nodes of
each site and two callbacks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import simpy

    from sim.members import SimMember
    from sim.network import SimNetwork
    from sim.scenario import Scenario

__all__ = ["FaultHost", "FaultPlayer", "STOP_BOUND_S"]

STOP_BOUND_S = 5.0  # a clean stop ends its process once the group took note, or this long after it began


class FaultHost(Protocol):
    """What the fault player uses of the simulation."""

    env: simpy.Environment
    network: SimNetwork
    scenario: Scenario
    site_nodes: dict[str, list[SimMember]]  # the nodes of each site (its member, its shards' members)

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any) -> None: ...

    def topology_changed(self) -> None: ...  # the majority bookkeeping after every fault


class FaultPlayer:
    """Plays one scenario's faults on one simulation (a SimPy process: `play`)."""

    def __init__(self, sim: FaultHost) -> None:
        self.sim = sim

    def play(self):
        env = self.sim.env
        net = self.sim.network
        for f in sorted(self.sim.scenario.faults, key=lambda f: f.at_s):  # stable: file order on ties
            if f.at_s > env.now:
                yield env.timeout(f.at_s - env.now)
            a = f.action
            if a == "crash":
                for n in self.sim.site_nodes[f.crash]:
                    n.crash()
            elif a == "stop":
                for n in self.sim.site_nodes[f.stop]:
                    n.stop(STOP_BOUND_S)
            elif a == "restart":
                for n in self.sim.site_nodes[f.restart]:
                    n.start()
            elif a == "partition":
                token = net.set_partition([list(g) for g in f.partition])
                if f.until_s is not None:
                    self.sim.after(f.until_s - env.now, self._end_partition, token)
            elif a == "heal":
                net.heal()
            elif a == "link":
                lf = f.link
                token = net.set_link_fault(lf.from_, lf.to, lf)
                if f.until_s is not None:
                    self.sim.after(f.until_s - env.now, self._end_link_fault, (lf.from_, lf.to, token))
            elif a == "clock_pause":
                for n in self.sim.site_nodes[f.clock_pause]:
                    n.pause(env.now + f.for_s)
            self.sim.topology_changed()

    def _end_partition(self, token) -> None:
        if self.sim.network.end_partition(token):
            self.sim.topology_changed()

    def _end_link_fault(self, arg) -> None:
        if self.sim.network.end_link_fault(*arg):
            self.sim.topology_changed()
