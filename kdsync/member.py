"""`kdsync run`: one production member — source topic(s) in, agreed order out.

Theory of operation
-------------------
One asyncio loop drives one ordering node (kdsync.core) per source topic,
exactly as kdsync/core documents: peer messages, source events and the clock
(`tick()` every `protocol.tick_ms`, measured on the loop's clock; while every
node is quiet the timer wakes for a pair of ticks every other period, and any
input runs the ticks due first) go in; after
every input batch the runtime drains `ready()` and does the I/O in the order
Ready prescribes:

1. `hard_state` is written to `state_dir/<topic>.hardstate` atomically
   (kdsync.state) before any message is sent;
2. messages go to the transport (one channel per source topic on one
   connection per peer: ``len(topic) topic data``);
3. deliveries are produced, in order, to this cluster's global topic
   (kdsync.kafka.sink).  When delivery reports confirm a contiguous prefix the
   node hears `durable(end)`, and only then are the source offsets of this
   member's own events in that prefix committed (enable.auto.commit=false).
   A delivery error is fatal: the member stops with one line and exit 1, and
   its restart recovers from the global topic (nothing is silently lost);
4. reads (positions the node no longer holds in memory) are answered from the
   global topic, in a worker thread (kdsync.kafka.reader).

Kafka's blocking calls stay off the loop: one thread consumes the source
topics (kdsync.kafka.source) and hands them to the loop as runs of one
partition; when too many own events are waiting to become durable, it pauses
(back-pressure).  The records' schema is kdsync.kafka.records.

Start-up: for every source topic the global topic (and its checkpoint topic)
is created if missing; the latest checkpoint is read and the global topic
from there to its end (kdsync.kafka.reader.load_start: partition EOF, never
ListOffsets alone), which gives `start_seq` and the origin watermarks; both
go to `make_node`, together with the persisted hard state.  The consumer
starts at max(committed offset, own watermark + 1).  A broker that is down at
start is retried with backoff.  From then on a checkpoint is written every
`[checkpoint] interval_ms` / `positions` (kdsync.kafka.checkpoint), so the
next start reads only what came after it.  A witness has no Kafka: its
deliveries are durable at once.

SIGINT/SIGTERM: stop consuming, wait for outstanding delivery reports, commit,
close, exit 0.

Shards (`[topics] shards = K > 1`): a Member is the member of one shard s
(kdsync.workers runs them): its config is `Config.for_shard(s)`, it consumes
the source partitions p with p mod K = s and writes, reads and checkpoints
partition s of each global topic alone (docs/shards.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from kdsync.config import Config, parse_address
from kdsync.core import (
    Delivery,
    LocalProtocolError,
    LogChunk,
    NodeConfig,
    OrderingNode,
    RemoteProtocolError,
    batches_from_events,
    make_node,
)
from kdsync.errors import FatalError
from kdsync.health import StallDetector
from kdsync.kafka.checkpoint import Checkpoint, CheckpointWriter, EndOffsets, checkpoint_topic, ensure_checkpoint_topic
from kdsync.kafka.reader import GlobalReader, load_start
from kdsync.kafka.sink import GlobalWriter, ensure_global, make_producer, producer_conf, read_present
from kdsync.kafka.source import SourceConsumer, SourceRun, consumer_conf
from kdsync.logs import KafkaClientLog, client_callback, kv
from kdsync.profiling import profiler
from kdsync.stages import LatencyTrace, StageClock, shard_trace_path
from kdsync.state import HardStateFile
from kdsync.transport.channels import frame_channel, split_channel

log = logging.getLogger("kdsync.member")

EARLY_MESSAGES = 10_000  # peer messages kept per topic while its pipeline starts
MAX_RECOVERIES, RECOVERY_WINDOW_S = 5, 60.0  # more producer recoveries than this within the window: fatal
DRAIN_S = 30.0  # a failed producer's in-flight requests are waited for this long before its tail is read
REPORT_POLL_S = 0.004  # while records await their delivery reports, the producer is polled this often


# ---------------------------------------------------------------- per topic
@dataclass
class TopicPipeline:
    """One source topic on its way to its global topic: its ordering node, the
    node's hard-state file, the writer and the reader of the global topic
    (None on a witness, which has no Kafka)."""

    topic: str
    global_topic: str
    node: OrderingNode
    state: HardStateFile
    writer: GlobalWriter | None = None
    reader: GlobalReader | None = None
    checkpoint: CheckpointWriter | None = None
    checkpoint_task: asyncio.Future | None = None
    end_offsets: EndOffsets | None = None
    read_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one read of the global topic at a time
    durable_end: int = 0
    status: str = ""  # the node's, as last logged
    process_scheduled: bool = False  # a ready() drain is queued on the loop
    stages: StageClock | None = None  # per-batch stage times (metrics, --trace-latency)
    consumed: int = 0  # source records submitted to the node
    delivered_end: int = 0  # next position the node has not delivered
    # own events per source partition: next offset submitted / next offset the group delivered (kdsync.health)
    submitted_next: dict[int, int] = field(default_factory=dict)
    own_next: dict[int, int] = field(default_factory=dict)

    def own_waiting(self) -> int:
        """Own events submitted that the group has not delivered yet."""
        own = self.own_next
        return sum(max(0, s - own.get(part, s)) for part, s in self.submitted_next.items())


class Member:
    """One kdsync member: drives a TopicPipeline per source topic from one
    asyncio loop (see the module docstring).  `run()` returns the exit code."""

    def __init__(self, cfg: Config, *, consume_batch: int = 1000, trace_latency: str | None = None,
                 shard: int | None = None, signals: bool = True):
        self.cfg = cfg
        self.trace_path = trace_latency
        self.trace: LatencyTrace | None = None
        self.shard = shard  # None: the one ordering group of each topic; s: shard s of K (module doc)
        self.shards = cfg.shards()
        self.signals = signals  # False: the caller stops it (stop()), e.g. a worker running several shards
        self.me = cfg.member.id
        self.witness = cfg.member.role == "witness"
        self.pcfg = cfg.protocol
        # librdkafka's own lines in the member's log format, rate-limited (every client of the member)
        self.kafka_log = KafkaClientLog(cfg.log.kafka_interval_ms / 1000.0)
        self.kafka_conf = consumer_conf(self.me, {**cfg.kafka.consumer_conf(), "logger": self.kafka_log})
        self.pipelines: dict[str, TopicPipeline] = {}
        self.starting: set[str] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transport = None
        self.producer = None
        self.source: SourceConsumer | None = None
        self.metrics = None
        self.consume_batch = consume_batch
        self._stop = asyncio.Event()
        self._fatal: str | None = None
        self._bad_logged = 0.0
        self._stopping = False
        self._kafka_err_logged: dict = {}
        self._early: dict[str, deque] = {}  # topic -> (peer, message) received before its pipeline was ready
        self.rng = random.Random()
        self._report_poll: asyncio.TimerHandle | None = None
        self._recovering = False  # the producer is being re-created (_recover_producer)
        self._recoveries: list[float] = []  # when recent recoveries began
        self._tick_timer: asyncio.TimerHandle | None = None
        self._ticks_late = False  # the timer skips a period: every node was quiet
        self._tick_period = self._next_tick = self._last_refresh = self._last_health = 0.0
        self.health = StallDetector(cfg.health.stall_after_ms / 1000.0)

    # ------------------------------------------------------------ helpers
    def _node_config(self) -> NodeConfig:
        p = self.pcfg
        return NodeConfig(member_id=self.me, members=self.cfg.member_ids(), roles=self.cfg.roles(), protocol=p.name,
                          heartbeat_ticks=p.ticks(p.heartbeat_ms), suspect_ticks=p.ticks(p.suspect_ms),
                          retransmit_ticks=p.ticks(p.retransmit_ms), max_batch=p.max_batch,
                          log_retention=p.log_retention, catchup_chunk=p.catchup_chunk)

    def _stats_for_metrics(self) -> dict[str, dict]:
        return {t: dict(p.node.stats) for t, p in list(self.pipelines.items())}

    def _peer_stats(self) -> dict:
        return dict(self.transport.stats) if self.transport is not None else {}

    # ------------------------------------------------------------ start
    async def run(self) -> int:
        """Run until SIGINT/SIGTERM or a fatal error; return 0 or 1."""
        prof = profiler(f"{self.me}-loop")
        try:
            return await self._run()
        finally:
            if prof is not None:
                prof()

    async def _run(self) -> int:
        self.loop = asyncio.get_running_loop()
        if self.signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.loop.add_signal_handler(sig, self._on_signal, sig)
        from kdsync.metrics import MemberMetrics
        from kdsync.transport import TLSSettings, TransportError, make_transport

        self.metrics = MemberMetrics(self._peer_stats, self._stats_for_metrics)
        if self.trace_path:
            path = shard_trace_path(self.trace_path, self.shard)
            try:
                self.trace = LatencyTrace(path, self.shard)
            except OSError as e:
                raise FatalError(f"--trace-latency: cannot write {path}: {e.strerror}") from None
        if self.cfg.metrics.listen:
            host, port = parse_address(self.cfg.metrics.listen)
            try:
                self.metrics.serve(host, port)
            except OSError as e:
                raise FatalError(f"metrics.listen: cannot listen on {self.cfg.metrics.listen}: {e.strerror}") from None
        tls = self.cfg.resolved_tls()
        try:
            self.transport = make_transport(
                self.cfg.transport.kind, self.me, parse_address(self.cfg.member.listen), self.cfg.peer_addresses(),
                self._on_peer_message, secret=self.cfg.secret_bytes(),
                tls=TLSSettings(tls.certfile, tls.keyfile, tls.cafile) if tls else None,
                max_frame_bytes=self.cfg.transport.max_frame_bytes, logger=logging.getLogger("kdsync.transport"))
            await self.transport.start()
        except TransportError as e:
            raise FatalError(str(e)) from None
        log.info("member started", **kv(**({} if self.shard is None else {"shard": self.shard}),
                                         role=self.cfg.member.role, protocol=self.pcfg.name,
                                         listen=self.cfg.member.listen, peers=",".join(self.cfg.member_ids())))
        try:
            if not self.witness:
                await self._start_kafka()
            elif self.cfg.topics is not None and self.cfg.topics.fixed_names():
                for t in self.cfg.topics.fixed_names():
                    await self._start_pipeline(t)
            self._start_ticks()
            try:
                await self._stop.wait()
            finally:
                self._stop_ticks()
        except asyncio.CancelledError:
            if not self._stop.is_set():
                raise
            # stopped while still starting (e.g. waiting for a broker): a clean stop
        except FatalError as e:
            self._fatal = self._fatal or str(e)
        finally:
            await self._shutdown()
        if self._fatal:
            print(f"kdsync run: {self._fatal}", file=sys.stderr)
            return 1
        return 0

    def _on_signal(self, sig) -> None:
        log.info("stopping", **kv(signal=signal.Signals(sig).name))
        self._stop.set()

    def stop(self) -> None:
        """Stop cleanly (as SIGTERM does); call on the member's loop."""
        self._stop.set()

    def fatal(self, msg: str) -> None:
        """Stop the member with `msg` as its one line (the first one wins)."""
        if self._fatal is None:
            self._fatal = msg
            log.error(msg, **kv(fatal=True))
        self._stop.set()

    async def _retry(self, what: str, fn, *args):
        """Run blocking `fn` in a thread until it succeeds, with backoff."""
        delay = 0.2
        while not self._stop.is_set():
            try:
                return await asyncio.to_thread(fn, *args)
            except FatalError:
                raise
            except Exception as e:  # broker down / not ready: log and retry
                log.warning(f"{what} failed, retrying", **kv(error=str(e).splitlines()[0] if str(e) else repr(e),
                                                             retry_in=f"{delay:.1f}s"))
                if self.producer is not None:
                    self.producer.poll(0)  # its client's log lines (the tick loop serves them once running)
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, 2.0)
        raise asyncio.CancelledError

    def _on_kafka_error(self, err) -> None:
        # called from producer.poll() (loop thread) or the consumer thread
        if err.fatal():
            msg = f"kafka: {err.str()}"
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.fatal, msg)
            return
        now = time.monotonic()
        if now - self._kafka_err_logged.get(err.code(), -1e9) > 5.0:  # broker down: one line per 5 s
            self._kafka_err_logged[err.code()] = now
            log.warning("kafka client error (retrying)", **kv(error=err.str()))

    def _producer_conf(self) -> dict:
        return {**producer_conf(self.cfg.kafka.producer_conf()),
                "error_cb": client_callback(self._on_producer_error, "producer error_cb"),
                "logger": self.kafka_log}

    def _on_producer_error(self, err) -> None:
        # called from producer.poll(), on the loop's thread
        if err.fatal():
            self._producer_failed(f"kafka producer: {err.str()}")
        else:
            self._on_kafka_error(err)

    def _producer_failed(self, why: str) -> None:
        """The producer failed (a fatal error, or a delivery error): recover
        it in place (kdsync.kafka.sink module doc) unless recoveries repeat."""
        if self._recovering or self._stopping:
            return
        now = time.monotonic()
        self._recoveries = [t for t in self._recoveries if now - t < RECOVERY_WINDOW_S] + [now]
        if len(self._recoveries) > MAX_RECOVERIES:
            self.fatal(f"{why} ({len(self._recoveries)} producer recoveries within {RECOVERY_WINDOW_S:.0f} s; "
                       f"restart the member once the cluster accepts writes; it resumes from the global topic)")
            return
        self._recovering = True
        for p in self.pipelines.values():
            if p.writer is not None:
                p.writer.suspend()
        asyncio.ensure_future(self._recover_producer(why))

    async def _recover_producer(self, why: str) -> None:
        log.warning("producer failed; re-creating it and resuming from the global topics' tails",
                    **kv(error=why))
        self.metrics.producer_recoveries.inc()
        old = self.producer
        try:
            with contextlib.suppress(Exception):
                old.purge(in_queue=True, in_flight=False)  # what was sent may still land: wait for it below
            deadline = time.monotonic() + DRAIN_S
            while len(old) > 0 and time.monotonic() < deadline and not self._stop.is_set():
                old.poll(0)  # its reports are ignored (suspended writers); they tell the requests are over
                await asyncio.sleep(0.05)
            if len(old):
                log.warning("the failed producer still has requests in flight; going on", **kv(messages=len(old)))
            self.producer = make_producer(self._producer_conf())
            for p in list(self.pipelines.values()):
                if p.writer is None:
                    continue
                w = p.writer
                present = await self._retry(f"reading the tail of {p.global_topic}", read_present, self.kafka_conf,
                                            p.global_topic, dict(w.floors), w.durable_end)
                w.resume(self.producer, present)
                if p.checkpoint is not None:
                    p.checkpoint.producer = self.producer
                log.info("writer resumed", **kv(topic=p.topic, durable_end=w.durable_end, present=len(present),
                                                produced_end=w.produced_end))
        except asyncio.CancelledError:
            return
        except Exception as e:  # noqa: BLE001 - recovery failed: stop with one line, the restart recovers
            self.fatal(f"{why}; recovering the producer failed: {e}")
            return
        finally:
            self._recovering = False
        if self._report_poll is None:
            self._report_poll = self.loop.call_later(REPORT_POLL_S, self._poll_reports)

    async def _start_kafka(self) -> None:
        self.producer = make_producer(self._producer_conf())
        self.source = SourceConsumer(
            {**self.kafka_conf, "error_cb": client_callback(self._on_kafka_error, "source error_cb")}, self.me, self.loop,
            on_runs=self._on_source_runs, on_fatal=self.fatal, batch=self.consume_batch,
            on_lag=lambda t, p, lag: self.metrics.input_lag.labels(t, str(p)).set(lag),
            on_commit=lambda t, delay: self.metrics.stage.labels(t, "committed").observe(delay),
            on_restart=self.metrics.source_restarted,
            shard=None if self.shard is None else (self.shard, self.shards))
        self.metrics.source_fetch_wait.set(self.source.conf.get("fetch.wait.max.ms", 500))
        topics = await self._retry("listing source topics", self._discover_topics)
        if not topics:
            log.warning("no source topic matches yet; waiting for one", **kv(source=str(self.cfg.topics.source)))
        for t in topics:
            await self._start_pipeline(t)
        self.source.start()

    def _discover_topics(self) -> list[str]:
        names = self.cfg.topics.fixed_names()
        if names is not None:
            return names
        from confluent_kafka.admin import AdminClient

        from kdsync.kafka.topic import admin_conf

        md = AdminClient(admin_conf(self.kafka_conf)).list_topics(timeout=10)
        return sorted(t for t in md.topics if self.cfg.topics.matches(t))

    async def _start_pipeline(self, topic: str) -> None:
        if topic in self.pipelines or topic in self.starting:
            return
        self.starting.add(topic)
        try:
            gt = self.cfg.topics.global_topic(topic) if self.cfg.topics else topic + "-global"
            start_seq, watermarks, parts, present, start = 0, {}, 1, set(), None
            if not self.witness:
                tc = self.cfg.topics
                parts = await self._retry(f"creating {gt}", ensure_global, self.kafka_conf, gt, tc.partition_count(),
                                          tc.replication_factor, tc.global_topic_config(), tc.shards)
                if self.shard is not None:
                    parts = 1  # this shard's partition of gt alone
                await self._retry(f"creating {checkpoint_topic(gt)}", ensure_checkpoint_topic, self.kafka_conf, gt,
                                  tc.replication_factor, tc.min_insync_replicas)
                start = await self._retry(f"reading {gt} from its checkpoint", load_start, self.kafka_conf, gt, parts,
                                          60.0, self.shard)
                start_seq, watermarks, present = start.end, start.watermarks, start.present
                if start.lost is not None:
                    log.warning("positions were deleted from the global topic (retention) before a checkpoint "
                                "covered them; resuming after them, with the checkpoint's watermarks for origin "
                                "partitions seen only there", **kv(topic=topic, global_topic=gt,
                                                                   lost=f"{start.lost[0]}..{start.lost[1] - 1}",
                                                                   start_seq=start_seq))
            state = HardStateFile(self.cfg.state_path() / f"{topic}.hardstate")
            hs = state.load()
            try:
                node = make_node(self._node_config(), rng=random.Random(self.rng.getrandbits(64)), start_seq=start_seq,
                                 watermarks=watermarks, hard_state=hs)
            except LocalProtocolError as e:
                raise FatalError(f"protocol: {e}") from None
            p = TopicPipeline(topic, gt, node, state, durable_end=start_seq, delivered_end=start_seq,
                              own_next={part: off + 1 for (origin, part), off in watermarks.items() if origin == self.me})
            p.stages = StageClock(topic, self.me, self.metrics, self.trace)
            if not self.witness:
                ids = [self.shard] if self.shard is not None else list(range(parts))
                p.writer = GlobalWriter(
                    self.producer, gt, parts, start_seq, origin=self.me, present=present,
                    on_durable=lambda end, commits: self._on_durable(p, end, commits),
                    on_done=p.stages.written, on_fatal=self.fatal, schedule=self.loop.call_soon, shard=self.shard,
                    start_offsets=dict(zip(ids, start.ends)), on_failed=self._producer_failed)
                p.reader = GlobalReader(self.kafka_conf, f"kdsync-{self.me}-reader", gt, parts, start.seq_base,
                                        shard=self.shard)
                self._start_checkpoints(p, start, parts)
            if present:
                log.warning("global topic has positions beyond a gap; they will not be written twice",
                            **kv(topic=topic, gap_at=start_seq, beyond=len(present)))
            self.pipelines[topic] = p
            if self.source is not None:
                self.source.add_topic(topic, {part: off + 1 for (origin, part), off in watermarks.items()
                                              if origin == self.me})
            self.metrics.delivered.labels(topic).set(start_seq)
            self._note_status(p, node.status)
            for peer, body in self._early.pop(topic, ()):
                try:
                    node.receive(peer, body)
                except RemoteProtocolError:
                    self.metrics.bad_messages.labels(peer).inc()
            log.info("topic ready", **kv(topic=topic, global_topic=gt, start_seq=start_seq,
                                         origins=len(watermarks), hard_state=hs is not None,
                                         **({} if start is None else {
                                             "checkpoint": start.checkpoint.seq if start.checkpoint else "none",
                                             "records_read": start.records})))
            self._process(p)
        finally:
            self.starting.discard(topic)

    def _start_checkpoints(self, p: TopicPipeline, start, parts: int) -> None:
        """The checkpoint writer of `p` (kdsync.kafka.checkpoint), and a first
        checkpoint of the start state unless the topic already holds positions
        beyond a gap."""
        cc = self.cfg.checkpoint
        p.end_offsets = EndOffsets(self.kafka_conf, p.global_topic, parts, shard=self.shard)
        p.checkpoint = CheckpointWriter(
            self.producer, p.global_topic, parts, self.me, start_seq=start.end, watermarks=start.watermarks,
            min_seq=max(start.present) + 1 if start.present else start.end, last=start.checkpoint,
            measure=p.end_offsets, interval_s=cc.interval_ms / 1000.0, positions=cc.positions, shard=self.shard,
            on_written=lambda cp, topic=p.topic: self.metrics.checkpoint_written(topic, cp.seq, cp.written_ms))
        cp = start.checkpoint
        if not start.present and (cp is None or cp.seq != start.end or cp.offsets != start.ends):
            p.checkpoint.write_now(Checkpoint(p.global_topic, start.end, start.ends, start.watermarks, self.me,
                                              shard=self.shard))
        p.checkpoint_task = asyncio.ensure_future(p.checkpoint.run())

    # ------------------------------------------------------------ driving the node
    def _start_ticks(self) -> None:
        self._tick_period = self.pcfg.tick_ms / 1000.0
        self._next_tick = self.loop.time() + self._tick_period
        self._last_refresh = self.loop.time()
        self._arm_tick()

    def _stop_ticks(self) -> None:
        self._ticks_late = False
        if self._tick_timer is not None:
            self._tick_timer.cancel()
            self._tick_timer = None

    def _arm_tick(self) -> None:
        """The timer of the next tick: at its time, or one period later while
        every node is quiet (core NodeBase.quiet): an idle member then wakes
        for a pair of ticks every other period.  Any input runs the ticks due
        first (_due_ticks), and one that makes a node busy again re-arms the
        timer on time (_process)."""
        nodes = self.pipelines.values()
        late = bool(nodes) and all(p.node.quiet() for p in nodes)
        self._ticks_late = late
        when = self._next_tick + self._tick_period if late else self._next_tick
        self._tick_timer = self.loop.call_at(when, self._on_tick_timer)

    def _on_tick_timer(self) -> None:
        self._tick_timer = None
        if self._stopping:
            return
        try:
            self._run_ticks(at_least=1)
        except Exception as e:  # a core bug: stop loudly rather than run without a clock
            log.exception("tick failed")
            self.fatal(f"tick: {e}")
            return
        self._arm_tick()

    def _due_ticks(self) -> None:
        """Input is about to reach a node while its ticks run late: run the
        ticks already due, so the node counts time exactly at every input."""
        if self.loop.time() >= self._next_tick:
            self._run_ticks(at_least=0)

    def _run_ticks(self, at_least: int) -> None:
        period = self._tick_period
        now = self.loop.time()
        n = 0
        while self._next_tick <= now and n < 5:  # a stalled loop catches up a few ticks, not hundreds
            self._next_tick += period
            n += 1
        if self._next_tick <= now:
            self._next_tick = now + period
        n = max(n, at_least)
        if not n:
            return
        for p in list(self.pipelines.values()):
            for _ in range(n):
                p.node.tick()
            self._process(p)
        if self.producer is not None:
            self.producer.poll(0)
        if now - self._last_health >= 1.0:
            self._check_health(now)
        if now - self._last_refresh > 5.0 and not self.witness and self.cfg.topics.fixed_names() is None:
            self._last_refresh = now
            asyncio.ensure_future(self._refresh_topics())

    def _check_health(self, now: float) -> None:
        """Sample every stage of every pipeline once a second (kdsync.health)."""
        self._last_health = now
        src = self.source
        held_back = src is None or src.held_back
        for p in list(self.pipelines.values()):
            w = p.writer
            samples = [("ordering", p.own_waiting(), p.delivered_end)]
            if src is not None:
                samples.append(("fetch", 0 if held_back else src.unfetched(p.topic), p.consumed))
            if w is not None:
                samples += [("produce", w.unproduced, w.produced_end), ("delivery report", w.outstanding, w.durable_end)]
            for stage, held, progress in samples:
                t = self.health.sample(now, p.topic, stage, held, progress)
                if t is None:
                    continue
                self.metrics.stalled.labels(t.topic, t.stage).set(1 if t.stalled else 0)
                if t.stalled:
                    log.warning("stalled: records wait in a stage that does not move", **kv(
                        topic=t.topic, stage=t.stage, held=t.held, for_s=round(t.for_s, 1)))
                else:
                    log.info("stall over", **kv(topic=t.topic, stage=t.stage, stalled_s=round(t.for_s, 1)))

    async def _refresh_topics(self) -> None:
        try:
            topics = await asyncio.to_thread(self._discover_topics)
        except Exception as e:
            log.warning("topic discovery failed", **kv(error=str(e)))
            return
        for t in topics:
            if t not in self.pipelines:
                await self._start_pipeline(t)

    def _on_peer_message(self, peer: str, data: bytes) -> None:
        try:
            topic, body = split_channel(data)
            p = self.pipelines.get(topic)
            if p is None:
                if not self._topic_allowed(topic):
                    return
                # kept until the pipeline is ready (bounded; beyond that the peer retransmits)
                self._early.setdefault(topic, deque(maxlen=EARLY_MESSAGES)).append((peer, body))
                if topic not in self.starting:
                    asyncio.ensure_future(self._start_pipeline(topic))
                return
            if self._ticks_late:
                self._due_ticks()
            p.node.receive(peer, body)
            if not p.process_scheduled:
                # every message of this loop iteration first, then one ready(): peer
                # messages arrive in batches, so this cuts one slot and one ack for many
                p.process_scheduled = True
                self.loop.call_soon(self._process_scheduled, p)
            return
        except RemoteProtocolError as e:
            self.metrics.bad_messages.labels(peer).inc()
            now = time.monotonic()
            if now - self._bad_logged > 1.0:
                self._bad_logged = now
                log.warning("malformed message from peer dropped", **kv(peer=peer, error=str(e)))

    def _topic_allowed(self, topic: str) -> bool:
        if self.cfg.topics is None:
            return self.witness
        return self.cfg.topics.matches(topic)

    def _on_source_runs(self, runs: list[SourceRun]) -> None:
        if self._stopping:
            return  # not committed: consumed again after a restart
        touched: dict[str, TopicPipeline] = {}
        if self._ticks_late:
            self._due_ticks()
        now = time.monotonic()
        for run in runs:
            p = self.pipelines.get(run.topic)
            if p is None:
                continue
            p.stages.submitted(run, now)
            b = run.batch
            p.consumed += b.count
            p.submitted_next[b.partition] = b.first_offset + b.count
            p.own_next.setdefault(b.partition, b.first_offset)  # below its first submission: ordered before
            p.node.submit([run.batch])
            touched[run.topic] = p
        for p in touched.values():
            self._process(p)

    def _process_scheduled(self, p: TopicPipeline) -> None:
        p.process_scheduled = False
        self._process(p)

    def _process(self, p: TopicPipeline) -> None:
        node = p.node
        while node.has_ready():
            rd = node.ready()
            if rd.hard_state is not None:
                p.state.save(rd.hard_state)
            send = self.transport.send
            if rd.messages and p.stages.unsent:
                p.stages.sent(time.monotonic())
            for m in rd.messages:
                try:
                    send(m.to, frame_channel(p.topic, m.data))
                except Exception as e:  # unknown peer / oversized: a core bug, not fatal
                    log.error("send failed", **kv(peer=m.to, error=str(e)))
            for d in rd.deliveries:
                self._deliver(p, d)
            for v in rd.views:
                self.metrics.view_id.labels(p.topic).set(v.view_id)
                self.metrics.live_members.labels(p.topic).set(len(v.members))
                log.info("view installed", **kv(topic=p.topic, view=v.view_id, members=",".join(v.members),
                                                start_seq=v.start_seq))
            self._note_status(p, rd.status)
            for r in rd.reads:
                asyncio.ensure_future(self._serve_read(p, r.start, r.stop))
            node.advance(rd)
            if self.witness and rd.deliveries:
                node.durable(p.durable_end)
                self.metrics.delivered.labels(p.topic).set(p.durable_end)
        if self._ticks_late and self._tick_timer is not None and not node.quiet():
            self._tick_timer.cancel()  # busy again: _arm_tick puts the next tick on time
            self._arm_tick()

    def _deliver(self, p: TopicPipeline, d: Delivery) -> None:
        p.delivered_end = d.end_seq
        own = p.own_next
        for b in d.batches:
            if b.origin == self.me and b.first_offset + b.count > own.get(b.partition, 0):
                own[b.partition] = b.first_offset + b.count
        p.stages.delivered(d, time.monotonic(), writes=p.writer is not None)
        if p.writer is None:  # a witness: nothing to write, durable at once (reported after advance)
            p.durable_end = d.end_seq
        else:
            p.writer.write(d)
            p.checkpoint.delivered(d)
            if self._report_poll is None:
                self._report_poll = self.loop.call_later(REPORT_POLL_S, self._poll_reports)

    def _poll_reports(self) -> None:
        """Serve delivery reports while some are outstanding (the tick serves
        them too, but a tick is long: durable ends and commits follow the
        reports within a few ms, not a tick)."""
        self._report_poll = None
        if self._stopping:
            return  # _shutdown serves the last reports itself
        self.producer.poll(0)
        if any(p.writer.outstanding for p in self.pipelines.values() if p.writer is not None):
            self._report_poll = self.loop.call_later(REPORT_POLL_S, self._poll_reports)

    def _note_status(self, p: TopicPipeline, status: str) -> None:
        if status and status != p.status:
            log.info("status", **kv(topic=p.topic, status=status, previous=p.status or "-"))
            p.status = status
            self.metrics.set_status(p.topic, status)

    # ------------------------------------------------------------ the global topic's reports
    def _on_durable(self, p: TopicPipeline, end: int, commits: dict[int, int]) -> None:
        p.durable_end = end
        p.node.durable(end)
        p.checkpoint.durable(end)
        self.metrics.delivered.labels(p.topic).set(end)
        if self.source is not None:
            self.source.commit(p.topic, commits)
        self._process(p)

    async def _serve_read(self, p: TopicPipeline, start: int, stop: int) -> None:
        if p.reader is None:
            log.warning("a witness cannot serve reads of a global topic", **kv(topic=p.topic, start=start, stop=stop))
            return
        chunk = self.pcfg.catchup_chunk
        async with p.read_lock:  # one reader consumer per pipeline, one read at a time
            try:
                events = await self._retry(f"reading {p.global_topic}[{start}:{stop})", p.reader.read, start, stop)
            except asyncio.CancelledError:
                return
        log.info("served a read from the global topic", **kv(topic=p.topic, start=start, stop=stop, events=len(events)))
        for i in range(0, len(events), chunk):
            p.node.step(LogChunk(start + i, tuple(batches_from_events(events[i:i + chunk]))))
            self._process(p)

    # ------------------------------------------------------------ stop
    async def _shutdown(self) -> None:
        self._stopping = True
        if self.source is not None:
            self.source.pause()  # no new source records; the thread still drains commits
        writers = [p.writer for p in self.pipelines.values() if p.writer is not None]
        if self.producer is not None and self._fatal is None:
            # wait (bounded) for outstanding delivery reports so their offsets get committed
            deadline = time.monotonic() + 10.0
            while any(w.outstanding for w in writers) and time.monotonic() < deadline:
                await asyncio.to_thread(self.producer.poll, 0.1)
                await asyncio.sleep(0)  # run the scheduled durable reports
            for w in writers:
                w.report_durable()
        for p in self.pipelines.values():
            if p.checkpoint_task is not None:
                p.checkpoint_task.cancel()
        if self.producer is not None and self._fatal is None:
            for p in self.pipelines.values():  # the next start then reads nothing of the global topic
                if p.checkpoint is not None:
                    await p.checkpoint.final()
        if self.source is not None:
            await asyncio.to_thread(self.source.close, 15)
        for p in self.pipelines.values():
            if p.reader is not None:
                await asyncio.to_thread(p.reader.close)
            if p.end_offsets is not None:
                await asyncio.to_thread(p.end_offsets.close)
        if self.transport is not None:
            await self.transport.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.trace is not None:
            self.trace.close()
        log.info("member stopped", **kv(clean=self._fatal is None, **{
            f"end_{t}": p.durable_end for t, p in self.pipelines.items()}))
