"""The CPU floor of a member built on confluent-kafka: copy, nothing else.

    python -m bench.copyfloor --rate 1000 --duration 4 [--json]

`run_copy_floor()` starts `clusters` embedded Tansu brokers with the bench's
source topic (`partitions` partitions) and, per cluster, one *copier*
process (`python -m bench.copyfloor --copier ...`): a consumer per cluster
(kdsync's own `consumer_conf`, the member's poll-then-consume loop, one
thread each) that produces every source record of every cluster into its
own cluster's `<topic>-copy` topic with kdsync's own `producer_conf`
(idempotent, acks=all, linger 1 ms), the main thread serving delivery
reports. That is MirrorMaker's job done in Python with the member's client
layer and no ordering, no peers, no metrics, no asyncio: whatever a member
spends per event above it is kdsync's runtime; what it spends up to it
the Kafka client layer costs on this box anyway.

The same paced writers as `bench.load` (one per cluster, rate / clusters
each) write for `duration_s`; each copier reports its CPU time (all threads;
split: librdkafka's threads vs Python threads) from the writers' start to
its last delivery report, and CPU per event = that / records it copied
(every paced record of every cluster: the denominator of a member's CPU per
ordered event). A copier that does not copy every record raises.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["run_copy_floor", "main"]

COPY_SUFFIX = "-copy"


# ------------------------------------------------------------------ copier
def copier(own: str, sources: list[str], topic: str, expect: int, timeout_s: float = 120.0) -> int:
    """The copier process: see the module doc.  Prints `ready` once every
    consumer has its partitions, then, after `go` on stdin, one JSON line
    when `expect` paced records (keys `p...`) have been copied and
    acknowledged, or after `timeout_s`."""
    import psutil
    from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

    from kdsync.testing.load import thread_cpu
    from kdsync.kafka.sink import producer_conf
    from kdsync.kafka.source import POLL_S, consumer_conf

    producer = Producer(producer_conf({"bootstrap.servers": own}))
    dest = topic + COPY_SUFFIX
    copied = [0]
    errors: list[str] = []
    stop = threading.Event()
    ready = threading.Barrier(len(sources) + 1)

    def delivered(err, msg) -> None:
        if err is not None:
            errors.append(str(err))
        elif msg.key().startswith(b"p"):  # a paced record (the writers' warm-up records are "w...")
            copied[0] += 1

    def consume(i: int, bootstrap: str) -> None:
        c = Consumer(consumer_conf(f"copy-{own}-{i}", {"bootstrap.servers": bootstrap}))
        parts = c.list_topics(topic, timeout=30).topics[topic].partitions
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        ready.wait()
        produce = producer.produce
        while not stop.is_set():
            first = c.poll(POLL_S)  # as the member: poll for the first record, then take what is there
            if first is None:
                continue
            for m in [first] + c.consume(999, timeout=0):
                if m.error() is None:
                    produce(dest, m.value(), m.key(), headers=m.headers(), on_delivery=delivered)
        c.close()

    threads = [threading.Thread(target=consume, args=(i, b), daemon=True) for i, b in enumerate(sources)]
    for t in threads:
        t.start()
    ready.wait()
    print("ready", flush=True)
    go = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), go.set()), daemon=True).start()
    while not go.is_set():  # the warm-up records: copied before the measurement starts
        producer.poll(0.05)
    me = psutil.Process()
    cpu0, t0 = thread_cpu(me), time.monotonic()
    while copied[0] < expect and not errors and time.monotonic() - t0 < timeout_s:
        producer.poll(0.05)
    cpu1, t1 = thread_cpu(me), time.monotonic()
    stop.set()
    d = {k: cpu1[k] - cpu0[k] for k in cpu0}  # librdkafka's threads; every other thread is Python
    print(json.dumps({"copied": copied[0], "errors": errors[:3], "seconds": round(t1 - t0, 3),
                      "kafka_s": round(d["kafka"], 4), "python_s": round(d["loop"] + d["threads"], 4)}), flush=True)
    for t in threads:
        t.join(5)
    producer.flush(10)
    return 0 if not errors and copied[0] >= expect else 1


# ------------------------------------------------------------------- bench
def run_copy_floor(rate_eps: float, duration_s: float, *, clusters: int = 3, partitions: int = 2,
                   topic: str = "events", timeout_s: float = 120.0, floor_idle_s: float = 0.0,
                   floor: bool = True) -> dict:
    """One paced run with copiers instead of members; returns cpu_us_per_event
    (mean over copiers), its split (cpu_us_kafka, cpu_us_threads), events,
    loadavg_1m; and bench.load's one-hop probe on cluster 1's broker for
    `floor_idle_s` before the load and during it (floor_idle_p50_ms, ...,
    floor_p99_ms): what the load does to the broker's latency when only
    copiers serve it, the reference for the members' figures."""
    from kdsync.testing.load import FLOOR_TOPIC, FloorProbe, PacedWriters
    from kdsync.testing.stats import percentile
    from kdsync.kafka.embedded import EmbeddedCluster
    from kdsync.kafka.topic import ensure_topic

    out: dict = {"protocol": "copy-floor", "rate_eps": rate_eps, "duration_s": duration_s, "clusters": clusters,
                 "partitions": partitions}
    per = max(1, int(round(rate_eps * duration_s / clusters)))
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="kdsync-copyfloor-") as d:
        brokers = [EmbeddedCluster(f"dc{i + 1}", log_dir=Path(d)) for i in range(clusters)]
        try:
            for b in brokers:
                b.start()
                ensure_topic(b.bootstrap, topic, partitions)
                ensure_topic(b.bootstrap, topic + COPY_SUFFIX, partitions)
            boots = [b.bootstrap for b in brokers]
            for b in boots:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "bench.copyfloor", "--copier", "--own", b, "--topic", topic,
                     "--expect", str(per * clusters), "--timeout", str(timeout_s), *[a for s in boots for a in ("--source", s)]],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True))
            for p in procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a copier did not start (exit {p.poll()})")
            ensure_topic(boots[0], FLOOR_TOPIC, 1)
            if floor_idle_s > 0:
                idle = FloorProbe(boots[0], max(1, int(rate_eps / clusters * floor_idle_s)), rate_eps / clusters)
                idle.start()
                idle.join(30 + floor_idle_s)
                if idle.lat:
                    out["floor_idle_p50_ms"] = round(percentile(idle.lat, 50), 2)
                    out["floor_idle_p99_ms"] = round(percentile(idle.lat, 99), 2)
            writers = PacedWriters(boots, topic, per, "p", rate_eps / clusters)
            writers.warm()
            probe = FloorProbe(boots[0], per, rate_eps / clusters) if floor else None
            if probe:  # as bench.load runs it beside the members: both sides see the same box
                probe.start()
            load0 = os.getloadavg()[0]
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            writers.go()
            writers.join()
            if probe:
                probe.join(30)
            if probe and probe.lat:
                out["floor_p50_ms"] = round(percentile(probe.lat, 50), 2)
                out["floor_p99_ms"] = round(percentile(probe.lat, 99), 2)
            res = []
            for p in procs:
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"a copier ended without a result (exit {p.wait(timeout_s)})")
                res.append(json.loads(line))
            bad = [r for r in res if r["errors"] or r["copied"] < per * clusters]
            if bad:
                raise RuntimeError(f"a copier copied {bad[0]['copied']} of {per * clusters}: {bad[0]['errors']}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.stdin.close() if not p.stdin.closed else None
                    try:
                        p.wait(15)
                    except subprocess.TimeoutExpired:
                        p.kill()
            for b in brokers:
                b.stop()
    n = per * clusters
    out.update({"events": n, "loadavg_1m": round(load0, 2),
                "cpu_us_per_event": round(sum(r["kafka_s"] + r["python_s"] for r in res) / clusters / n * 1e6, 1),
                "cpu_us_kafka": round(sum(r["kafka_s"] for r in res) / clusters / n * 1e6, 1),
                "cpu_us_threads": round(sum(r["python_s"] for r in res) / clusters / n * 1e6, 1),
                "member_cpu_pct": round(100 * sum(r["kafka_s"] + r["python_s"] for r in res) / clusters
                                        / max(1e-3, max(r["seconds"] for r in res)), 1)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.copyfloor", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=1000.0, help="total events/s over every cluster")
    p.add_argument("--duration", type=float, default=4.0, help="seconds of paced load")
    p.add_argument("--clusters", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one JSON line instead of a summary")
    p.add_argument("--copier", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--own", help=argparse.SUPPRESS)
    p.add_argument("--source", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--topic", default="events", help=argparse.SUPPRESS)
    p.add_argument("--expect", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.copier:
        return copier(a.own, a.source, a.topic, a.expect, a.timeout)
    r = run_copy_floor(a.rate, a.duration, clusters=a.clusters)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"copy floor at {a.rate:g} events/s: {r['cpu_us_per_event']} µs of CPU per copied event "
              f"(librdkafka threads {r['cpu_us_kafka']}, Python threads {r['cpu_us_threads']}); "
              f"load average {r['loadavg_1m']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
