"""`kdsync audit`: prove that clusters agree (or that a simulated run did).

    kdsync audit --cluster dc1=HOST:9092 --cluster dc2=HOST:9092 --topic T
                 [--master URL] [--out DIR] [--global-suffix -global] [--shards K]
    kdsync audit --trace RUN_DIR_OR_TRACE.parquet ... [--out DIR]

Real clusters: every cluster's T (source) and T-global are read in parallel
with the kdsync-kafka data source and turned into trace rows (member = the
cluster name, seq = kdsync.seq, submit_ts = kdsync.origin.ts/1000,
deliver_ts = the global record's timestamp/1000, event_id =
"origin/partition/offset"); source records of cluster NAME are events
"NAME/partition/offset".  With --shards K (the members' [topics] shards),
partition s of T-global is its own ordering group: it is audited as run
"T/s" (positions, agreement, loss and order judged per partition), whose
events are the source records of partitions p with p mod K = s.  Sim traces are read as they are (next to each a
summary.json, when present, names scenario / protocol / seed).  Both go
through `kdsync.spark.analysis.analyse`.

Prints one JSON report to stdout; --out DIR also writes every table as
Parquet (DIR/<table>/) and the report as DIR/report.json.
Exit 0 when all invariants hold, 1 on a violation, 2 on bad input.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import typer

from kdsync import invariants as checker
from kdsync.cli_style import UsageError, command, new_app, run_job
from kdsync.cli_style import run as run_cli
from kdsync.kafka.records import H_OOFF, H_OPART, H_ORIGIN, H_OTS, H_SEQ

MAX_EXAMPLES = 5
MAX_RUNS_IN_JSON = 1000


def parse_clusters(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, brokers = item.partition("=")
        if not sep or not name.strip() or not brokers.strip():
            raise UsageError(f"--cluster {item!r}: expected NAME=HOST:PORT[,HOST:PORT]")
        if name in out:
            raise UsageError(f"--cluster {name!r} given twice")
        out[name.strip()] = brokers.strip()
    return out


def _kafka_props(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UsageError(f"--kafka-property {item!r}: expected KEY=VALUE")
        out[k] = v
    return out


def check_brokers(clusters: dict[str, str], props: dict[str, str], timeout: float = 5.0) -> None:
    """UsageError naming the first cluster whose brokers do not answer."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    for name, brokers in clusters.items():
        admin = AdminClient({"bootstrap.servers": brokers, "log_level": 0, **props})
        try:
            md = admin.list_topics(timeout=timeout)
            if not md.brokers:
                raise KafkaException("no brokers in metadata")
        except KafkaException as e:
            raise UsageError(f"--cluster {name}={brokers}: brokers do not answer ({e})") from None


# ---------------------------------------------------------------- real clusters

