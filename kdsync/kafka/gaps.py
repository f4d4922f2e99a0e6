"""Gap accounting in the source consumer: every source offset between two
consumed positions is accounted for, or the partition does not go past it.

The consumer (kdsync.kafka.source) knows the next offset it expects of each
partition; a run of records that starts above it is a gap (one comparison per
run of records).  Only a gap pays for a look: the partition's leader is
asked for the batches from the expected offset (kdsync.kafka.wire, Fetch v4,
read_uncommitted) and each offset of the gap is classified (`classify`):

| kind | what lies there | then |
|---|---|---|
| `control` | a transaction marker (control batch) | accepted |
| `aborted` | a record of a transaction whose marker is an abort | accepted |
| `compacted` | nothing, on a topic with cleanup.policy=compact | accepted |
| `retention` | below the partition's log start (deleted before it was consumed) | accepted, one WARNING |
| (missing) | a record the broker has and did not hand over, or nothing at all on a topic that is not compacted | re-fetched |

A gap with a missing record is re-fetched: the records after it are not
handed over, the consumer seeks back to the expected offset and fetches
again.  When the re-fetch brings the expected offset the gap is closed
(`refetched`, one WARNING naming the broker); while it does not, the
partition holds (paused between tries, backing off to GAP_RETRY_MAX_S) and
after GAP_STALL_S one `stalled:` WARNING names topic, partition and offsets.
A look that cannot be made (the leader unreachable, an error) is a missing
record too: retried, never skipped.

Clusters the look cannot speak to (SASL) are `unverified`: the gap is
re-fetched once, and when the same gap comes back it is accepted with one
WARNING per partition — what librdkafka alone can do.

`kdsync_source_gaps_total{kind}` counts gaps by kind (a gap holding markers
and aborted records counts once for each); `refetched` counts gaps closed by
a re-fetch.

The readers that take a global topic back (start-up, catch-up, the exact end
of a checkpoint, the producer's recovery, `kdsync offsets`) account with
`ReadGaps` through `kdsync.kafka.topic.read_to_eof(..., gaps=)`: kdsync
alone writes a global topic, so only retention and compaction explain a
gap; anything else is re-fetched, and a gap that does not close fails the
read (GlobalGapError, one line) — `kdsync_global_read_gaps_total{kind}`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from kdsync.fatal import FatalError
from kdsync.kafka.wire import OFFSET_OUT_OF_RANGE, BatchHeader, WireError, fetch_batches
from kdsync.observability.logs import kv

__all__ = ["GAP_KINDS", "READ_GAP_KINDS", "Account", "GapLook", "GlobalGapError", "Pending", "ReadGaps",
           "accounting_on", "classify", "read_accounting_on", "read_gap_counts"]

log = logging.getLogger("kdsync.source")

GAP_KINDS = ("control", "aborted", "compacted", "retention", "refetched", "unverified")
GAP_STALL_S = 10.0  # a gap not closed this long: one `stalled:` line (the partition keeps holding)
GAP_RETRY_MAX_S = 2.0  # the longest pause between two re-fetches of a gap that does not close


def accounting_on() -> bool:
    """KDSYNC_SOURCE_GAP_ACCOUNTING=off turns the accounting off (tests that
    show what it prevents); anything else, or unset: on."""
    return os.environ.get("KDSYNC_SOURCE_GAP_ACCOUNTING", "on").lower() not in ("off", "0", "false", "no")


def _add(ranges: list[list[int]], lo: int, hi: int) -> None:
    if lo >= hi:
        return
    if ranges and ranges[-1][1] == lo:
        ranges[-1][1] = hi
    else:
        ranges.append([lo, hi])


def classify(batches: list[BatchHeader], start: int, end: int) -> tuple[dict[str, int], list[list[int]],
                                                                          list[list[int]]]:
    """Offsets [start, end) against the batches a look read: (offsets per
    accepted kind, missing ranges [lo, hi) — records there that were not
    handed over —, hole ranges — offsets no batch holds a record at: compacted
    on a compacted topic, missing on any other)."""
    kinds: dict[str, int] = {}
    missing: list[list[int]] = []
    holes: list[list[int]] = []
    markers: dict[int, list[tuple[int, int | None]]] = {}  # producer -> [(marker offset, type)]
    for b in batches:
        if b.control:
            markers.setdefault(b.producer_id, []).append((b.base_offset, b.control_type))
    at = start  # offsets below it are classified
    for b in sorted(batches, key=lambda x: x.base_offset):
        lo, hi = max(b.base_offset, at), min(b.last_offset + 1, end)
        if hi <= lo:
            continue
        _add(holes, at, lo)  # no batch between the last one and this
        at = hi
        if b.control:
            kinds["control"] = kinds.get("control", 0) + hi - lo
        elif b.transactional and _fate(markers.get(b.producer_id, ()), b.last_offset) == 0:
            kinds["aborted"] = kinds.get("aborted", 0) + hi - lo
        elif b.offsets is not None:  # the records' own offsets: the rest of the batch's span is a hole
            for o in range(lo, hi):
                _add(missing if o in b.offsets else holes, o, o + 1)
        elif b.records >= b.last_offset - b.base_offset + 1:  # every offset of the span holds a record
            _add(missing, lo, hi)
        else:  # compressed and compacted: which records are left is not read; the span counts as a hole
            _add(holes, lo, hi)
    _add(holes, at, end)
    return kinds, missing, holes


def _fate(markers, last_offset: int) -> int | None:
    """The type of the producer's first marker after `last_offset` (0 abort,
    1 commit), None when the look found none (an open transaction, or beyond
    what was read: not known to be aborted)."""
    after = [(o, t) for o, t in markers if o > last_offset]
    return min(after)[1] if after else None


@dataclass
class Account:
    """What a look found in a gap: offsets per accepted kind; `missing`
    ranges (re-fetch them); `broker` asked; `error` when no look was made."""

    kinds: dict[str, int] = field(default_factory=dict)
    missing: list[list[int]] = field(default_factory=list)
    broker: str = "?"
    error: str | None = None
    unverified: bool = False  # the cluster's security protocol is not spoken by the look


@dataclass
class Pending:
    """A gap of one partition being re-fetched: [start, end) expected, the records handed at `end`."""

    start: int
    end: int
    since: float
    broker: str = "?"
    tries: int = 0
    retry_at: float = 0.0
    stalled: bool = False
    unverified: bool = False
    missing: str = ""  # the missing ranges the last look found ("lo..hi,...")
    error: str | None = None  # why the last look could not be made


class GapLook:
    """Looks at gaps of one cluster's source partitions (the consumer thread's)."""

    def __init__(self, conf: dict):
        self.conf = conf
        self._compacted: dict[str, bool] = {}
        proto = str(conf.get("security.protocol", "plaintext")).lower()
        self.speaks = proto in ("plaintext", "ssl")

    def leader(self, c, topic: str, partition: int) -> tuple[str, int]:
        """The leader of the partition, from the consumer's metadata."""
        md = c.list_topics(timeout=5)  # every topic: naming one may create it
        t = md.topics.get(topic)
        if t is None or partition not in t.partitions:
            raise WireError(f"{topic}[{partition}] is not in the metadata")
        b = md.brokers.get(t.partitions[partition].leader)
        if b is None:
            raise WireError(f"{topic}[{partition}] has no leader")
        return b.host, b.port

    def compacted(self, topic: str) -> bool:
        """cleanup.policy of `topic` holds compact (asked once; a broker that
        does not answer DescribeConfigs: not compacted)."""
        if topic not in self._compacted:
            from kdsync.kafka.topic import topic_settings

            try:
                _, cfg = topic_settings(self.conf, topic, timeout=5)
                self._compacted[topic] = "compact" in cfg.get("cleanup.policy", "")
            except Exception as e:  # noqa: BLE001 - asked again at the next gap
                log.warning("reading the source topic's cleanup.policy failed", **kv(topic=topic, error=str(e)))
                return False
        return self._compacted[topic]

    def account(self, c, topic: str, partition: int, start: int, end: int) -> Account:
        """Look at offsets [start, end) of the partition (module doc)."""
        if not self.speaks:
            return Account(missing=[[start, end]], unverified=True,
                           error=f"security.protocol={self.conf.get('security.protocol')} is not spoken by the look")
        acct = Account()
        try:
            host, port = self.leader(c, topic, partition)
            acct.broker = f"{host}:{port}"
            batches, ans = fetch_batches(host, port, topic, partition, start, end, conf=self.conf)
            if ans is not None and ans.error == OFFSET_OUT_OF_RANGE:
                lo = self._log_start(c, topic, partition)
                if lo <= start:
                    raise WireError(f"offset {start} out of range (log start {lo})")
                acct.kinds["retention"] = min(lo, end) - start
                if lo >= end:
                    return acct
                start = lo
                batches, ans = fetch_batches(host, port, topic, partition, start, end, conf=self.conf)
            if ans is not None and ans.error:
                raise WireError(f"the fetch answered error {ans.error}")
            # a transaction in the gap whose marker lies beyond it: read on to the marker
            open_ = {b.producer_id for b in batches if b.transactional and not b.control
                     and start <= b.last_offset and b.base_offset < end}
            marked = {b.producer_id for b in batches if b.control and b.base_offset > start}
            if open_ - marked and batches and ans is not None and batches[-1].last_offset + 1 < ans.high_watermark:
                more, _ = fetch_batches(host, port, topic, partition, batches[-1].last_offset + 1,
                                        ans.high_watermark, conf=self.conf)
                batches += more
        except WireError as e:
            acct.error = str(e)
            acct.missing = [[start, end]]
            return acct
        except Exception as e:  # noqa: BLE001 - a metadata call failed: retried like a failed look
            acct.error = f"{type(e).__name__}: {e}"
            acct.missing = [[start, end]]
            return acct
        kinds, missing, holes = classify(batches, start, end)
        for k, n in kinds.items():
            acct.kinds[k] = acct.kinds.get(k, 0) + n
        if holes and self.compacted(topic):
            acct.kinds["compacted"] = acct.kinds.get("compacted", 0) + sum(hi - lo for lo, hi in holes)
            holes = []
        acct.missing = sorted(missing + holes)
        return acct

    @staticmethod
    def _log_start(c, topic: str, partition: int) -> int:
        from confluent_kafka import TopicPartition

        lo, _ = c.get_watermark_offsets(TopicPartition(topic, partition), timeout=5, cached=False)
        return lo


