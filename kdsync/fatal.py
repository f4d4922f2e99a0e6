"""Errors shared by the member's parts (kept apart so that no part imports the member)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from kdsync.observability.logs import kv

log = logging.getLogger("kdsync.member")


class FatalError(Exception):
    """Stops the member: one line for the operator, exit 1."""


async def retry(stop: asyncio.Event, what: str, fn, *args, on_failure: Callable[[], None] = lambda: None):
    """Run blocking `fn(*args)` in a thread until it succeeds, with backoff
    (0.2 s doubling to 2 s), one warning per failure; `on_failure()` after
    each (the member serves its client's log lines); FatalError passes
    through; CancelledError once `stop` is set."""
    delay = 0.2
    while not stop.is_set():
        try:
            return await asyncio.to_thread(fn, *args)
        except FatalError:
            raise
        except Exception as e:  # broker down / not ready: log and retry
            log.warning(f"{what} failed, retrying", **kv(error=str(e).splitlines()[0] if str(e) else repr(e),
                                                         retry_in=f"{delay:.1f}s"))
            on_failure()
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, 2.0)
    raise asyncio.CancelledError
