"""Small, synchronous topic helpers shared by the member, the demo and tests.

The tail of a partition is found by reading to partition EOF, never by
ListOffsets alone (Tansu reports the high watermark too low after
multi-record batches; on Kafka with transactions control records take offsets).

A read that gets nothing while the partition's high watermark is ahead of it
(a stalled fetch: Tansu on S3 storage answers fetches whose wait is shorter
than its storage listing with nothing, docs/durable.md) raises
`FetchStalledError` after `STALL_S` and raises the fetch wait of every
consumer this process creates afterwards (`consumer`): the caller's retry,
with a new consumer, gets past it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from kdsync.observability.logs import client_log

__all__ = ["LATEST", "FetchStalledError", "PartitionEndError", "TopicSettingsError", "TopicSpec", "admin_conf", "consumer",
           "empty_topics", "ensure_topic", "ensure_topics",
           "fetch_wait_ms", "iter_partition",
           "partition_count", "read_partition", "read_to_eof", "topic_settings", "weaker_settings"]

log = logging.getLogger("kdsync.kafka.topic")

# create_topics errors that no retry can fix: the asked settings are wrong for this cluster
_SETTINGS_ERRORS = {KafkaError.INVALID_CONFIG, KafkaError.INVALID_REPLICATION_FACTOR, KafkaError.POLICY_VIOLATION,
                    KafkaError.INVALID_REQUEST, KafkaError.INVALID_PARTITIONS, KafkaError.UNSUPPORTED_VERSION,
                    KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED}


# topics per DescribeConfigs request: Tansu 0.6 answers one for a few hundred topics with a
# response librdkafka cannot parse (found by tests/test_topic_settings.py)
DESCRIBE_AT_ONCE = 50
LIST_AT_ONCE = 500  # partitions per ListOffsets request (empty_topics)
OFFSET_LATEST_TS = -1  # ListOffsets' timestamp for "the latest offset"


class TopicSettingsError(ValueError):
    """The cluster refused to create a topic with the asked settings; str() is one line."""


LATEST = -1  # ListOffsets' timestamp for "the end" (offsets_for_times passes it through)
STALL_S = 2.0  # a read that gets nothing this long while records wait is a stalled fetch
MAX_FETCH_WAIT_MS = 5000
_learned_wait_ms = 0  # raised by a stalled read: the least fetch wait of the consumers created from then on


class FetchStalledError(TimeoutError):
    """Every fetch came back empty for STALL_S although the partition's high
    watermark is ahead of the read; retry with a new consumer (`consumer`
    now asks for a longer fetch wait)."""


def fetch_wait_ms(configured: int = 10) -> int:
    """The fetch wait for a new consumer: `configured`, or more after a stalled read."""
    return max(int(configured), _learned_wait_ms)


def _stalled(c: Consumer, topic: str, partition: int, nxt: int) -> int:
    """Records waiting in topic[partition] ahead of offset `nxt`, by the high
    watermark of `c`'s last fetch response (0: none or unknown)."""
    try:
        _, hi = c.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
    except Exception:
        return 0
    return hi - nxt if hi is not None and hi > nxt >= 0 else 0


def consumer(bootstrap_or_conf: str | dict) -> Consumer:
    """A consumer for reads to partition EOF (no commits, EOF events on); returns it."""
    conf = {"bootstrap.servers": bootstrap_or_conf} if isinstance(bootstrap_or_conf, str) else dict(bootstrap_or_conf)
    conf.update({
        "group.id": conf.get("group.id", "kdsync-reader"),
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        "log_level": conf.get("log_level", 3),
        "logger": conf.get("logger") or client_log(),  # never raw %3|... lines (kdsync.observability.logs)
        "fetch.wait.max.ms": fetch_wait_ms(conf.get("fetch.wait.max.ms", 10)),  # EOF comes after an empty fetch
    })
    return Consumer(conf)


class PartitionEndError(ValueError):
    """A partition ends (partition EOF) before the offset a strict read asked for."""


