"""One source topic's pipeline in `kdsync run`, and how it starts.

A `TopicPipeline` is one source topic on its way to its global topic: its
ordering node, the node's hard-state file, the writer, reader and checkpoint
writer of the global topic (none on a witness, which has no Kafka) and the
counters the stall detector samples (kdsync.observability.stalls).

`open_pipeline` is the start-up kdsync.member's docstring describes: the
global topic and its checkpoint topic are created if missing, the latest
checkpoint and the global topic after it are read (start position, origin
watermarks, positions present beyond a gap), the hard state is loaded, and
the node, writer, reader and checkpoint writer are made.  The member then
registers the pipeline (source partitions, early peer messages).

What these functions may use of the member that runs them is written down
in `PipelineHost` (and `ReadHost` for the reads the node asks for): values
and callbacks, nothing else.  `kdsync.member.Member` provides them; a test
provides them with a plain object (tests/test_member_parts.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kdsync.core import HardState, LocalProtocolError, LogChunk, NodeConfig, OrderingNode, batches_from_events, make_node
from kdsync.fatal import FatalError
from kdsync.kafka.checkpoint import (Checkpoint, CheckpointWriter, EndOffsets, OffsetsConsumer, checkpoint_topic,
                                     checkpoint_topic_spec, ensure_checkpoint_topic)
from kdsync.kafka.reader import FROM_START, GlobalReader, GlobalStart, PartitionRead, decide_start, load_start
from kdsync.kafka.sink import GlobalWriter, check_global_partitions, ensure_global
from kdsync.kafka.topic import TopicSettingsError, TopicSpec, empty_topics, ensure_topics
from kdsync.observability.logs import kv
from kdsync.observability.stage_latency import ALL_TOPICS, StageClock
from kdsync.state import StateLog

if TYPE_CHECKING:
    from kdsync.config import Config, ProtocolSection
    from kdsync.core import Delivery
    from kdsync.kafka.source import SourceRun
    from kdsync.kafka.checkpoint import CheckpointRounds
    from kdsync.observability.stage_latency import LatencyTrace

__all__ = ["PipelineHost", "Prepared", "ReadHost", "TopicPipeline", "at_most", "close_pipelines", "discover_topics",
           "known", "log_ready", "node_config", "open_pipeline", "prepare_topics", "prime_metadata", "serve_read",
           "start_each", "start_listed", "start_topics"]

log = logging.getLogger("kdsync.member")

AT_ONCE = 4  # topics starting (or taking their last checkpoint) at once: each holds a worker thread while it waits


class Prepared(NamedTuple):
    """What `prepare_topics` found out about a source topic's global topic."""

    partitions: int
    empty: bool  # the global and checkpoint topics never held a record: nothing to read at start


@dataclass
class TopicPipeline:
    """One source topic on its way to its global topic (module doc)."""

    topic: str
    global_topic: str
    node: OrderingNode
    state: StateLog  # the member's, holding this node's hard state (Member.process)
    writer: GlobalWriter | None = None
    reader: GlobalReader | None = None
    checkpoint: CheckpointWriter | None = None
    end_offsets: EndOffsets | None = None
    read_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one read of the global topic at a time
    durable_end: int = 0
    status: str = ""  # the node's, as last logged
    saving: bool = False  # a Ready waits for its hard state to be on disk (Member.process)
    stages: StageClock | None = None  # per-batch stage times (metrics, --trace-latency)
    consumed: int = 0  # source records submitted to the node
    delivered_end: int = 0  # next position the node has not delivered
    # own events per source partition: next offset submitted / next offset the group delivered (kdsync.observability.stalls)
    submitted_next: dict[int, int] = field(default_factory=dict)
    own_next: dict[int, int] = field(default_factory=dict)

    def submit(self, run: SourceRun, now: float) -> None:
        """A run of source records to the node, counted (submitted, own events waiting)."""
        self.stages.submitted(run, now)
        b = run.batch
        self.consumed += b.count
        self.submitted_next[b.partition] = b.first_offset + b.count
        self.own_next.setdefault(b.partition, b.first_offset)  # below its first submission: ordered before
        self.node.submit([b])

    def deliver(self, d: Delivery, me: str, now: float) -> bool:
        """The node delivered `d`: to the writer (True), or durable at once
        on a witness, which has nothing to write (False)."""
        self.delivered_end = d.end_seq
        own = self.own_next
        for b in d.batches:
            if b.origin == me and b.first_offset + b.count > own.get(b.partition, 0):
                own[b.partition] = b.first_offset + b.count
        self.stages.delivered(d, now, writes=self.writer is not None)
        if self.writer is None:  # durable at once (reported after advance)
            self.durable_end = d.end_seq
            return False
        self.writer.write(d)
        self.checkpoint.delivered(d)
        return True

    def durable(self, end: int) -> None:
        """The global topic holds every position below `end`: the node and the checkpoint writer hear it."""
        self.durable_end = end
        self.node.durable(end)
        self.checkpoint.durable(end)

    def own_waiting(self) -> int:
        """Own events submitted that the group has not delivered yet."""
        own = self.own_next
        return sum(max(0, s - own.get(part, s)) for part, s in self.submitted_next.items())

    async def close(self) -> None:
        """Close the global topic's reader and end-offset client (threads: they block)."""
        if self.reader is not None:
            await asyncio.to_thread(self.reader.close)
        if self.end_offsets is not None:
            await asyncio.to_thread(self.end_offsets.close)