def kafka_tables(spark, clusters: dict[str, str], topics: list[str], global_suffix: str = "-global",
                 props: dict | None = None, shards: int = 1):
    """(trace, sources, malformed) DataFrames for real clusters.

    trace: the trace rows (docs/outputs.md) of every cluster's global topic, plus
    `global_partition`/`position` (where the record sits); sources: (run_id,
    origin, origin_partition, origin_offset) of every source record; malformed: global records without the
    kdsync headers (run_id, member, global_partition, position).  `shards`
    > 1: run_id "T/s" per global partition s, sources of partition p in run
    "T/(p mod shards)" (module doc)."""
    from pyspark.sql import functions as F

    from kdsync.spark.kafka_source import read_topic

    # one scan of every cluster's source and global topics
    wanted = list(topics) + [t + global_suffix for t in topics]
    raw = read_topic(spark, dict(props or {}), wanted, clusters=clusters)
    h = F.map_from_entries(F.col("headers"))
    hs = lambda k: h[k].cast("string")  # noqa: E731
    is_global = F.col("topic").endswith(global_suffix)
    run_id = F.when(is_global, F.expr(f"substring(topic, 1, length(topic) - {len(global_suffix)})")) \
        .otherwise(F.col("topic"))
    slim = raw.select(
        run_id.alias("run_id"), F.col("cluster").alias("member"), is_global.alias("is_global"),
        F.col("partition"), F.col("offset"), F.col("timestamp"),
        hs(H_ORIGIN).alias("origin"),
        hs(H_OPART).cast("int").alias("origin_partition"),
        hs(H_OOFF).cast("long").alias("origin_offset"),
        hs(H_SEQ).cast("long").alias("seq"),
        hs(H_OTS).cast("long").alias("origin_ts")).persist()
    if shards > 1:  # one run per shard: global partition s, source partitions p mod K = s
        slim = slim.withColumn("run_id", F.concat_ws("/", "run_id", F.when(
            F.col("is_global"), F.col("partition")).otherwise(F.col("partition") % F.lit(shards))))
    g = slim.where(F.col("is_global"))
    trace = g.select(
        "run_id", "member", "origin", "origin_partition", "origin_offset", "seq",
        (F.col("origin_ts").cast("double") / 1000.0).alias("submit_ts"),
        (F.col("timestamp").cast("double") / 1000.0).alias("deliver_ts"),
        F.col("partition").alias("global_partition"), F.col("offset").alias("position"),
        F.concat_ws("/", "origin", "origin_partition", "origin_offset").alias("event_id"))
    src = slim.where(~F.col("is_global")).select(
        "run_id", F.col("member").alias("origin"), F.col("partition").alias("origin_partition"),
        F.col("offset").alias("origin_offset"))
    ok = (F.col("origin").isNotNull() & F.col("origin_partition").isNotNull() & F.col("origin_offset").isNotNull()
          & F.col("seq").isNotNull())
    malformed = trace.where(~ok).select("run_id", "member", "global_partition", "position")
    return trace.where(ok), src, malformed


# ---------------------------------------------------------------- sim traces

def _trace_files(paths: list[str]) -> list[tuple[str, dict]]:
    """(parquet path, attributes from a summary.json beside it) per input."""
    out = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise UsageError(f"--trace {raw}: no such file or directory")
        if p.is_dir() and (p / "trace.parquet").exists():
            p = p / "trace.parquet"
        elif p.is_dir() and not any(p.glob("*.parquet")) and any(p.rglob("trace.parquet")):
            for sub in sorted(p.rglob("trace.parquet")):
                out += _trace_files([str(sub)])
            continue
        summary = p.parent / "summary.json" if p.name.endswith(".parquet") else p / "summary.json"
        attrs = {}
        if summary.is_file():
            try:
                s = json.loads(summary.read_text())
                attrs = {k: (None if s.get(k) is None else str(s.get(k))) for k in ("scenario", "protocol", "seed")}
            except (ValueError, OSError) as e:
                raise UsageError(f"{summary}: not valid JSON ({e})") from None
        out.append((str(p.resolve()), attrs))
    return out


def trace_table(spark, paths: list[str]):
    """(trace, run attributes): one DataFrame of all trace files, and one row
    per run (run_id, scenario, protocol, seed) taken from each run's
    summary.json (None when no trace has one); the trace's own attribute
    columns, when present, take precedence."""
    from pyspark.sql import functions as F

    from kdsync.spark.analysis import missing_columns

    files = _trace_files(paths)
    try:
        df = spark.read.parquet(*[f for f, _ in files])
    except Exception as e:  # AnalysisException: not parquet, unreadable
        raise UsageError(f"--trace: cannot read as Parquet ({str(e).splitlines()[0][:200]})") from None
    miss = missing_columns(df)
    if miss:
        raise UsageError(f"--trace: missing trace column(s) {', '.join(miss)} (see docs/outputs.md, trace.parquet)")
    rows = [(f, a.get("scenario"), a.get("protocol"), a.get("seed")) for f, a in files if a]
    if not rows:
        return df, None
    meta = spark.createDataFrame(rows, "trace_root string, scenario string, protocol string, seed string")
    path = F.url_decode(F.regexp_replace(F.input_file_name(), "^file:(//)?", ""))
    # a trace is a file or a directory of part files: match either; one row per (run, file)
    files_of_runs = df.select("run_id", path.alias("_file")).distinct().withColumn(
        "trace_root", F.when(F.col("_file").endswith("trace.parquet"), F.col("_file"))
        .otherwise(F.regexp_extract("_file", r"^(.*trace\.parquet)/[^/]+$", 1)))
    return df, files_of_runs.join(F.broadcast(meta), "trace_root").select("run_id", "scenario", "protocol", "seed")


