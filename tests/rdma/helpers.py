"""Shared helpers of the in-VM RDMA tests (no pytest-asyncio in the guest)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable


async def wait_for(cond: Callable[[], bool], timeout: float, what: str, step: float = 0.005) -> float:
    """Poll `cond` until true; return the seconds it took; AssertionError on timeout."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(step)
    return time.monotonic() - t0


def group(ids: list[str], addr: str, ports: list[int]) -> dict[str, tuple[str, int]]:
    return {m: (addr, ports[i]) for i, m in enumerate(ids)}