def discover_topics(cfg: Config, kafka_conf: dict) -> list[str]:
    """The source topics of `cfg`: its fixed names, or the cluster's topics
    its pattern matches (blocking: run in a thread)."""
    names = cfg.topics.fixed_names()
    if names is not None:
        return names
    from confluent_kafka.admin import AdminClient

    from kdsync.kafka.topic import admin_conf

    md = AdminClient(admin_conf(kafka_conf)).list_topics(timeout=10)
    return sorted(t for t in md.topics if cfg.topics.matches(t))


def node_config(cfg: Config) -> NodeConfig:
    """The ordering node's configuration from the member's."""
    p = cfg.protocol
    return NodeConfig(member_id=cfg.member.id, members=cfg.member_ids(), roles=cfg.roles(), protocol=p.name,
                      heartbeat_ticks=p.ticks(p.heartbeat_ms), suspect_ticks=p.ticks(p.suspect_ms),
                      retransmit_ticks=p.ticks(p.retransmit_ms), max_batch=p.max_batch,
                      log_retention=p.log_retention, catchup_chunk=p.catchup_chunk,
                      clock_lead_us=int((p.clock_lead_ms or 0) * 1000),
                      auto_lead=p.clock_lead_ms is None, commit_quorum=p.commit_quorum,
                      adaptive_suspect=p.adaptive_suspect, crash_fence=p.crash_fence,
                      lift_fence=p.lift_fence)


class ReadHost(Protocol):
    """What `serve_read` uses of the member: its protocol settings, its
    retry with backoff, and the two steps around an input to a node."""

    pcfg: ProtocolSection

    async def retry(self, what: str, fn: Callable[..., Any], *args: Any) -> Any: ...

    def before_input(self, p: TopicPipeline) -> None: ...  # wake the node if it sleeps

    def process(self, p: TopicPipeline) -> None: ...  # drain the node (kdsync.handshake)


class PipelineHost(ReadHost, Protocol):
    """Everything the start-up of a topic (`start_topics`, `open_pipeline`)
    may use of the member: its settings and identity, its Kafka clients, the
    hard-state log, the sets of topics it orders, and callbacks for what a
    pipeline reports.  Nothing else of the member is reachable from here."""

    cfg: Config
    me: str
    shard: int | None  # None: every partition of the global topic; s: partition s alone (docs/shards.md)
    witness: bool  # no Kafka: no global topic, writer, reader or checkpoints
    kafka_conf: dict
    rng: random.Random
    metrics: Any  # kdsync.observability.metrics.MemberMetrics (checkpoint_written; StageClock's histograms)
    trace: LatencyTrace | None
    producer: Any  # the member's producer (replaced in place by kdsync.producer_recovery)
    loop: asyncio.AbstractEventLoop
    offsets_consumer: OffsetsConsumer | None  # the end-offset client every checkpoint writer shares
    checkpoint_rounds: CheckpointRounds
    state_log: StateLog  # the member's hard-state log (kdsync.state)
    pipelines: dict[str, TopicPipeline]
    starting: set[str]
    planned: set[str]  # topics start_topics will start (a peer's message for one waits for it)

    def fatal(self, msg: str) -> None: ...

    def on_durable(self, p: TopicPipeline, end: int, commits: dict[int, int]) -> None: ...

    def producer_failed(self, why: str) -> None: ...  # kdsync.producer_recovery

    async def start_pipeline(self, topic: str, prepared: Prepared | None = None) -> None: ...


