"""The requests a member's event path sends its broker, by request type.

Each request is work for the broker too: on a 2-core box the brokers' CPU
per ordered event was measured as large as the member's own (make bench,
table member_brokers).  Counted are the clients on the event path, which
are served all the time: the source consumer (the client of each of its
restarts too) and the producer.  The member's other clients (the global
topics' readers, the idle watch, exact checkpoint ends, admin calls) are
polled only when used: librdkafka queues a client's statistics until it is
polled, so those would pile up; they do not report.
librdkafka counts the requests of every client handle (its statistics,
`statistics.interval.ms`: per broker, `req` = requests sent by type,
cumulative over the handle's life); `KafkaRequests` keeps each handle's
latest count and exports their sum as
`kdsync_kafka_requests_total{client,request}` (client = consumer /
producer, request = Fetch, Produce, ListOffsets, Metadata, OffsetCommit,
...).  A handle closed between two statistics loses at most one interval's
requests.  `[metrics] kafka_stats_ms` sets the interval (0: off).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily

from kdsync.observability.logs import kv

__all__ = ["KafkaRequests"]

log = logging.getLogger("kdsync.member")


class KafkaRequests:
    """Requests sent by this process's Kafka clients (module doc); a
    prometheus_client collector.  `conf()` is merged into a client's
    configuration; the statistics arrive on whatever thread serves that
    client, hence the lock."""

    def __init__(self, interval_ms: int):
        self.interval_ms = interval_ms
        self._lock = threading.Lock()
        self._handles: dict[str, tuple[str, Counter]] = {}  # handle name -> (client type, requests by type)

    def conf(self) -> dict:
        """librdkafka properties that make a client report its statistics here."""
        if self.interval_ms <= 0:
            return {}
        return {"statistics.interval.ms": self.interval_ms, "stats_cb": self.on_stats}

    def on_stats(self, raw: str) -> None:
        try:
            d = json.loads(raw)
            counts: Counter = Counter()
            for name, b in d.get("brokers", {}).items():
                if name.endswith("/internal"):  # librdkafka's own queue, no broker
                    continue
                for api, n in (b.get("req") or {}).items():
                    if n:
                        counts[api] += n
            kind, handle = d.get("type", "?"), d["name"]
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # never let statistics stop a client
            log.debug("unreadable librdkafka statistics", **kv(error=str(e)))
            return
        with self._lock:
            self._handles[handle] = (kind, counts)

    def totals(self) -> dict[tuple[str, str], int]:
        """(client type, request type) -> requests sent, over every handle so far."""
        out: Counter = Counter()
        with self._lock:
            for kind, counts in self._handles.values():
                for api, n in counts.items():
                    out[(kind, api)] += n
        return dict(out)

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily("kdsync_kafka_requests", "requests the member's source consumer and producer sent "
                                  "their broker, by client type and request type (librdkafka statistics, every "
                                  "[metrics] kafka_stats_ms)", labels=["client", "request"])
        for (kind, api), n in sorted(self.totals().items()):
            fam.add_metric([kind, api], n)
        yield fam