# ---------------------------------------------------------------- report

def _num(x):
    if x is None:
        return None
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, 3)
    return x


def build_report(tables, mode: str, malformed=None) -> dict:
    """The JSON report (aggregates and a few examples only)."""
    from pyspark.sql import functions as F

    runs = tables.runs.orderBy("run_id").limit(MAX_RUNS_IN_JSON + 1).collect()
    n_runs = tables.runs.count() if len(runs) > MAX_RUNS_IN_JSON else len(runs)
    runs = runs[:MAX_RUNS_IN_JSON]
    ids = [r["run_id"] for r in runs]
    members = {}
    for m in tables.members.where(F.col("run_id").isin(ids)).orderBy("run_id", "member").collect():
        members.setdefault(m["run_id"], []).append(m)

    # a few examples of each anomaly per run and member, in one Spark job
    from pyspark.sql import Window

    by_seq = F.lpad(F.col("seq").cast("string"), 20, "0")
    kinds = {"dup": (tables.duplicates, ["event_id", "copies"], F.col("event_id")),
             "foreign": (tables.foreign, ["event_id"], F.col("event_id")),
             "lost": (tables.lost, ["event_id"], F.col("event_id")),
             "inv": (tables.inversions, ["origin", "origin_partition", "seq", "origin_offset", "prev_offset"], by_seq),
             "div": (tables.divergent, ["seq", "events", "members"], by_seq)}
    parts = []
    for kind, (df, cols, order) in kinds.items():
        member = F.col("member") if kind != "div" else F.lit("all")
        parts.append(df.where(F.col("run_id").isin(ids)).select(
            "run_id", member.alias("_member"), F.lit(kind).alias("_kind"),
            F.to_json(F.struct(*cols)).alias("_detail"), order.alias("_order")))
    union = parts[0]
    for part in parts[1:]:
        union = union.unionByName(part)
    w = Window.partitionBy("run_id", "_member", "_kind").orderBy("_order", "_detail")
    ex: dict[str, dict] = {k: {} for k in kinds}
    for row in (union.withColumn("_rn", F.row_number().over(w)).where(F.col("_rn") <= MAX_EXAMPLES)
                .orderBy("run_id", "_member", "_kind", "_rn").collect()):
        ex[row["_kind"]].setdefault(row["run_id"], {}).setdefault(row["_member"], []).append(
            json.loads(row["_detail"]))
    ex_dup, ex_foreign, ex_lost, ex_inv, ex_div = (ex[k] for k in kinds)
    bad = {}
    if malformed is not None:
        for row in malformed.groupBy("run_id", "member").count().collect():
            bad.setdefault(row["run_id"], {})[row["member"]] = row["count"]

    out_runs = []
    all_ok = True
    for r in runs:
        rid = r["run_id"]
        ms = members.get(rid, [])
        by = lambda key: {m["member"]: _num(m[key]) for m in ms}  # noqa: E731
        lat = lambda row, p="latency_ms_": {k: _num(row[f"{p}{k}"]) for k in ("p50", "p90", "p99", "max")}  # noqa: E731
        violations = []
        mirror = (r["protocol"] or "") == "mirror"

        def violation(anomaly: str, detail: str, count: int, member: str | None = None, fails: bool = True) -> None:
            # kind + anomaly: the simulator's summary.json vocabulary (kdsync.invariants)
            v = {"kind": checker.KIND_OF[anomaly], "anomaly": anomaly, "count": count}
            if member is not None:
                v["member"] = member
            violations.append({**v, "fails": fails, "detail": detail})

        if r["differing_positions"]:
            violation(checker.INCONSISTENT_OFFSETS, f"{r['differing_positions']} position(s) differ, first at seq "
                      f"{r['first_divergent']}", r["differing_positions"], fails=not mirror)
        for m in ms:
            for anomaly, key, what in ((checker.DUPLICATE, "duplicates", "duplicate deliveries"),
                                       (checker.FOREIGN, "foreign", "foreign events (in no source topic)"),
                                       (checker.LOST_WRITE, "lost", "source events missing"),
                                       (checker.NONMONOTONIC, "inversions", "origin-order inversions")):
                if m[key]:
                    violation(anomaly, f"{m['member']}: {m[key]} {what}", m[key], m["member"])
        for member, n in sorted(bad.get(rid, {}).items()):
            violation(checker.MALFORMED, f"{member}: {n} global record(s) without kdsync headers", n, member)
        anomalies: dict[str, int] = {}
        for v in violations:
            anomalies[v["anomaly"]] = anomalies.get(v["anomaly"], 0) + v["count"]
        ok = not any(v["fails"] for v in violations)
        all_ok &= ok
        out_runs.append({
            "run_id": rid, "scenario": r["scenario"], "protocol": r["protocol"], "seed": r["seed"],
            "members": list(r["member_list"]),
            "events_submitted": r["events_submitted"] if mode == "kafka" else r["events_delivered_any"],
            "events_delivered": by("distinct_events"),
            "deliveries": by("delivered"),
            "agreement": {"positions": r["positions"], "differing_positions": r["differing_positions"],
                          "first_divergent": r["first_divergent"],
                          "examples": ex_div.get(rid, {}).get("all", [])},
            "integrity": {"duplicates": by("duplicates"), "foreign": by("foreign"),
                          "malformed": bad.get(rid, {}),
                          "duplicate_examples": ex_dup.get(rid, {}), "foreign_examples": ex_foreign.get(rid, {})},
            "loss": {"lost": by("lost"), "examples": ex_lost.get(rid, {})},
            "origin_order": {"inversions": by("inversions"), "examples": ex_inv.get(rid, {})},
            "positions": {"first_seq": by("first_seq"), "last_seq": by("last_seq"),
                          "missing_positions": by("missing_positions")},
            "latency_ms": lat(r),
            "latency_ms_by_member": {m["member"]: lat(m) for m in ms},
            "throughput_eps": _num(r["throughput_eps"]),
            "throughput_eps_by_member": by("throughput_eps"),
            "violations": violations,
            "anomalies": anomalies,
            "ok": ok,
        })
    if n_runs > len(runs):
        all_ok = all_ok and tables.runs.where(~F.col("ok")).limit(1).count() == 0
    return {"mode": mode, "ok": all_ok, "runs_total": n_runs, "runs_shown": len(out_runs), "runs": out_runs}


