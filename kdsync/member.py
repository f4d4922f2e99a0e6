"""`kdsync run`: one production member — source topic(s) in, agreed order out.

Theory of operation
-------------------
One asyncio loop drives one ordering node (kdsync.core) per source topic,
exactly as kdsync/core documents: peer messages, source events and the clock
(`tick()` every `protocol.tick_ms`, measured on the loop's clock) go in; after
every input batch the runtime drains `ready()` and does the I/O in the order
Ready prescribes:

1. `hard_state` is written to `state_dir/<topic>.hardstate` atomically (temp
   file, fsync, rename, fsync of the directory) before any message is sent;
2. messages go to the transport (one channel per source topic on one
   connection per peer: ``len(topic) topic data``);
3. deliveries are produced, in order, to this cluster's global topic by an
   idempotent producer (enable.idempotence, acks=all, message.timeout.ms=0:
   librdkafka retries retriable errors with backoff for ever, so order and
   exactly-once hold while a broker is paused).  Delivery reports are checked
   one by one; when they confirm a contiguous prefix the node hears
   `durable(end)`, and only then are the source offsets of this member's own
   events in that prefix committed (enable.auto.commit=false).  A delivery
   error is fatal: the member stops with one line and exit 1, and its restart
   recovers from the global topic (nothing is silently lost);
4. reads (positions the node no longer holds in memory) are answered from the
   global topic, in a worker thread.

Kafka's blocking calls stay off the loop: one thread per member consumes the
source topics in batches (`consume(num_messages, timeout)`), commits offsets
and refreshes watermarks; batches are handed to the loop with
`call_soon_threadsafe`.  When too many own events are waiting to become
durable, the consumer pauses (back-pressure).

Start-up: for every source topic the global topic is created if missing and
read to its end (partition EOF, never ListOffsets alone): the last
`kdsync.seq` gives `start_seq`, the origin headers give the watermarks; both
go to `make_node`, together with the persisted hard state.  The consumer
starts at max(committed offset, own watermark + 1).  A broker that is down at
start is retried with backoff.  A witness has no Kafka: its deliveries are
durable at once.

SIGINT/SIGTERM: stop consuming, wait for outstanding delivery reports, commit,
close, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import random
import signal
import sys
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from kdsync.config import Config, ConfigError, legacy_config, load_config
from kdsync.core import (
    Event,
    HardState,
    LocalProtocolError,
    LogChunk,
    batches_from_events,
    NodeConfig,
    Ready,
    RemoteProtocolError,
    make_node,
)

log = logging.getLogger("kdsync.member")

H_SEQ, H_ORIGIN, H_OPART, H_OOFF, H_OTS = (
    "kdsync.seq", "kdsync.origin", "kdsync.origin.partition", "kdsync.origin.offset", "kdsync.origin.ts")
EARLY_MESSAGES = 10_000  # peer messages kept per topic while its group starts
MAX_INFLIGHT = 50_000  # source records consumed but not yet durable+committed before the consumer pauses


class FatalError(Exception):
    """Stops the member: one line for the operator, exit 1."""


# ---------------------------------------------------------------- logging
class KVFormatter(logging.Formatter):
    """One line per event: ``ts=... level=info logger=... msg="..." key=value``."""

    def __init__(self, member: str, as_json: bool = False):
        super().__init__()
        self.member = member
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields = {"ts": f"{record.created:.3f}", "level": record.levelname.lower(), "member": self.member,
                  "logger": record.name, "msg": record.getMessage()}
        fields.update(getattr(record, "kv", {}))
        if record.exc_info and record.levelno >= logging.ERROR:
            fields["exc"] = self.formatException(record.exc_info).splitlines()[-1]
        if self.as_json:
            return json.dumps(fields, default=str)
        out = []
        for k, v in fields.items():
            s = str(v)
            out.append(f"{k}={json.dumps(s)}" if (not s or any(c in s for c in ' "=\n')) else f"{k}={s}")
        return " ".join(out)


def _kv(**kw) -> dict:
    return {"extra": {"kv": kw}}


# ---------------------------------------------------------------- payloads
def pack_payload(key: bytes | None, value: bytes | None, headers) -> bytes:
    """Event.payload: key, value and the source headers (a list of pairs)."""
    return msgpack.packb([key, value, [[k, v] for k, v in (headers or ())]], use_bin_type=True)


def unpack_payload(payload: bytes):
    key, value, headers = msgpack.unpackb(payload, raw=False)
    return key, value, [(k, v) for k, v in headers]


def _hget(headers, name: str) -> bytes | None:
    for k, v in headers or ():
        if k == name:
            return v
    return None


def event_from_global(msg) -> tuple[int, Event]:
    """(seq, Event) of a record of a global topic; raises ValueError if it
    lacks kdsync headers (something else wrote to the topic)."""
    hs = msg.headers() or []
    seq = _hget(hs, H_SEQ)
    if seq is None:
        raise FatalError(f"{msg.topic()}[{msg.partition()}] offset {msg.offset()} has no {H_SEQ} header: kdsync must be "
                         f"the only writer of its global topics (topics.global_suffix)")
    src = [(k, v) for k, v in hs if not k.startswith("kdsync.")]
    ev = Event(origin=_hget(hs, H_ORIGIN).decode(), partition=int(_hget(hs, H_OPART)), offset=int(_hget(hs, H_OOFF)),
               payload=pack_payload(msg.key(), msg.value(), src), timestamp_ms=int(_hget(hs, H_OTS) or b"0"))
    return int(seq), ev


def global_partition(key: bytes | None, seq: int, partitions: int) -> int:
    """Partition of a global record: by key hash (CRC-32, identical in every
    cluster), keyless records by position."""
    if partitions == 1:
        return 0
    return (zlib.crc32(key) if key is not None else seq) % partitions


# ---------------------------------------------------------------- hard state
def save_hard_state(path: Path, hs: HardState) -> None:
    """Atomic: temp file + fsync + rename + fsync of the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = msgpack.packb([hs.incarnation, hs.view_id, list(hs.members), list(hs.promised), hs.accepted],
                         use_bin_type=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def load_hard_state(path: Path) -> HardState | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        inc, view_id, members, promised, accepted = msgpack.unpackb(data, raw=False)
        return HardState(int(inc), int(view_id), tuple(members), (int(promised[0]), int(promised[1])), bytes(accepted))
    except Exception:
        raise FatalError(f"state file {path} is corrupt; move it away to start this member afresh") from None


# ---------------------------------------------------------------- channels
def frame_channel(topic: str, data: bytes) -> bytes:
    t = topic.encode()
    return bytes((len(t),)) + t + data


def split_channel(data: bytes) -> tuple[str, bytes]:
    if not data:
        raise RemoteProtocolError("empty message")
    n = data[0]
    if len(data) < 1 + n or n == 0:
        raise RemoteProtocolError("bad channel header")
    try:
        return bytes(data[1:1 + n]).decode(), data[1 + n:]
    except UnicodeDecodeError:
        raise RemoteProtocolError("bad channel name") from None


# ---------------------------------------------------------------- per topic
@dataclass
class Group:
    """One source topic, its global topic and its ordering node."""

    topic: str
    global_topic: str
    node: object
    partitions: int = 1
    state_path: Path | None = None
    pending: dict[int, Event] = field(default_factory=dict)  # seq -> event produced, report outstanding
    confirmed: set[int] = field(default_factory=set)  # seqs confirmed above the durable prefix
    durable_end: int = 0
    produced_end: int = 0
    view_id: int = -1
    status: str = ""
    reader: object = None  # Consumer serving reads, used under read_lock
    read_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    own: deque = field(default_factory=deque)  # (seq, partition, offset) of own events produced, not yet durable
    durable_scheduled: bool = False
    present: set = field(default_factory=set)  # positions already in the global topic beyond start (P > 1 only)
    process_scheduled: bool = False  # a ready() drain is queued on the loop


class Member:
    def __init__(self, cfg: Config, *, consume_batch: int = 1000):
        self.cfg = cfg
        self.me = cfg.member.id
        self.witness = cfg.member.role == "witness"
        self.pcfg = cfg.protocol
        self.groups: dict[str, Group] = {}
        self.starting: set[str] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transport = None
        self.producer = None
        self.metrics = None
        self.consume_batch = consume_batch
        self._stop = asyncio.Event()
        self._fatal: str | None = None
        self._commit_q: queue.Queue = queue.Queue()
        self._consumer_thread: threading.Thread | None = None
        self._consumer_stop = threading.Event()
        self._consumer_resume = threading.Event()
        self._consumer_resume.set()
        self._positions: dict[tuple[str, int], int] = {}  # start offsets for the consumer
        self._bad_logged = 0.0
        self._stopping = False
        self._kafka_err_logged: dict = {}
        self._committed: dict[tuple[str, int], int] = {}  # source offsets committed (durably ordered below)
        self._early: dict[str, deque] = {}  # topic -> (peer, message) received before its group was ready
        self.rng = random.Random()

    # ------------------------------------------------------------ helpers
    def _node_config(self) -> NodeConfig:
        p = self.pcfg
        return NodeConfig(member_id=self.me, members=self.cfg.member_ids(), roles=self.cfg.roles(), protocol=p.name,
                          heartbeat_ticks=p.ticks(p.heartbeat_ms), suspect_ticks=p.ticks(p.suspect_ms),
                          retransmit_ticks=p.ticks(p.retransmit_ms), max_batch=p.max_batch,
                          log_retention=p.log_retention, catchup_chunk=p.catchup_chunk)

    def _consumer_conf(self) -> dict:
        conf = {"group.id": f"kdsync-{self.me}", "auto.offset.reset": "earliest", "fetch.wait.max.ms": 5,
                "log_level": 3, "socket.connection.setup.timeout.ms": 5000}
        conf.update(self.cfg.kafka.consumer_conf())
        conf["enable.auto.commit"] = False  # an offset is committed only once its event is durable
        conf["enable.auto.offset.store"] = False
        return conf

    def _producer_conf(self) -> dict:
        conf = {"acks": "all", "linger.ms": 1, "message.timeout.ms": 0, "retry.backoff.ms": 100,
                "retry.backoff.max.ms": 2000, "log_level": 3, "queue.buffering.max.messages": 1_000_000}
        conf.update(self.cfg.kafka.producer_conf())
        conf["enable.idempotence"] = True
        return conf

    def _stats_for_metrics(self) -> dict[str, dict]:
        return {t: dict(getattr(g.node, "stats", {})) for t, g in list(self.groups.items())}

    def _peer_stats(self) -> dict:
        return dict(self.transport.stats) if self.transport is not None else {}

    # ------------------------------------------------------------ start
    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self._on_signal, sig)
        from kdsync.metrics import MemberMetrics
        from kdsync.transport import TLSSettings, TransportError, make_transport

        self.metrics = MemberMetrics(self._peer_stats, self._stats_for_metrics)
        if self.cfg.metrics.listen:
            from kdsync.config import parse_address

            host, port = parse_address(self.cfg.metrics.listen)
            try:
                self.metrics.serve(host, port)
            except OSError as e:
                raise FatalError(f"metrics.listen: cannot listen on {self.cfg.metrics.listen}: {e.strerror}") from None
        tls = self.cfg.resolved_tls()
        try:
            from kdsync.config import parse_address

            self.transport = make_transport(
                self.cfg.transport.kind, self.me, parse_address(self.cfg.member.listen), self.cfg.peer_addresses(),
                self._on_peer_message, secret=self.cfg.secret_bytes(),
                tls=TLSSettings(tls.certfile, tls.keyfile, tls.cafile) if tls else None,
                max_frame_bytes=self.cfg.transport.max_frame_bytes, logger=logging.getLogger("kdsync.transport"))
            await self.transport.start()
        except TransportError as e:
            raise FatalError(str(e)) from None
        log.info("member started", **_kv(role=self.cfg.member.role, protocol=self.pcfg.name,
                                          listen=self.cfg.member.listen, peers=",".join(self.cfg.member_ids())))
        try:
            if not self.witness:
                await self._start_kafka()
            elif self.cfg.topics is not None and self.cfg.topics.fixed_names():
                for t in self.cfg.topics.fixed_names():
                    await self._start_group(t)
            ticker = asyncio.create_task(self._tick_loop())
            await self._stop.wait()
            ticker.cancel()
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
        log.info("stopping", **_kv(signal=signal.Signals(sig).name))
        self._stop.set()

    def fatal(self, msg: str) -> None:
        if self._fatal is None:
            self._fatal = msg
            log.error(msg, **_kv(fatal=True))
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
                log.warning(f"{what} failed, retrying", **_kv(error=str(e).splitlines()[0] if str(e) else repr(e),
                                                              retry_in=f"{delay:.1f}s"))
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, 2.0)
        raise asyncio.CancelledError

    async def _start_kafka(self) -> None:
        from confluent_kafka import Producer

        self.producer = Producer({**self._producer_conf(), "error_cb": self._on_kafka_error})
        topics = await self._retry("listing source topics", self._discover_topics)
        if not topics:
            log.warning("no source topic matches yet; waiting for one", **_kv(source=str(self.cfg.topics.source)))
        for t in topics:
            await self._start_group(t)
        self._consumer_thread = threading.Thread(target=self._consume_loop, name="kdsync-consumer", daemon=True)
        self._consumer_thread.start()

    def _discover_topics(self) -> list[str]:
        names = self.cfg.topics.fixed_names()
        if names is not None:
            return names
        from confluent_kafka.admin import AdminClient

        from kdsync.kafka.topic import _admin_conf

        md = AdminClient(_admin_conf(self._consumer_conf())).list_topics(timeout=10)
        return sorted(t for t in md.topics if self.cfg.topics.matches(t))

    async def _start_group(self, topic: str) -> None:
        if topic in self.groups or topic in self.starting:
            return
        self.starting.add(topic)
        try:
            gt = self.cfg.topics.global_topic(topic) if self.cfg.topics else topic + "-global"
            start_seq, watermarks, parts, present = 0, {}, 1, set()
            if not self.witness:
                parts = await self._retry(f"creating {gt}", self._ensure_global, gt)
                start_seq, watermarks, present = await self._retry(f"reading {gt} to its end", self._scan_global, gt,
                                                                   parts)
            state_path = self.cfg.state_path() / f"{topic}.hardstate"
            hs = load_hard_state(state_path)
            try:
                node = make_node(self._node_config(), rng=random.Random(self.rng.getrandbits(64)), start_seq=start_seq,
                                 watermarks=watermarks, hard_state=hs)
            except LocalProtocolError as e:
                raise FatalError(f"protocol: {e}") from None
            g = Group(topic, gt, node, parts, state_path, durable_end=start_seq, produced_end=start_seq, present=present)
            if present:
                log.warning("global topic has positions beyond a gap; they will not be written twice",
                            **_kv(topic=topic, gap_at=start_seq, beyond=len(present)))
            for (origin, p), off in watermarks.items():
                if origin == self.me:
                    self._positions[(topic, p)] = off + 1
            self.groups[topic] = g
            self.metrics.delivered.labels(topic).set(start_seq)
            self._note_status(g, getattr(node, "status", ""))
            for peer, body in self._early.pop(topic, ()):
                try:
                    node.receive(peer, body)
                except RemoteProtocolError:
                    self.metrics.bad_messages.labels(peer).inc()
            log.info("topic ready", **_kv(topic=topic, global_topic=gt, start_seq=start_seq,
                                          origins=len(watermarks), hard_state=hs is not None))
            self._process(g)
        finally:
            self.starting.discard(topic)

    def _ensure_global(self, gt: str) -> int:
        from kdsync.kafka.topic import ensure_topic

        want = self.cfg.topics.global_partitions
        have = ensure_topic(self._consumer_conf(), gt, want, timeout=3.0)
        if have != want:
            raise FatalError(f"topics.global_partitions = {want} but {gt} already has {have} partitions")
        return have

    def _scan_global(self, gt: str, parts: int) -> tuple[int, dict, set[int]]:
        """Read the global topic to its end: (end of the contiguous prefix of
        positions, origin watermarks of that prefix, positions present beyond it).

        With one partition the prefix is the whole topic.  With several, a crash
        can leave position k missing in one partition while k+1 landed in
        another: the node restarts at k, and positions already present above it
        are not written again when they are delivered (see _produce)."""
        from kdsync.kafka.topic import iter_partition

        events: dict[int, Event] = {}
        for p in range(parts):
            for m in iter_partition(self._consumer_conf(), gt, p, timeout=60):
                seq, ev = event_from_global(m)
                events[seq] = ev
        end = 0
        while end in events:
            end += 1
        wm: dict = {}
        for seq in range(end):
            ev = events[seq]
            k = (ev.origin, ev.partition)
            if ev.offset > wm.get(k, -1):
                wm[k] = ev.offset
        return end, wm, {seq for seq in events if seq > end}

    # ------------------------------------------------------------ driving the node
    async def _tick_loop(self) -> None:
        period = self.pcfg.tick_ms / 1000.0
        loop = self.loop
        next_t = loop.time() + period
        last_refresh = loop.time()
        while True:
            await asyncio.sleep(max(0.0, next_t - loop.time()))
            now = loop.time()
            n = 0
            while next_t <= now and n < 5:  # a stalled loop catches up a few ticks, not hundreds
                next_t += period
                n += 1
            if next_t <= now:
                next_t = now + period
            for g in list(self.groups.values()):
                for _ in range(max(n, 1)):
                    g.node.tick()
                self._process(g)
            if self.producer is not None:
                self.producer.poll(0)
            if now - last_refresh > 5.0 and not self.witness and self.cfg.topics.fixed_names() is None:
                last_refresh = now
                asyncio.create_task(self._refresh_topics())

    async def _refresh_topics(self) -> None:
        try:
            topics = await asyncio.to_thread(self._discover_topics)
        except Exception as e:
            log.warning("topic discovery failed", **_kv(error=str(e)))
            return
        for t in topics:
            if t not in self.groups:
                await self._start_group(t)

    def _on_peer_message(self, peer: str, data: bytes) -> None:
        try:
            topic, body = split_channel(data)
            g = self.groups.get(topic)
            if g is None:
                if not self._topic_allowed(topic):
                    return
                # kept until the group is ready (bounded; beyond that the peer retransmits)
                self._early.setdefault(topic, deque(maxlen=EARLY_MESSAGES)).append((peer, body))
                if topic not in self.starting:
                    asyncio.ensure_future(self._start_group(topic))
                return
            g.node.receive(peer, body)
            if not g.process_scheduled:
                # every message of this loop iteration first, then one ready(): peer
                # messages arrive in batches, so this cuts one slot and one ack for many
                g.process_scheduled = True
                self.loop.call_soon(self._process_scheduled, g)
            return
        except RemoteProtocolError as e:
            self.metrics.bad_messages.labels(peer).inc()
            now = time.monotonic()
            if now - self._bad_logged > 1.0:
                self._bad_logged = now
                log.warning("malformed message from peer dropped", **_kv(peer=peer, error=str(e)))

    def _topic_allowed(self, topic: str) -> bool:
        if self.cfg.topics is None:
            return self.witness
        return self.cfg.topics.matches(topic)

    def _on_source_batch(self, batch: dict[str, list[Event]]) -> None:
        if self._stopping:
            return  # not committed: consumed again after a restart
        for topic, events in batch.items():
            g = self.groups.get(topic)
            if g is None:
                continue
            self.metrics.consumed.labels(topic).inc(len(events))
            g.node.submit(batches_from_events(events))
            self._process(g)

    def _process_scheduled(self, g: Group) -> None:
        g.process_scheduled = False
        self._process(g)

    def _process(self, g: Group) -> None:
        node = g.node
        while node.has_ready():
            rd: Ready = node.ready()
            if rd.hard_state is not None:
                save_hard_state(g.state_path, rd.hard_state)
            send = self.transport.send
            for m in rd.messages:
                try:
                    send(m.to, frame_channel(g.topic, m.data))
                except Exception as e:  # unknown peer / oversized: a core bug, not fatal
                    log.error("send failed", **_kv(peer=m.to, error=str(e)))
            for d in rd.deliveries:
                if self.witness:
                    g.durable_end = d.end_seq
                else:
                    self._produce(g, d)
            for v in rd.views:
                g.view_id = v.view_id
                self.metrics.view_id.labels(g.topic).set(v.view_id)
                self.metrics.live_members.labels(g.topic).set(len(v.members))
                log.info("view installed", **_kv(topic=g.topic, view=v.view_id, members=",".join(v.members),
                                                 start_seq=v.start_seq))
            self._note_status(g, rd.status)
            for r in rd.reads:
                asyncio.ensure_future(self._serve_read(g, r.start, r.stop))
            node.advance(rd)
            if self.witness and rd.deliveries:
                node.durable(g.durable_end)
                self.metrics.delivered.labels(g.topic).set(g.durable_end)

    def _note_status(self, g: Group, status: str) -> None:
        if status and status != g.status:
            log.info("status", **_kv(topic=g.topic, status=status, previous=g.status or "-"))
            g.status = status
            self.metrics.set_status(g.topic, status)

    # ------------------------------------------------------------ Kafka out
    def _produce(self, g: Group, d) -> None:
        p = self.producer
        seq = d.first_seq
        if seq != g.produced_end:
            self.fatal(f"internal: delivery at position {seq} but {g.global_topic} continues at {g.produced_end}")
            return
        for ev in d.events():
            key, value, headers = unpack_payload(ev.payload)
            headers = headers + [(H_SEQ, str(seq).encode()), (H_ORIGIN, ev.origin.encode()),
                                 (H_OPART, str(ev.partition).encode()), (H_OOFF, str(ev.offset).encode()),
                                 (H_OTS, str(ev.timestamp_ms).encode())]
            g.pending[seq] = ev
            if ev.origin == self.me:
                g.own.append((seq, ev.partition, ev.offset))
            if g.present and seq in g.present:  # written before a crash, beyond a gap: do not duplicate
                g.present.discard(seq)
                self._on_delivery(g, seq, True, None, None)
                seq += 1
                continue
            cb = (lambda err, msg, s=seq, c=d.catchup: self._on_delivery(g, s, c, err, msg))
            while True:
                try:
                    p.produce(g.global_topic, value=value, key=key, headers=headers,
                              partition=global_partition(key, seq, g.partitions), on_delivery=cb)
                    break
                except BufferError:  # local queue full: serve reports, then retry
                    p.poll(0.05)
            seq += 1
        g.produced_end = seq

    def _on_delivery(self, g: Group, seq: int, catchup: bool, err, msg) -> None:
        ev = g.pending.pop(seq, None)
        if err is not None:
            self.fatal(f"writing position {seq} to {g.global_topic} failed: {err.str()} "
                       f"(restart the member once the cluster accepts writes; it resumes from the global topic)")
            return
        if ev is None:
            return
        if not catchup and ev.timestamp_ms > 0:
            self.metrics.latency.labels(g.topic).observe(max(0.0, time.time() - ev.timestamp_ms / 1000.0))
        self.metrics.written.labels(g.topic).inc()
        g.confirmed.add(seq)
        if seq == g.durable_end:
            end = seq
            while end in g.confirmed:
                g.confirmed.discard(end)
                end += 1
            g.durable_end = end
            if not g.durable_scheduled:  # report once per batch of delivery reports
                g.durable_scheduled = True
                self.loop.call_soon(self._report_durable, g)

    def _report_durable(self, g: Group) -> None:
        g.durable_scheduled = False
        g.node.durable(g.durable_end)
        self.metrics.delivered.labels(g.topic).set(g.durable_end)
        self._commit_own(g)
        self._process(g)

    def _commit_own(self, g: Group) -> None:
        """Queue commits of the source offsets of own events now durable."""
        commits: dict[int, int] = {}
        own = g.own
        while own and own[0][0] < g.durable_end:
            _, part, off = own.popleft()
            commits[part] = off + 1
        if commits:
            self._commit_q.put((g.topic, commits))

    # ------------------------------------------------------------ reads
    async def _serve_read(self, g: Group, start: int, stop: int) -> None:
        if self.witness:
            log.warning("a witness cannot serve reads of a global topic", **_kv(topic=g.topic, start=start, stop=stop))
            return
        chunk = self.pcfg.catchup_chunk
        async with g.read_lock:  # one reader consumer per group, one read at a time
            try:
                events = await self._retry(f"reading {g.global_topic}[{start}:{stop})", self._read_range, g, start, stop)
            except asyncio.CancelledError:
                return
        log.info("served a read from the global topic", **_kv(topic=g.topic, start=start, stop=stop, events=len(events)))
        for i in range(0, len(events), chunk):
            g.node.step(LogChunk(start + i, tuple(batches_from_events(events[i:i + chunk]))))
            self._process(g)

    def _read_range(self, g: Group, start: int, stop: int, timeout: float = 60.0) -> list[Event]:
        """Events at positions [start, stop) of the global topic (fewer if it ends
        first).  One partition: seq == offset, read from `start`; several: scan."""
        from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

        if g.reader is None:
            g.reader = Consumer({**self._consumer_conf(), "group.id": f"kdsync-{self.me}-reader",
                                 "enable.partition.eof": True, "fetch.wait.max.ms": 10})
        c = g.reader
        found: dict[int, Event] = {}
        for p in range(g.partitions):
            c.assign([TopicPartition(g.global_topic, p, start if g.partitions == 1 else 0)])
            deadline = time.monotonic() + timeout
            done = False
            while not done:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no end of {g.global_topic}[{p}] within {timeout}s")
                for m in c.consume(1000, timeout=0.2):
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            done = True
                            break
                        if err.fatal():
                            raise KafkaException(err)
                        continue
                    seq, ev = event_from_global(m)
                    if start <= seq < stop:
                        found[seq] = ev
                    if g.partitions == 1 and seq + 1 >= stop:
                        done = True
                        break
            c.unassign()
        out = []
        for s in range(start, stop):
            if s not in found:
                break
            out.append(found[s])
        return out

    # ------------------------------------------------------------ Kafka in
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
            log.warning("kafka client error (retrying)", **_kv(error=err.str()))

    def _consume_loop(self) -> None:
        from confluent_kafka import Consumer, KafkaError, TopicPartition

        c = Consumer({**self._consumer_conf(), "error_cb": self._on_kafka_error})
        assigned: dict[tuple[str, int], bool] = {}
        consumed: dict[tuple[str, int], int] = {}  # next offset to consume, per source partition
        last_meta = 0.0
        last_lag = 0.0

        def refresh() -> None:
            new = []
            try:
                md = c.list_topics(timeout=5)
            except Exception as e:
                log.warning("source metadata unavailable", **_kv(error=str(e)))
                return
            for t in list(self.groups):
                tm = md.topics.get(t)
                if tm is None or tm.error is not None:
                    continue
                for p in tm.partitions:
                    if (t, p) not in assigned:
                        new.append(TopicPartition(t, p))
            if not new:
                return
            try:
                committed = c.committed(new, timeout=10)
            except Exception as e:
                log.warning("reading committed offsets failed", **_kv(error=str(e)))
                return
            for tp in committed:
                start = max(tp.offset if tp.offset >= 0 else 0, self._positions.get((tp.topic, tp.partition), 0))
                tp.offset = start
                self._committed.setdefault((tp.topic, tp.partition), start)
                assigned[(tp.topic, tp.partition)] = True
                log.info("consuming", **_kv(topic=tp.topic, partition=tp.partition, offset=start))
            c.incremental_assign(committed)

        try:
            while not self._consumer_stop.is_set():
                now = time.monotonic()
                if now - last_meta > (0.5 if not assigned else 5.0):
                    last_meta = now
                    refresh()
                self._drain_commits(c)
                if not self._consumer_resume.wait(0.05):
                    continue
                # back-pressure: too many consumed records not yet durably ordered and committed
                if sum(nxt - self._committed.get(tp, 0) for tp, nxt in consumed.items()) > MAX_INFLIGHT:
                    self._consumer_stop.wait(0.02)
                    continue
                if not assigned:
                    self._consumer_stop.wait(0.1)
                    continue
                if now - last_lag > 1.0:
                    last_lag = now
                    self._update_lag(c, assigned, TopicPartition)
                # poll() returns as soon as one record is there; consume(n, timeout) would
                # wait for n records or the timeout, adding up to the timeout to latency
                first = c.poll(0.05)
                if first is None:
                    continue
                msgs = [first] + c.consume(self.consume_batch - 1, timeout=0)
                batch: dict[str, list[Event]] = {}
                for m in msgs:
                    err = m.error()
                    if err is not None:
                        if err.fatal():
                            self.loop.call_soon_threadsafe(self.fatal, f"kafka consumer: {err.str()}")
                        elif err.code() != KafkaError._PARTITION_EOF:
                            log.warning("consumer", **_kv(error=err.str()))
                        continue
                    consumed[(m.topic(), m.partition())] = m.offset() + 1
                    ts_type, ts = m.timestamp()
                    batch.setdefault(m.topic(), []).append(
                        Event(self.me, m.partition(), m.offset(), pack_payload(m.key(), m.value(), m.headers()),
                              ts if ts > 0 else int(time.time() * 1000)))
                if batch:
                    self.loop.call_soon_threadsafe(self._on_source_batch, batch)
        except Exception as e:  # a bug or an unexpected client error: stop with one line
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.fatal, f"kafka consumer: {e}")
        finally:
            self._drain_commits(c, final=True)
            c.close()

    def _update_lag(self, c, assigned, TopicPartition) -> None:
        """input_lag = source high watermark (from fetch responses, which Tansu
        reports right) - offset below which every event is durably ordered."""
        for (t, p) in list(assigned):
            try:
                lo, hi = c.get_watermark_offsets(TopicPartition(t, p), cached=True)
            except Exception:
                continue
            if hi is not None and hi >= 0:
                self.metrics.input_lag.labels(t, str(p)).set(max(0, hi - self._committed.get((t, p), 0)))

    def _drain_commits(self, c, final: bool = False) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        merged: dict[tuple[str, int], int] = {}
        while True:
            try:
                topic, commits = self._commit_q.get_nowait()
            except queue.Empty:
                break
            for p, off in commits.items():
                merged[(topic, p)] = max(off, merged.get((topic, p), 0))
        if not merged:
            return
        tps = [TopicPartition(t, p, off) for (t, p), off in sorted(merged.items())]
        for (t, p), off in merged.items():
            self._committed[(t, p)] = max(off, self._committed.get((t, p), 0))
        try:
            c.commit(offsets=tps, asynchronous=not final)
        except KafkaException as e:
            # not fatal: a later commit covers it; on restart the watermarks skip what is durable
            log.warning("offset commit failed", **_kv(error=str(e)))

    # ------------------------------------------------------------ stop
    async def _shutdown(self) -> None:
        self._stopping = True
        self._consumer_resume.clear()  # no new source batches; the thread still drains commits
        if self.producer is not None and self._fatal is None:
            # wait (bounded) for outstanding delivery reports so their offsets get committed
            deadline = time.monotonic() + 10.0
            while any(g.pending for g in self.groups.values()) and time.monotonic() < deadline:
                await asyncio.to_thread(self.producer.poll, 0.1)
                await asyncio.sleep(0)  # run the scheduled durable reports
            for g in self.groups.values():
                self._report_durable(g)
        self._consumer_stop.set()
        self._consumer_resume.set()
        if self._consumer_thread is not None:
            await asyncio.to_thread(self._consumer_thread.join, 15)
        for g in self.groups.values():
            if g.reader is not None:
                await asyncio.to_thread(g.reader.close)
        if self.transport is not None:
            await self.transport.close()
        if self.metrics is not None:
            self.metrics.close()
        log.info("member stopped", **_kv(clean=self._fatal is None, **{
            f"end_{t}": g.durable_end for t, g in self.groups.items()}))