CHECKPOINTS_PER_S = 20  # a member's checkpoint writes at most, over all its topics (one broker append each)


def ordered_topics(m: PipelineHost) -> int:
    """The distinct topics a member orders: open, starting or planned (the
    sets overlap while topics start)."""
    return len(m.pipelines.keys() | m.starting | m.planned)


def known(m: PipelineHost, topic: str) -> bool:
    """`topic` has a pipeline at `m`, or one starting or about to start."""
    return topic in m.pipelines or topic in m.starting or topic in m.planned


def start_listed(m: PipelineHost, names: list[str]) -> None:
    """The source's metadata listed `names` (a member whose source topics
    come from a pattern): start the matching topics `m` does not know yet."""
    new = sorted(t for t in names if m.cfg.topics.matches(t) and not known(m, t))
    if new:
        m.planned.update(new)  # known at once: the next listing does not start them twice
        asyncio.ensure_future(start_topics(m, new))


def checkpoint_interval(m: PipelineHost) -> float:
    """Seconds between a topic's checkpoints: `[checkpoint] interval_ms`, or
    longer past CHECKPOINTS_PER_S x interval topics (1 000 topics: every
    50 s; `positions` still bounds what a restart reads).  At 1 000 topics
    that each changed, a checkpoint per topic every 10 s was 100 broker
    appends a second, more than the data (each also measured its ends with
    two broker requests); the brokers' load is not explained by it alone
    (docs/design/many-topics.md)."""
    return max(m.cfg.checkpoint.interval_ms / 1000.0, ordered_topics(m) / CHECKPOINTS_PER_S)


def histogram_label(m: PipelineHost, topic: str) -> str:
    """The topic label of `topic`'s histograms: itself while the member orders
    at most `[metrics] topic_histograms` topics (those open, starting or
    planned: at start-up, all it found), else ALL_TOPICS."""
    return topic if ordered_topics(m) <= m.cfg.metrics.topic_histograms else ALL_TOPICS


async def start_topics(m: PipelineHost, topics: list[str]) -> None:
    """Start the pipelines of `topics` (source topics of a member with
    Kafka): their global and checkpoint topics made and measured in one
    batch (`prepare_topics`), then `start_each`.  Until each has started, a
    peer's message for one of them waits for it (`m.planned`) instead of
    starting it alone."""
    if topics:
        m.planned.update(topics)
        try:
            prepared = await m.retry(f"creating the global and checkpoint topics of {len(topics)} source topics",
                                     prepare_topics, m.cfg, m.kafka_conf, topics)
            if m.producer is not None:
                await asyncio.to_thread(prime_metadata, m.producer)
            await start_each(topics, m.start_pipeline, prepared)
        finally:
            m.planned.difference_update(topics)


async def start_each(topics: list[str], start: Callable[[str, Prepared | None], Awaitable[None]],
                     prepared: dict[str, Prepared] | None = None) -> None:
    """`start(topic, prepared)` every topic of `topics`, AT_ONCE at a time:
    a start waits on its cluster (the checkpoint and the global topic's
    tail), not on this process, so a thousand topics start in seconds rather
    than one by one.  The first failure cancels the others and is raised as
    it is (a FatalError stops the member)."""
    await at_most(AT_ONCE, [start(t, None if prepared is None else prepared[t]) for t in topics])


async def at_most(n: int, aws: list[Awaitable]) -> None:
    """Await every one of `aws`, `n` at a time; the first failure cancels the
    rest and is raised as it is."""
    gate = asyncio.Semaphore(n)

    async def one(aw: Awaitable) -> None:
        async with gate:
            await aw

    tasks = [asyncio.ensure_future(one(aw)) for aw in aws]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_pipelines(pipelines: list[TopicPipeline], offsets: OffsetsConsumer | None, final: bool) -> None:
    """Stop the checkpoint writers of `pipelines`; with `final` (a clean stop
    with every delivery report in), take their last checkpoints first, AT_ONCE
    at a time, so the next start reads nothing of the global topics; close
    their clients and the member's shared end-offset consumer `offsets`."""
    for p in pipelines:
        if p.checkpoint is not None:
            p.checkpoint.stop()
    if final:
        await at_most(AT_ONCE, [p.checkpoint.final() for p in pipelines if p.checkpoint is not None])
    await at_most(AT_ONCE, [p.close() for p in pipelines])
    if offsets is not None:
        await asyncio.to_thread(offsets.close)


