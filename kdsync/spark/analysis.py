"""The checks of `kdsync audit`, as Spark DataFrame transformations.

Input is the trace schema of docs/outputs.md — one row per (member, delivered
event): run_id, member, event_id, origin, origin_partition, origin_offset,
seq, submit_ts, deliver_ts (seconds) — plus optional attribute columns
(scenario, protocol, seed).  Real clusters are converted to the same rows by
`kdsync.spark.audit`, simulated runs come as trace.parquet, so one pipeline
checks both.  Optionally a table of *source* events (run_id, event_id) says
what was written to the source topics (for loss and foreign events); without
it the universe of a run is every event any member delivered.

Everything is computed with joins and aggregations in Spark; only aggregates
(one row per run and member) and a few examples are collected to the driver.

Definitions (per run), named as `kdsync.invariants` names them (the table that
holds each is in brackets; `AuditTables.by_anomaly()` maps the names):
  inconsistent-offsets  positions (seq) where members' events differ; a member
                  that lacks a position is a prefix there, not a divergence
                  [divergent]
  duplicate       rows of a member minus its distinct events [duplicates]
  foreign         distinct events of a member that are not source events
                  [foreign]
  lost-write      source events a member did not deliver [lost]
  nonmonotonic    events delivered after a higher offset of the same origin
                  partition (in seq order, per member) — as the simulator
                  counts them [inversions]
  latency         deliver_ts - submit_ts in ms, exact percentiles (linear
                  interpolation, as numpy) unless approx=True
  throughput      distinct events / (last deliver_ts - first submit_ts);
                  per member: its rows / (its last deliver - first submit);
                  per window: deliveries per member per `window_s`
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from kdsync import invariants as checker
from kdsync.invariants import TRACE_COLUMNS

ATTRIBUTE_COLUMNS = ["scenario", "protocol", "seed"]
QUANTILES = [0.5, 0.9, 0.99]


@dataclass
class AuditTables:
    """Every table of an audit (Spark DataFrames; written by --out)."""

    runs: DataFrame          # one row per run: agreement, counts, latency, throughput
    members: DataFrame       # one row per (run, member)
    divergent: DataFrame     # (run_id, seq, events, members) where members disagree
    duplicates: DataFrame    # (run_id, member, event_id, copies)
    foreign: DataFrame       # (run_id, member, event_id)
    lost: DataFrame          # (run_id, member, event_id)
    inversions: DataFrame    # (run_id, member, origin, origin_partition, seq, origin_offset, prev_offset)
    throughput: DataFrame    # (run_id, member, window_start, events)
    scenarios: DataFrame     # rollup by (scenario, protocol)
    extra: dict = field(default_factory=dict)

    def by_anomaly(self) -> dict[str, DataFrame]:
        """anomaly name (kdsync.invariants) -> the table that lists its occurrences."""
        return {checker.INCONSISTENT_OFFSETS: self.divergent, checker.DUPLICATE: self.duplicates,
                checker.FOREIGN: self.foreign, checker.LOST_WRITE: self.lost, checker.NONMONOTONIC: self.inversions}

    def items(self):
        return [("runs", self.runs), ("members", self.members), ("divergent", self.divergent),
                ("duplicates", self.duplicates), ("foreign", self.foreign), ("lost", self.lost),
                ("inversions", self.inversions), ("throughput", self.throughput),
                ("scenarios", self.scenarios)] + list(self.extra.items())


def missing_columns(df: DataFrame) -> list[str]:
    return [c for c in TRACE_COLUMNS if c not in df.columns]


def normalise(trace: DataFrame) -> DataFrame:
    """Cast the trace columns to their types and add absent attribute columns."""
    df = trace.select(
        F.col("run_id").cast("string").alias("run_id"),
        F.col("member").cast("string").alias("member"),
        F.col("event_id").cast("string").alias("event_id"),
        F.col("origin").cast("string").alias("origin"),
        F.col("origin_partition").cast("int").alias("origin_partition"),
        F.col("origin_offset").cast("long").alias("origin_offset"),
        F.col("seq").cast("long").alias("seq"),
        F.col("submit_ts").cast("double").alias("submit_ts"),
        F.col("deliver_ts").cast("double").alias("deliver_ts"),
        *[(F.col(c).cast("string") if c in trace.columns else F.lit(None).cast("string")).alias(c)
          for c in ATTRIBUTE_COLUMNS],
    )
    return df


def _latency_aggs(col: str, approx: bool, prefix: str = "") -> list:
    if approx:
        q = F.percentile_approx(col, QUANTILES, 100000)
    else:
        q = F.percentile(col, F.array(*[F.lit(x) for x in QUANTILES]))
    return [q.alias(f"{prefix}_q"), F.max(col).alias(f"{prefix}max")]


def _unpack_q(df: DataFrame, prefix: str = "") -> DataFrame:
    return (df.withColumn(f"{prefix}p50", F.col(f"{prefix}_q")[0])
              .withColumn(f"{prefix}p90", F.col(f"{prefix}_q")[1])
              .withColumn(f"{prefix}p99", F.col(f"{prefix}_q")[2])
              .drop(f"{prefix}_q"))


def analyse(trace: DataFrame, sources: DataFrame | None = None, window_s: float = 1.0,
            approx: bool = False, members: list[str] | None = None) -> AuditTables:
    """All audit tables of `trace` (normalised here).  `sources` has columns
    (run_id, event_id): the events written to any source topic; None means
    the union of what members delivered.  `members` names every member that
    should hold each run (default: those with a row in it), so a member whose
    global topic is empty still shows up, with everything lost."""
    # an event whose submit time is unknown (NaN/null) has no latency
    lat = (F.col("deliver_ts") - F.col("submit_ts")) * 1000.0
    t = normalise(trace).withColumn("latency_ms", F.when(~F.isnan(lat), lat))
    t = t.persist()

    attrs = t.groupBy("run_id").agg(*[F.first(c, ignorenulls=True).alias(c) for c in ATTRIBUTE_COLUMNS],
                                    F.sort_array(F.collect_set("member")).alias("member_list"))
    if members is not None:
        run_ids = t.select("run_id")
        if sources is not None:
            run_ids = run_ids.unionByName(sources.select("run_id"))
        attrs = (run_ids.distinct().join(attrs.drop("member_list"), "run_id", "left")
                 .withColumn("member_list", F.array(*[F.lit(x) for x in sorted(members)])))
    attrs = attrs.persist()
    run_members = F.broadcast(attrs.select("run_id", "member_list"))

    # one row per (run, member, event): copies > 1 is a duplicate
    per_event = t.groupBy("run_id", "member", "event_id").agg(F.count(F.lit(1)).alias("copies")).persist()
    duplicates = per_event.where(F.col("copies") > 1)

    # one row per (run, event): who delivered it, and whether a source wrote it
    ev = per_event.groupBy("run_id", "event_id").agg(F.collect_list("member").alias("by"))
    if sources is not None:
        src = sources.select("run_id", "event_id").distinct().withColumn("is_source", F.lit(True))
        ev = ev.join(src, ["run_id", "event_id"], "full")
    else:
        ev = ev.withColumn("is_source", F.lit(True))
    ev = ev.join(run_members, "run_id").persist()
    foreign = (ev.where(F.col("is_source").isNull())
               .select("run_id", F.explode("by").alias("member"), "event_id"))
    lost = (ev.where(F.col("is_source"))
            .select("run_id", F.explode(F.array_except("member_list", F.coalesce("by", F.array().cast("array<string>"))))
                    .alias("member"), "event_id"))

    # agreement: position by position (min != max event at a position = members differ)
    by_pos = t.groupBy("run_id", "seq").agg(F.min("event_id").alias("lo"), F.max("event_id").alias("hi"))
    div_pos = by_pos.where(F.col("lo") != F.col("hi")).select("run_id", "seq")
    divergent = (t.join(div_pos, ["run_id", "seq"], "left_semi").groupBy("run_id", "seq")
                 .agg(F.sort_array(F.collect_set("event_id")).alias("events"),
                      F.sort_array(F.collect_set(F.concat_ws("=", "member", "event_id"))).alias("members")))
    agreement = by_pos.groupBy("run_id").agg(
        F.count(F.lit(1)).alias("positions"),
        F.sum(F.when(F.col("lo") != F.col("hi"), 1).otherwise(0)).alias("differing_positions"),
        F.min(F.when(F.col("lo") != F.col("hi"), F.col("seq"))).alias("first_divergent"))

    # origin order: adjacent descents in seq order within an origin partition
    w = (Window.partitionBy("run_id", "member", "origin", "origin_partition").orderBy("seq", "origin_offset")
         .rowsBetween(Window.unboundedPreceding, -1))
    inversions = (t.select("run_id", "member", "origin", "origin_partition", "seq", "origin_offset")
                  .withColumn("prev_offset", F.max("origin_offset").over(w))
                  .where(F.col("origin_offset") < F.col("prev_offset")))

    # per member
    distinct = per_event.groupBy("run_id", "member").agg(F.count(F.lit(1)).alias("distinct_events"))
    m = t.groupBy("run_id", "member").agg(
        F.count(F.lit(1)).alias("delivered"),
        F.min("seq").alias("first_seq"), F.max("seq").alias("last_seq"),
        F.countDistinct("seq").alias("distinct_positions"),
        F.min(F.when(~F.isnan("submit_ts"), F.col("submit_ts"))).alias("first_submit_ts"), F.max("deliver_ts").alias("last_deliver_ts"),
        *_latency_aggs("latency_ms", approx, "latency_ms_"))
    m = _unpack_q(m, "latency_ms_")
    counts = lambda df, name: df.groupBy("run_id", "member").agg(F.count(F.lit(1)).alias(name))  # noqa: E731
    grid = attrs.select("run_id", F.explode("member_list").alias("member"))
    members_t = (grid.join(m, ["run_id", "member"], "left").join(distinct, ["run_id", "member"], "left")
               .fillna(0, ["delivered", "distinct_events", "distinct_positions"])
               .join(counts(duplicates, "duplicated_events"), ["run_id", "member"], "left")
               .join(counts(foreign, "foreign"), ["run_id", "member"], "left")
               .join(counts(lost, "lost"), ["run_id", "member"], "left")
               .join(counts(inversions, "inversions"), ["run_id", "member"], "left")
               .fillna(0, ["duplicated_events", "foreign", "lost", "inversions"])
               .withColumn("duplicates", F.col("delivered") - F.col("distinct_events"))
               .withColumn("missing_positions",
                           F.col("last_seq") - F.col("first_seq") + 1 - F.col("distinct_positions"))
               .withColumn("throughput_eps", F.col("delivered") /
                           F.greatest(F.col("last_deliver_ts") - F.col("first_submit_ts"), F.lit(1e-9)))).persist()

    # per run
    r = t.groupBy("run_id").agg(
        F.count(F.lit(1)).alias("deliveries"),
        F.min(F.when(~F.isnan("submit_ts"), F.col("submit_ts"))).alias("first_submit_ts"), F.max("deliver_ts").alias("last_deliver_ts"),
        *_latency_aggs("latency_ms", approx, "latency_ms_"))
    r = _unpack_q(r, "latency_ms_")
    src_counts = ev.groupBy("run_id").agg(
        F.sum(F.when(F.col("is_source"), 1).otherwise(0)).alias("events_submitted"),
        F.sum(F.when(F.col("by").isNotNull(), 1).otherwise(0)).alias("events_delivered_any"))
    viol = members_t.groupBy("run_id").agg(
        F.sum("duplicates").alias("duplicates"), F.sum("foreign").alias("foreign"),
        F.sum("lost").alias("lost"), F.sum("inversions").alias("inversions"))
    runs = (attrs.join(r, "run_id", "left").join(agreement, "run_id", "left").join(src_counts, "run_id", "left")
            .join(viol, "run_id", "left")
            .fillna(0, ["deliveries", "positions", "differing_positions", "events_submitted",
                        "events_delivered_any", "duplicates", "foreign", "lost", "inversions"])
            .withColumn("throughput_eps", F.col("events_delivered_any") /
                        F.greatest(F.col("last_deliver_ts") - F.col("first_submit_ts"), F.lit(1e-9)))
            .withColumn("agreement_ok", F.col("differing_positions") == 0)
            .withColumn("ok", (F.col("duplicates") == 0) & (F.col("foreign") == 0) & (F.col("lost") == 0)
                        & (F.col("inversions") == 0)
                        & (F.col("agreement_ok") | (F.coalesce(F.col("protocol"), F.lit("")) == "mirror")))).persist()

    throughput = (t.withColumn("window_start", F.floor(F.col("deliver_ts") / window_s) * window_s)
                  .groupBy("run_id", "member", "window_start").agg(F.count(F.lit(1)).alias("events")))

    scenarios = (runs.groupBy("scenario", "protocol").agg(
        F.count(F.lit(1)).alias("runs"),
        F.sum(F.when(F.col("ok"), 0).otherwise(1)).alias("runs_with_violations"),
        F.sum("events_delivered_any").alias("events"),
        F.avg("latency_ms_p50").alias("mean_latency_ms_p50"),
        F.avg("latency_ms_p99").alias("mean_latency_ms_p99"),
        F.max("latency_ms_max").alias("latency_ms_max"),
        F.avg("throughput_eps").alias("mean_throughput_eps")))

    return AuditTables(runs=runs, members=members_t, divergent=divergent, duplicates=duplicates,
                       foreign=foreign, lost=lost, inversions=inversions, throughput=throughput,
                       scenarios=scenarios)
