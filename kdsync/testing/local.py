"""The local-cluster harness every test, benchmark and the demo share.

* `LocalGroup(n, workdir, ...)` — n embedded brokers (real processes;
  `broker="tansu"` or `"noida"`, by default $KDSYNC_TEST_BROKER or tansu:
  docs/brokers.md; `durable=True`: Tansu on a local S3 store, kept across
  kill -9), generated TOML
  configs and n `kdsync run` subprocesses; `start_member(i)`,
  `signal_member(i, sig)`, `wait_member(i)`, `close()` (stops every process
  it started, members first; fails on a member's stall warning unless
  `expect_stalls`: True, or the stages whose stalls the test expects, e.g.
  ("fetch",) for a broker that may not hand records over for a while).
* `write_events(bootstrap, topic, n, tag)` — produce n keyed records, return
  when every one is acknowledged.
* `read_global(bootstrap, topic)` — a global topic read to partition EOF,
  as `GlobalRecord`s; `GlobalTail` follows one.
* `check_global_topics({member: records})` — (ok, one-line detail).
* sharded groups (`LocalGroup(..., shards=K, workers=W, source_partitions=P)`):
  `read_partitions()`, `wait_for_partitions(n)` and `check_sharded(...)`
  (every partition identical in every cluster, every event once, each
  source partition's order kept).
* `measure(protocol, workdir)` — throughput and latency of one protocol on
  local clusters.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from kdsync.kafka.embedded import BROKERS, EmbeddedCluster, S3Store, check_broker, die_with_parent
from kdsync.kafka.records import H_SEQ, read_global_headers
from kdsync.kafka.topic import FetchStalledError, consumer, ensure_topic, iter_partition, read_to_eof
from kdsync.observability.logs import client_log
from kdsync.testing.stats import percentile

__all__ = ["DURABLE_LINGER_MS", "GlobalRecord", "GlobalTail", "LocalGroup", "TEST_BROKER_ENV", "WARM_TOPIC", "Writers",
           "check_global_topics", "check_sharded", "child_pids", "default_broker", "free_port_block", "measure",
           "read_global", "write_events"]

WARM_TOPIC = "kdsync-demo-warmup"  # the writers' warm-up records go here, never into an ordered topic
TEST_BROKER_ENV = "KDSYNC_TEST_BROKER"  # the embedded broker of a LocalGroup that names none (tansu | noida)


def default_broker() -> str:
    """$KDSYNC_TEST_BROKER if set (checked: one of BROKERS), else "tansu"."""
    name = os.environ.get(TEST_BROKER_ENV, "").strip()
    if not name:
        return BROKERS[0]
    try:
        return check_broker(name)
    except ValueError as e:
        raise ValueError(f"{TEST_BROKER_ENV}: {e}") from None


@dataclass(frozen=True)
class GlobalRecord:
    offset: int
    seq: int
    origin: str
    origin_partition: int
    origin_offset: int
    origin_ts: int
    key: bytes | None
    value: bytes | None
    write_ts: int  # record timestamp in the global topic (ms)

    @property
    def event_id(self) -> tuple[str, int, int]:
        return (self.origin, self.origin_partition, self.origin_offset)


def _global_record(m) -> GlobalRecord:
    h = read_global_headers(m.headers())
    if h is None:
        raise ValueError(f"{m.topic()}[{m.partition()}] offset {m.offset()} has no {H_SEQ} header")
    return GlobalRecord(m.offset(), h.seq, h.origin, h.origin_partition, h.origin_offset, h.origin_ts, m.key(),
                        m.value(), m.timestamp()[1])


def read_global(bootstrap: str, topic: str, timeout: float = 30.0, partition: int = 0) -> list[GlobalRecord]:
    """Every record of one partition (default 0) of a global topic, read to partition EOF."""
    return [_global_record(m) for m in iter_partition(bootstrap, topic, partition, timeout=timeout)]


def read_globals_of(bootstrap: str, topics: list[str], timeout: float = 30.0) -> dict[str, list[GlobalRecord]]:
    """`read_global` of many global topics (partition 0 of each) with one
    consumer assigned to all of them at once: checking 80 topics in three
    clusters cost a consumer, its metadata and an assignment per topic and
    per cluster (about 0.2 s each here) and most of a test's time.  A
    missing topic reads as empty; TimeoutError when some partition does not
    reach its end within `timeout` seconds."""
    from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

    out: dict[str, list[GlobalRecord]] = {t: [] for t in topics}
    c = consumer(bootstrap)
    try:
        md = c.list_topics(timeout=min(timeout, 10.0))
        present = [t for t in topics if t in md.topics and md.topics[t].error is None and 0 in md.topics[t].partitions]
        c.assign([TopicPartition(t, 0, OFFSET_BEGINNING) for t in present])
        left = set(present)
        deadline = time.monotonic() + timeout
        while left:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(left)} global topics not read to their end in {timeout:.0f} s, "
                                   f"e.g. {sorted(left)[0]}")
            for m in c.consume(1000, 0.2):
                err = m.error()
                if err is None:
                    if m.topic() in left:
                        out[m.topic()].append(_global_record(m))
                elif err.code() == KafkaError._PARTITION_EOF:
                    left.discard(m.topic())
                elif err.fatal() or not err.retriable():
                    raise KafkaException(err)
    finally:
        c.close()
    return out


class GlobalTail:
    """Follows one partition (default 0) of one global topic with one long-lived consumer:
    `read()` returns every record so far, fetching only what is new."""

    def __init__(self, bootstrap: str, topic: str, partition: int = 0):
        self.bootstrap, self.topic, self.partition = bootstrap, topic, partition
        self.records: list[GlobalRecord] = []
        self.next = 0  # next offset to read (above len(records) after a hole: check_global_topics reports it)
        self._c = None

    def read(self, timeout: float = 30.0) -> list[GlobalRecord]:
        if self._c is None:
            self._c = consumer({"bootstrap.servers": self.bootstrap, "group.id": "kdsync-demo-tail",
                                "topic.metadata.refresh.interval.ms": 500})
        try:
            for m in read_to_eof(self._c, self.topic, self.partition, self.next, timeout=timeout, poll=0.1):
                if m.offset() >= self.next:
                    self.records.append(_global_record(m))
                    self.next = m.offset() + 1
        except FetchStalledError:
            self.close()  # the next read asks with a new consumer (and a longer fetch wait)
        except TimeoutError:
            pass  # what has come so far
        return list(self.records)

    def close(self) -> None:
        if self._c is not None:
            self._c.close()
            self._c = None


def check_global_topics(topics: dict[str, list[GlobalRecord]], expected: int | None = None) -> tuple[bool, str]:
    """Every global topic holds the same events at the same offsets, seq ==
    offset, no duplicate, origin order, the same key and value for an event
    everywhere, and (if given) exactly `expected` records.  Returns (ok, one
    line: the first violation of `kdsync.invariants`, or what holds)."""
    from kdsync.invariants import FOREIGN, LOST_WRITE, Violation, check, gap, runs_from_events

    names = sorted(topics)
    found: list[Violation] = []
    for n in names:
        for i, r in enumerate(topics[n]):
            if r.offset != i or r.seq != i:
                found.append(gap(n, i, r.seq if r.offset == i else r.offset))
                break
    # the bytes of an event are those of the first cluster holding it
    first: dict[tuple[str, int, int], tuple] = {}
    for n in names:
        for r in topics[n]:
            first.setdefault(r.event_id, (n, r.key, r.value))

    def content(member: str, run):
        recs = topics[member]
        bad, at = 0, -1
        for j in range(run.count):
            r = recs[run.seq + j]
            if first[r.event_id][1:] != (r.key, r.value):
                bad += 1
                at = j if at < 0 else at
        return (bad, at) if bad else None

    found += check({n: runs_from_events([r.event_id for r in topics[n]]) for n in names}, content=content)
    if expected is not None:
        for n in names:
            if len(topics[n]) != expected:
                anomaly = LOST_WRITE if len(topics[n]) < expected else FOREIGN
                found.append(Violation(anomaly, f"{n}: {len(topics[n])} records, expected {expected}", n))
    if found:
        return False, f"{found[0].anomaly}: {found[0].detail}"
    for n in names[1:]:
        if len(topics[n]) != len(topics[names[0]]):
            return False, f"{names[0]} has {len(topics[names[0]])} records, {n} has {len(topics[n])}"
    return True, f"{len(topics[names[0]]) if names else 0} records identical in {len(names)} clusters"


def check_sharded(parts: dict[str, list[list[GlobalRecord]]], expected: int | None = None) -> tuple[bool, str]:
    """A sharded global topic ({cluster: records of each partition}): each
    partition holds the same events at the same offsets in every cluster
    (`check_global_topics` per partition), every source event is in exactly one
    partition once (and `expected` of them, if given), in the partition of its
    shard (source partition mod K), and each source partition's events are in
    source-offset order.  Returns (ok, one line)."""
    names = sorted(parts)
    k = len(parts[names[0]]) if names else 0
    for s in range(k):
        ok, detail = check_global_topics({n: parts[n][s] for n in names})
        if not ok:
            return False, f"partition {s}: {detail}"
    for n in names:
        seen: set = set()
        for s, recs in enumerate(parts[n]):
            last: dict[tuple[str, int], int] = {}
            for r in recs:
                if r.event_id in seen:
                    return False, f"{n}: event {r.event_id} twice"
                seen.add(r.event_id)
                if r.origin_partition % k != s:
                    return False, f"{n}: event {r.event_id} in partition {s}, not {r.origin_partition % k}"
                src = (r.origin, r.origin_partition)
                if r.origin_offset <= last.get(src, -1):
                    return False, f"{n}: partition {s}: {src} offset {r.origin_offset} after {last[src]}"
                last[src] = r.origin_offset
        if expected is not None and len(seen) != expected:
            return False, f"{n}: {len(seen)} events, expected {expected}"
    sizes = "/".join(str(len(parts[names[0]][s])) for s in range(k)) if names else "-"
    return True, (f"{len(names)} clusters agree partition by partition ({k} partitions: {sizes} records), "
                  f"every event once, source-partition order kept")


def write_events(bootstrap: str, topic: str, n: int, tag: str, rate: float | None = None,
                 timeout: float = 60.0, warm_topic: str | None = None,
                 on_ready: Callable[[], object] | None = None, linger_ms: float = 2) -> int:
    """Produce n records key=f"{tag}-{i}" (optionally paced at `rate`/s);
    return how many were acknowledged.  Raises RuntimeError on a delivery error.

    A producer that fails (a fatal idempotence error, which a busy durable
    broker can cause, or a delivery error: logged) is replaced as an
    application should do it: the topic is read back and only the records not
    in it are produced again by a new producer, so none is written twice.

    `warm_topic`: first write one record there and wait for it, so the
    idempotent producer has its id and connection before the first counted
    record (a cold one holds its first records ~0.5 s, which would show as
    the ordering's latency); `on_ready()` is called once warm, before the
    first record (e.g. a barrier, so the caller's clock starts then)."""
    w = _RecoveringWriter(bootstrap, topic, tag, linger_ms, timeout)
    if warm_topic is not None:
        ensure_topic(bootstrap, warm_topic, 1)
        w.p.produce(warm_topic, key=tag.encode(), value=b"warm-up")
        if w.p.flush(timeout):
            raise RuntimeError(f"writing to {warm_topic} at {bootstrap}: warm-up record not acknowledged")
    if on_ready is not None:
        on_ready()
    t0 = time.monotonic()
    for i in range(n):
        w.produce(i)
        if rate:
            ahead = (i + 1) / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    return w.finish()


class _RecoveringWriter:
    """write_events' idempotent producer, replaced when it fails (its doc):
    a fatal error or a delivery error leaves the fate of the records in
    flight unknown, so the topic is read back once they are settled and only
    the records missing there are written again."""

    MAX_REPLACEMENTS = 5

    def __init__(self, bootstrap: str, topic: str, tag: str, linger_ms: float, timeout: float):
        self.bootstrap, self.topic, self.tag, self.timeout = bootstrap, topic, tag, timeout
        # librdkafka keeps a failed producer's in-flight records until
        # message.timeout.ms (default 300 s) when their broker is down; half
        # the timeout lets them settle in time for the read-back (CI: "10
        # records still in flight after 240 s" after a restarted broker).
        self.conf = {"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": linger_ms,
                     "message.timeout.ms": int(timeout * 500), "log_level": 3, "logger": client_log(),
                     "error_cb": self._on_error}
        self.unacked: set[int] = set()  # produced, no successful report yet
        self.acked = 0
        self.failed = None  # the KafkaError that failed the current producer
        self.gen = 0  # of the current producer: reports of a replaced one are ignored
        self.p = self._producer()

    def _producer(self):
        from confluent_kafka import Producer

        self.gen += 1
        self.failed = None
        return Producer(self.conf)

    def _on_error(self, err) -> None:
        if err.fatal():
            self.failed = err

    def _report(self, gen: int, i: int, err, msg) -> None:
        if gen != self.gen:
            return  # a replaced producer's: the read-back decided
        if err is None:
            self.unacked.discard(i)
            self.acked += 1
        elif self.failed is None:
            self.failed = err

    def _poll(self, t: float) -> None:
        """poll(t); a fatal error it raises (confluent-kafka raises some
        instead of calling error_cb) fails the producer."""
        from confluent_kafka import KafkaException

        try:
            self.p.poll(t)
        except (KafkaException, SystemError) as e:
            cause = e if isinstance(e, KafkaException) else e.__cause__
            if not isinstance(cause, KafkaException):
                raise
            self.failed = self.failed or cause.args[0]

    def produce(self, i: int) -> None:
        self.unacked.add(i)
        if not self._send(i):
            self._recover()  # i is unacknowledged: written there

    def _send(self, i: int) -> bool:
        """Produce record i; False if the producer failed (nothing sent)."""
        from confluent_kafka import KafkaException

        while self.failed is None:
            try:
                self.p.produce(self.topic, key=f"{self.tag}-{i}".encode(), value=f"{self.tag} event {i}".encode(),
                               headers=[("app", self.tag.encode())], on_delivery=partial(self._report, self.gen, i))
                self._poll(0)
                return True
            except BufferError:
                self._poll(0.01)
            except KafkaException as e:  # a fatal producer refuses records
                self.failed = e.args[0]
        return False

    def _drain(self) -> int:
        """Serve reports until none is outstanding or the timeout; the records left."""
        deadline = time.monotonic() + self.timeout
        while len(self.p) and time.monotonic() < deadline:
            self._poll(0.05)
        return len(self.p)

    def _recover(self) -> None:
        """Replace the failed producer; write the unacknowledged records the
        topic does not hold, in order."""
        import logging

        from kdsync.kafka.topic import partition_count

        for _ in range(self.MAX_REPLACEMENTS):
            if self.failed is None:
                return
            why = self.failed.str()
            logging.getLogger("kdsync.testing").warning(
                "writer %s: producer failed (%s); reading %s back and writing what is missing", self.tag, why,
                self.topic)
            with contextlib.suppress(Exception):
                self.p.purge(in_queue=True, in_flight=False)
            if self._drain():  # what was in flight may still land: it must settle before the read-back
                raise RuntimeError(f"writing to {self.topic} at {self.bootstrap}: {why}; {len(self.p)} records "
                                   f"still in flight after {self.timeout} s")
            keys = {f"{self.tag}-{i}".encode(): i for i in self.unacked}
            for part in range(partition_count(self.bootstrap, self.topic)):
                for m in iter_partition(self.bootstrap, self.topic, part, timeout=30, idle=True):
                    i = keys.pop(m.key(), None)
                    if i is not None:
                        self.unacked.discard(i)
                        self.acked += 1
            self.p = self._producer()
            for i in sorted(self.unacked):
                if not self._send(i):
                    break  # failed again: read back again
        if self.failed is not None:
            raise RuntimeError(f"writing to {self.topic} at {self.bootstrap}: {self.failed.str()} "
                               f"({self.MAX_REPLACEMENTS} producers in a row failed)")

    def finish(self) -> int:
        """Wait for every record; how many were acknowledged."""
        left = self._drain()
        while self.failed is not None:
            self._recover()
            left = self._drain()
        if left:
            raise RuntimeError(f"writing to {self.topic} at {self.bootstrap}: {left} unacknowledged")
        return self.acked


class Writers:
    """One paced idempotent writer thread per cluster of `g` (a LocalGroup),
    `n` events each (`write_events`, tag f"{tag}-{cluster}"), started at once.
    `acked[i]`: events cluster i acknowledged; `errors`: one line per writer
    that failed; join() waits and returns the events acknowledged in all."""

    def __init__(self, g, n: int, tag: str, rate: float | None, *, linger_ms: float = 2, timeout: float = 300,
                 warm_topic: str | None = None):
        self.acked = [0] * g.n
        self.errors: list[str] = []

        def w(i: int) -> None:
            try:
                self.acked[i] = write_events(g.bootstrap(i), g.topic, n, f"{tag}-{g.names[i]}", rate=rate,
                                             timeout=timeout, linger_ms=linger_ms, warm_topic=warm_topic)
            except Exception as e:  # the caller decides (join's result, errors)
                self.errors.append(f"writer {g.names[i]}: {e}")

        self.threads = [threading.Thread(target=w, args=(i,), daemon=True) for i in range(g.n)]
        for t in self.threads:
            t.start()

    def join(self, timeout: float = 600, *, strict: bool = False) -> int:
        """Wait for every writer; the events acknowledged in all.  `strict`:
        raise RuntimeError naming the first writer that failed."""
        for t in self.threads:
            t.join(timeout)
        if strict and self.errors:
            raise RuntimeError(f"writing failed: {self.errors[0]}")
        return sum(self.acked)


def child_pids(pid: int) -> list[int]:
    """Pids of the live children of process `pid` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d))
    return sorted(out)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


_TAKEN: set[int] = set()  # ports handed out by free_port_block in this process


def free_port_block(k: int) -> int:
    """A port P with P .. P + k - 1 all free (shard s listens on P + s), below
    the kernel's ephemeral range (so that no client connection takes P + 1
    meanwhile) and not handed out before by this process."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(500):
        p = random.randrange(10_000, max(10_001, low - k))
        if any(q in _TAKEN for q in range(p, p + k)):
            continue
        socks = []
        try:
            for q in range(p, p + k):
                sk = socket.socket()
                socks.append(sk)
                sk.bind(("127.0.0.1", q))
            _TAKEN.update(range(p, p + k))
            return p
        except OSError:
            continue
        finally:
            for sk in socks:
                sk.close()
    raise RuntimeError(f"no block of {k} free ports")


def _toml_str(v) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_str(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_str(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


DURABLE_LINGER_MS = 50  # producers' linger on durable clusters: fewer, larger batches (docs/durable.md)


class LocalGroup:
    """n embedded clusters and n `kdsync run` member processes (see module doc).

    `peer_address(i, j)` may route member i's link to member j elsewhere (a
    test proxy); by default it is member j's listen address.  Members listen
    on `host` (127.0.0.1; the RDMA tests give the address of the RDMA device,
    which rdma_cm cannot reach through loopback).  `broker`: the embedded
    implementation of every cluster, "tansu" or "noida" (None: $KDSYNC_TEST_BROKER,
    else tansu); a durable group is Tansu's whatever the environment says.
    """

    def __init__(self, n: int, workdir: str | os.PathLike[str], *, topic: str = "events", protocol: str = "derecho",
                 secret: str | None = "demo-secret", tick_ms: float = 5, heartbeat_ms: float = 20,
                 suspect_ms: float = 300, retransmit_ms: float = 30, names: list[str] | None = None,
                 peer_address: Callable[[int, int], str] | None = None, extra: dict[str, dict] | None = None,
                 metrics: bool = False, witnesses: set[int] | frozenset[int] = frozenset(), shards: int = 1,
                 workers: int | None = None, source_partitions: int = 1, durable: bool = False,
                 stall_after_ms: int = 10_000, expect_stalls: bool | tuple[str, ...] = False, host: str = "127.0.0.1",
                 broker: str | None = None,
                 durable_tuning: bool = True):
        # the environment's choice does not turn a durable group (S3: Tansu only) into an error
        self.broker = check_broker(broker, durable) if broker is not None else (
            "tansu" if durable else default_broker())
        self.n = n
        self.host = host
        # [health] stall_after_ms of every member; unless expect_stalls, close() fails on a member's "stalled" line
        self.stall_after_ms, self.expect_stalls = stall_after_ms, expect_stalls
        # durable: every cluster keeps its log in its own bucket of one S3 store (kill -9 + restart keep it)
        self.store = S3Store(log_dir=workdir) if durable else None
        self.shards = shards  # [topics] shards; shard s of member i listens on ports[i] + s
        self.workers = workers  # kdsync run --workers W (None: without)
        self.source_partitions = source_partitions
        self.witnesses = set(witnesses)  # indices of members with role "witness" (no cluster)
        self.data = [i for i in range(n) if i not in self.witnesses]
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.topic = topic
        self.global_topic = topic + "-global"
        self.names = names or [f"dc{i + 1}" for i in range(n)]
        self.clusters = [EmbeddedCluster(name, log_dir=self.dir, store=self.store, broker=self.broker)
                         for name in self.names]
        self.ports = [free_port_block(shards) for _ in range(n)]
        # with workers: the supervisor's port, then one per worker (kdsync.workers)
        self.metrics_ports = [free_port_block(1 + (workers or 0)) for _ in range(n)] if metrics else None
        self.protocol = protocol
        self.secret = secret
        self.timing = dict(tick_ms=tick_ms, heartbeat_ms=heartbeat_ms, suspect_ms=suspect_ms, retransmit_ms=retransmit_ms)
        self.peer_address = peer_address or (lambda i, j: f"{self.host}:{self.ports[j]}")
        self.extra = extra or {}
        # durable (unless durable_tuning=False: the members' plain defaults, as a user's config would have them):
        if durable and durable_tuning:  # Tansu on S3 stores one object per batch and lists a partition's objects on every fetch
            self.extra = {"kafka.producer": {"linger.ms": DURABLE_LINGER_MS},
                          "kafka.consumer": {"fetch.wait.max.ms": 100}, **self.extra}
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.member_args: dict[int, list[str]] = {}  # extra `kdsync run` arguments of member i
        self.logs: list[Path] = [self.dir / f"member-{name}.log" for name in self.names]
        self._tails: dict[int, GlobalTail] = {}

    # -------------------------------------------------------------- brokers
    def start_brokers(self) -> None:
        for i in self.data:
            self.clusters[i].start()
            ensure_topic(self.clusters[i].bootstrap, self.topic, self.source_partitions)

    def bootstrap(self, i: int) -> str:
        return self.clusters[i].bootstrap

    # -------------------------------------------------------------- members
    def config_text(self, i: int, **overrides) -> str:
        name = self.names[i]
        # state_dir is a top-level key: it comes before the first table
        lines = [f"state_dir = {_toml_str(str(self.dir / ('state-' + name)))}", "",
                 "[member]", f"id = {_toml_str(name)}", f"listen = {_toml_str(f'{self.host}:{self.ports[i]}')}",
                 f"role = {_toml_str('witness' if i in self.witnesses else 'member')}"]
        lines += [f"{_toml_str(k)} = {_toml_str(v)}" for k, v in {**self.extra.get("member", {}),
                                                                  **overrides.get("member", {})}.items()]
        lines += ["", "[peers]"]
        for j, other in enumerate(self.names):
            addr = f"{self.host}:{self.ports[j]}" if j == i else self.peer_address(i, j)
            if j in self.witnesses:
                lines.append(f"{other} = {{ address = {_toml_str(addr)}, role = \"witness\" }}")
            else:
                lines.append(f"{other} = {_toml_str(addr)}")
        sections = {
            "kafka": {"bootstrap.servers": self.clusters[i].bootstrap if i not in self.witnesses else "127.0.0.1:1"},
            "topics": {"source": self.topic, "global_suffix": "-global",
                       **({"shards": self.shards} if self.shards > 1 else {})},
            "transport": {"kind": "tcp", **({"secret": self.secret} if self.secret else {})},
            "protocol": {"name": self.protocol, **self.timing},
            "health": {"stall_after_ms": self.stall_after_ms},
        }
        if self.metrics_ports:
            sections["metrics"] = {"listen": f"127.0.0.1:{self.metrics_ports[i]}"}
        for sec, vals in (*self.extra.items(), *overrides.items()):
            if sec != "member":  # written above, in its table
                sections.setdefault(sec, {}).update(vals)
        for sec, vals in sections.items():
            lines += ["", f"[{sec}]"] + [f"{_toml_str(k)} = {_toml_str(v)}" for k, v in vals.items()]
        return "\n".join(lines) + "\n"

    def config_path(self, i: int) -> Path:
        return self.dir / f"{self.names[i]}.toml"

    def start_member(self, i: int, **overrides) -> subprocess.Popen:
        path = self.config_path(i)
        path.write_text(self.config_text(i, **overrides))
        log = open(self.logs[i], "ab")
        # PYTHONFAULTHANDLER: a member that crashes in native code (SIGSEGV) leaves its Python stack in its log
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
        workers = ["--workers", str(self.workers)] if self.workers else []
        self.procs[i] = subprocess.Popen([sys.executable, "-m", "kdsync.cli", "run", "--config", str(path), *workers,
                                          *self.member_args.get(i, ())],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=die_with_parent, start_new_session=True)
        log.close()
        return self.procs[i]

    def start_members(self) -> None:
        for i in range(self.n):
            self.start_member(i)

    def signal_member(self, i: int, sig: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(sig)

    def wait_member(self, i: int, timeout: float = 30.0) -> int:
        p = self.procs[i]
        rc = p.wait(timeout)
        self.procs[i] = None
        return rc

    def stop_member(self, i: int, timeout: float = 20.0) -> int | None:
        p = self.procs[i]
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs[i] = None
        return p.returncode

    def metrics(self, i: int, port_offset: int = 0, timeout: float = 2.0) -> dict[tuple[str, tuple], float]:
        """Member i's Prometheus samples {(name, sorted label items): value};
        empty when the endpoint does not answer (yet).  `port_offset`: with
        workers, 1 + w reads worker w's endpoint (0: the supervisor's)."""
        from urllib.request import urlopen

        from prometheus_client.parser import text_string_to_metric_families

        if not self.metrics_ports:
            raise RuntimeError("LocalGroup(metrics=True) is needed to read metrics")
        try:
            with urlopen(f"http://127.0.0.1:{self.metrics_ports[i] + port_offset}/metrics", timeout=timeout) as r:
                text = r.read().decode()
        except OSError:
            return {}
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def shard_metrics(self, i: int) -> dict[tuple[str, tuple], float]:
        """Member i's samples of every shard (label `shard`), from each worker's endpoint."""
        out: dict = {}
        for w in range(min(self.workers, self.shards) if self.workers else 0):
            out.update(self.metrics(i, 1 + w))
        return out if self.workers else self.metrics(i)

    def is_active(self, i: int) -> bool:
        if self.shards > 1:
            m = self.shard_metrics(i)
            return all(m.get(("kdsync_status", (("shard", str(s)), ("status", "active"), ("topic", self.topic))))
                       == 1.0 for s in range(self.shards))
        m = self.metrics(i)
        if m.get(("kdsync_status", (("status", "active"), ("topic", self.topic)))) != 1.0:
            return False
        # a data member's source consumer runs (it reports its lag once assigned): records
        # written from now on are fetched at once, not after the member's start-up
        return i not in self.data or any(name == "kdsync_input_lag" and ("topic", self.topic) in labels
                                         for name, labels in m)

    def worker_pids(self, i: int) -> list[int]:
        """Pids of member i's worker processes (children of its `kdsync run --workers`)."""
        p = self.procs[i]
        if p is None:
            return []
        return [pid for pid in child_pids(p.pid) if b"kdsync.workers" in _cmdline(pid)]

    def wait_ready(self, timeout: float = 30.0, members: list[int] | None = None) -> None:
        """Wait until every (listed) member reports status "active" for the topic
        (and, for a data member, that its source consumer runs).
        Raises TimeoutError naming the ones that did not (and RuntimeError if one exited)."""
        idx = list(range(self.n)) if members is None else members
        deadline = time.monotonic() + timeout
        waiting = list(idx)
        while waiting:
            for i in list(waiting):
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    # killed by a signal (a crash in native code): the log's tail holds
                    # faulthandler's Python stack of every thread (PYTHONFAULTHANDLER=1)
                    tail = self.log_text(i).strip().splitlines()[-1 if p.returncode >= 0 else -60:]
                    raise RuntimeError(f"member {self.names[i]} exited with {p.returncode}: " + "\n".join(tail))
                if self.is_active(i):
                    waiting.remove(i)
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"members not active after {timeout}s: {[self.names[i] for i in waiting]}")
            if waiting:
                time.sleep(0.05)

    def log_text(self, i: int) -> str:
        try:
            return self.logs[i].read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -------------------------------------------------------------- checks
    def read_globals(self, timeout: float = 30.0) -> dict[str, list[GlobalRecord]]:
        return {self.names[i]: read_global(self.clusters[i].bootstrap, self.global_topic, timeout) for i in self.data}

    def wait_for(self, expected: int, timeout: float, members: list[int] | None = None,
                 poll: float = 0.1) -> dict[str, list[GlobalRecord]]:
        """Poll until every (listed) global topic holds `expected` records or
        the deadline passes; returns the last reading either way."""
        idx = self.data if members is None else members
        deadline = time.monotonic() + timeout
        while True:
            got = {self.names[i]: self._tail(i).read(min(5.0, max(1.0, deadline - time.monotonic()))) for i in idx}
            if all(len(v) >= expected for v in got.values()) or time.monotonic() > deadline:
                return got
            for i in idx:  # a member that died will not get there
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    return got
            time.sleep(poll)

    def _tail(self, i: int, partition: int = 0) -> GlobalTail:
        key = i if partition == 0 else (i, partition)
        if key not in self._tails:
            self._tails[key] = GlobalTail(self.clusters[i].bootstrap, self.global_topic, partition)
        return self._tails[key]

    def read_partitions(self, timeout: float = 30.0) -> dict[str, list[list[GlobalRecord]]]:
        """Every partition (one per shard) of each cluster's global topic."""
        return {self.names[i]: [read_global(self.clusters[i].bootstrap, self.global_topic, timeout, s)
                                for s in range(self.shards)] for i in self.data}

    def wait_for_partitions(self, expected: int, timeout: float, poll: float = 0.1) -> dict[str, list[list[GlobalRecord]]]:
        """Poll until every cluster's global topic holds `expected` records over
        its partitions (one per shard) or the deadline passes; returns the last
        reading either way."""
        deadline = time.monotonic() + timeout
        while True:
            left = min(5.0, max(1.0, deadline - time.monotonic()))
            got = {self.names[i]: [self._tail(i, s).read(left) for s in range(self.shards)] for i in self.data}
            if all(sum(map(len, v)) >= expected for v in got.values()) or time.monotonic() > deadline:
                return got
            time.sleep(poll)

    # -------------------------------------------------------------- cleanup
    def close(self) -> None:
        for t in self._tails.values():
            with contextlib.suppress(Exception):
                t.close()
        for i in range(self.n):  # all at once, then wait for each
            with contextlib.suppress(Exception):
                self.signal_member(i, signal.SIGCONT)
                self.signal_member(i, signal.SIGTERM)
        for i in range(self.n):
            with contextlib.suppress(Exception):
                self.stop_member(i, timeout=10)
        for c in self.clusters:
            with contextlib.suppress(Exception):
                c.close()
        if self.store is not None:
            self.store.close()
        if self.expect_stalls is not True and sys.exc_info()[0] is None:
            self.assert_no_stall()

    def stalls(self) -> list[str]:
        """Every "stalled" line the members logged (kdsync.observability.stalls)."""
        return [f"{self.names[i]}: {line}" for i in range(self.n) for line in self.log_text(i).splitlines()
                if 'msg="stalled: ' in line]

    def assert_no_stall(self) -> None:
        expected = () if self.expect_stalls is False else self.expect_stalls
        found = [line for line in self.stalls() if not any(f" stage={st} " in line for st in expected)]
        if found:
            raise AssertionError(f"{len(found)} stall warning(s) in a run that expected none "
                                 f"(LocalGroup(expect_stalls=True) if the test causes them): {found[0]}")

    def read_sources(self, timeout: float = 30.0) -> dict[str, list[tuple[int, int, bytes | None]]]:
        """Every record in each cluster's source topic: name -> [(partition, offset, key)].
        `timeout`: seconds without a record (a durable broker's topic of many
        small objects reads slowly on a busy machine, but it reads)."""
        return {self.names[i]: [(m.partition(), m.offset(), m.key()) for p in range(self.source_partitions)
                                for m in iter_partition(self.bootstrap(i), self.topic, p, timeout=timeout, idle=True)]
                for i in self.data}

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def measure(protocol: str, workdir: Path, clusters: int = 3, backlog: int = 5000, rate: float = 300.0,
            paced: int = 1500, timeout: float = 180.0, **group_kw) -> dict:
    """End-to-end figures of one protocol on `clusters` local clusters.

    throughput: `backlog` events per cluster are written while the members are
    down, then the members start; events/s = all events / the span of their
    global records' timestamps (first written -> last in the last cluster: a
    clock started after `wait_ready` would miss a small backlog already
    ordered by then).
    latency: with the group running, `paced` events in total written at `rate`
    events/s across the clusters (writers warmed up first: a cold idempotent
    producer holds its first records ~0.5 s); p50/p99 of (global record
    timestamp - source timestamp) over every cluster's global topic.
    Raises on a member or broker failure.
    """
    out: dict = {"protocol": protocol, "clusters": clusters, "backlog_per_cluster": backlog, "rate_eps": rate}
    with LocalGroup(clusters, workdir, protocol=protocol, metrics=True, **group_kw) as g:
        g.start_brokers()
        Writers(g, backlog, "b", None).join(strict=True)  # members are down: a backlog waits in every source topic
        g.start_members()
        g.wait_ready(timeout=90)
        total = backlog * clusters
        got = g.wait_for(total, timeout, poll=0.5)
        short = {n: len(v) for n, v in got.items() if len(v) < total}
        if short:
            raise RuntimeError(f"backlog of {total} not delivered in {timeout:.0f} s: {short}")
        ts = [r.write_ts for v in got.values() for r in v]
        span_s = max(1e-3, (max(ts) - min(ts)) / 1000.0)
        out["throughput_eps"] = total / span_s
        out["throughput_span_s"] = round(span_s, 3)
        out["throughput_ok"] = True  # every cluster holds the whole backlog (checked above)
        if protocol == "mirror":
            ok, detail = True, "mirror: counts only (no agreed order)"
        else:
            ok, detail = check_global_topics(got, expected=total)
        per = paced // clusters
        Writers(g, per, "p", rate / clusters, warm_topic=WARM_TOPIC).join(strict=True)
        got = g.wait_for(total + per * clusters, timeout, poll=0.5)
        lat = [max(0, r.write_ts - r.origin_ts) for v in got.values() for r in v if (r.key or b"").startswith(b"p")]
        out["latency_p50_ms"] = percentile(lat, 50)
        out["latency_p99_ms"] = percentile(lat, 99)
        out["latency_samples"] = len(lat)
        if protocol != "mirror":
            ok2, detail = check_global_topics(got, expected=total + per * clusters)
            ok = ok and ok2
        out["agreement"] = None if protocol == "mirror" else ok
        out["detail"] = detail
    return out
