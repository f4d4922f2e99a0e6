"""Transactions in the source topics: aborted records never enter the order.

The source consumer reads `read_committed` (librdkafka's default, and a
config error to change: kdsync.config): a broker that honours it hands over
the committed records of each partition in offset order and never an
aborted one, and the gap accounting (kdsync.kafka.gaps) accounts for the
markers and aborted records it skipped.  Tansu 0.6 does not honour it: it
hands aborted records to `read_committed` readers as if committed, and no
client can tell them apart (docs/brokers.md, "Transactions").

So the member checks its broker, once per start (`probe`, run by the source
consumer's thread before its first fetch): one transaction aborted and one
committed on the kdsync-owned topic PROBE_TOPIC, read back `read_committed`.

| verdict | the broker | then |
|---|---|---|
| `hides` | hides the aborted record (Kafka, noida-db) | one INFO line; nothing more is checked |
| `shows` | hands the aborted record over (Tansu 0.6) | one ERROR line naming the broker; the guard is on |
| `failed` | could not be asked (ACLs, no transaction support, a timeout) | one WARNING line; the guard is on |

With the guard on (`TxnGuard`), every run of records is checked against the
record batches' headers (kdsync.kafka.wire, one Fetch from the run's first
offset, cached: a look covers what the broker holds beyond the run too)
before it is handed to the order.  Records in non-transactional batches pass.
At the first record of a transactional batch the partition holds: the
records before it are ordered, it and everything after it are not, and one
ERROR line ``stalled: ...`` names topic, partition, offset and the switch.
Nothing is skipped: the partition stays at that offset until the member is
restarted with `[kafka] trust_read_committed = true`, which skips the probe
and the guard and orders whatever `read_committed` hands over — on a broker
that shows aborted records, aborted records included.  A look that cannot be
made (the leader unreachable) is retried from the same offset; one WARNING.

Cost: the probe is two small transactions and a read (~0.1 s); the guard,
on a broker that needs it, about one extra Fetch per partition per consumed
batch.  On a broker that hides aborted records it costs nothing after the
probe.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from kdsync.kafka.wire import WireError, fetch_batches
from kdsync.observability.logs import kv

__all__ = ["PROBE_TOPIC", "SWITCH", "ProbeResult", "TxnGuard", "probe"]

log = logging.getLogger("kdsync.source")

PROBE_TOPIC = "__kdsync-txn-probe"  # `__`: never a source topic (kdsync.config: TopicsSection.matches)
SWITCH = "[kafka] trust_read_committed = true"
PROBE_TIMEOUT_S = 10.0
RETRY_MAX_S = 2.0  # the longest pause between two tries of a look that failed
STALL_S = 10.0  # a look failing this long: one `stalled:` line

_cache: dict[str, ProbeResult] = {}  # bootstrap.servers -> verdict: several shards in one process probe once
_cache_lock = threading.Lock()


@dataclass(frozen=True)
class ProbeResult:
    verdict: str  # "hides" | "shows" | "failed"
    broker: str  # bootstrap.servers of the cluster asked
    detail: str = ""  # why it failed
    seconds: float = 0.0


def _error(e: Exception) -> str:
    err = e.args[0] if e.args else None
    return err.str() if hasattr(err, "str") else f"{type(e).__name__}: {e}"


def probe(conf: dict, transactional_id: str, timeout: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """Ask the cluster of `conf` whether `read_committed` readers see an
    aborted record (module doc); never raises."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from kdsync.kafka.topic import admin_conf, ensure_topic

    t0 = time.monotonic()
    base = admin_conf({k: v for k, v in conf.items() if k != "error_cb"})  # the member's error_cb stops it
    broker = str(base.get("bootstrap.servers", "?"))
    nonce = f"{transactional_id}/{time.time_ns()}".encode()
    p = c = None
    try:
        ensure_topic(base, PROBE_TOPIC, 1, timeout=timeout, config={"retention.ms": str(24 * 3600 * 1000)})
        c = Consumer({**base, "group.id": "kdsync-txn-probe", "isolation.level": "read_committed",
                      "enable.auto.commit": False, "auto.offset.reset": "earliest", "fetch.wait.max.ms": 10})
        _, start = c.get_watermark_offsets(TopicPartition(PROBE_TOPIC, 0), timeout=timeout)
        p = Producer({**base, "transactional.id": transactional_id, "error_cb": lambda err: None,
                      "transaction.timeout.ms": int(timeout * 1000) * 3})
        p.init_transactions(timeout)
        p.begin_transaction()
        p.produce(PROBE_TOPIC, value=nonce + b" aborted", partition=0)
        p.flush(timeout)  # else the abort may come before the record reached the broker
        p.abort_transaction(timeout)
        p.begin_transaction()
        p.produce(PROBE_TOPIC, value=nonce + b" committed", partition=0)
        p.commit_transaction(timeout)
        # Tansu's latest offset may be low: reading from below it only reads the earlier probes again
        c.assign([TopicPartition(PROBE_TOPIC, 0, max(0, start - 8))])
        seen_aborted = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None or m.error() is not None:
                continue
            if m.value() == nonce + b" aborted":
                seen_aborted = True
            elif m.value() == nonce + b" committed":
                return ProbeResult("shows" if seen_aborted else "hides", broker, seconds=time.monotonic() - t0)
        raise TimeoutError(f"the committed probe record was not read back within {timeout:g} s")
    except Exception as e:  # noqa: BLE001 - a probe that cannot be made is a WARNING, never fatal
        return ProbeResult("failed", broker, _error(e), time.monotonic() - t0)
    finally:
        for client in (p, c):
            if client is not None:
                try:
                    client.close()
                except Exception:  # noqa: BLE001
                    pass


