"""The member's garbage collector: fewer and shorter pauses, and the
longest one measured (`kdsync_gc_pause_seconds`, the `loop late` line).

Measured at 1 000 topics (3 members and 3 Tansu on 2 cores, one record
written into each topic at 30 events/s): with CPython's default thresholds
(700, 10, 10) a member ran full collections that held its event loop for
0.15-0.9 s and collected nothing.  Peers then judged it silent, and each
silence sent a thousand groups into a view change, whose work made the next
pause longer.  The member's long-lived objects (groups, pipelines, clients,
start-up state) are made while it starts and forms its groups, so `kdsync
run` freezes them then (`gc.freeze`: no collection traverses them again) and
collects young objects less often (`THRESHOLDS`); a full collection then
walks what was made since.  The cost: cyclic garbage among frozen objects is
never collected; they live as long as the member anyway.
"""

from __future__ import annotations

import gc
import time

__all__ = ["FREEZE_AFTER_S", "THRESHOLDS", "GcPauses", "freeze", "freeze_started", "tune"]

THRESHOLDS = (10_000, 20, 20)  # young objects, then collections of each generation (default 700, 10, 10)
FREEZE_AFTER_S = 60.0  # after start-up, again once the groups formed (their views and logs are long-lived)

_tuned = False


def tune() -> None:
    """For a process that runs one member (`kdsync run`): larger thresholds,
    and `freeze` takes effect."""
    global _tuned
    _tuned = True
    gc.set_threshold(*THRESHOLDS)


def freeze() -> None:
    """After start-up, in a process `tune`d: freeze every object tracked
    (O(1); a collection first held the loop 0.3-0.4 s at 1 000 topics).
    Elsewhere (tests running members in their own process) nothing."""
    if _tuned:
        gc.freeze()


def freeze_started(loop) -> None:
    """A member started its topics: `freeze` now, and again FREEZE_AFTER_S
    later, once its groups formed."""
    freeze()
    loop.call_later(FREEZE_AFTER_S, freeze)


class GcPauses:
    """The longest collection since the last `take`, in seconds (any thread's)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.worst = max(self.worst, time.perf_counter() - self._start)

    def take(self) -> float:
        w, self.worst = self.worst, 0.0
        return w

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
