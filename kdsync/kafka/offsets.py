"""Consumer-group fail-over between clusters by offset (`kdsync offsets`).

kdsync writes the agreed order to `T-global` in every cluster, so a record
sits at the same partition and offset of `T-global` in every cluster (one
partition: offset = `kdsync.seq`; several: the partition comes from the key's
CRC-32 or the position, identical everywhere, and each partition holds its
share of the order).  A committed offset is therefore exact in every cluster,
and moving a consumer group is copying its committed offsets:

* `sync_offsets(...)` copies group G's committed offsets on `T-global` from
  one cluster to another, after checking that the target group has no
  consumers (a broker refuses an admin commit into an active group anyway)
  and that the target's `T-global` holds the same record just below every
  offset (same `kdsync.seq` and origin): the target is not behind and the two
  logs are the same log.
* `translate(...)` finds where an event of a source topic sits in `T-global`.

How translate finds the record without reading the whole topic: the records
of one origin partition appear in `T-global` in increasing origin-offset order
(kdsync delivers each origin partition in order; the order holds in every
global partition, which each hold a subsequence of the global order).  Let
g(x) be the origin offset of the first record of that origin partition at or
after offset x; g never decreases as x grows, so a binary search over
offsets finds the first x with g(x) >= the wanted origin offset.  A probe
reads forward from x until it meets a record of that origin partition (or the
end), so a probe costs about the distance between two records of that origin
partition, and a search about log2(records) probes; a probe that lands on a
record below the target moves the lower bound past that record.  When the
source record can be read (the cluster is the origin) and has a key, the
global partition follows from the key and only that partition is searched;
otherwise every partition is.

The end of a partition is found by reading from the reported high watermark
to partition EOF (Tansu under-reports ListOffsets after batches; see
kdsync.kafka.topic).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from confluent_kafka import ConsumerGroupState, ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from kdsync.kafka.gaps import GlobalGapError, ReadGaps
from kdsync.kafka.topic import consumer, read_to_eof
from kdsync.kafka.records import H_OOFF, H_OPART, H_ORIGIN, H_SEQ, global_partition

__all__ = ["ClusterRef", "GlobalRecordRef", "OffsetsError", "SyncResult", "Location", "parse_cluster",
           "sync_offsets", "translate"]

_ACTIVE = {ConsumerGroupState.STABLE, ConsumerGroupState.PREPARING_REBALANCING,
           ConsumerGroupState.COMPLETING_REBALANCING}
_GROUP_BUSY = {KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION, KafkaError.REBALANCE_IN_PROGRESS}


class OffsetsError(Exception):
    """A refusal or failure of `kdsync offsets`; str() is one line for the operator (exit 1)."""


class BadInput(OffsetsError):
    """The request itself cannot be answered as asked (exit 2)."""


@dataclass(frozen=True)
class ClusterRef:
    """A cluster named on the command line: NAME=BROKERS."""

    name: str
    bootstrap: str


def parse_cluster(text: str) -> ClusterRef:
    """"dc1=host:9092,host2:9092" -> ClusterRef; raises ValueError with a short reason."""
    name, sep, brokers = text.partition("=")
    if not sep or not name or not brokers:
        raise ValueError(f"expected NAME=BROKERS, got {text!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise ValueError(f"{name!r} is not a valid cluster name (letters, digits, . _ -)")
    for b in brokers.split(","):
        host, _, port = b.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{b!r} is not host:port in {text!r}")
    return ClusterRef(name, brokers)


@dataclass(frozen=True)
class GlobalRecordRef:
    """Where one record sits in a global topic and which event it is."""

    partition: int
    offset: int
    seq: int
    origin: str
    origin_partition: int
    origin_offset: int

    @property
    def event(self) -> tuple[int, str, int, int]:
        return (self.seq, self.origin, self.origin_partition, self.origin_offset)


def _ref(m) -> GlobalRecordRef:
    h = dict(m.headers() or [])
    try:
        return GlobalRecordRef(m.partition(), m.offset(), int(h[H_SEQ]), h[H_ORIGIN].decode(), int(h[H_OPART]),
                               int(h[H_OOFF]))
    except (KeyError, ValueError, AttributeError):
        raise OffsetsError(f"{m.topic()}[{m.partition()}] offset {m.offset()} has no kdsync headers: "
                           f"kdsync must be the only writer of its global topics") from None


class _Reader:
    """One consumer (assign only, never joins a group) for point reads."""

    def __init__(self, bootstrap: str, timeout: float):
        # small fetches: a probe wants the records near one offset, not megabytes ahead
        self.c = consumer({"bootstrap.servers": bootstrap, "queued.min.messages": 500, "log_level": 0,
                            "max.partition.fetch.bytes": 262144, "fetch.max.bytes": 1048576})
        self.gaps = ReadGaps(bootstrap)  # every offset of a global topic read, or the command fails
        self.timeout = timeout
        self.ends: dict[tuple[str, int], int] = {}

    def scan(self, topic: str, partition: int, start: int):
        """Yield records of topic[partition] from `start` (or the first one after it) to partition EOF."""
        end = self.ends.get((topic, partition))
        if end is None:
            end = self.end(topic, partition)[1]
        if start >= end:
            # nothing there; and a fetch past the end gets no answer at all from Tansu (no EOF, no error)
            return
        yield from self._scan(topic, partition, start)

    def _scan(self, topic: str, partition: int, start: int):
        try:
            for m in read_to_eof(self.c, topic, partition, start, timeout=self.timeout, strict=True, batch=500,
                                 gaps=self.gaps):
                if m.offset() >= start:  # an offset reset may start below `start`
                    yield m
        except TimeoutError:
            raise OffsetsError(f"no answer reading {topic}[{partition}] from offset {start} within "
                               f"{self.timeout:g}s") from None
        except KafkaException as e:
            raise OffsetsError(f"reading {topic}[{partition}]: {e.args[0].str()}") from None
        except GlobalGapError as e:
            raise OffsetsError(str(e)) from None

    def first_at(self, topic: str, partition: int, offset: int):
        """The record at `offset`, or the first one after it, or None at the end."""
        for m in self.scan(topic, partition, offset):
            return m
        return None

    def end(self, topic: str, partition: int) -> tuple[int, int]:
        """(first offset, end offset) of a partition, the end read to EOF (and remembered for scans)."""
        try:
            lo, hi = self.c.get_watermark_offsets(TopicPartition(topic, partition), timeout=self.timeout,
                                                  cached=False)
        except KafkaException as e:
            raise OffsetsError(f"reading the end of {topic}[{partition}]: {e.args[0].str()}") from None
        end = max(hi, lo)
        for m in self._scan(topic, partition, end):  # ListOffsets may count short (Tansu): never past the end
            end = m.offset() + 1
        self.ends[(topic, partition)] = end
        return max(lo, 0), end

    def close(self) -> None:
        self.c.close()


# ---------------------------------------------------------------- sync
@dataclass
class SyncResult:
    """What `sync_offsets` did: offsets per partition on the target, before and after."""

    group: str
    topic: str
    source: str
    target: str
    offsets: dict[int, int] = field(default_factory=dict)
    previous: dict[int, int | None] = field(default_factory=dict)
    without_commit: list[int] = field(default_factory=list)  # partitions G never committed on the source

    @property
    def changed(self) -> bool:
        return any(self.previous.get(p) != o for p, o in self.offsets.items())

    def as_json(self) -> dict:
        return {"group": self.group, "topic": self.topic, "from": self.source, "to": self.target,
                "offsets": {str(p): o for p, o in sorted(self.offsets.items())},
                "previous": {str(p): o for p, o in sorted(self.previous.items())},
                "without_commit": self.without_commit, "changed": self.changed}


def _admin(bootstrap: str) -> AdminClient:
    # log_level 0: a broker that is down is reported once, as the error of the request, not per retry
    return AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})


def partition_count(cluster: ClusterRef, topic: str, timeout: float) -> int:
    """Partitions of `topic` in `cluster`, 0 when it does not exist; raises OffsetsError when unreachable."""
    try:
        md = _admin(cluster.bootstrap).list_topics(timeout=timeout)  # naming the topic would auto-create it
    except KafkaException as e:
        raise OffsetsError(f"cannot reach {cluster.name} at {cluster.bootstrap}: {e.args[0].str()}") from None
    t = md.topics.get(topic)
    return 0 if t is None or t.error is not None else len(t.partitions)


def committed_offsets(admin: AdminClient, group: str, topic: str, partitions: int, timeout: float) -> dict[int, int]:
    """Group's committed offsets on topic[0..partitions) (partitions without one are left out).
    Raises OffsetsError when the broker cannot answer."""
    req = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in range(partitions)])
    try:
        res = admin.list_consumer_group_offsets([req], request_timeout=timeout)[group].result()
    except KafkaException as e:
        raise OffsetsError(f"reading the committed offsets of group {group}: {e.args[0].str()}") from None
    out = {}
    for tp in res.topic_partitions:
        if tp.error is not None:
            raise OffsetsError(f"reading the committed offset of group {group} on {topic}[{tp.partition}]: "
                               f"{tp.error.str()}")
        if tp.topic == topic and tp.offset >= 0:
            out[tp.partition] = tp.offset
    return out


def group_activity(admin: AdminClient, group: str, timeout: float) -> tuple[bool, str]:
    """(active, description): whether the group has consumers (members, or a
    state other than Empty/Dead: Tansu reports a Stable group without members)."""
    try:
        d = admin.describe_consumer_groups([group], request_timeout=timeout)[group].result()
    except KafkaException as e:
        if e.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND:
            return False, "unknown"
        raise OffsetsError(f"describing group {group}: {e.args[0].str()}") from None
    active = bool(d.members) or d.state in _ACTIVE
    return active, f"{d.state.name.lower()}, {len(d.members)} members"


def _check_partitions(src: ClusterRef, dst: ClusterRef, gt: str, timeout: float) -> int:
    parts = partition_count(src, gt, timeout)
    if parts == 0:
        raise OffsetsError(f"{src.name} has no topic {gt}")
    other = partition_count(dst, gt, timeout)
    if other == 0:
        raise OffsetsError(f"{dst.name} has no topic {gt}")
    if other != parts:
        raise OffsetsError(f"{gt} has {parts} partitions in {src.name} but {other} in {dst.name}")
    return parts


def sync_offsets(src: ClusterRef, dst: ClusterRef, group: str, topic: str, global_suffix: str = "-global",
                 timeout: float = 30.0) -> SyncResult:
    """Copy `group`'s committed offsets on topic+suffix from `src` to `dst`, exactly.

    Returns the SyncResult (nothing is written when the target already has
    the same offsets).  Raises OffsetsError (one line) when the target group
    is active, the target topic is behind (or holds a different record below
    an offset), the source group has no committed offset, or a broker fails."""
    gt = topic + global_suffix
    parts = _check_partitions(src, dst, gt, timeout)
    sa, da = _admin(src.bootstrap), _admin(dst.bootstrap)
    offsets = committed_offsets(sa, group, gt, parts, timeout)
    if not offsets:
        raise OffsetsError(f"group {group} has no committed offset on {gt} in {src.name}")
    active, how = group_activity(da, group, timeout)
    if active:
        raise OffsetsError(f"group {group} is active in {dst.name} ({how}): stop its consumers there first")
    _check_target_holds(src, dst, group, gt, offsets, timeout)
    res = SyncResult(group, gt, src.name, dst.name, dict(offsets),
                     {p: None for p in offsets}, [p for p in range(parts) if p not in offsets])
    res.previous.update(committed_offsets(da, group, gt, parts, timeout))
    res.previous = {p: res.previous[p] for p in offsets}
    if not res.changed:
        return res
    req = ConsumerGroupTopicPartitions(group, [TopicPartition(gt, p, o) for p, o in sorted(offsets.items())])
    try:
        out = da.alter_consumer_group_offsets([req], request_timeout=timeout)[group].result()
    except KafkaException as e:
        err = e.args[0]
        if err.code() in _GROUP_BUSY:
            raise OffsetsError(f"group {group} became active in {dst.name} while syncing: "
                               f"stop its consumers there first") from None
        raise OffsetsError(f"committing offsets of group {group} in {dst.name}: {err.str()}") from None
    for tp in out.topic_partitions:
        if tp.error is not None:
            if tp.error.code() in _GROUP_BUSY:
                raise OffsetsError(f"group {group} became active in {dst.name} while syncing: "
                                   f"stop its consumers there first")
            raise OffsetsError(f"committing {gt}[{tp.partition}] = {tp.offset} for group {group} in {dst.name}: "
                               f"{tp.error.str()}")
    return res


def _check_target_holds(src: ClusterRef, dst: ClusterRef, group: str, gt: str, offsets: dict[int, int],
                        timeout: float) -> None:
    """The target holds, below every committed offset o, the same record at o-1 as the source."""
    rs, rd = _Reader(src.bootstrap, timeout), _Reader(dst.bootstrap, timeout)
    try:
        for p, o in sorted(offsets.items()):
            if o == 0:
                continue
            end = rd.end(gt, p)[1]
            d = rd.first_at(gt, p, o - 1)
            if d is None:
                raise OffsetsError(f"{dst.name} is behind: {gt}[{p}] has no record at offset {o - 1} yet "
                                   f"(it ends at {end}; group {group} committed {o} in {src.name}); "
                                   f"retry once kdsync has caught up")
            s = rs.first_at(gt, p, o - 1)
            if d.offset() != o - 1 or s is None or s.offset() != o - 1:
                continue  # deleted by retention/compaction on a side: the target reaches past o-1 all the same
            a, b = _ref(s), _ref(d)
            if a.event != b.event:
                raise OffsetsError(f"{gt}[{p}] offset {o - 1} holds position {a.seq} from {a.origin} in {src.name} "
                                   f"but position {b.seq} from {b.origin} in {dst.name}: not the same log, "
                                   f"offsets cannot be copied")
    finally:
        rs.close()
        rd.close()


# ---------------------------------------------------------------- translate
@dataclass(frozen=True)
class Location:
    """Answer of `translate`: the record (if found) and how many reads it took."""

    found: bool
    record: GlobalRecordRef | None
    reason: str
    probes: int

    def as_json(self, cluster: str, topic: str, origin: str, partition: int, offset: int) -> dict:
        out = {"cluster": cluster, "topic": topic, "origin": origin, "source_partition": partition,
               "source_offset": offset, "found": self.found}
        if self.found:
            out.update(partition=self.record.partition, offset=self.record.offset, seq=self.record.seq)
        else:
            out["reason"] = self.reason
        return out


class _Search:
    """First record of (origin, origin partition) with origin offset >= target, in one global partition."""

    def __init__(self, reader: _Reader, topic: str, partition: int, origin: str, opart: int):
        self.r, self.topic, self.partition, self.origin, self.opart = reader, topic, partition, origin, opart
        self.probes = 0

    def first_match(self, x: int) -> GlobalRecordRef | None:
        """g(x): the first record of the origin partition at offset >= x, or None."""
        self.probes += 1
        for m in self.r.scan(self.topic, self.partition, x):
            ref = _ref(m)
            if ref.origin == self.origin and ref.origin_partition == self.opart:
                return ref
        return None

    def find(self, target: int) -> GlobalRecordRef | None:
        lo, hi = self.r.end(self.topic, self.partition)
        # invariant: lo <= q+1 <= hi, q = offset of the last record of the origin partition below `target`
        while lo < hi:
            mid = (lo + hi) // 2
            rec = self.first_match(mid)
            if rec is not None and rec.origin_offset < target:
                lo = rec.offset + 1
            else:
                hi = mid
        return self.first_match(lo)


def translate(cluster: ClusterRef, topic: str, source_partition: int, source_offset: int, origin: str | None = None,
              global_suffix: str = "-global", timeout: float = 30.0, shards: int = 1) -> Location:
    """Where the event at `source_offset` of partition `source_partition` of
    source topic `topic` in cluster `origin` (default: this cluster's name)
    sits in `cluster`'s global topic.  Returns a Location (found or not, with
    the reason).  `shards` ([topics] shards of the members) > 1: the event
    is in partition source_partition mod shards alone (docs/shards.md).
    Without it, a search of the partition the key maps to that finds
    nothing goes on in every other partition (a sharded topic does not map
    by key).  Raises BadInput for a missing topic or partition (or fewer
    partitions than shards), OffsetsError when a broker fails."""
    origin = origin or cluster.name
    gt = topic + global_suffix
    if source_partition < 0 or source_offset < 0:
        raise BadInput("--source-partition and --source-offset must be >= 0")
    parts = partition_count(cluster, gt, timeout)
    if parts == 0:
        raise BadInput(f"{cluster.name} has no topic {gt} (check --topic, and that kdsync runs there)")
    candidates = list(range(parts))
    if shards > 1:
        if parts < shards:
            raise BadInput(f"{gt} has {parts} partitions in {cluster.name}, fewer than --shards {shards}")
        candidates = [source_partition % shards]
    reader = _Reader(cluster.bootstrap, timeout)
    probes = 0
    by_key = False
    first_beyond = None
    try:
        if origin == cluster.name and parts > 1 and shards == 1:
            # the source record is here: its key says which global partition holds it
            src_parts = partition_count(cluster, topic, timeout)
            if source_partition >= max(src_parts, 1):
                raise BadInput(f"{topic} has {src_parts} partitions in {cluster.name}, no partition {source_partition}")
            m = reader.first_at(topic, source_partition, source_offset)
            probes += 1
            if m is not None and m.offset() == source_offset and m.key() is not None:
                candidates = [global_partition(m.key(), 0, parts)]
                by_key = True
        beyond = None
        if by_key:  # then the others: a sharded topic (searched without --shards) maps by source partition
            candidates += [p for p in range(parts) if p != candidates[0]]
        for p in candidates:
            s = _Search(reader, gt, p, origin, source_partition)
            rec = s.find(source_offset)
            probes += s.probes
            if rec is not None and rec.origin_offset == source_offset:
                return Location(True, rec, "", probes)
            if rec is not None:
                beyond = rec if beyond is None or rec.origin_offset < beyond.origin_offset else beyond
            if p == candidates[0]:
                first_beyond = rec
    finally:
        reader.close()
    if by_key and first_beyond is not None:  # the key's partition, as before the fallback
        beyond = first_beyond
    if beyond is not None and (len(candidates) == 1 or shards > 1 or (by_key and first_beyond is not None)):
        # origin order: had the event been ordered, it would come before this later one
        return Location(False, None, f"absent: {gt} continues {origin}[{source_partition}] at origin offset "
                                     f"{beyond.origin_offset} (offset {source_offset} is not a record, or is older "
                                     f"than the topic's retention)", probes)
    if beyond is not None:  # another partition may still be receiving it
        return Location(False, None, f"not in {gt}, which holds origin offset {beyond.origin_offset} of "
                                     f"{origin}[{source_partition}] (absent, or still being written)", probes)
    return Location(False, None, f"not yet in {gt}", probes)
