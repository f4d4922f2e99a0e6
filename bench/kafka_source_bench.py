"""Records/s of the kdsync-kafka Spark data source reading a real global topic:

    .venv/bin/python -m bench.kafka_source_bench [--records 2000000] [--partitions 4] [--master local[2]]

Starts one embedded Tansu broker and writes `records` source records into
topic `bench` and, for each, the global record kdsync would have written
(the five kdsync headers, a 100-byte value; one cluster, `[topics] shards`
= partitions).  Then, in one SparkSession started before the clock runs:
the kdsync-kafka source reads `bench-global` (every record counted: the
source cannot prune columns, so every column is read and shipped), and
`kdsync audit --cluster dc1=... --topic bench --shards P` reads both topics
and checks them (must pass, every event accounted for).  Reports records/s
of each (the first includes the Python workers' start) and the Spark JVM's
peak RSS; writes results/kafka_source_bench.csv.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bench.common import write_rows


def write_topics(bootstrap: str, topic: str, records: int, partitions: int) -> float:
    """Write `records` source records round-robin over the partitions of
    `topic` and, for each, the global record kdsync would write for it (same
    partition and offset of `topic`-global, the five kdsync headers, one
    cluster "dc1", [topics] shards = `partitions`); seconds taken."""
    from confluent_kafka import Producer

    from kdsync.kafka.records import H_OOFF, H_OPART, H_ORIGIN, H_OTS, H_SEQ
    from kdsync.kafka.topic import ensure_topic

    for t in (topic, topic + "-global"):
        ensure_topic(bootstrap, t, partitions)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "batch.size": 1_000_000,
                  "queue.buffering.max.messages": 1_000_000, "log_level": 3})
    value = b"x" * 100
    t0 = time.perf_counter()
    for i in range(records):
        part, off = i % partitions, i // partitions  # offsets of an empty topic written in order
        headers = [(H_SEQ, str(off).encode()), (H_ORIGIN, b"dc1"), (H_OPART, str(part).encode()),
                   (H_OOFF, str(off).encode()), (H_OTS, b"1700000000000")]
        for t, h in ((topic, None), (topic + "-global", headers)):
            while True:
                try:
                    p.produce(t, value=value, partition=part, headers=h)
                    break
                except BufferError:
                    p.poll(0.05)
        if i % 10_000 == 0:
            p.poll(0)
    assert p.flush(300) == 0, "records not acknowledged"
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.kafka_source_bench")
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--out", default="results/kafka_source_bench.csv")
    a = ap.parse_args(argv)

    from bench.audit_bench import _vm_hwm_kib
    from kdsync.kafka.embedded import EmbeddedCluster
    from kdsync.spark.audit import AuditArgs
    from kdsync.spark.audit import run as audit_run
    from kdsync.spark.kafka_source import read_topic
    from kdsync.spark.session import spark_session

    spark = spark_session(a.master, "kdsync-kafka-source-bench", {"spark.ui.showConsoleProgress": "false"})
    jvm_pid = int(spark._jvm.java.lang.ProcessHandle.current().pid())
    rows = []
    with EmbeddedCluster(name="dc1") as c:
        write_s = write_topics(c.bootstrap, "bench", a.records, a.partitions)
        print(f"wrote {a.records} source and {a.records} global records in {write_s:.1f} s", flush=True)
        for what in ("global topic, every column", "kdsync audit (source + global)"):
            t0 = time.perf_counter()
            if what.startswith("global"):
                # a Python data source cannot prune columns: a count reads and ships every column
                n = read_topic(spark, c.bootstrap, "bench-global", cluster="dc1").count()
                assert n == a.records, (n, a.records)
            else:
                code, report = audit_run(AuditArgs(cluster=[f"dc1={c.bootstrap}"], topic=["bench"],
                                                   master=a.master, shards=a.partitions))
                runs = report["runs"]
                assert code == 0 and sum(r["events_submitted"] for r in runs) == a.records, (code, runs[:1])
                n = 2 * a.records
            wall = time.perf_counter() - t0
            row = {"read": what, "records": n, "partitions": a.partitions, "master": a.master,
                   "seconds": round(wall, 1), "records_per_s": round(n / wall),
                   "write_records_per_s": round(2 * a.records / write_s),
                   "jvm_peak_rss_mib": round(_vm_hwm_kib(jvm_pid) / 1024),
                   "load_avg_1m": round(os.getloadavg()[0], 1), "cpus": os.cpu_count()}
            rows.append(row)
            print(row, flush=True)
            spark.catalog.clearCache()
    print(f"wrote {write_rows(rows, Path(a.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
