"""A developer's switch: KDSYNC_PROFILE=DIR profiles the member's threads."""

from __future__ import annotations

import cProfile
import os
import time
from pathlib import Path

__all__ = ["profiler"]


def profiler(name: str):
    """KDSYNC_PROFILE=DIR (a developer's switch, docs/commands.md): profile
    this thread's CPU time (cProfile, thread_time) into DIR/<name>.prof;
    returns the function that stops and writes it, or None."""
    out = os.environ.get("KDSYNC_PROFILE")
    if not out:
        return None
    prof = cProfile.Profile(time.thread_time)
    prof.enable()

    def stop() -> None:
        prof.disable()
        Path(out).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(Path(out) / f"{name}.prof"))

    return stop