def read_to_eof(c: Consumer, topic: str, partition: int = 0, start: int = 0, stop: int | None = None, *,
                timeout: float = 30.0, idle: bool = False, strict: bool = False, batch: int = 1000,
                poll: float = 0.2, gaps=None) -> Iterator[Message]:
    """Assign consumer `c` (created with enable.partition.eof) to
    `topic[partition]` at offset `start` and yield its records until partition
    EOF or offset `stop` (exclusive); unassign when done or abandoned.

    The one read-to-EOF loop of kdsync: every reader of a topic's tail uses it.
    `timeout`: seconds to reach EOF or `stop`, counted from the start, or, with
    `idle`, from the last record received.  Raises TimeoutError when it passes.
    Lenient (default): a missing topic or partition reads as empty, transient
    errors are retried, fatal ones raise KafkaException.  `strict` (the range
    must exist): every non-retriable error raises KafkaException, and an EOF
    before `stop` raises PartitionEndError.  The generator's return value
    (``end = yield from read_to_eof(...)``) is the partition's end offset
    at EOF, `stop` when it stopped there, None for a missing topic.
    `gaps` (a kdsync.kafka.gaps.ReadGaps, for topics only kdsync writes): an
    offset skipped between `start` and a record or the end is explained or
    fetched again, never read past (one comparison per record; raises
    GlobalGapError when it cannot be read).
    """
    global _learned_wait_ms
    c.assign([TopicPartition(topic, partition, max(start, 0))])  # out of range -> earliest
    if gaps is not None and not gaps.enabled():  # KDSYNC_GLOBAL_GAP_ACCOUNTING=off (kdsync.kafka.gaps)
        gaps = None
    try:
        deadline = time.monotonic() + timeout
        progress = time.monotonic()
        nxt = max(start, 0)  # the next offset this read waits for
        while True:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"no end of {topic}[{partition}] within {timeout}s")
            # a consumer created with a long fetch wait may rightly get nothing for that long
            if now - progress > max(STALL_S, 3 * _learned_wait_ms / 1000):
                progress = now
                waiting = _stalled(c, topic, partition, nxt)
                if waiting:
                    _learned_wait_ms = min(MAX_FETCH_WAIT_MS, max(2 * _learned_wait_ms, 80))
                    log.warning("fetches of %s[%d] return nothing while %d records wait; new consumers ask with "
                                "fetch.wait.max.ms=%d (docs/durable.md)", topic, partition, waiting, _learned_wait_ms)
                    raise FetchStalledError(f"{topic}[{partition}]: fetches return nothing while {waiting} records "
                                            f"wait (stalled fetch; retry with a new consumer)")
            msgs = c.consume(batch, timeout=poll)
            if msgs:
                progress = time.monotonic()
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if gaps is not None and m.offset() > nxt and not gaps.explained(
                                c, topic, partition, nxt, m.offset()):
                            _seek(c, topic, partition, nxt)  # the end is beyond offsets never read: again
                            break
                        if strict and stop is not None and m.offset() < stop:
                            raise PartitionEndError(f"{topic}[{partition}] ends at {m.offset()}, "
                                                    f"before the requested end {stop}")
                        return m.offset()
                    if strict:
                        if err.fatal() or not err.retriable():
                            raise KafkaException(err)
                    elif err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION,
                                        KafkaError._UNKNOWN_TOPIC):
                        return  # no topic: empty
                    elif err.fatal():
                        raise KafkaException(err)
                    continue
                if gaps is not None:
                    if m.offset() > nxt and not gaps.explained(c, topic, partition, nxt,
                                                               m.offset() if stop is None else min(m.offset(), stop)):
                        _seek(c, topic, partition, nxt)  # fetch again; the records after the gap are not handed over
                        break
                    if gaps.pending:
                        gaps.arrived(c, topic, partition, m.offset() + 1)
                if stop is not None and m.offset() >= stop:
                    return stop
                if idle:
                    deadline = time.monotonic() + timeout
                nxt = m.offset() + 1
                yield m
                if stop is not None and m.offset() + 1 >= stop:
                    return stop
    finally:
        if gaps is not None:
            gaps.forget(topic, partition)
        c.unassign()


def _seek(c: Consumer, topic: str, partition: int, offset: int) -> None:
    """Fetch topic[partition] again from `offset` (what was fetched beyond it is dropped)."""
    try:
        c.seek(TopicPartition(topic, partition, offset))
    except KafkaException:  # not yet fetching: assign there
        c.assign([TopicPartition(topic, partition, offset)])


def iter_partition(conf: str | dict, topic: str, partition: int = 0, start: int = 0,
                   stop: int | None = None, timeout: float = 30.0, batch: int = 1000,
                   idle: bool = False) -> Iterator[Message]:
    """Yield the records of one partition from offset `start` until partition
    EOF (or offset `stop`, exclusive), with a consumer of its own.  Raises
    TimeoutError when EOF is not reached within `timeout` seconds (with
    `idle`: `timeout` seconds without a record), KafkaException on a fatal
    error."""
    if partition_count(conf, topic) <= partition:
        return  # no such topic/partition: nothing to read
    nxt = start
    stalls = 0
    while True:  # a stalled fetch: again from where it got, with a new consumer (and a longer fetch wait)
        c = consumer(conf)
        before = nxt
        try:
            for m in read_to_eof(c, topic, partition, nxt, stop, timeout=timeout, batch=batch, idle=idle):
                nxt = m.offset() + 1
                yield m
            return
        except FetchStalledError:
            stalls = 0 if nxt > before else stalls + 1  # six in a row without a record: give up
            if stalls == 6:
                raise
        finally:
            c.close()


