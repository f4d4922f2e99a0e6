"""A developer's switch: KDSYNC_PROFILE=DIR profiles the member's threads
(KDSYNC_PROFILE_AFTER_S=N: the event loop's from N s after start, the steady
state without the start-up)."""

from __future__ import annotations

import cProfile
import os
import time
from pathlib import Path

__all__ = ["profiler"]


def profiler(name: str, loop=None):
    """KDSYNC_PROFILE=DIR (a developer's switch, docs/commands.md): profile
    this thread's CPU time (cProfile, thread_time) into DIR/<name>.prof;
    returns the function that stops and writes it, or None.  With `loop`
    (this thread's running event loop) and KDSYNC_PROFILE_AFTER_S=N, the
    profile starts N s later."""
    out = os.environ.get("KDSYNC_PROFILE")
    if not out:
        return None
    prof = cProfile.Profile(time.thread_time)
    after = float(os.environ.get("KDSYNC_PROFILE_AFTER_S") or 0)
    if loop is not None and after > 0:
        loop.call_later(after, prof.enable)
    else:
        prof.enable()

    def stop() -> None:
        prof.disable()
        Path(out).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(Path(out) / f"{name}.prof"))

    return stop