# ---------------------------------------------------------------- reading a global topic back
READ_GAP_KINDS = ("retention", "compacted", "refetched", "failed")
READ_GAP_GIVE_UP_S = 10.0  # a gap of a global topic not closed by re-fetches this long: the read fails
_READ_RETRY_MAX_S = 1.0
_read_counts = {k: 0 for k in READ_GAP_KINDS}  # the process's global-read gaps (kdsync_global_read_gaps_total)


def read_accounting_on() -> bool:
    """KDSYNC_GLOBAL_GAP_ACCOUNTING=off turns the accounting of global-topic
    reads off (tests that show what it prevents); anything else, or unset: on."""
    return os.environ.get("KDSYNC_GLOBAL_GAP_ACCOUNTING", "on").lower() not in ("off", "0", "false", "no")


def read_gap_counts() -> dict[str, int]:
    """Gaps of global-topic reads in this process so far, by kind (a copy)."""
    return dict(_read_counts)


class GlobalGapError(FatalError):
    """A global topic read back has offsets that are neither records nor
    explained, and fetching them again did not bring them; str() is one line
    naming topic, partition and offsets."""


class ReadGaps:
    """The gap accounting of a read of a topic only kdsync writes — a global
    topic, read back at start (kdsync.kafka.reader.load_start), by catch-up
    reads (GlobalReader), for the exact end of a checkpoint
    (kdsync.kafka.checkpoint.EndOffsets), by the producer's recovery
    (kdsync.kafka.sink.read_present) and by `kdsync offsets`.

    kdsync writes a global topic with an idempotent producer and no
    transactions, so between two consumed offsets every offset is a record.
    `read_to_eof(..., gaps=ReadGaps(conf))` hands each skipped range
    [lo, hi) to `explained`:

    | what lies there | then |
    |---|---|
    | below the partition's log start (retention, DeleteRecords) | accepted (`retention`) |
    | nothing, on a topic with cleanup.policy=compact (the look of GapLook) | accepted (`compacted`) |
    | anything else | fetched again from `lo` (the records after the gap are not handed over) |

    A gap a re-fetch closes is logged once (`refetched`, the broker named);
    one that has not closed after READ_GAP_GIVE_UP_S raises GlobalGapError
    (`failed`), one line naming topic, partition, offsets and what a look
    found there: a skipped position would make the member resume at the
    wrong place, so a read never goes past it.  One per reader; not
    thread-safe (one read at a time, like its consumer)."""

    @staticmethod
    def enabled() -> bool:
        """The accounting of global-topic reads is on (`read_accounting_on`)."""
        return read_accounting_on()

    def __init__(self, conf: dict | str):
        self.conf = {"bootstrap.servers": conf} if isinstance(conf, str) else dict(conf)
        self.look = GapLook(self.conf)
        self.pending: dict[tuple[str, int], Pending] = {}  # (topic, partition) -> the gap being re-fetched
        self.counts = {k: 0 for k in READ_GAP_KINDS}

    def _count(self, kind: str) -> None:
        self.counts[kind] += 1
        _read_counts[kind] += 1

    def explained(self, c, topic: str, partition: int, lo: int, hi: int) -> bool:
        """A read of topic[partition] expected offset `lo` and got `hi`:
        True when [lo, hi) is explained (counted), False when the caller must
        fetch again from `lo`.  Raises GlobalGapError (see the class doc)."""
        import time

        from confluent_kafka import TopicPartition

        try:
            low, _ = c.get_watermark_offsets(TopicPartition(topic, partition), timeout=5, cached=False)
        except Exception:  # noqa: BLE001 - not known: nothing is explained by it
            low = -1
        if low >= hi:
            self._count("retention")
            return True
        lo = max(lo, low)
        if self.look.compacted(topic):
            acct = self.look.account(c, topic, partition, lo, hi)
            if not acct.missing and acct.error is None:
                self._count("compacted")
                return True
        now = time.monotonic()
        key = (topic, partition)
        p = self.pending.get(key)
        if p is None or not p.start <= lo < p.end:
            p = self.pending[key] = Pending(lo, hi, now)
        p.tries += 1
        p.end = max(p.end, hi)
        if now - p.since >= READ_GAP_GIVE_UP_S:
            self._count("failed")
            self.pending.pop(key, None)
            acct = self.look.account(c, topic, partition, p.start, p.end)
            if acct.error is not None:
                there = f"the look at the broker failed: {acct.error}"
            elif any(k in acct.kinds for k in ("control", "aborted")):
                there = "transaction records (kdsync never writes transactions: another writer?)"
            else:
                there = ("the broker holds records there and does not hand them over" if acct.missing
                         else "no record there and the topic is not compacted")
            raise GlobalGapError(
                f"global topic {topic} partition {partition}: offsets {p.start}..{p.end - 1} are missing from "
                f"what the broker ({acct.broker}) hands over after {p.tries} fetches in {now - p.since:.0f} s "
                f"({there}); kdsync does not read past a position it cannot see, see docs/operations.md")
        if p.tries > 1:  # the same gap again: back off before the next fetch
            time.sleep(min(_READ_RETRY_MAX_S, 0.05 * 2 ** (p.tries - 2)))
        return False

    def arrived(self, c, topic: str, partition: int, nxt: int) -> None:
        """Every offset below `nxt` of topic[partition] was read: a gap being re-fetched there is closed."""
        key = (topic, partition)
        p = self.pending.get(key)
        if p is None or nxt < p.end:
            return
        del self.pending[key]
        self._count("refetched")
        try:
            host, port = self.look.leader(c, topic, partition)
            broker = f"{host}:{port}"
        except Exception:  # noqa: BLE001 - the line without it
            broker = "?"
        log.warning("global topic gap closed by a re-fetch: the broker skipped records it holds",
                    **kv(topic=topic, partition=partition, offsets=f"{p.start}..{p.end - 1}", broker=broker,
                         fetches=p.tries + 1))

    def forget(self, topic: str, partition: int) -> None:
        """A read of topic[partition] ended (or was abandoned): no gap of it pending."""
        self.pending.pop((topic, partition), None)
