"""Synthetic traces (the trace.parquet schema) generated inside Spark, for
tests and the audit benchmark.  Deterministic for given arguments.

`events` distinct events, each delivered by every member (rows = events *
members).  Event i has seq i, comes from origin members[i % M], origin
partition (i // M) % partitions, origin offset i // (M * partitions), is
submitted at i / rate_eps and reaches each member after a latency of
`base_ms` plus a hash-derived jitter in [0, jitter_ms).
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def synthetic_trace(spark, events: int, members: list[str] | None = None, partitions: int = 4,
                    rate_eps: float = 10_000.0, base_ms: float = 20.0, jitter_ms: float = 30.0,
                    run_id: str = "synthetic", slices: int | None = None) -> DataFrame:
    members = members or ["dc1", "dc2", "dc3"]
    nm = len(members)
    ev = spark.range(0, events, numPartitions=slices or max(2, events // 500_000))
    mem = spark.createDataFrame([(j, m) for j, m in enumerate(members)], "midx int, member string")
    origin = F.element_at(F.array(*[F.lit(m) for m in members]), (F.col("id") % nm + 1).cast("int"))
    df = (ev.crossJoin(F.broadcast(mem))
          .select(
              F.lit(run_id).alias("run_id"),
              F.col("member"),
              origin.alias("origin"),
              ((F.col("id") / nm).cast("long") % partitions).cast("int").alias("origin_partition"),
              (F.col("id") / (nm * partitions)).cast("long").alias("origin_offset"),
              F.col("id").alias("seq"),
              (F.col("id") / F.lit(rate_eps)).alias("submit_ts"),
              F.col("midx"), F.col("id")))
    jitter = (F.abs(F.xxhash64("id", "midx")) % 1_000_000) / 1_000_000.0 * jitter_ms
    return (df.withColumn("deliver_ts", F.col("submit_ts") + (F.lit(base_ms) + jitter) / 1000.0)
              .withColumn("event_id", F.concat_ws("/", "origin", "origin_partition", "origin_offset"))
              .select("run_id", "member", "event_id", "origin", "origin_partition", "origin_offset", "seq",
                      "submit_ts", "deliver_ts"))