def read_partition(conf: str | dict, topic: str, partition: int = 0, start: int = 0,
                   stop: int | None = None, timeout: float = 30.0) -> list[Message]:
    """All records of `topic[partition]` from `start` to its end, as a list."""
    return list(iter_partition(conf, topic, partition, start, stop, timeout))


def partition_count(conf: str | dict, topic: str, timeout: float = 10.0) -> int:
    """Number of partitions of `topic`, 0 if it does not exist."""
    admin = AdminClient(admin_conf(conf))
    md = admin.list_topics(timeout=timeout)  # naming the topic would auto-create it
    t = md.topics.get(topic)
    if t is None or t.error is not None:
        return 0
    return len(t.partitions)


def admin_conf(conf: str | dict) -> dict:
    if isinstance(conf, str):
        return {"bootstrap.servers": conf}
    drop = {"group.id", "enable.auto.commit", "auto.offset.reset", "enable.partition.eof",
            "enable.idempotence", "acks", "linger.ms", "compression.type", "isolation.level",
            "session.timeout.ms", "max.poll.interval.ms", "fetch.wait.max.ms", "batch.num.messages",
            "queue.buffering.max.ms", "queue.buffering.max.messages", "message.timeout.ms", "retries"}
    return {k: v for k, v in conf.items() if k not in drop}


@dataclass(frozen=True)
class TopicSpec:
    """A topic to ensure: its name, partition count, replication factor (None:
    the broker's default.replication.factor) and topic configs."""

    name: str
    partitions: int = 1
    replication_factor: int | None = None
    config: dict[str, str] = field(default_factory=dict)


def ensure_topic(conf: str | dict, topic: str, partitions: int = 1, timeout: float = 10.0,
                 replication_factor: int | None = None, config: dict[str, str] | None = None) -> int:
    """Create `topic` with `partitions` partitions unless it exists; return its
    partition count (which may differ if it already existed).  One topic of
    `ensure_topics`, which says the rest."""
    spec = TopicSpec(topic, partitions, replication_factor, dict(config or {}))
    return ensure_topics(conf, [spec], timeout)[topic]


def ensure_topics(conf: str | dict, specs: list[TopicSpec], timeout: float = 10.0) -> dict[str, int]:
    """Create every topic of `specs` that does not exist; return each one's
    partition count (an existing topic's may differ from the spec's).

    A new topic gets its spec's replication factor and configs.  An existing
    topic is left as it is; when settings were asked and it has weaker ones,
    one WARNING line per topic says which.  However many topics, this is one
    metadata request, one CreateTopics for the missing ones and one
    DescribeConfigs for the existing ones with settings asked (a member
    starting with a thousand topics does not walk them one by one).  Raises
    TopicSettingsError when the cluster refuses a spec's settings,
    KafkaException / TimeoutError when it cannot be reached."""
    admin = AdminClient(admin_conf(conf))
    md = admin.list_topics(timeout=timeout)  # naming a topic would auto-create it
    have: dict[str, int] = {}
    missing: list[TopicSpec] = []
    check: list[tuple[TopicSpec, int]] = []
    asked: set[str] = set()
    for s in specs:
        t = md.topics.get(s.name)
        if t is not None and t.error is None and t.partitions:
            have[s.name] = len(t.partitions)
            if s.replication_factor is not None or s.config:
                check.append((s, min(len(p.replicas) for p in t.partitions.values())))
        elif s.name not in asked:
            missing.append(s)
        asked.add(s.name)
    if check:
        _warn_if_weaker(admin, check, timeout)
    if not missing:
        return have
    # -1: let the broker apply its default (CreateTopics v4+, Kafka 2.4+)
    futs = admin.create_topics([NewTopic(s.name, s.partitions, s.replication_factor if s.replication_factor is not None
                                         else -1, config=dict(s.config)) for s in missing], operation_timeout=timeout)
    for s in missing:
        try:
            futs[s.name].result(timeout)
        except KafkaException as e:
            err = e.args[0]
            if err.code() in _SETTINGS_ERRORS:
                asked = f"replication_factor={s.replication_factor if s.replication_factor is not None else 'default'}"
                asked += "".join(f", {k}={v}" for k, v in sorted(s.config.items()))
                raise TopicSettingsError(f"creating {s.name} ({asked}): {err.str()}") from None
            if err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    deadline = time.monotonic() + timeout
    while True:
        md = admin.list_topics(timeout=timeout)
        for s in missing:
            t = md.topics.get(s.name)
            if t is not None and t.error is None and t.partitions:
                have[s.name] = len(t.partitions)
        waiting = [s.name for s in missing if s.name not in have]
        if not waiting:
            return have
        if time.monotonic() >= deadline:
            raise TimeoutError(f"topic {waiting[0]} not visible after creation"
                               + (f" (and {len(waiting) - 1} more)" if len(waiting) > 1 else ""))
        time.sleep(0.05)