def prime_metadata(producer) -> None:
    """Fill `producer`'s metadata cache with every topic of its cluster in
    one request.  Without it librdkafka asks a Metadata request of the
    broker at the first write into each topic: a member of 1 000 source
    topics writes into 2 000 (global and checkpoint), and those requests
    (995 for a first write into each of 1 000 topics, 2 with the cache
    primed: a probe on Tansu) cost the broker more than the writes.  Only
    an optimisation: a failure is logged and the lookups happen as before."""
    try:
        producer.list_topics(timeout=10.0)
    except Exception as e:  # noqa: BLE001 - the writes look their topics up themselves
        log.info("producer metadata not primed", **kv(error=str(e)))


def prepare_topics(cfg: Config, kafka_conf: dict, topics: list[str]) -> dict[str, Prepared]:
    """Create the global and checkpoint topics of every source topic in
    `topics` that lacks them, in one batch (kdsync.kafka.topic.ensure_topics),
    and find those that never held a record (`empty_topics`, one request):
    `open_pipeline` reads nothing of those.  Returns each source topic's
    `Prepared`.  Blocking: run in a thread.  Raises FatalError as
    ensure_global does."""
    tc = cfg.topics
    globals_ = {t: tc.global_topic(t) for t in topics}
    want = tc.partition_count()
    specs = [TopicSpec(gt, want, tc.replication_factor, tc.global_topic_config()) for gt in globals_.values()]
    specs += [checkpoint_topic_spec(gt, tc.replication_factor, tc.min_insync_replicas) for gt in globals_.values()]
    try:
        have = ensure_topics(kafka_conf, specs, timeout=10.0)
    except TopicSettingsError as e:  # the cluster refuses [topics] settings: no retry can fix that
        raise FatalError(f"topics: {e}") from None
    parts = {t: check_global_partitions(gt, have[gt], want, tc.shards) for t, gt in globals_.items()}
    measure = {gt: have[gt] for gt in globals_.values()}
    measure.update({checkpoint_topic(gt): have[checkpoint_topic(gt)] for gt in globals_.values()})
    empty = empty_topics(kafka_conf, measure, timeout=10.0)
    return {t: Prepared(parts[t], gt in empty and checkpoint_topic(gt) in empty) for t, gt in globals_.items()}


def empty_start(global_topic: str, partitions: int, shard: int | None) -> GlobalStart:
    """What `load_start` finds in a global topic and checkpoint topic that
    never held a record, without reading them."""
    ids = [shard] if shard is not None else list(range(partitions))
    return decide_start(global_topic, [PartitionRead(p, 0, 0, how=FROM_START) for p in ids], None, [])


async def open_pipeline(m: PipelineHost, topic: str, prepared: Prepared | None = None,
                        ) -> tuple[TopicPipeline, GlobalStart | None, HardState | None]:
    """The pipeline of `topic` for member `m`, started from its global topic
    (none read on a witness), with the start state read and the hard state
    loaded.  `prepared`: its global and checkpoint topics already made and
    measured by `prepare_topics`; None: made and read here."""
    gt = m.cfg.topics.global_topic(topic) if m.cfg.topics else topic + "-global"
    start_seq, watermarks, parts, present, start = 0, {}, 1, set(), None
    if not m.witness:
        tc = m.cfg.topics
        if prepared is not None:
            parts = prepared.partitions
        else:
            parts = await m.retry(f"creating {gt}", ensure_global, m.kafka_conf, gt, tc.partition_count(),
                                  tc.replication_factor, tc.global_topic_config(), tc.shards)
            await m.retry(f"creating {checkpoint_topic(gt)}", ensure_checkpoint_topic, m.kafka_conf, gt,
                          tc.replication_factor, tc.min_insync_replicas)
        if m.shard is not None:
            parts = 1  # this shard's partition of gt alone
        if prepared is not None and prepared.empty:
            start = empty_start(gt, parts, m.shard)
        else:
            start = await m.retry(f"reading {gt} from its checkpoint", load_start, m.kafka_conf, gt, parts, 60.0,
                                  m.shard)
        start_seq, watermarks, present = start.end, start.watermarks, start.present
        if start.lost is not None:
            log.warning("positions were deleted from the global topic (retention) before a checkpoint "
                        "covered them; resuming after them, with the checkpoint's watermarks for origin "
                        "partitions seen only there", **kv(topic=topic, global_topic=gt,
                                                           lost=f"{start.lost[0]}..{start.lost[1] - 1}",
                                                           start_seq=start_seq))
    state = m.state_log
    hs = state.get(topic)
    try:
        node = make_node(node_config(m.cfg), rng=random.Random(m.rng.getrandbits(64)), start_seq=start_seq,
                         watermarks=watermarks, hard_state=hs)
    except LocalProtocolError as e:
        raise FatalError(f"protocol: {e}") from None
    p = TopicPipeline(topic, gt, node, state, durable_end=start_seq, delivered_end=start_seq,
                      own_next={part: off + 1 for (origin, part), off in watermarks.items() if origin == m.me})
    p.stages = StageClock(topic, m.me, m.metrics, m.trace, label=histogram_label(m, topic))
    if not m.witness:
        ids = [m.shard] if m.shard is not None else list(range(parts))
        p.writer = GlobalWriter(
            m.producer, gt, parts, start_seq, origin=m.me, present=present,
            on_durable=lambda end, commits: m.on_durable(p, end, commits),
            on_done=p.stages.written, on_fatal=m.fatal, schedule=m.loop.call_soon, shard=m.shard,
            start_offsets=dict(zip(ids, start.ends)), on_failed=m.producer_failed)
        p.reader = GlobalReader(m.kafka_conf, f"kdsync-{m.me}-reader", gt, parts, start.seq_base, shard=m.shard)
        _start_checkpoints(m, p, start, parts)
    if present:
        log.warning("global topic has positions beyond a gap; they will not be written twice",
                    **kv(topic=topic, gap_at=start_seq, beyond=len(present)))
    return p, start, hs


