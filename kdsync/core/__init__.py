"""kdsync/core — the ordering protocol as a pure, deterministic state machine.

No sockets, clocks, threads, asyncio, simpy or Kafka in here (a test walks the
package and enforces it).  Every adapter drives a node the same way::

    node = make_node(config, rng=random.Random(seed), start_seq=0,
                     watermarks={}, hard_state=None)
    node.submit(batches)           # local source Batches (members, not witnesses)
    node.receive(peer_id, data)    # bytes a peer sent; RemoteProtocolError if bad
    node.step(LogChunk(...))       # answer to a ReadRequest
    node.durable(seq_end)          # positions < seq_end are in our global topic
    node.tick()                    # time passes; timeouts are counted in ticks
    node.clock(now_us)             # the host's wall clock, before inputs (the clock protocol stamps with it)
    if node.has_ready():
        rd = node.ready()          # Ready: hard_state, messages, deliveries, views, reads
        ...                        # do the I/O in the order Ready documents
        node.advance(rd)

Observable attributes (read-only for adapters): `node.status` — "forming",
"active", "wedged", "minority", "joining" or "catching-up" (the baselines are
always "active"); `node.next_seq` (next position to deliver);
`node.durable_seq`; `node.view` (derecho, sequencer: the current View); `node.stats`, a
dict of counters with the keys "submitted", "delivered", "deduplicated",
"resubmitted" and "bad_messages".

`make_node` picks the variant named by `config.protocol`: "derecho" (the
product), "clock" (derecho's views with Clock-RSM's timestamp order inside
them, for clusters across regions: docs/wan.md), "sequencer" (one leader per view assigns positions and fails over
through the same view change) or "mirror" (no agreement; the
MirrorMaker-style baseline).

The unit of order is a `Batch`: a contiguous run of one origin partition
(see `kdsync.core.batch`).  Deliveries are runs of batches at a first
position; positions are per record.
"""

from kdsync.core.batch import Batch, batches_from_events
from kdsync.core.types import (
    Delivery,
    Event,
    HardState,
    LocalProtocolError,
    LogChunk,
    NodeConfig,
    Outgoing,
    ProtocolError,
    ReadRequest,
    Ready,
    RemoteProtocolError,
    View,
)
from kdsync.core.node import OrderingNode

__all__ = [
    "Batch",
    "Delivery",
    "Event",
    "HardState",
    "LocalProtocolError",
    "LogChunk",
    "NodeConfig",
    "OrderingNode",
    "Outgoing",
    "ProtocolError",
    "ReadRequest",
    "Ready",
    "RemoteProtocolError",
    "View",
    "batches_from_events",
    "make_node",
]


def make_node(config: NodeConfig, **kwargs) -> OrderingNode:
    """Return the protocol variant named by `config.protocol`.

    Keyword arguments: `rng` (random.Random, required), `start_seq` (next
    position this member has not made durable; 0 on a fresh cluster),
    `watermarks` (dict (origin, partition) -> highest origin offset present in
    the durable prefix), `hard_state` (HardState persisted by a previous run,
    or None).  Raises LocalProtocolError on a bad config.
    """
    if config.protocol == "derecho":
        from kdsync.core.derecho import DerechoNode as cls
    elif config.protocol == "clock":
        from kdsync.core.clock import ClockNode as cls
    elif config.protocol == "sequencer":
        from kdsync.core.sequencer import SequencerNode as cls
    elif config.protocol == "mirror":
        from kdsync.core.mirror import MirrorNode as cls
    else:
        raise LocalProtocolError(f"unknown protocol {config.protocol!r} (expected derecho, clock, sequencer or mirror)")
    return cls(config, **kwargs)