def write_tables(tables, out: str, report: dict, malformed=None) -> None:
    for name, df in tables.items():
        df.write.mode("overwrite").parquet(os.path.join(out, name))
    if malformed is not None:
        malformed.write.mode("overwrite").parquet(os.path.join(out, "malformed"))
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")


@dataclass
class AuditArgs:
    """What to audit (the options of `kdsync audit`)."""

    cluster: list[str] = field(default_factory=list)  # NAME=BROKERS
    topic: list[str] = field(default_factory=list)
    global_suffix: str = "-global"
    trace: list[str] = field(default_factory=list)
    master: str = "local[*]"
    out: str | None = None
    window_s: float = 1.0
    approx: bool = False
    kafka_property: list[str] = field(default_factory=list)  # KEY=VALUE
    shards: int = 1  # [topics] shards of the members: one run per global partition


def run(args: AuditArgs) -> tuple[int, dict]:
    """Run the audit described by `args`; (exit code, report).  Raises
    UsageError on bad input, anything else when Spark or a broker fails."""
    from kdsync.spark.analysis import analyse
    from kdsync.spark.session import spark_session

    if args.trace and args.cluster:
        raise UsageError("give either --cluster/--topic or --trace, not both")
    if not args.trace and not args.cluster:
        raise UsageError("nothing to audit: give --cluster NAME=BROKERS ... --topic T, or --trace PATH ...")
    if args.window_s <= 0:
        raise UsageError("--window-s must be > 0")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a directory")
    malformed = run_attrs = None
    if args.cluster:
        clusters = parse_clusters(args.cluster)
        if not args.topic:
            raise UsageError("--topic T is required with --cluster")
        if any(not t or t.endswith(args.global_suffix) for t in args.topic):
            raise UsageError(f"--topic names the source topic T, not T{args.global_suffix}")
        props = _kafka_props(args.kafka_property)
        check_brokers(clusters, props)
        spark = spark_session(args.master, "kdsync-audit")
        trace, sources, malformed = kafka_tables(spark, clusters, args.topic, args.global_suffix, props, args.shards)
        mode = "kafka"
    else:
        _trace_files(args.trace)  # bad paths fail before Spark starts
        spark = spark_session(args.master, "kdsync-audit")
        (trace, run_attrs), sources, mode = trace_table(spark, args.trace), None, "trace"
    tables = analyse(trace, sources, window_s=args.window_s, approx=args.approx,
                     members=list(clusters) if args.cluster else None,
                     run_attrs=run_attrs)
    report = build_report(tables, mode, malformed)
    if args.out:
        write_tables(tables, args.out, report, malformed)
    return (0 if report["ok"] else 1), report


