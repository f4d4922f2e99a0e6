"""The checks of `kdsync audit`, as Spark DataFrame transformations.

Input is the trace schema of docs/outputs.md — one row per (member, delivered
event): run_id, member, event_id, origin, origin_partition, origin_offset,
seq, submit_ts, deliver_ts (seconds) — plus optional attribute columns
(scenario, protocol, seed).  Real clusters are converted to the same rows by
`kdsync.spark.audit`, simulated runs come as trace.parquet, so one pipeline
checks both.  Optionally a table of *source* events (run_id, origin,
origin_partition, origin_offset) says what was written to the source topics
(for loss and foreign events); without it the universe of a run is every
event any member delivered.  An event is (origin, origin_partition,
origin_offset), which event_id spells as `origin/partition/offset`.

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
                  interpolation, as numpy) of the latencies rounded to the
                  microsecond (to the millisecond with approx=True)
  throughput      distinct events / (last deliver_ts - first submit_ts);
                  per member: its rows / (its last deliver - first submit);
                  per window: deliveries per member per `window_s`

How (docs/design/audit.md): everything stays in the JVM.  Names are coded
once (run, member, origin -> small integers; a member is one bit of a 64-bit
mask), then four passes over the trace, each one aggregation or one sort:
  1. per (run, member): counts, first/last seq and times (no shuffle of rows)
  2. per event (one shuffle): rows, mask of the members holding it
     -> distinct events, duplicates, loss, foreign (against the sources)
  3. per position (one shuffle): min/max of each event column, mask
     -> differing positions, distinct positions per member
  4. per origin partition and member, in seq order (one sort): inversions
  and a latency histogram (rows per distinct latency) whose percentiles are
  weighted.  Only the aggregates reach the driver; the tables that list
  anomalies are built (again from the trace) only for kinds that occurred.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from kdsync import invariants as checker
from kdsync.invariants import TRACE_COLUMNS

ATTRIBUTE_COLUMNS = ["scenario", "protocol", "seed"]
QUANTILES = [0.5, 0.9, 0.99]
MAX_MEMBERS = 63  # members of one run: bits of a (signed) 64-bit mask
EVENT = ["o", "origin_partition", "origin_offset"]


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
    """Cast the trace columns to their types and add absent attribute columns
    (event_id is not read: origin, origin_partition and origin_offset name
    the event; a missing run, member or origin name reads as "")."""
    name = lambda c: F.coalesce(F.col(c).cast("string"), F.lit("")).alias(c)  # noqa: E731  (a null name is "")
    return trace.select(
        name("run_id"), name("member"), name("origin"),
        F.col("origin_partition").cast("int").alias("origin_partition"),
        F.col("origin_offset").cast("long").alias("origin_offset"),
        F.col("seq").cast("long").alias("seq"),
        F.col("submit_ts").cast("double").alias("submit_ts"),
        F.col("deliver_ts").cast("double").alias("deliver_ts"),
        *[(F.col(c).cast("string") if c in trace.columns else F.lit(None).cast("string")).alias(c)
          for c in ATTRIBUTE_COLUMNS],
    )


SCHEMAS = {
    "members": "run_id string, member string, delivered long, first_seq long, last_seq long, "
               "distinct_positions long, first_submit_ts double, last_deliver_ts double, latency_ms_max double, "
               "latency_ms_p50 double, latency_ms_p90 double, latency_ms_p99 double, distinct_events long, "
               "duplicated_events long, foreign long, lost long, inversions long, duplicates long, "
               "missing_positions long, throughput_eps double",
    "runs": "run_id string, scenario string, protocol string, seed string, member_list array<string>, "
            "deliveries long, first_submit_ts double, last_deliver_ts double, latency_ms_max double, "
            "latency_ms_p50 double, latency_ms_p90 double, latency_ms_p99 double, positions long, "
            "differing_positions long, first_divergent long, events_submitted long, events_delivered_any long, "
            "duplicates long, foreign long, lost long, inversions long, throughput_eps double, "
            "agreement_ok boolean, ok boolean",
    "divergent": "run_id string, seq long, events array<string>, members array<string>",
    "duplicates": "run_id string, member string, event_id string, copies long",
    "foreign": "run_id string, member string, event_id string",
    "lost": "run_id string, member string, event_id string",
    "inversions": "run_id string, member string, origin string, origin_partition int, seq long, "
                  "origin_offset long, prev_offset long",
}


def _bit(m: str = "m"):
    return F.expr(f"shiftleft(CAST(1 AS BIGINT), {m})")


def _has(j: int):
    """The mask holds member j (false when the mask is null)."""
    return F.coalesce(F.col("mask").bitwiseAND(F.lit(1 << j)) != 0, F.lit(False))


def _count(cond):
    return F.sum(F.when(cond, 1).otherwise(0))


def _span(first, last) -> float | None:
    if first is None or last is None:
        return None
    return max(last - first, 1e-9)


class _Names:
    """Runs, members and origins as small integers (r, m, o), and back."""

    def __init__(self, spark, runs: list[str], members: dict[str, list[str]], origins: list[str]):
        from kdsync.cli_style import UsageError

        self.runs, self.members, self.origins = runs, members, origins
        for run_id, ms in members.items():
            if len(ms) > MAX_MEMBERS:
                raise UsageError(f"run {run_id!r} has {len(ms)} members; the audit handles at most {MAX_MEMBERS}")
        self.r = {run_id: r for r, run_id in enumerate(runs)}
        self.max_members = max((len(ms) for ms in members.values()), default=0)
        self.run_df = F.broadcast(_local(spark, [(run_id, r, len(members[run_id])) for r, run_id in enumerate(runs)],
                                         "run_id string, r int, nm int"))
        self.member_df = F.broadcast(_local(
            spark, [(run_id, self.r[run_id], member, m) for run_id in runs for m, member in enumerate(members[run_id])],
            "run_id string, r int, member string, m int"))
        self.origin_df = F.broadcast(_local(spark, [(o, i) for i, o in enumerate(origins)], "origin string, o int"))

    def code(self, df: DataFrame, with_member: bool = True) -> DataFrame:
        """df with run_id (and member), origin -> r (and m), o."""
        df = df.join(self.member_df if with_member else self.run_df.drop("nm"),
                     ["run_id", "member"] if with_member else ["run_id"])
        return df.join(self.origin_df, "origin")

    def decode(self, df: DataFrame) -> DataFrame:
        """df with r (and m, o) -> run_id (and member, origin) added."""
        if "m" in df.columns:
            df = df.join(self.member_df, ["r", "m"])
        else:
            df = df.join(self.run_df.drop("nm"), "r")
        if "o" in df.columns:
            df = df.join(self.origin_df, "o")
        return df


def event_id_col():
    return F.concat_ws("/", "origin", "origin_partition", "origin_offset")


def analyse(trace: DataFrame, sources: DataFrame | None = None, window_s: float = 1.0,
            approx: bool = False, members: list[str] | None = None,
            run_attrs: DataFrame | None = None) -> AuditTables:
    """All audit tables of `trace` (normalised here).  `sources` has columns
    (run_id, origin, origin_partition, origin_offset): the events written to
    any source topic; None means the union of what members delivered.
    `members` names every member that should hold each run (default: those
    with a row in it), so a member whose global topic is empty still shows
    up, with everything lost.  `run_attrs` (run_id, scenario, protocol,
    seed) fills attributes the trace rows lack."""
    spark = trace.sparkSession
    t0 = normalise(trace)
    lat_ms = (F.col("deliver_ts") - F.col("submit_ts")) * 1000.0
    unit = 1.0 if approx else 1000.0  # latencies to the millisecond / microsecond (rint: no BigDecimal per row)
    t0 = t0.withColumn("lat", F.when(~F.isnan(lat_ms), F.rint(lat_ms * unit) / unit))

    # pass 1: rows per (run, member, origin, attributes, latency) -> the names
    # to code, the runs' attributes, per member and per run counts and latency
    keys = ["run_id", "member", "origin", *ATTRIBUTE_COLUMNS]
    base = t0.groupBy(*keys, "lat").agg(
        F.count(F.lit(1)).alias("n"), F.min("seq").alias("first_seq"), F.max("seq").alias("last_seq"),
        F.min(F.when(~F.isnan("submit_ts"), F.col("submit_ts"))).alias("first_submit_ts"),
        F.max("deliver_ts").alias("last_deliver_ts")).persist()
    seen = base.select(*keys).distinct().collect()
    attrs: dict[str, dict] = {}
    for x in seen:
        a = attrs.setdefault(x["run_id"], {c: None for c in ATTRIBUTE_COLUMNS})
        for c in ATTRIBUTE_COLUMNS:
            a[c] = a[c] if a[c] is not None else x[c]
    for x in run_attrs.collect() if run_attrs is not None else []:
        for c in ATTRIBUTE_COLUMNS:
            if x["run_id"] in attrs and attrs[x["run_id"]][c] is None:
                attrs[x["run_id"]][c] = x[c]
    p1 = {(x["run_id"], x["member"]): x for x in base.rollup("run_id", "member").agg(
        F.sum("n").alias("delivered"), F.min("first_seq").alias("first_seq"), F.max("last_seq").alias("last_seq"),
        F.min("first_submit_ts").alias("first_submit_ts"), F.max("last_deliver_ts").alias("last_deliver_ts"),
        F.percentile("lat", QUANTILES, F.col("n")).alias("q"), F.max("lat").alias("max")).collect()
        if x["run_id"] is not None}
    base.unpersist()
    run_ids = set(attrs)
    origins = {x["origin"] for x in seen}
    src = None
    if sources is not None:
        src = sources.select("run_id", "origin", "origin_partition", "origin_offset").distinct()
        if members is not None:
            run_ids |= {x["run_id"] for x in src.select("run_id").distinct().collect()}
        origins |= set(members or [])
    runs = sorted(run_ids)
    member_lists = {r: sorted(members) if members is not None else
                    sorted({x["member"] for x in seen if x["run_id"] == r}) for r in runs}
    names = _Names(spark, runs, member_lists, sorted(o for o in origins if o is not None))
    t = names.code(t0).select("r", "m", *EVENT, "seq")

    # pass 2: per event (one shuffle of the rows)
    ev = t.groupBy("r", *EVENT).agg(F.count(F.lit(1)).alias("rows"), F.bit_or(_bit()).alias("mask"),
                                    F.min("seq").alias("seq_lo"), F.max("seq").alias("seq_hi"))
    if src is not None:
        coded = names.code(src, with_member=False).select("r", *EVENT).withColumn("is_source", F.lit(True))
        ev = ev.join(coded, ["r", *EVENT], "full")
    else:
        ev = ev.withColumn("is_source", F.lit(True))
    ev = ev.persist()
    nm_max = names.max_members
    foreign_ev = F.col("is_source").isNull()
    p2 = {x["r"]: x for x in ev.groupBy("r").agg(
        _count(F.col("is_source")).alias("events_submitted"), F.count("mask").alias("events_delivered_any"),
        _count(F.col("rows") > F.bit_count("mask")).alias("duplicated"),
        _count(F.col("seq_lo") != F.col("seq_hi")).alias("moved"),
        *[_count(_has(j)).alias(f"distinct_{j}") for j in range(nm_max)],
        *[_count(F.col("is_source") & ~_has(j)).alias(f"lost_{j}") for j in range(nm_max)],
        *[_count(foreign_ev & _has(j)).alias(f"foreign_{j}") for j in range(nm_max)]).collect()}
    moved = any(x["moved"] for x in p2.values())
    delivered = ev.where(F.col("mask").isNotNull())

    # pass 3: per position.  Each event at one position everywhere (nothing
    # moved): from the events, else from every row
    if moved:
        pos = t.groupBy("r", "seq").agg(*[f(c).alias(f"{f.__name__}_{c}") for c in EVENT for f in (F.min, F.max)],
                                        F.bit_or(_bit()).alias("mask"))
        differs = F.lit(False)
        for c in EVENT:
            differs = differs | (F.col(f"min_{c}") != F.col(f"max_{c}"))
    else:
        pos = delivered.groupBy("r", F.col("seq_lo").alias("seq")).agg(
            F.count(F.lit(1)).alias("events"), F.bit_or("mask").alias("mask"))
        differs = F.col("events") > 1
    pos = pos.withColumn("differs", differs)
    p3 = {x["r"]: x for x in pos.groupBy("r").agg(
        F.count(F.lit(1)).alias("positions"), _count(F.col("differs")).alias("differing_positions"),
        F.min(F.when(F.col("differs"), F.col("seq"))).alias("first_divergent"),
        *[_count(_has(j)).alias(f"positions_{j}") for j in range(nm_max)]).collect()}

    # pass 4: origin order.  A member's events of one origin partition are a
    # subsequence of all events in position order, so when nothing moved and
    # that order has no inversion no member has one; else per member
    def inversions_of(df: DataFrame, by: list[str], seq: str) -> DataFrame:
        w = Window.partitionBy(*by, "o", "origin_partition").orderBy("seq", "origin_offset").rowsBetween(
            Window.unboundedPreceding, -1)
        return (df.select(*by, *EVENT, F.col(seq).alias("seq"))
                .withColumn("prev_offset", F.max("origin_offset").over(w))
                .where(F.col("origin_offset") < F.col("prev_offset")))

    inv = inversions_of(t, ["r", "m"], "seq")
    p4: dict[tuple, int] = {}
    if moved or inversions_of(delivered, ["r"], "seq_lo").limit(1).count():
        p4 = {(x["r"], x["m"]): x["n"] for x in inv.groupBy("r", "m").agg(F.count(F.lit(1)).alias("n")).collect()}

    # the anomaly tables, only for the kinds that occurred
    def empty(name: str) -> DataFrame:
        return _local(spark, [], SCHEMAS[name])

    duplicates = empty("duplicates")
    dup_by_member: dict[tuple, int] = {}
    if any(x["duplicated"] for x in p2.values()):
        dup_events = ev.where(F.col("rows") > F.bit_count("mask")).select("r", *EVENT)
        d = (t.join(dup_events, ["r", *EVENT], "left_semi").groupBy("r", "m", *EVENT)
             .agg(F.count(F.lit(1)).alias("copies")).where(F.col("copies") > 1)).persist()
        dup_by_member = {(x["r"], x["m"]): x["n"] for x in d.groupBy("r", "m").agg(F.count(F.lit(1)).alias("n"))
                         .collect()}
        duplicates = names.decode(d).select("run_id", "member", event_id_col().alias("event_id"), "copies")

    def by_member(df: DataFrame, holds: bool) -> DataFrame:
        """(run_id, member, event_id) per event and member of its run that does / does not hold it."""
        bit = lambda j: F.coalesce(F.col("mask"), F.lit(0).cast("long")).bitwiseAND(  # noqa: E731
            F.pow(F.lit(2), j).cast("long"))
        keep = (lambda j: bit(j) != 0) if holds else (lambda j: bit(j) == 0)
        df = df.join(names.run_df, "r").select("r", *EVENT, F.explode(
            F.filter(F.sequence(F.lit(0), F.col("nm") - 1), keep)).alias("m"))
        return names.decode(df).select("run_id", "member", event_id_col().alias("event_id"))

    lost_n = {(r, j): p2[r][f"lost_{j}"] for r in p2 for j in range(len(member_lists[runs[r]]))}
    foreign_n = {(r, j): p2[r][f"foreign_{j}"] for r in p2 for j in range(len(member_lists[runs[r]]))}
    lost = by_member(ev.where(F.col("is_source")), holds=False) if any(lost_n.values()) else empty("lost")
    foreign = by_member(ev.where(foreign_ev), holds=True) if any(foreign_n.values()) else empty("foreign")
    inversions = (names.decode(inv).select("run_id", "member", "origin", "origin_partition", "seq", "origin_offset",
                                           "prev_offset") if any(p4.values()) else empty("inversions"))
    divergent = empty("divergent")
    if any(x["differing_positions"] for x in p3.values()):
        rows = names.decode(t.join(pos.where("differs").select("r", "seq"), ["r", "seq"], "left_semi"))
        divergent = (rows.withColumn("event_id", event_id_col()).groupBy("run_id", "seq").agg(
            F.sort_array(F.collect_set("event_id")).alias("events"),
            F.sort_array(F.collect_set(F.concat_ws("=", "member", "event_id"))).alias("members")))

    # the runs and members tables, from the aggregates
    member_rows, run_rows = [], []
    for r, run_id in enumerate(runs):
        x2, x3 = p2.get(r), p3.get(r)
        ms = member_lists[run_id]
        sums = {k: 0 for k in ("deliveries", "duplicates", "foreign", "lost", "inversions")}
        for j, member in enumerate(ms):
            x1 = p1.get((run_id, member))
            n_rows = x1["delivered"] if x1 else 0
            distinct = x2[f"distinct_{j}"] if x2 else 0
            npos = x3[f"positions_{j}"] if x3 else 0
            first_seq, last_seq = (x1["first_seq"], x1["last_seq"]) if x1 else (None, None)
            fs, ld = (x1["first_submit_ts"], x1["last_deliver_ts"]) if x1 else (None, None)
            row = {"run_id": run_id, "member": member, "delivered": n_rows, "first_seq": first_seq,
                   "last_seq": last_seq, "distinct_positions": npos, "first_submit_ts": fs,
                   "last_deliver_ts": ld, **_lat(x1), "distinct_events": distinct,
                   "duplicated_events": dup_by_member.get((r, j), 0), "foreign": foreign_n.get((r, j), 0),
                   "lost": lost_n.get((r, j), 0), "inversions": p4.get((r, j), 0),
                   "duplicates": n_rows - distinct,
                   "missing_positions": None if first_seq is None else last_seq - first_seq + 1 - npos,
                   "throughput_eps": None if _span(fs, ld) is None else n_rows / _span(fs, ld)}
            member_rows.append(row)
            sums["deliveries"] += n_rows
            for k in ("duplicates", "foreign", "lost", "inversions"):
                sums[k] += row[k]
        a = attrs.get(run_id, {c: None for c in ATTRIBUTE_COLUMNS})
        x1 = p1.get((run_id, None))
        differing = x3["differing_positions"] if x3 else 0
        delivered_any = x2["events_delivered_any"] if x2 else 0
        agreement_ok = differing == 0
        ok = (not any(sums[k] for k in ("duplicates", "foreign", "lost", "inversions"))
              and (agreement_ok or (a["protocol"] or "") == "mirror"))
        fs, ld = (x1["first_submit_ts"], x1["last_deliver_ts"]) if x1 else (None, None)
        run_rows.append({
            "run_id": run_id, **a, "member_list": ms, "deliveries": sums["deliveries"],
            "first_submit_ts": fs, "last_deliver_ts": ld, **_lat(x1),
            "positions": x3["positions"] if x3 else 0, "differing_positions": differing,
            "first_divergent": x3["first_divergent"] if x3 else None,
            "events_submitted": x2["events_submitted"] if x2 else 0, "events_delivered_any": delivered_any,
            **{k: sums[k] for k in ("duplicates", "foreign", "lost", "inversions")},
            "throughput_eps": None if _span(fs, ld) is None else delivered_any / _span(fs, ld),
            "agreement_ok": agreement_ok, "ok": ok})
    members_t = _table(spark, "members", member_rows)
    runs_t = _table(spark, "runs", run_rows)

    throughput = (t0.withColumn("window_start", F.floor(F.col("deliver_ts") / window_s) * window_s)
                  .groupBy("run_id", "member", "window_start").agg(F.count(F.lit(1)).alias("events")))
    scenarios = (runs_t.groupBy("scenario", "protocol").agg(
        F.count(F.lit(1)).alias("runs"),
        F.sum(F.when(F.col("ok"), 0).otherwise(1)).alias("runs_with_violations"),
        F.sum("events_delivered_any").alias("events"),
        F.avg("latency_ms_p50").alias("mean_latency_ms_p50"),
        F.avg("latency_ms_p99").alias("mean_latency_ms_p99"),
        F.max("latency_ms_max").alias("latency_ms_max"),
        F.avg("throughput_eps").alias("mean_throughput_eps")))

    return AuditTables(runs=runs_t, members=members_t, divergent=divergent, duplicates=duplicates,
                       foreign=foreign, lost=lost, inversions=inversions, throughput=throughput,
                       scenarios=scenarios)


def _lat(row) -> dict:
    q = row["q"] if row is not None else None
    return {"latency_ms_max": row["max"] if row is not None else None,
            **{f"latency_ms_p{round(x * 100)}": (q[i] if q else None) for i, x in enumerate(QUANTILES)}}


def _local(spark, rows: list[tuple], schema: str) -> DataFrame:
    """A small DataFrame held in the plan (Arrow, no Python worker)."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    st = T._parse_datatype_string(schema)
    arrow = to_arrow_schema(st)
    cols = list(zip(*rows)) if rows else [[] for _ in st.fields]
    return spark.createDataFrame(pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(cols, arrow)],
                                                      schema=arrow))


def _table(spark, name: str, rows: list[dict]) -> DataFrame:
    fields = T._parse_datatype_string(SCHEMAS[name]).fieldNames()
    return _local(spark, [tuple(r[f] for f in fields) for r in rows], SCHEMAS[name])
