"""A member's clean stop, bounded (`[member] stop_timeout_ms`).

On SIGTERM a member finishes what it can: it waits (bounded) for the
delivery reports of what it wrote, commits their source offsets, takes a
last exact checkpoint, closes its Kafka clients and its links.  Each of
those steps talks to a broker, and a broker that is slow or stalled (Tansu
reading S3, a paused process) can hold a step far longer than its own
bound: librdkafka's close and commit calls run in threads that Python
cannot interrupt, and the interpreter joins those threads before it exits.
A supervisor does not wait for ever — systemd kills after TimeoutStopSec
(60 s in packaging/systemd/kdsync.service), Kubernetes after its grace
period (30 s by default) — and a member that hangs there is killed with
nothing said.

The first step leaves the ordering groups (`leave_groups`): every node
announces the clean stop (`OrderingNode.leave`), so the peers form their
next view at once instead of waiting `suspect_ms` for the silence, and the
member waits (at most `LEAVE_WAIT_S`) until each group took note.  Own
events not ordered yet are not committed: the restart consumes them again.

`StopClock` times the steps: a step slower than `SLOW_STEP_S` is logged
with its duration (`stop step slow`), and when the whole stop has not
finished within the timeout it logs which step it is stuck in, dumps every
thread's stack to stderr and exits with status 1 at once.  That is safe at
any point: it is what kill -9 does, and a member restarts from its state
file, its checkpoint and the global topic (docs/operations.md).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from kdsync.observability.logs import kv

__all__ = ["LEAVE_WAIT_S", "SLOW_STEP_S", "StopClock", "StopSignal", "announce_leave", "leave_groups"]

log = logging.getLogger("kdsync.member")

SLOW_STEP_S = 2.0  # a stop step taking longer than this is logged
LEAVE_WAIT_S = 2.0  # a stop waits at most this long for its groups to take note of its leave


def announce_leave(nodes: Callable[[], list], process: Callable[[object], None]) -> None:
    """Tell every group of the clean stop now (`OrderingNode.leave`, then the
    node's messages out through `process(item)`): called from the signal,
    before the member's loop ends and the stop's first steps run — those
    took ~200 ms on a loaded box, and meanwhile the peers waited for this
    member's clock.  `leave_groups` finds the nodes leaving already."""
    for item, node in nodes():
        node.leave()
        process(item)


async def leave_groups(nodes: Callable[[], list], process: Callable[[object], None], tick_s: float,
                       wait_s: float = LEAVE_WAIT_S) -> int:
    """Announce the clean stop to every group (module doc) and wait until
    each took note, ticking the leaving nodes (their Leave is repeated every
    retransmit period) and draining them with `process(item)`; `nodes()`
    gives (item, node) pairs.  Returns how many groups had not taken note
    when the wait ended (0: all did)."""
    import asyncio

    announce_leave(nodes, process)
    deadline = time.monotonic() + wait_s
    while True:
        waiting = [(item, node) for item, node in nodes() if not node.left]
        if not waiting or time.monotonic() >= deadline:
            return len(waiting)
        await asyncio.sleep(tick_s)
        for item, node in waiting:
            node.tick()
            process(item)


class StopSignal:
    """SIGINT/SIGTERM for a thread-driven main loop (the supervisor of
    workers, `kdsync offsets sync --follow`): `install()`, then
    `wait(timeout)` until `signal` is set.

    The handler only stores the signal number.  It must not set a
    `threading.Event`: a Python signal handler runs in the main thread
    between two bytecodes, and when that thread is inside `Event.wait` just
    after taking the event's lock, `Event.set` waits on that same lock for
    ever.  A supervisor hung that way in CI once: SIGTERM, then nothing,
    until the caller's SIGKILL.  `wait` sleeps in short slices instead
    (`time.sleep` holds no lock)."""

    SLICE_S = 0.05

    def __init__(self) -> None:
        self.signal: int | None = None

    def handler(self, sig: int, _frame: object = None) -> None:
        self.signal = sig

    def install(self, sigs: tuple[int, ...] | None = None) -> None:
        import signal as _signal

        for sig in sigs or (_signal.SIGINT, _signal.SIGTERM):
            _signal.signal(sig, self.handler)

    def is_set(self) -> bool:
        return self.signal is not None

    def wait(self, timeout: float) -> bool:
        """Sleep until a signal came or `timeout` passed; True when one came."""
        end = time.monotonic() + timeout
        while self.signal is None:
            left = end - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(self.SLICE_S, left))
        return self.signal is not None


def _hard_exit(code: int) -> None:  # pragma: no cover - replaced in tests
    os._exit(code)


class StopClock:
    """The steps of one stop and its deadline (module doc).  `exit`: how the
    process ends when the deadline passes (tests pass their own)."""

    def __init__(self, timeout_s: float, *, exit: Callable[[int], None] = _hard_exit,
                 clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.step_name = "starting the stop"
        self.slow: list[tuple[str, float]] = []  # (step, seconds) of the slow steps
        self._exit, self._clock = exit, clock
        self._timer: threading.Timer | None = None
        self._started = 0.0

    def start(self) -> None:
        """Arm the deadline (once: a second signal does not move it)."""
        if self._timer is not None:
            return
        self._started = self._clock()
        self._timer = threading.Timer(self.timeout_s, self.expire)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.step_name = name
        t0 = self._clock()
        try:
            yield
        finally:
            dt = self._clock() - t0
            if dt > SLOW_STEP_S:
                self.slow.append((name, dt))
                log.warning("stop step slow", **kv(step=name, seconds=round(dt, 1)))

    def expire(self) -> None:
        """The deadline passed: say where the stop is stuck and end the process."""
        waited = self._clock() - self._started
        log.error("stop did not finish", **kv(step=self.step_name, timeout_s=self.timeout_s,
                                               waited_s=round(waited, 1)))
        print(f"kdsync run: the stop did not finish within {self.timeout_s:g} s (stuck in: {self.step_name}); "
              "exiting now: the next start resumes from the state file and the global topic", file=sys.stderr)
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, AttributeError):  # stderr closed or replaced by a non-file
            pass
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:  # noqa: BLE001 - exiting either way
                pass
        sys.stderr.flush()
        self._exit(1)