# ---------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kdsync run", description="Run one kdsync member.", add_help=True)
    ap.add_argument("--config", "-c", metavar="FILE", help="TOML configuration file")
    ap.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="overrides [log] level")
    ap.add_argument("positional", nargs="*", metavar="N BROKERS TOPIC",
                    help="original form: N members (default 2), brokers (default 127.0.0.1:9092), topic (default test); "
                         "peers from derecho.cfg or $DERECHO_CONF_FILE")
    return ap


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _ArgError(message)


def _config_from_args(argv: list[str]) -> tuple[Config, str | None]:
    ap = _parser()
    ap.__class__ = _Parser
    args = ap.parse_args(argv)
    if args.config:
        if args.positional:
            raise _ArgError("give either --config FILE or N BROKERS TOPIC, not both")
        return load_config(args.config), args.log_level
    pos = args.positional
    if len(pos) > 3:
        raise _ArgError(f"too many arguments: {' '.join(pos[3:])}")
    try:
        n = int(pos[0]) if pos else 2
    except ValueError:
        raise _ArgError(f"N must be a number of members, got {pos[0]!r}") from None
    brokers = pos[1] if len(pos) > 1 else "127.0.0.1:9092"
    topic = pos[2] if len(pos) > 2 else "test"
    cfg_file = os.environ.get("DERECHO_CONF_FILE") or "derecho.cfg"
    return legacy_config(n, brokers, topic, cfg_file), args.log_level


def _setup_logging(cfg: Config, level: str | None) -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(KVFormatter(cfg.member.id, as_json=cfg.log.format == "json"))
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel((level or cfg.log.level).upper())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, level = _config_from_args(argv)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    except _ArgError as e:
        print(f"kdsync run: {e}", file=sys.stderr)
        return 2
    _setup_logging(cfg, level)
    member = Member(cfg)
    try:
        return asyncio.run(member.run())
    except FatalError as e:
        print(f"kdsync run: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
