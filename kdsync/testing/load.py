"""The load runner the benchmark and the simulator's calibration share:
paced load on real processes, and what one `kdsync run` member costs and adds
(`python -m bench.load` runs it from the command line).

`run_load()` starts `clusters` embedded Tansu brokers and one `kdsync run`
member per cluster (`kdsync.testing.local.LocalGroup`) with the default configuration
a new user has (the README's minimal TOML: only `[protocol] name`; no fast
timing overrides unless `timing=` is given), a source topic of `partitions`
partitions (keys spread over them), then:

1. drain (optional, `backlog` > 0): `backlog` events per cluster are written
   while the members are down; events/s = all of them / (first -> last global
   record timestamp over every cluster);
2. paced load: one producer per cluster writes `rate_eps / clusters` events/s
   for `duration_s`; latency of every paced event in every global topic =
   global record timestamp - `kdsync.origin.ts` header (ms);
   at the same time a plain producer (`linger.ms=1`) -> consumer
   (`fetch.wait.max.ms=5`) pair on cluster 0's broker gives the floor
   (consumer receive time - record timestamp) at the same rate as one cluster;
   member CPU per ordered event = psutil user+system CPU time of the member
   process over the phase / records added to its global topic in the phase;
3. idle: no traffic for `idle_s`; each member's CPU in % of one core.

Everything returned is computed from real records and process counters; a
run in which a paced event does not reach every global topic raises.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from kdsync.testing.stats import percentile

__all__ = ["FloorProbe", "PacedWriters", "cpu_s", "frames_out", "run_load", "stage_sums", "thread_cpu"]

FLOOR_TOPIC = "kdsync-floor"


def cpu_s(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def thread_cpu(proc) -> dict[str, float]:
    """CPU seconds of a member's threads by kind: `loop` (the main thread:
    asyncio loop, ordering core, producer callbacks), `kafka` (librdkafka's
    own threads, rdk:*), `threads` (other Python threads: the source
    consumer, to_thread workers, the metrics server)."""
    out = {"loop": 0.0, "kafka": 0.0, "threads": 0.0}
    for t in proc.threads():
        try:
            with open(f"/proc/{proc.pid}/task/{t.id}/comm") as f:
                name = f.read().strip()
        except OSError:
            name = ""
        kind = "loop" if t.id == proc.pid else "kafka" if name.startswith("rdk:") else "threads"
        out[kind] += t.user_time + t.system_time
    return out


class PacedWriters:
    """One application producer per cluster (idempotent, linger.ms=1, as
    kdsync.testing.local.write_events) writing `per` records keyed f"{tag}{i}-{n}" at
    `rate` records/s each, all starting together once every producer is
    connected: one warm-up record each (key "w...", ordered like any other
    but not measured) is acknowledged first, so the latency figures hold no
    client start-up (metadata, producer id: hundreds of ms on a busy box)."""

    STEP_S = 0.005  # records of a 5 ms step are written back to back, then the thread sleeps

    def __init__(self, bootstraps: list[str], topic: str, per: int, tag: str, rate: float):
        self.bootstraps, self.topic, self.per, self.tag, self.rate = bootstraps, topic, per, tag, rate
        self.errors: list[str] = []
        self._warm = threading.Barrier(len(bootstraps) + 1)
        self._go = threading.Event()
        self.t0 = 0.0
        self.threads = [threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(len(bootstraps))]

    def warm(self, timeout: float = 60.0) -> None:
        for t in self.threads:
            t.start()
        self._warm.wait(timeout)

    def go(self) -> None:
        self.t0 = time.monotonic()
        self._go.set()

    def join(self) -> None:
        for t in self.threads:
            t.join()
        if self.errors:
            raise RuntimeError(f"writing failed: {self.errors[0]}")

    def _one(self, i: int) -> None:
        from confluent_kafka import Producer

        failed: list = []

        def cb(err, msg):
            if err is not None:
                failed.append(err)

        try:
            p = Producer({"bootstrap.servers": self.bootstraps[i], "enable.idempotence": True, "linger.ms": 1,
                          "log_level": 3})
            p.produce(self.topic, key=f"w{self.tag}{i}".encode(), value=b"warm-up", on_delivery=cb)
            if p.flush(30) or failed:
                raise RuntimeError("warm-up record not acknowledged")
        except Exception as e:
            self.errors.append(str(e))
            self._warm.abort()
            return
        self._warm.wait()
        self._go.wait()
        n, step, rate, t0 = 0, self.STEP_S, self.rate, self.t0
        tag = f"{self.tag}{i}"
        while n < self.per:
            due = min(self.per, int((time.monotonic() - t0) * rate) + 1)
            while n < due:
                try:
                    p.produce(self.topic, key=f"{tag}-{n}".encode(), value=f"{tag} event {n}".encode(),
                              headers=[("app", tag.encode())], on_delivery=cb)
                    n += 1
                except BufferError:
                    p.poll(0.01)
            p.poll(0)
            time.sleep(step)
        if p.flush(60) or failed:
            self.errors.append(f"{self.bootstraps[i]}: {len(failed)} errors")


class FloorProbe:
    """Plain producer -> consumer on one broker: (receive time - record
    timestamp) in ms for `n` records written at `rate`/s."""

    def __init__(self, bootstrap: str, n: int, rate: float):
        self.bootstrap, self.n, self.rate = bootstrap, n, rate
        self.lat: list[float] = []
        self.error: str | None = None
        self._ready = threading.Event()
        self._consumer = threading.Thread(target=self._consume, daemon=True)
        self._producer = threading.Thread(target=self._produce, daemon=True)

    def start(self) -> None:
        self._consumer.start()
        self._ready.wait(30)
        self._producer.start()

    def join(self, timeout: float) -> None:
        self._producer.join(timeout)
        self._consumer.join(timeout)

    def _consume(self) -> None:
        from confluent_kafka import OFFSET_END, Consumer, TopicPartition

        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "kdsync-bench-floor",
                      "enable.auto.commit": False, "fetch.wait.max.ms": 5, "log_level": 3})
        try:
            c.assign([TopicPartition(FLOOR_TOPIC, 0, OFFSET_END)])
            # the assignment is in place once a poll has resolved the end offset
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.0:
                c.poll(0.05)
            self._ready.set()
            deadline = time.monotonic() + 60 + self.n / max(1.0, self.rate)
            while len(self.lat) < self.n and time.monotonic() < deadline:
                m = c.poll(0.2)
                if m is None or m.error() or m.key() == b"fw":
                    continue
                now = time.time() * 1000.0
                self.lat.append(max(0.0, now - m.timestamp()[1]))
        except Exception as e:
            self.error = str(e)
        finally:
            self._ready.set()
            c.close()

    def _produce(self) -> None:
        from confluent_kafka import Producer

        p = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 1, "log_level": 3})
        p.produce(FLOOR_TOPIC, key=b"fw", value=b"warm-up", partition=0)  # connected before the clock starts
        p.flush(30)
        t0 = time.monotonic()
        for i in range(self.n):
            p.produce(FLOOR_TOPIC, key=b"f%d" % i, value=b"floor", partition=0)
            p.poll(0)
            ahead = (i + 1) / self.rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
        p.flush(30)


def stage_sums(g, i: int) -> dict[str, tuple[float, float]]:
    """kdsync_stage_seconds of member i: stage -> (sum, count)."""
    out: dict[str, list[float]] = {}
    for (name, labels), v in g.metrics(i).items():
        if name in ("kdsync_stage_seconds_sum", "kdsync_stage_seconds_count"):
            stage = dict(labels).get("stage", "")
            out.setdefault(stage, [0.0, 0.0])[0 if name.endswith("_sum") else 1] += v
    return {k: (a, b) for k, (a, b) in out.items()}


def frames_out(g, i: int) -> float:
    return sum(v for (name, labels), v in g.metrics(i).items()
               if name == "kdsync_peer_frames_total" and ("direction", "out") in labels)


def kafka_requests(g, i: int) -> dict[str, float]:
    """Requests member i's Kafka clients sent so far, by request type
    (kdsync_kafka_requests_total, as fresh as `[metrics] kafka_stats_ms`)."""
    out: dict[str, float] = {}
    for (name, labels), v in g.metrics(i).items():
        if name == "kdsync_kafka_requests_total":
            req = dict(labels).get("request", "?")
            out[req] = out.get(req, 0.0) + v
    return out


REQUEST_KINDS = ("Fetch", "Produce", "ListOffsets", "OffsetCommit", "Metadata")  # reported one by one; the rest: other


def run_load(protocol: str, rate_eps: float, duration_s: float, *, clusters: int = 3, partitions: int = 2,
             peer_address: Callable[[int, int], str] | None = None, workdir: str | os.PathLike | None = None,
             backlog: int = 0, idle_s: float = 0.0, timing: dict | None = None, secret: str | None = None,
             extra: dict[str, dict] | None = None, floor: bool = True, timeout_s: float = 120.0,
             on_group: Callable | None = None, on_done: Callable | None = None, host: str = "127.0.0.1",
             broker: str | None = None, floor_idle_s: float = 0.0) -> dict:
    """One paced-load run (see the module docstring); returns a dict of figures:
    p50_ms/p99_ms (paced events, every global topic), floor_p50_ms/floor_p99_ms,
    floor_idle_p50_ms/floor_idle_p99_ms (with `floor_idle_s` > 0: the same probe
    for that long before the load, members up and idle: the broker's own
    latency without the load, issue 43's "idle p99"),
    cpu_us_per_event (mean over members) and per member, member_cpu_pct (load
    phase), idle_cpu_pct (mean, when idle_s > 0), drain_eps (when backlog > 0),
    frames_out_per_event, events, latency_samples, loadavg.

    `peer_address(i, j)` routes member i's link to member j (a proxy);
    `timing` = the [protocol] timing keys (None: the defaults of kdsync run);
    `extra` = further config sections; `host` = the address members listen
    and dial on (an RDMA device's, for `[transport] kind = "rdma"`); `on_group(g)` is called once the
    members are active (e.g. to start a profiler on their pids), `on_done(g,
    out)` after the figures, before anything is stopped; `broker` = the
    embedded implementation ("tansu" / "noida"; None: LocalGroup's default).
    broker_cpu_us_per_event: the brokers' CPU time over the load phase / events
    ordered, mean over clusters (the requests a member makes are served there).
    With `[metrics] kafka_stats_ms` > 0 in `extra` (250 gives a 4 s load
    a fair count): requests_per_event = the Kafka requests of a member over
    the load phase / events ordered, mean over members, and req_<Kind>_per_event
    for REQUEST_KINDS and the rest (req_other_per_event)."""
    import psutil

    from kdsync.testing import local
    from kdsync.kafka.topic import ensure_topic

    own_dir = None
    if workdir is None:
        own_dir = tempfile.TemporaryDirectory(prefix=f"kdsync-load-{protocol}-")
        workdir = own_dir.name
    out: dict = {"protocol": protocol, "rate_eps": rate_eps, "duration_s": duration_s, "clusters": clusters,
                 "partitions": partitions, "timing": "default" if timing is None else "custom"}
    try:
        g = local.LocalGroup(clusters, Path(workdir), protocol=protocol, metrics=True, peer_address=peer_address,
                            extra=extra, secret=secret, host=host, broker=broker)
        g.timing = dict(timing or {})  # empty: no [protocol] key but name, as the README's minimal config
        with g:
            for c in g.clusters:
                c.start()
            for i in range(clusters):
                ensure_topic(g.bootstrap(i), g.topic, partitions)
            if floor:
                ensure_topic(g.bootstrap(0), FLOOR_TOPIC, 1)
            if backlog:  # as fast as possible, every cluster at once
                local.Writers(g, backlog, "b", None).join(strict=True)
            g.start_members()
            g.wait_ready(timeout=90)
            procs = [psutil.Process(p.pid) for p in g.procs]
            brokers = [psutil.Process(c.pid) for c in g.clusters if c.pid]
            before = 0
            if backlog:
                before = backlog * clusters
                got = g.wait_for(before, timeout_s, poll=0.2)
                short = {n: len(v) for n, v in got.items() if len(v) < before}
                if short:
                    raise RuntimeError(f"backlog of {before} not ordered in {timeout_s:.0f} s: {short}")
                ts = [r.write_ts for v in got.values() for r in v if (r.key or b"").startswith(b"b")]
                span = max(1e-3, (max(ts) - min(ts)) / 1000.0)
                out["drain_eps"] = round(before / span, 1)
                out["drain_span_s"] = round(span, 3)
            else:
                got = g.wait_for(0, 5)
            if on_group is not None:
                on_group(g)
            per = max(1, int(round(rate_eps * duration_s / clusters)))
            if floor and floor_idle_s > 0:  # the probe alone first: its latency without the load
                idle = FloorProbe(g.bootstrap(0), max(1, int(rate_eps / clusters * floor_idle_s)), rate_eps / clusters)
                idle.start()
                idle.join(30 + floor_idle_s)
                if idle.lat:
                    out["floor_idle_p50_ms"] = round(percentile(idle.lat, 50), 2)
                    out["floor_idle_p99_ms"] = round(percentile(idle.lat, 99), 2)
            writers = PacedWriters([g.bootstrap(i) for i in range(clusters)], g.topic, per, "p", rate_eps / clusters)
            writers.warm()
            before += clusters  # the warm-up records
            got = g.wait_for(before, timeout_s, poll=0.05)
            have0 = [len(v) for v in got.values()]
            fl = FloorProbe(g.bootstrap(0), per, rate_eps / clusters) if floor else None
            if fl:
                fl.start()
            load0 = os.getloadavg()
            frames0 = [frames_out(g, i) for i in range(clusters)]
            stages0 = [stage_sums(g, i) for i in range(clusters)]
            stats_ms = ((extra or {}).get("metrics") or {}).get("kafka_stats_ms", 0)
            req0 = [kafka_requests(g, i) for i in range(clusters)] if stats_ms else None
            cpu0 = [cpu_s(p) for p in procs]
            bcpu0 = [cpu_s(p) for p in brokers]
            split0 = [thread_cpu(p) for p in procs]
            t0 = time.monotonic()
            writers.go()
            writers.join()
            total = before + per * clusters
            got = g.wait_for(total, timeout_s, poll=0.05)
            t1 = time.monotonic()
            cpu1 = [cpu_s(p) for p in procs]
            bcpu1 = [cpu_s(p) for p in brokers]
            split1 = [thread_cpu(p) for p in procs]
            frames1 = [frames_out(g, i) for i in range(clusters)]
            stages1 = [stage_sums(g, i) for i in range(clusters)]
            if fl:
                fl.join(30)
            short = {n: len(v) for n, v in got.items() if len(v) < total}
            if short:
                raise RuntimeError(f"{total} events not ordered in {timeout_s:.0f} s: {short}")
            lat = [max(0, r.write_ts - r.origin_ts) for v in got.values() for r in v
                   if (r.key or b"").startswith(b"p")]
            if len(lat) != per * clusters * clusters:
                raise RuntimeError(f"{len(lat)} paced records in the global topics, expected {per * clusters ** 2}")
            ordered = [len(v) - h for v, h in zip(got.values(), have0)]
            cpu = [c1 - c0 for c0, c1 in zip(cpu0, cpu1)]
            out.update({
                "events": per * clusters,
                "latency_samples": len(lat),
                "p50_ms": percentile(lat, 50), "p90_ms": percentile(lat, 90), "p99_ms": percentile(lat, 99),
                "max_ms": max(lat),
                "cpu_us_per_event_by_member": [round(c / max(1, n) * 1e6, 1) for c, n in zip(cpu, ordered)],
                "member_cpu_pct": round(100 * sum(cpu) / len(cpu) / max(1e-3, t1 - t0), 1),
                "phase_s": round(t1 - t0, 2),
                "frames_out_per_event": round(sum(f1 - f0 for f0, f1 in zip(frames0, frames1))
                                              / max(1, per * clusters), 3),
                "loadavg_1m": round(load0[0], 2),
            })
            out["cpu_us_per_event"] = round(sum(out["cpu_us_per_event_by_member"]) / clusters, 1)
            if req0 is not None:
                time.sleep(2 * stats_ms / 1000.0)  # the statistics after the phase reach the metrics
                req1 = [kafka_requests(g, i) for i in range(clusters)]
                kinds: dict[str, float] = {}
                for a, b in zip(req0, req1):
                    for k, v in b.items():
                        key = k if k in REQUEST_KINDS else "other"
                        kinds[key] = kinds.get(key, 0.0) + v - a.get(k, 0.0)
                per = max(1, sum(ordered))  # every member's requests / every member's ordered events
                out["requests_per_event"] = round(sum(kinds.values()) / per, 3)
                for k in (*REQUEST_KINDS, "other"):
                    out[f"req_{k}_per_event"] = round(kinds.get(k, 0.0) / per, 3)
            if brokers:
                out["broker_cpu_us_per_event"] = round(sum(b1 - b0 for b0, b1 in zip(bcpu0, bcpu1)) / len(brokers)
                                                       / max(1, sum(ordered) / clusters) * 1e6, 1)
            out["broker"] = g.broker
            for stage in ("fetch", "handoff", "sent", "delivered", "produced", "report"):
                # mean time of the stage per batch in the phase, ms, over every member
                tot = sum(b.get(stage, (0, 0))[0] - a.get(stage, (0, 0))[0] for a, b in zip(stages0, stages1))
                n = sum(b.get(stage, (0, 0))[1] - a.get(stage, (0, 0))[1] for a, b in zip(stages0, stages1))
                out[f"stage_{stage}_ms"] = round(1000 * tot / n, 3) if n else None
            for kind in ("loop", "kafka", "threads"):  # µs per ordered event, mean over members
                out[f"cpu_us_{kind}"] = round(sum((b[kind] - a[kind]) / max(1, n) * 1e6 for a, b, n in
                                                  zip(split0, split1, ordered)) / clusters, 1)
            if protocol != "mirror":
                ok, detail = local.check_global_topics(got, expected=total)
                out["agreement"], out["agreement_detail"] = ok, detail
            if fl:
                if fl.error or not fl.lat:
                    out["floor_error"] = fl.error or "no floor record received"
                out["floor_samples"] = len(fl.lat)
                out["floor_p50_ms"] = round(percentile(fl.lat, 50), 2)
                out["floor_p99_ms"] = round(percentile(fl.lat, 99), 2)
            if idle_s > 0:
                time.sleep(1.0)  # the last delivery reports, commits
                c0, w0 = [cpu_s(p) for p in procs], time.monotonic()
                time.sleep(idle_s)
                c1, w1 = [cpu_s(p) for p in procs], time.monotonic()
                pct = [100 * (b - a) / (w1 - w0) for a, b in zip(c0, c1)]
                out["idle_cpu_pct_by_member"] = [round(x, 2) for x in pct]
                out["idle_cpu_pct"] = round(sum(pct) / len(pct), 2)
            out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
            if on_done is not None:
                on_done(g, out)
    finally:
        if own_dir is not None:
            own_dir.cleanup()
    return out