def log_ready(p: TopicPipeline, start: GlobalStart | None, hs: HardState | None) -> None:
    """The "topic ready" line of a pipeline the member registered."""
    log.info("topic ready", **kv(topic=p.topic, global_topic=p.global_topic, start_seq=p.durable_end,
                                 origins=len(start.watermarks) if start is not None else 0, hard_state=hs is not None,
                                 **({} if start is None else {
                                     "checkpoint": start.checkpoint.seq if start.checkpoint else "none",
                                     "records_read": start.records})))


def _start_checkpoints(m: PipelineHost, p: TopicPipeline, start: GlobalStart, parts: int) -> None:
    """The checkpoint writer of `p` (kdsync.kafka.checkpoint), and a first
    checkpoint of the start state unless the topic already holds positions
    beyond a gap."""
    cc = m.cfg.checkpoint
    p.end_offsets = EndOffsets(m.kafka_conf, p.global_topic, parts, shard=m.shard, shared=m.offsets_consumer)
    p.checkpoint = CheckpointWriter(
        m.producer, p.global_topic, parts, m.me, start_seq=start.end, watermarks=start.watermarks,
        min_seq=max(start.present) + 1 if start.present else start.end, last=start.checkpoint,
        measure=p.end_offsets, interval_s=checkpoint_interval(m), positions=cc.positions, shard=m.shard,
        on_written=lambda cp, topic=p.topic: m.metrics.checkpoint_written(topic, cp.seq, cp.written_ms))
    cp = start.checkpoint
    if not start.present:
        p.checkpoint.known_exact(start.end, start.ends)
        # a topic that never held a record needs none (its restart finds it empty
        # again): a thousand new topics would otherwise write a thousand at start
        nothing = start.end == 0 and not start.watermarks and not any(start.ends)
        if (cp is None and not nothing) or (cp is not None and (cp.seq != start.end or cp.offsets != start.ends)):
            p.checkpoint.write_now(Checkpoint(p.global_topic, start.end, start.ends, start.watermarks, m.me,
                                              shard=m.shard))
    m.checkpoint_rounds.add(p.checkpoint)


async def serve_read(m: ReadHost, p: TopicPipeline, start: int, stop: int) -> None:
    """Answer the node's read of positions [start, stop) it no longer holds
    from the global topic (a worker thread), in chunks of `catchup_chunk`."""
    if p.reader is None:
        log.warning("a witness cannot serve reads of a global topic", **kv(topic=p.topic, start=start, stop=stop))
        return
    chunk = m.pcfg.catchup_chunk
    async with p.read_lock:  # one reader consumer per pipeline, one read at a time
        try:
            events = await m.retry(f"reading {p.global_topic}[{start}:{stop})", p.reader.read, start, stop)
        except asyncio.CancelledError:
            return
    log.info("served a read from the global topic", **kv(topic=p.topic, start=start, stop=stop, events=len(events)))
    for i in range(0, len(events), chunk):
        m.before_input(p)
        p.node.step(LogChunk(start + i, tuple(batches_from_events(events[i:i + chunk]))))
        m.process(p)
