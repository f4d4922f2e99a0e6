"""`OrderingNode`: the one interface every adapter drives.

The member (`kdsync run`), the simulator and the in-memory test network all
type against this protocol, never against a concrete variant; `make_node`
returns an object that satisfies it whatever `config.protocol` names.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Protocol, runtime_checkable

from kdsync.core.types import Batch, LogChunk, Ready


@runtime_checkable
class OrderingNode(Protocol):
    """A pure, deterministic ordering state machine (see `kdsync.core`).

    Read-only attributes an adapter may look at:

    * `status` — "forming", "active", "wedged", "minority", "joining" or
      "catching-up" (the baselines are always "active");
    * `next_seq` — the next position this member will deliver;
    * `durable_seq` — positions below it are durable in the global topic;
    * `stats` — counters: "submitted", "delivered", "deduplicated",
      "resubmitted", "bad_messages".
    """

    status: str
    next_seq: int
    durable_seq: int
    stats: dict[str, int]

    def submit(self, batches: Iterable[Batch]) -> None:
        """Local source batches, in origin-offset order per (origin, partition).
        Raises LocalProtocolError on a witness."""

    def receive(self, sender: str, data: bytes) -> None:
        """Bytes a peer sent.  Raises RemoteProtocolError when malformed (log,
        drop, carry on: the node's state is unchanged)."""

    def step(self, item: LogChunk) -> None:
        """The answer to a ReadRequest."""

    def durable(self, seq_end: int) -> None:
        """Positions below `seq_end` are durable in this member's global topic."""

    def tick(self) -> None:
        """One unit of time passed (the adapter decides how long)."""

    def dormant(self) -> bool:
        """True when the driver may stop ticking this node until input or a
        peer falls silent (kdsync.core.liveness); False for protocols without it."""

    def wake(self, ticks: int, heard_ago: Mapping[str, int]) -> None:
        """Woken after `ticks` ticks of sleep, before any input; `heard_ago`:
        ticks since the member last heard each peer."""

    def heard(self, heard_ago: Mapping[str, int]) -> None:
        """The member's liveness of its peers (ticks since each was heard)."""

    def clock(self, now_us: int) -> None:
        """The host's wall clock in microseconds (the `clock` protocol stamps
        with it; the others ignore it).  Skew, drift and jumps never cost
        safety, only latency."""

    def leave(self) -> None:
        """Stop cleanly: tell the peers at once (they move on without this
        member instead of waiting for its silence); keep draining ready()
        until `left`, then stop driving the node."""

    @property
    def left(self) -> bool:
        """After leave(): the peers took note (True at once for the baselines)."""

    def has_ready(self) -> bool:
        """True when ready() would hand over something to do."""

    def ready(self) -> Ready:
        """What to do now (see `Ready` for the order); call advance() after."""

    def advance(self, rd: Ready) -> None:
        """Close the handshake of the Ready last returned."""