app = new_app()


@app.command("audit", greedy=("--cluster", "--trace"),
             help="PySpark job: check agreement, loss, duplicates, per-origin order and latency of real clusters "
                  "(--cluster ... --topic T) or of kdsync-sim traces (--trace ...).  Prints one JSON report; exit 0 "
                  "when every invariant holds, 1 on a violation, 2 on bad input.")
def _audit(
    cluster: list[str] = typer.Option([], metavar="NAME=BROKERS", show_default="none",
                                      help="clusters to audit (several after one flag, or repeat the flag; bootstrap "
                                           "servers comma-separated)"),
    topic: list[str] = typer.Option([], metavar="T", show_default="none",
                                    help="source topic T (the global topic is T + --global-suffix); repeat to audit "
                                         "several topics in one pass, one run per topic"),
    global_suffix: str = typer.Option("-global", metavar="SUFFIX", help="suffix of the global topics"),
    trace: list[str] = typer.Option([], metavar="PATH", show_default="none",
                                    help="audit kdsync-sim trace.parquet files or run directories instead of clusters "
                                         "(several after one flag)"),
    master: str = typer.Option("local[*]", metavar="URL", help="Spark master"),
    out: str | None = typer.Option(None, metavar="DIR", show_default="none: report on stdout only",
                                   help="write the tables as Parquet and report.json here"),
    window_s: float = typer.Option(1.0, metavar="SECONDS", help="throughput window in seconds"),
    approx: bool = typer.Option(False, "--approx", show_default="off",
                                help="latency percentiles at millisecond instead of microsecond resolution"),
    kafka_property: list[str] = typer.Option([], metavar="KEY=VALUE", show_default="none",
                                             help="extra librdkafka property for every cluster (repeat)"),
    shards: int = typer.Option(1, metavar="K", min=1, help="[topics] shards of the members: each partition of "
                                                           "T-global is audited as its own run T/s"),
) -> int:
    args = AuditArgs(cluster, topic, global_suffix, trace, master, out, window_s, approx, kafka_property, shards)
    ok, result = run_job("kdsync audit", run, args)  # a failed Spark job or broker: one line
    if not ok:
        return 1
    code, report = result
    print(json.dumps(report, indent=2, default=str))
    return code


def main(argv: list[str] | None = None) -> int:
    """`kdsync audit ARGS`; returns the exit code (0 all invariants hold, 1 a violation or failure, 2 bad input)."""
    return run_cli(command(app, "audit"), argv, "kdsync audit")


if __name__ == "__main__":
    sys.exit(main())
