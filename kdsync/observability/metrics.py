"""Prometheus metrics of one member (prometheus_client, own registry).

Gauges the runtime sets as things happen, plus a collector that reads the
counters the transport (`Transport.stats`) and the core (`node.stats`) keep,
at scrape time, so nothing is copied on the hot path.

Exported (all prefixed `kdsync_`):
  view_id{topic}, live_members{topic}, status{topic,status} (1 for the current)
  delivered_position{topic}            next position durable in the global topic
  input_lag{topic,partition}           source records not yet durably ordered
  e2e_latency_seconds{topic}           histogram: source timestamp -> written to global topic
  stage_seconds{topic,stage}           histogram: one stage of a batch's trip (kdsync.observability.stage_latency), per batch
  events_consumed_total{topic}, events_written_total{topic}
  peer_bytes_total{peer,direction}, peer_frames_total{peer,direction}, peer_connected{peer}, peer_refused_total{peer,reason}
  peer_path{peer,path}                 1 for the link messages to the peer take now: rdma | tcp | none
  rdma_device_up, rdma_fallbacks_total{peer}   RDMA transport only: a device serves the listen address; times
                                       a peer's messages moved from a lost RDMA link to TCP (kdsync.transport.rdma)
  core_events_total{topic,kind}        kind = submitted|delivered|resubmitted|deduplicated|bad_messages
  bad_peer_messages_total{peer}        malformed messages dropped
  stalled{topic,stage}                1 while a stage holds records that do not move (kdsync.observability.stalls)
  producer_recoveries_total           the global-topic producer failed and was re-created in place (kdsync.kafka.sink)
  source_restarts_total, source_fetch_wait_ms   the source client re-created after a stalled fetch (kdsync.kafka.source)
  source_gaps_total{kind}             source offset gaps by what filled them: control|aborted|compacted|retention,
                                       refetched (closed by fetching again), unverified (kdsync.kafka.gaps)
  global_read_gaps_total{kind}        offsets skipped by a read of a global topic (start-up, catch-up, exact end,
                                       producer recovery): retention|compacted, refetched, failed (the read
                                       failed: kdsync.kafka.gaps.ReadGaps); the process's count
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as _Tally
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kdsync.kafka.gaps import GAP_KINDS, READ_GAP_KINDS, read_gap_counts

__all__ = ["MemberMetrics", "observe_many"]

# kdsync_peer_refused_total's reasons, every one exported per peer (a series that appears at 1 has no increase)
REFUSAL_REASONS = ("secret", "tls", "malformed", "identity", "wire_version", "contract", "handshake")

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
STAGE_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)


def observe_many(child, values: Iterable[float]) -> None:
    """`child.observe(v)` for every v (a labelled Histogram), in one pass:
    the values are tallied per bucket first, so each bucket and the sum are
    touched once (a Delivery's records at a few hundred ns each instead of
    a few microseconds).  Relies on prometheus_client's Histogram layout
    (pinned; tests/test_member_parts.py checks it against observe())."""
    values = list(values)
    if not values:
        return
    bounds = child._upper_bounds
    for i, n in _Tally(bisect_left(bounds, v) for v in values).items():
        child._buckets[i].inc(n)
    child._sum.inc(sum(values))


class _Live:
    """Collector reading transport and core counters at scrape time."""

    def __init__(self, peers: Callable[[], dict], cores: Callable[[], dict[str, dict]],
                 links: Callable[[], tuple[dict, tuple | None]]):
        self._peers = peers
        self._cores = cores
        self._links = links

    def collect(self):
        b = CounterMetricFamily("kdsync_peer_bytes", "bytes exchanged with a peer", labels=["peer", "direction"])
        f = CounterMetricFamily("kdsync_peer_frames", "frames exchanged with a peer", labels=["peer", "direction"])
        c = GaugeMetricFamily("kdsync_peer_connected", "1 while the link to the peer is up", labels=["peer"])
        r = CounterMetricFamily("kdsync_peer_refused", "connections with this peer refused at the handshake, by "
                                "reason", labels=["peer", "reason"])
        for peer, s in sorted(self._peers().items()):
            b.add_metric([peer, "in"], s.bytes_in)
            b.add_metric([peer, "out"], s.bytes_out)
            f.add_metric([peer, "in"], s.frames_in)
            f.add_metric([peer, "out"], s.frames_out)
            c.add_metric([peer], 1 if s.connected else 0)
            by = dict.fromkeys(REFUSAL_REASONS, 0)
            for reason, n in s.refusals.items():  # "contract:<setting>": the setting is in the log line
                key = reason.split(":")[0]
                by[key if key in by else "handshake"] += n
            for reason, n in by.items():
                r.add_metric([peer, reason], n)
        e = CounterMetricFamily("kdsync_core_events", "events counted by the ordering core", labels=["topic", "kind"])
        for topic, stats in sorted(self._cores().items()):
            for kind, v in sorted(stats.items()):
                e.add_metric([topic, kind], v)
        yield from (b, f, c, r, e)
        paths, rdma = self._links()
        pg = GaugeMetricFamily("kdsync_peer_path", "1 for the link messages to the peer take now (rdma, tcp, none)",
                               labels=["peer", "path"])
        for peer, path in sorted(paths.items()):
            for name in ("rdma", "tcp", "none"):
                pg.add_metric([peer, name], 1 if (path or "none") == name else 0)
        yield pg
        if rdma is not None:
            up, fallbacks = rdma
            yield GaugeMetricFamily("kdsync_rdma_device_up", "1 while an RDMA device serves the listen address "
                                    "(0 after the device was removed: TCP until the member restarts)", value=1 if up else 0)
            fb = CounterMetricFamily("kdsync_rdma_fallbacks", "times a peer's messages moved from an RDMA link "
                                     "that went down with its device to TCP", labels=["peer"])
            for peer, n in sorted(fallbacks.items()):
                fb.add_metric([peer], n)
            yield fb


class _ReadGaps:
    """kdsync_global_read_gaps_total{kind}: the gaps the process's reads of global topics met
    (kdsync.kafka.gaps.ReadGaps keeps the count; read at scrape time)."""

    def collect(self):
        fam = CounterMetricFamily("kdsync_global_read_gaps", "offsets skipped by a read of a global topic, by what "
                                  "explained or closed them (kdsync.kafka.gaps.ReadGaps)", labels=["kind"])
        counts = read_gap_counts()
        for kind in READ_GAP_KINDS:
            fam.add_metric([kind], counts[kind])
        yield fam


class MemberMetrics:
    def __init__(self, peers: Callable[[], dict] = dict, cores: Callable[[], dict[str, dict]] = dict,
                 links: Callable[[], tuple[dict, tuple | None]] = lambda: ({}, None)):
        self.registry = reg = CollectorRegistry()
        self.view_id = Gauge("kdsync_view_id", "installed view", ["topic"], registry=reg)
        self.live_members = Gauge("kdsync_live_members", "members of the installed view", ["topic"], registry=reg)
        self.status = Gauge("kdsync_status", "1 for the current status of the ordering node", ["topic", "status"], registry=reg)
        self.delivered = Gauge("kdsync_delivered_position", "next position not yet durable in the global topic",
                               ["topic"], registry=reg)
        self.input_lag = Gauge("kdsync_input_lag", "source records not yet durably ordered", ["topic", "partition"],
                               registry=reg)
        self.latency = Histogram("kdsync_e2e_latency_seconds", "source record timestamp to written in the global topic",
                                 ["topic"], buckets=LATENCY_BUCKETS, registry=reg)
        self.consumed = Counter("kdsync_events_consumed", "source records consumed", ["topic"], registry=reg)
        self.written = Counter("kdsync_events_written", "records confirmed in the global topic", ["topic"], registry=reg)
        self.stage = Histogram("kdsync_stage_seconds", "one stage of a batch's trip through the member (per batch)",
                               ["topic", "stage"], buckets=STAGE_BUCKETS, registry=reg)
        self.producer_recoveries = Counter("kdsync_producer_recoveries", "failed producers re-created in place "
                                           "(fatal idempotence error or delivery error)", registry=reg)
        self.stalled = Gauge("kdsync_stalled", "1 while a stage holds records and has not moved for [health] "
                             "stall_after_ms (kdsync.observability.stalls)", ["topic", "stage"], registry=reg)
        self.source_restarts = Counter("kdsync_source_restarts", "source clients re-created because every fetch "
                                       "came back empty while records waited", registry=reg)
        self.source_fetch_wait = Gauge("kdsync_source_fetch_wait_ms", "fetch.wait.max.ms of the source client",
                                       registry=reg)
        self.source_gaps = Counter("kdsync_source_gaps", "gaps between consumed source offsets, by what the look "
                                   "found there (kdsync.kafka.gaps)", ["kind"], registry=reg)
        for kind in GAP_KINDS:
            self.source_gaps.labels(kind)
        self.loop_delay = Gauge("kdsync_loop_delay_seconds", "the longest the member's tick timer ran after its "
                                "time since the last health sample (a busy or CPU-starved loop)", registry=reg)
        self.gc_pause = Gauge("kdsync_gc_pause_seconds", "the longest garbage collection since the last health "
                              "sample (it holds the member's loop)", registry=reg)
        self.suspect_after = Gauge("kdsync_peer_suspect_after_seconds", "how long the peer may be silent before "
                                   "this member suspects it: suspect_ms plus what late loops and late pings taught "
                                   "it (kdsync.core.liveness)", ["peer"], registry=reg)
        self.groups_asleep = Gauge("kdsync_groups_asleep", "ordering groups asleep (quiescent: no tick, no "
                                   "heartbeat of their own until input wakes them)", registry=reg)
        self.bad_messages = Counter("kdsync_bad_peer_messages", "malformed peer messages dropped", ["peer"], registry=reg)
        self.checkpoint_position = Gauge("kdsync_checkpoint_position",
                                         "position of the latest checkpoint the cluster confirmed (a restart reads "
                                         "the global topic from there)", ["topic"], registry=reg)
        self.checkpoint_time = Gauge("kdsync_checkpoint_timestamp_seconds",
                                     "when the latest confirmed checkpoint was written (Unix time)", ["topic"],
                                     registry=reg)
        reg.register(_Live(peers, cores, links))
        reg.register(_ReadGaps())
        self._status: dict[str, str] = {}
        self.server = None

    def source_restarted(self, fetch_wait_ms: int) -> None:
        """A stalled source client was re-created with `fetch_wait_ms` (any thread)."""
        self.source_restarts.inc()
        self.source_fetch_wait.set(fetch_wait_ms)

    def source_gap(self, kind: str) -> None:
        """A source gap of `kind` was accounted for or closed (consumer thread)."""
        self.source_gaps.labels(kind).inc()

    def set_status(self, topic: str, status: str) -> None:
        old = self._status.get(topic)
        if old == status:
            return
        if old is not None:
            self.status.labels(topic, old).set(0)
        self.status.labels(topic, status).set(1)
        self._status[topic] = status

    def checkpoint_written(self, topic: str, seq: int, written_ms: int) -> None:
        """The cluster confirmed (or start-up read) a checkpoint of `topic`'s global topic."""
        self.checkpoint_position.labels(topic).set(seq)
        self.checkpoint_time.labels(topic).set(written_ms / 1000.0)

    @classmethod
    def of_member(cls, transport: Callable[[], object | None], pipelines: dict) -> MemberMetrics:
        """A member's metrics: the peer and link families read its transport
        (`transport()`, None until made), the core family its pipelines' nodes."""

        def peers() -> dict:
            t = transport()
            return dict(t.stats) if t is not None else {}

        def links() -> tuple[dict, tuple | None]:
            t = transport()
            return ({p: t.path(p) for p in sorted(t.peers)}, t.rdma_links()) if t is not None else ({}, None)

        return cls(peers, lambda: {topic: dict(p.node.stats) for topic, p in list(pipelines.items())}, links)

    def listen(self, address: str | None) -> None:
        """Serve on `[metrics] listen` (None: not served); a port taken is a FatalError naming it."""
        if address:
            from kdsync.config import parse_address
            from kdsync.fatal import FatalError

            try:
                self.serve(*parse_address(address))
            except OSError as e:
                raise FatalError(f"metrics.listen: cannot listen on {address}: {e.strerror}") from None

    def serve(self, host: str, port: int) -> None:
        """Start the HTTP endpoint (a daemon thread). Raises OSError if the port is taken."""
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
