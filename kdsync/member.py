"""`kdsync run`: one production member — source topic(s) in, agreed order out.

Theory of operation
-------------------
One asyncio loop drives one ordering node (kdsync.core) per source topic as
kdsync/core documents: peer messages, source events and ticks go in (the tick
timer and the idle groups that sleep: kdsync.ticks); after every input batch
the runtime drains `ready()` and does the I/O in the order Ready prescribes
(kdsync.handshake):

1. `hard_state` is appended to `state_dir/hardstate.log` (kdsync.state,
   one fsync for every group that changed in a loop iteration) before any
   message of its Ready is sent;
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

Start-up of the source topics, side by side: kdsync.pipeline (global and
checkpoint topics, start position and watermarks from the last checkpoint,
the node).  A failed producer: kdsync.producer_recovery.

SIGINT/SIGTERM: stop consuming, wait for outstanding delivery reports, commit,
close, exit 0.

Shards (`[topics] shards = K > 1`): a Member is the member of one shard s
(kdsync.workers runs them): its config is `Config.for_shard(s)`, it consumes
the source partitions p with p mod K = s and writes, reads and checkpoints
partition s of each global topic alone (docs/shards.md).
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import sys
import time

from kdsync.config import Config
from kdsync.core import Delivery
from kdsync.fatal import FatalError, retry
from kdsync.observability.stalls import StallDetector, loop_delay, sample_pipelines
from kdsync.kafka.checkpoint import CheckpointRounds, OffsetsConsumer
from kdsync.kafka.sink import ReportPoller, make_producer, producer_conf
from kdsync.kafka.source import SourceConsumer, SourceRun, consumer_conf
from kdsync.observability.logs import KafkaClientLog, KafkaErrors, client_callback, kv
from kdsync.pipeline import (Prepared, TopicPipeline, close_pipelines, discover_topics, known, log_ready, open_pipeline,
                             start_each, start_listed, start_topics)
from kdsync.producer_recovery import ProducerRecovery
from kdsync.observability.gcpauses import GcPauses, freeze_started
from kdsync.observability.kafka_requests import KafkaRequests
from kdsync.observability.profiler import profiler
from kdsync.observability.stage_latency import LatencyTrace, open_trace
from kdsync.handshake import ReadyHandshake
from kdsync.inbox import PeerInbox
from kdsync.state import StateDirLock, StateLog
from kdsync.stopping import StopClock, announce_leave, leave_groups
from kdsync.ticks import Coalesced, FormingSlots, GroupTicks, Pulse, Sleepers, TickClock

log = logging.getLogger("kdsync.member")

FORMING_SLOTS = 64  # groups in a view change ticked at once (kdsync.ticks.FormingSlots)


SAMPLED_PER_S = 200  # health sampling: every second, or this many pipelines a second (1 000: every 5 s)


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
        # the requests of the source consumer and the producer, by type (kdsync.observability.kafka_requests)
        self.kafka_requests = KafkaRequests(cfg.metrics.kafka_stats_ms)
        self.kafka_conf = consumer_conf(self.me, {**cfg.kafka.consumer_conf(), "logger": self.kafka_log})
        self.pipelines: dict[str, TopicPipeline] = {}
        self.starting: set[str] = set()
        self.planned: set[str] = set()  # topics start_topics will start (a peer's message for one waits)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transport = None
        self.producer = None
        self.offsets_consumer: OffsetsConsumer | None = None  # the end-offset client every checkpoint writer shares
        self.checkpoint_rounds = CheckpointRounds()  # every checkpoint writer's interval, one timer
        self.source: SourceConsumer | None = None
        self.metrics = None
        self.consume_batch = consume_batch
        self._stop = asyncio.Event()
        self._fatal: str | None = None
        self.stopping = False
        self.rng = random.Random()
        # peer frames to the nodes (the loop's parts it uses are made in _run: looked up when a frame comes)
        self.inbox = PeerInbox(self.pipelines, heard=lambda *a: self.sleepers.heard(*a), orders=self._orders,
                               known=lambda t: known(self, t), start=self.start_pipeline, due=lambda: self.clock.due(),
                               wake=self.before_input, process=lambda p: self.to_process.add(p),
                               bad=lambda peer: self.metrics.bad_messages.labels(peer).inc())
        self.reports = ReportPoller(lambda: self.producer, lambda why: self.recovery.failed(why), lambda: any(
            p.writer.outstanding for p in self.pipelines.values() if p.writer is not None), lambda: self.stopping)
        # a long pass still pings and writes every half heartbeat: a late loop is not a silent peer
        self.pulse = Pulse(lambda: (self.sleepers.ping(), self.transport.flush_now()), self.pcfg.heartbeat_ms / 2000,
                           auto=True)
        self.recovery = ProducerRecovery(self)
        self.producer_failed = self.recovery.failed  # a writer's producer failed: re-created in place
        self.handshake = ReadyHandshake(self, StateLog(cfg.state_path()))  # every group's Ready (load() in _run)
        self._last_health = 0.0
        self.health = StallDetector(cfg.health.stall_after_ms / 1000.0)
        self.stop_clock = StopClock(cfg.member.stop_timeout_ms / 1000.0)  # the stop's steps and deadline
        self.dir_lock = StateDirLock(cfg.state_path())  # one process per state directory
        # every client's error_cb: the last error (kdsync status), a fatal one stops the member
        self.kafka_errors = KafkaErrors(self._fatal_soon, log)
        self.started = time.monotonic()

    # ------------------------------------------------------------ helpers
    def status(self) -> dict:
        """Where this member stands (kdsync.status), for `kdsync status`."""
        from kdsync.status import member_status

        return member_status(self.me, self.pcfg.name, self.shard, self.started, self.transport.local.wire,
                             list(self.pipelines.values()), self.transport, self.source, self.health.stalled(),
                             self.kafka_errors.last)

    def stop_requested(self) -> bool:
        return self._stop.is_set()

    @property
    def state_log(self) -> StateLog:
        """The hard-state log of every group (kdsync.pipeline.PipelineHost)."""
        return self.handshake.state_log

    # ------------------------------------------------------------ start
    async def run(self) -> int:
        """Run until SIGINT/SIGTERM or a fatal error; return 0 or 1."""
        prof = profiler(f"{self.me}-loop", asyncio.get_running_loop())
        try:
            return await self._run()
        finally:
            if prof is not None:
                prof()

    async def _run(self) -> int:
        self.dir_lock.acquire()  # before anything: a second process on this state directory exits 1 here
        self.loop = asyncio.get_running_loop()
        if self.signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.loop.add_signal_handler(sig, self._on_signal, sig)
        from kdsync.observability.metrics import MemberMetrics
        from kdsync.transport import TransportError, member_transport

        self.metrics = MemberMetrics.of_member(lambda: self.transport, self.pipelines)
        self.metrics.registry.register(self.kafka_requests)
        self.gc_pauses, self.trace = GcPauses(), open_trace(self.trace_path, self.shard)
        self.metrics.listen(self.cfg.metrics.listen)
        try:
            self.transport = member_transport(self.cfg, self.shard, self.inbox.on_message)
            self.transport.status = self.status  # what a `kdsync status` probe is answered
            await self.transport.start()
        except TransportError as e:
            raise FatalError(str(e)) from None
        pc = self.pcfg
        self.forming = FormingSlots(FORMING_SLOTS, 4 * pc.ticks(pc.suspect_ms))
        self.sleepers = Sleepers([m for m in self.cfg.member_ids() if m != self.me], pc.ticks(pc.heartbeat_ms),
                                 pc.ticks(pc.suspect_ms), self.transport.send, sleep=pc.quiesce,
                                 adaptive=pc.adaptive_suspect)
        self.transport.on_heard = self.sleepers.live.heard  # bytes arrived: alive, before its messages are read
        self.ticks = GroupTicks(self.pipelines, self.sleepers, self.forming, self.process, self._after_ticks)
        self.clock = TickClock(self.loop, pc.tick_ms, quiet=self.ticks.quiet, on_ticks=self.ticks,
                               on_error=self._on_tick_error, stopping=lambda: self.stopping)
        self.to_process = Coalesced(self.loop, self.process, pulse=self.pulse)  # nodes given peer messages or source runs
        log.info("member started", **kv(**({} if self.shard is None else {"shard": self.shard}),
                                         role=self.cfg.member.role, protocol=self.pcfg.name,
                                         listen=self.cfg.member.listen, peers=",".join(self.cfg.member_ids())))
        try:
            self.handshake.state_log.load()
            # ticks from the start: a group forms as soon as its pipeline is
            # ready here and at its peers, not once a thousand others are
            self.clock.start()
            try:
                if not self.witness:
                    await self._start_kafka()
                elif self.cfg.topics is not None and self.cfg.topics.fixed_names():
                    await start_each(self.cfg.topics.fixed_names(), self.start_pipeline)
                await self._stop.wait()
            finally:
                self.clock.stop()
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
        self.stop(deadline=True)
        if self.transport is not None and self._fatal is None:  # the peers need not wait for the loop's end
            announce_leave(self._nodes, self.process)

    def stop(self, deadline: bool = False) -> None:
        """Stop cleanly (as SIGTERM does); call on the member's loop.  `deadline` (a signal):
        exit 1 if the stop has not finished within `[member] stop_timeout_ms` (kdsync.stopping)."""
        if deadline:  # also when already stopping (a fatal error): a signal bounds that stop too
            self.stop_clock.start()
        self._stop.set()

    def fatal(self, msg: str) -> None:
        """Stop the member with `msg` as its one line (the first one wins)."""
        if self._fatal is None:
            self._fatal = msg
            log.error(msg, **kv(fatal=True))
        self._stop.set()

    async def retry(self, what: str, fn, *args):
        """Run blocking `fn` in a thread until it succeeds, with backoff (kdsync.fatal.retry)."""
        return await retry(self._stop, what, fn, *args, on_failure=self.poll_producer)

    def _fatal_soon(self, msg: str) -> None:
        """`fatal(msg)` on the loop, from any thread (a Kafka client's callback)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.fatal, msg)

    def producer_conf(self) -> dict:
        return {**producer_conf(self.cfg.kafka.producer_conf()),
                "error_cb": client_callback(self.kafka_errors.routed(  # from producer.poll(), on the loop
                    lambda why: self.recovery.failed(f"kafka producer: {why}")), "producer error_cb"),
                "logger": self.kafka_log, **self.kafka_requests.conf()}

    async def _start_kafka(self) -> None:
        self.producer = make_producer(self.producer_conf())
        self.offsets_consumer = OffsetsConsumer(self.kafka_conf)
        self.source = SourceConsumer(
            {**self.kafka_conf, "error_cb": client_callback(self.kafka_errors, "source error_cb")}, self.me, self.loop,
            on_runs=self._on_source_runs, on_fatal=self.fatal, batch=self.consume_batch,
            on_lag=lambda t, p, lag: self.metrics.input_lag.labels(t, str(p)).set(lag),
            on_commit=lambda t, delay: (p := self.pipelines.get(t)) and p.stages.h["committed"].observe(delay),
            on_restart=self.metrics.source_restarted, idle=self.cfg.topics.idle(), on_gap=self.metrics.source_gap,
            txn_probe=not self.cfg.kafka.trust_read_committed,  # kdsync.kafka.transactions
            shard=None if self.shard is None else (self.shard, self.shards),
            on_topics=self._on_listed if self.cfg.topics.fixed_names() is None else None,
            client_extra=self.kafka_requests.conf())
        self.metrics.source_fetch_wait.set(self.source.conf.get("fetch.wait.max.ms", 500))
        topics = await self.retry("listing source topics", discover_topics, self.cfg, self.kafka_conf)
        if not topics:
            log.warning("no source topic matches yet; waiting for one", **kv(source=str(self.cfg.topics.source)))
        await start_topics(self, topics)
        self.source.start()
        freeze_started(self.loop)

    async def start_pipeline(self, topic: str, prepared: Prepared | None = None) -> None:
        if topic in self.pipelines or topic in self.starting:
            return
        self.starting.add(topic)
        try:
            p, start, hs = await open_pipeline(self, topic, prepared)
            self.pipelines[topic] = p
            if getattr(p.node, "view", None) is not None:  # restored: its view counts in the pings' digest
                self.sleepers.views.set(topic, p.node.view.view_id)
            if self.source is not None:  # from the next offset of its own events in the start state
                self.source.add_topic(topic, dict(p.own_next))
            self.metrics.delivered.labels(topic).set(p.durable_end)
            self.handshake.note_status(p, p.node.status)
            self.inbox.replay(topic, p.node)
            log_ready(p, start, hs)
            self.process(p)
        finally:
            self.starting.discard(topic)

    # ------------------------------------------------------------ driving the node
    def _on_tick_error(self, e: Exception) -> None:  # a core bug: stop loudly rather than run without a clock
        log.exception("tick failed")
        self.fatal(f"tick: {e}")

    def _after_ticks(self, now: float) -> None:
        """The end of every tick pass (kdsync.ticks.GroupTicks): reports served, health sampled."""
        self.poll_producer()
        if now - self._last_health >= max(1.0, len(self.pipelines) / SAMPLED_PER_S):
            self._last_health = now
            loop_delay(self.metrics, self.clock.take_delay(), self.pcfg.suspect_ms, len(self.pipelines),
                       len(self.sleepers.dorm.asleep), self.gc_pauses.take(), self.sleepers.live)
            sample_pipelines(self.health, self.metrics, self.pipelines.values(), self.source, now)

    def before_input(self, p: TopicPipeline) -> None:
        """Before any input reaches `p`'s node: wake it if it sleeps."""
        self.sleepers.wake(p.topic, p.node)

    def _on_listed(self, names: list[str]) -> None:
        """Source topics from a pattern: the source consumer's metadata refresh listed `names`."""
        if not self.stopping:
            start_listed(self, names)

    def _orders(self, topic: str) -> bool:
        """This member orders `topic` (a witness orders whatever its peers name)."""
        if self.cfg.topics is None:
            return self.witness
        return self.cfg.topics.matches(topic)

    def _on_source_runs(self, runs: list[SourceRun]) -> None:
        if self.stopping:
            return  # not committed: consumed again after a restart
        self.clock.due()
        now = time.monotonic()
        for run in runs:
            p = self.pipelines.get(run.topic)
            if p is None:
                continue
            self.before_input(p)
            p.submit(run, now)
            self.to_process.add(p)  # drained with this loop iteration's peer messages: one slot (coalesce_us)

    def process(self, p: TopicPipeline) -> None:
        """Drain `p`'s node (kdsync.handshake); a long pass pulses."""
        self.handshake.process(p)
        self.pulse()

    def deliver(self, p: TopicPipeline, d: Delivery) -> None:
        if p.deliver(d, self.me, time.monotonic()):
            self.poll_reports_soon()

    def poll_reports_soon(self) -> None:
        self.reports.soon()

    def _nodes(self) -> list:
        return [(p, p.node) for p in self.pipelines.values()]

    def poll_producer(self) -> None:
        """Serve the producer's callbacks now (kdsync.kafka.sink.ReportPoller)."""
        self.reports.poll()

    # ------------------------------------------------------------ the global topic's reports
    def on_durable(self, p: TopicPipeline, end: int, commits: dict[int, int]) -> None:
        self.before_input(p)
        p.durable(end)
        self.metrics.delivered.labels(p.topic).set(end)
        if self.source is not None:
            self.source.commit(p.topic, commits)
        self.process(p)

    # ------------------------------------------------------------ stop
    async def _shutdown(self) -> None:
        self.stopping = True
        step = self.stop_clock.step  # each step timed; a slow one is logged (kdsync.stopping)
        self.gc_pauses.close()
        if self.source is not None:
            self.source.pause()  # no new source records; the thread still drains commits
        if self.transport is not None and self._fatal is None:
            with step("leaving the groups"):  # the peers move on at once, not after suspect_ms
                left = await leave_groups(self._nodes, self.process, self.pcfg.tick_ms / 1000)
                log.info("left the groups", **kv(groups=len(self.pipelines), not_confirmed=left))
        if self.producer is not None and self._fatal is None:
            with step("delivery reports"):  # bounded: their offsets get committed
                await self.reports.drain([p.writer for p in self.pipelines.values() if p.writer is not None])
        if self.source is not None:
            with step("source offsets commit and consumer close"):
                await asyncio.to_thread(self.source.close, 15)
        self.checkpoint_rounds.close()
        with step("final checkpoints and Kafka clients"):
            await close_pipelines(list(self.pipelines.values()), self.offsets_consumer,
                                  final=self.producer is not None and self._fatal is None)
        self.handshake.state_log.close()
        self.dir_lock.release()
        if self.transport is not None:
            with step("peer links"):
                await self.transport.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.trace is not None:
            self.trace.close()
        log.info("member stopped", **kv(clean=self._fatal is None, **{
            f"end_{t}": p.durable_end for t, p in self.pipelines.items()}))
        self.stop_clock.step_name = "process exit (the Kafka clients' threads)"
