"""Faulty physical clocks for the test network and the simulator.

A member's clock reads ``EPOCH_US + offset + true_time * (1 + drift)``, plus
the jumps that have happened by then (a step of NTP, a VM migration).  The
`clock` protocol must stay safe under any of them; they only cost latency.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EPOCH_US = 10**12  # every clock starts far from 0, as a wall clock does


@dataclass(frozen=True)
class ClockFault:
    offset_us: int = 0
    drift_ppm: float = 0.0
    jumps: tuple[tuple[int, int], ...] = field(default=())  # (at true µs, by µs)

    def read(self, true_us: int) -> int:
        """The clock's reading (µs) at true time `true_us`; never below 0."""
        t = EPOCH_US + self.offset_us + true_us + int(true_us * self.drift_ppm / 1e6)
        for at, by in self.jumps:
            if true_us >= at:
                t += by
        return max(0, t)


PERFECT = ClockFault()