def probe_once(conf: dict, transactional_id: str) -> ProbeResult:
    """`probe`, once per process and cluster (shards of one member share a process)."""
    key = str(conf.get("bootstrap.servers", ""))
    with _cache_lock:
        if key not in _cache or _cache[key].verdict == "failed":
            _cache[key] = probe(conf, transactional_id)
        return _cache[key]


@dataclass
class _Retry:
    offset: int
    since: float
    at: float = 0.0
    tries: int = 0
    stalled: bool = False


class TxnGuard:
    """The source consumer's check of transactional records (module doc).
    Every method runs in the consumer's thread."""

    def __init__(self, conf: dict, look, transactional_id: str):
        self.conf = {k: v for k, v in conf.items() if not callable(v)}
        self._full_conf = conf
        self.look = look  # kdsync.kafka.gaps.GapLook: the partition's leader, the protocol it speaks
        self.transactional_id = transactional_id
        self.on = False  # checking runs (a broker that shows aborted records, or one that could not be asked)
        self.result: ProbeResult | None = None
        self.held: dict[tuple[str, int], int] = {}  # partition -> offset of the transactional record it holds at
        self.retry: dict[tuple[str, int], _Retry] = {}  # partitions whose look failed: tried again from there
        self._clean: dict[tuple[str, int], tuple[int, int]] = {}  # [lo, hi) seen in non-transactional batches
        self._leaders: dict[tuple[str, int], tuple[str, int]] = {}
        self.looks = 0

    def prefetch(self) -> None:
        """Start the probe now in a thread of its own, so that it runs while the
        member opens its topics; `start` then takes its result (probe_once: one
        probe per process and cluster, a second caller waits for the first).
        Without it a member's first fetch waited for the probe (0.05-0.5 s on
        Tansu), and records written meanwhile waited with it."""
        threading.Thread(target=probe_once, args=(self._full_conf, self.transactional_id), name="kdsync-txn-probe",
                         daemon=True).start()

    def start(self) -> ProbeResult:
        """Probe the cluster (once per process and cluster) and say what follows, in one line."""
        r = self.result = probe_once(self._full_conf, self.transactional_id)
        self.on = r.verdict != "hides"
        if r.verdict == "hides":
            log.info("transaction probe: the broker hides aborted records from read_committed readers", **kv(
                broker=r.broker, probe_s=round(r.seconds, 2)))
        elif r.verdict == "shows":
            log.error("the broker hands aborted transactions' records to read_committed readers: a source partition "
                      f"holding transactional records will hold at the first one (never copied, never skipped) "
                      f"unless {SWITCH}", **kv(broker=r.broker, probe_topic=PROBE_TOPIC))
        else:
            log.warning(f"transaction probe failed: a source partition holding transactional records will hold at "
                        f"the first one unless {SWITCH}", **kv(broker=r.broker, probe_topic=PROBE_TOPIC,
                                                               error=r.detail))
        return r

    def allowed(self, c, tp: tuple[str, int], first: int, end: int) -> int:
        """How far records [first, end) of `tp` may be handed over: `end`
        when no transactional batch holds them; else the offset where the
        partition stops (held for good at a transactional record, or tried
        again after a failed look: `retry`)."""
        if tp in self.held:
            return first
        lo, hi = self._clean.get(tp, (0, -1))
        if lo <= first and end <= hi:
            return end
        if not self.look.speaks:
            return self._hold(tp, first, f"security.protocol={self.conf.get('security.protocol')}: the batch "
                                         f"headers cannot be read")
        try:
            host, port = self._leader(c, tp)
            batches, _ = fetch_batches(host, port, tp[0], tp[1], first, end, conf=self.conf)
        except Exception as e:  # noqa: BLE001 - WireError or a metadata call: tried again, never skipped
            self._leaders.pop(tp, None)
            self._failed(tp, first, str(e) if isinstance(e, WireError) else _error(e))
            return first
        self.looks += 1
        self.retry.pop(tp, None)
        clean = first
        for b in sorted(batches, key=lambda x: x.base_offset):
            if b.last_offset < clean:
                continue
            if b.base_offset > clean:
                break  # a hole the look did not read: the clean run ends here
            if b.transactional and not b.control:
                return self._hold(tp, clean, broker=f"{host}:{port}", producer=b.producer_id)
            clean = b.last_offset + 1
        if clean > first:
            self._clean[tp] = (first, clean)
        if clean < end:  # the look did not reach `end`: hand over what it saw, fetch the rest again
            self._failed(tp, clean, f"the look read up to offset {clean} of {end}")
        return min(clean, end)

    def due(self, now: float) -> list[tuple[tuple[str, int], int]]:
        """Partitions whose failed look is due again: (partition, offset to fetch from)."""
        out = []
        for tp, r in self.retry.items():
            if r.at and r.at <= now:
                r.at = 0.0
                out.append((tp, r.offset))
            # a look failing for STALL_S: while the partition waits for the fetch that
            # carries the retry (r.at == 0) nothing has failed again, and a fetch that
            # lasts is the fetch stage's stall (a durable broker's empty fetch: seconds)
            if r.at and not r.stalled and now - r.since >= STALL_S:
                r.stalled = True
                log.warning("stalled: a source partition holds: the batch headers of its records cannot be read "
                            "(transactions cannot be told apart)", **kv(topic=tp[0], partition=tp[1],
                                                                        offset=r.offset, tries=r.tries))
        return out

    def stopped(self, tp: tuple[str, int]) -> bool:
        """Held for good, or waiting for a failed look's retry: not fetched, not a stall of the fetch."""
        return tp in self.held or (tp in self.retry and self.retry[tp].at > 0)

    # ------------------------------------------------------------------
    def _leader(self, c, tp: tuple[str, int]) -> tuple[str, int]:
        """The partition's leader; one metadata listing fills in every partition's
        (a thousand source topics: one listing, not one per partition)."""
        if tp not in self._leaders:
            md = c.list_topics(timeout=5)  # every topic: naming one may create it
            for name, t in md.topics.items():
                for p, pm in (t.partitions or {}).items():
                    b = md.brokers.get(pm.leader)
                    if b is not None:
                        self._leaders[(name, p)] = (b.host, b.port)
            if tp not in self._leaders:
                raise WireError(f"{tp[0]}[{tp[1]}] has no leader in the metadata")
        return self._leaders[tp]

    def _hold(self, tp: tuple[str, int], offset: int, why: str = "", **fields) -> int:
        self.held[tp] = offset
        self.retry.pop(tp, None)
        log.error(f"stalled: a source partition holds at a transactional record its broker may hand over even if "
                  f"aborted; set {SWITCH} to order what the broker hands over, aborted records included",
                  **kv(topic=tp[0], partition=tp[1], offset=offset, **fields, **({"why": why} if why else {})))
        return offset

    def _failed(self, tp: tuple[str, int], offset: int, error: str) -> None:
        now = time.monotonic()
        r = self.retry.get(tp)
        if r is None or r.offset != offset:
            r = self.retry[tp] = _Retry(offset, now)
            log.warning("reading a source partition's batch headers failed; fetching it again from the same offset",
                        **kv(topic=tp[0], partition=tp[1], offset=offset, error=error))
        r.tries += 1
        r.at = now + min(RETRY_MAX_S, 0.05 * 2 ** r.tries)