def empty_topics(conf: str | dict, partitions: dict[str, int], timeout: float = 10.0) -> set[str]:
    """The topics of `partitions` (topic -> partition count) whose every
    partition holds no record and never did: the latest offset is 0 for
    each (Tansu reports too low an end after multi-record batches, but never
    0 for a partition with a record).  One ListOffsets per LIST_AT_ONCE
    partitions, however many topics: a member starting a thousand new topics
    skips reading each.  Raises KafkaException / TimeoutError when the
    cluster cannot be reached.

    Asked through a consumer's offsets_for_times (timestamp -1: the latest
    offset), not AdminClient.list_offsets: in CI the admin call crashed the
    process with SIGSEGV inside confluent-kafka (2.16.1) while submitting the
    second request of a loop like this one."""
    from contextlib import closing

    tps = [TopicPartition(t, p, OFFSET_LATEST_TS) for t, n in partitions.items() for p in range(n)]
    full: set[str] = set()
    with closing(consumer(conf)) as c:
        for i in range(0, len(tps), LIST_AT_ONCE):
            for tp in c.offsets_for_times(tps[i:i + LIST_AT_ONCE], timeout):
                if tp.error is not None:
                    raise KafkaException(tp.error)
                if tp.offset != 0:
                    full.add(tp.topic)
    return set(partitions) - full


def topic_settings(conf: str | dict, topic: str, timeout: float = 10.0) -> tuple[int, dict[str, str]]:
    """(replication factor, topic configs) of an existing topic as the cluster
    reports them: the smallest replica count over its partitions, and every
    config DescribeConfigs returns.  Raises KafkaException, or KeyError when
    the topic does not exist."""
    return _settings(AdminClient(admin_conf(conf)), topic, timeout)


def _settings(admin: AdminClient, topic: str, timeout: float) -> tuple[int, dict[str, str]]:
    md = admin.list_topics(timeout=timeout)  # naming the topic would auto-create it
    t = md.topics.get(topic)
    if t is None or t.error is not None or not t.partitions:
        raise KeyError(topic)
    rf = min(len(p.replicas) for p in t.partitions.values())
    res = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)], request_timeout=timeout)
    entries = next(iter(res.values())).result(timeout)
    return rf, {k: v.value for k, v in entries.items() if v.value is not None}


def weaker_settings(have_rf: int, have: dict[str, str], replication_factor: int | None,
                    config: dict[str, str]) -> list[str]:
    """What an existing topic has below (or other than) what was asked, one
    phrase per setting; empty when it has everything."""
    out = []
    if replication_factor is not None and have_rf < replication_factor:
        out.append(f"replication factor {have_rf} < {replication_factor}")
    for k, want in sorted(config.items()):
        got = have.get(k)
        if got == want:
            continue
        if got is None:
            out.append(f"{k} not set (asked {want})")
        elif k == "min.insync.replicas" and got.isdigit() and want.isdigit():
            if int(got) < int(want):
                out.append(f"{k} {got} < {want}")
        else:
            out.append(f"{k} = {got} (asked {want})")
    return out


def _warn_if_weaker(admin: AdminClient, existing: list[tuple[TopicSpec, int]], timeout: float) -> None:
    """One WARNING per existing topic (spec, replication factor it has) whose
    settings are weaker than its spec asks; one DescribeConfigs for all."""
    by_name = {}
    try:
        for i in range(0, len(existing), DESCRIBE_AT_ONCE):
            futs = admin.describe_configs([ConfigResource(ResourceType.TOPIC, s.name)
                                           for s, _ in existing[i:i + DESCRIBE_AT_ONCE]], request_timeout=timeout)
            by_name.update((r.name, f) for r, f in futs.items())
    except Exception as e:  # the topics work all the same: say we could not check
        log.warning("cannot read the settings of existing topics", extra={"kv": {"topics": len(existing),
                                                                               "error": str(e)}})
        return
    for s, rf in existing:
        try:
            entries = by_name[s.name].result(timeout)
        except Exception as e:
            log.warning("cannot read the settings of an existing topic", extra={"kv": {"topic": s.name,
                                                                                     "error": str(e)}})
            continue
        have = {k: v.value for k, v in entries.items() if v.value is not None}
        weaker = weaker_settings(rf, have, s.replication_factor, s.config)
        if weaker:
            log.warning("existing topic has weaker settings than [topics] asks; kdsync does not change them "
                        "(kafka-configs / kafka-reassign-partitions do)",
                        extra={"kv": {"topic": s.name, "weaker": "; ".join(weaker)}})
