"""`kdsync archive | compact | restore`: the ordered log on Parquet.

    kdsync archive --cluster NAME=BROKERS --topic T-global --path PREFIX
                   [--max-records N] [--max-bytes B] [--max-age-s S] [--flush]
    kdsync compact --path PREFIX [--cluster NAME] [--topic T-global]
                   [--target-bytes B] [--all]
    kdsync restore --path PREFIX --cluster NAME=BROKERS --topic T-global
                   [--from NAME]

Layout (any filesystem Hadoop can write: local paths, hdfs://, s3a://)::

    PREFIX/<cluster>/<topic>/_checkpoint.json          next offset per partition
    PREFIX/<cluster>/<topic>/<partition>/<level>/<start>-<end>/part-*.parquet

`start`-`end` are the first and last offset in the segment (inclusive,
zero-padded to 20 digits so names sort).  Columns: partition, offset,
timestamp (ms), key, value, headers (array<struct<key, value>>).

Theory of operation.
* archive reads the topic from the checkpoint to partition EOF (kdsync-kafka
  data source) and cuts each partition into level-0 segments: a segment ends
  where the running record count crosses a multiple of --max-records or the
  running bytes cross a multiple of --max-bytes.  The last, partial segment
  of a partition is written only when its first record is older than
  --max-age-s (or with --flush); otherwise the next run picks it up.  Segments
  are written to a staging directory, renamed into place, and only then is
  the checkpoint advanced (atomically, write-then-rename): a crash leaves at
  worst a segment that the rerun rewrites identically.
* compact merges runs of consecutive level-0 segments of a partition into one
  level-1 segment once they reach --target-bytes (--all: also the tail).  The
  new segment is written under a temporary name, its row count checked, then
  renamed; the merged level-0 segments are deleted only after that.  A
  level-0 segment covered by a level-1 segment (a crash between rename and
  delete) is deleted by the next compaction and ignored by readers.
* restore reads every segment (level 1, plus level 0 not covered by level 1),
  and produces each partition in offset order, with key, value, headers and
  timestamp as they were, into the (empty) target topic with the same number
  of partitions.  When the archive of a partition starts at offset 0 and has
  no gaps, every record lands at its original offset.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid

import typer

from kdsync.cli_style import UsageError, command, new_app, run_job
from kdsync.cli_style import run as run_cli

SEGMENT_RE = re.compile(r"^(\d{20})-(\d{20})$")
CHECKPOINT = "_checkpoint.json"


def seg_name(start: int, end: int) -> str:
    return f"{start:020d}-{end:020d}"


# ---------------------------------------------------------------- filesystem

class FS:
    """The few Hadoop FileSystem operations the archive needs (through the
    Spark JVM, so every filesystem Spark can write works)."""

    def __init__(self, spark, root: str):
        self._jvm = jvm = spark._jvm
        self._Path = jvm.org.apache.hadoop.fs.Path
        self.root = root.rstrip("/")
        self.fs = self._Path(self.root).getFileSystem(spark._jsc.hadoopConfiguration())

    def p(self, *parts) -> str:
        return "/".join([self.root, *[str(x) for x in parts]])

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._Path(path)))

    def dirs(self, path: str) -> list[str]:
        """Names of the sub-directories of `path` ([] when absent)."""
        if not self.exists(path):
            return []
        return sorted(s.getPath().getName() for s in self.fs.listStatus(self._Path(path)) if s.isDirectory())

    def size(self, path: str) -> int:
        return int(self.fs.getContentSummary(self._Path(path)).getLength())

    def mkdirs(self, path: str) -> None:
        self.fs.mkdirs(self._Path(path))

    def rename(self, src: str, dst: str) -> None:
        parent = dst.rsplit("/", 1)[0]
        self.mkdirs(parent)
        if not self.fs.rename(self._Path(src), self._Path(dst)):
            raise OSError(f"rename {src} -> {dst} failed")

    def delete(self, path: str) -> None:
        self.fs.delete(self._Path(path), True)

    def read_text(self, path: str) -> str | None:
        if not self.exists(path):
            return None
        j = self._jvm
        stream = self.fs.open(self._Path(path))
        try:
            reader = j.java.io.BufferedReader(j.java.io.InputStreamReader(stream, "UTF-8"))
            lines = []
            while (line := reader.readLine()) is not None:
                lines.append(line)
            return "\n".join(lines)
        finally:
            stream.close()

    def write_text_atomic(self, path: str, text: str) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        out = self.fs.create(self._Path(tmp), True)
        try:
            out.write(bytearray(text.encode("utf-8")))
        finally:
            out.close()
        if self.exists(path):
            self.delete(path)
        self.rename(tmp, path)


# ---------------------------------------------------------------- segments

def list_segments(fs: FS, cluster: str, topic: str) -> dict[int, dict[int, list[tuple[int, int]]]]:
    """partition -> level -> sorted [(start, end)] of complete segments."""
    out: dict[int, dict[int, list[tuple[int, int]]]] = {}
    for pdir in fs.dirs(fs.p(cluster, topic)):
        if not pdir.isdigit():
            continue
        for ldir in fs.dirs(fs.p(cluster, topic, pdir)):
            if not ldir.isdigit():
                continue
            segs = []
            for name in fs.dirs(fs.p(cluster, topic, pdir, ldir)):
                m = SEGMENT_RE.match(name)
                if m:
                    segs.append((int(m.group(1)), int(m.group(2))))
            out.setdefault(int(pdir), {})[int(ldir)] = sorted(segs)
    return out


def live_segments(levels: dict[int, list[tuple[int, int]]]) -> list[tuple[int, int, int]]:
    """(level, start, end) that hold the data of one partition: every level-1
    segment, and the level-0 segments no level-1 segment covers."""
    l1 = levels.get(1, [])
    out = [(1, s, e) for s, e in l1]
    for s, e in levels.get(0, []):
        if not any(a <= s and e <= b for a, b in l1):
            out.append((0, s, e))
    return sorted(out, key=lambda x: x[1])


def _cluster_arg(items: list[str]) -> tuple[str, str]:
    if len(items) != 1:
        raise UsageError("give exactly one --cluster NAME=BROKERS")
    name, sep, brokers = items[0].partition("=")
    if not sep or not name or not brokers or "/" in name:
        raise UsageError(f"--cluster {items[0]!r}: expected NAME=HOST:PORT[,HOST:PORT]")
    return name, brokers


def _check_brokers(name: str, brokers: str) -> None:
    from kdsync.spark.audit import check_brokers

    check_brokers({name: brokers}, {})


def _positive(name: str, v):
    if v is not None and v <= 0:
        raise UsageError(f"{name} must be > 0")


# ---------------------------------------------------------------- archive

def archive(spark, name: str, brokers: str, topic: str, prefix: str, max_records: int = 100_000,
            max_bytes: int = 64 << 20, max_age_s: float = 300.0, flush: bool = False,
            now_ms: int | None = None) -> dict:
    """Append the topic's new records to level-0 segments; return a summary."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from kdsync.spark.kafka_source import read_topic

    fs = FS(spark, prefix)
    ckpt_path = fs.p(name, topic, CHECKPOINT)
    raw = fs.read_text(ckpt_path)
    ckpt = {int(k): int(v) for k, v in json.loads(raw)["next_offset"].items()} if raw else {}
    df = read_topic(spark, {"bootstrap.servers": brokers}, topic,
                    startingOffsets={str(k): v for k, v in ckpt.items()})
    size = (F.coalesce(F.length("key"), F.lit(0)) + F.coalesce(F.length("value"), F.lit(0))
            + F.coalesce(F.aggregate("headers", F.lit(0), lambda acc, h: acc + F.length(h["key"])
                                     + F.coalesce(F.length(h["value"]), F.lit(0))), F.lit(0)) + 24)
    w = Window.partitionBy("partition").orderBy("offset")
    cut = (df.withColumn("_size", size)
           .withColumn("_rn", F.row_number().over(w) - 1)
           .withColumn("_before", F.sum("_size").over(w) - F.col("_size"))
           .withColumn("_seg", F.greatest(F.floor(F.col("_rn") / max_records),
                                          F.floor(F.col("_before") / max_bytes)).cast("long"))
           .persist())
    segs = (cut.groupBy("partition", "_seg")
            .agg(F.min("offset").alias("start"), F.max("offset").alias("end"), F.count(F.lit(1)).alias("records"),
                 F.sum("_size").alias("bytes"), F.min("timestamp").alias("first_ts"))
            .orderBy("partition", "_seg").collect())
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    last = {}
    for s in segs:
        last[s["partition"]] = s["_seg"]
    closed = []
    for s in segs:
        is_last = s["_seg"] == last[s["partition"]]
        full = s["records"] >= max_records or s["bytes"] >= max_bytes
        old = s["first_ts"] is not None and (now_ms - s["first_ts"]) / 1000.0 >= max_age_s
        if not is_last or full or old or flush:
            closed.append(s)
    written = []
    if closed:
        staging = fs.p(name, topic, "_staging", uuid.uuid4().hex[:12])
        keys = spark.createDataFrame([(s["partition"], s["_seg"]) for s in closed], "partition int, _seg long")
        (cut.join(F.broadcast(keys), ["partition", "_seg"])
         .withColumn("_p", F.col("partition")).withColumn("_s", F.col("_seg"))
         .repartition("_p", "_s").sortWithinPartitions("offset")
         .select("partition", "offset", "timestamp", "key", "value", "headers", "_p", "_s")
         .write.partitionBy("_p", "_s").parquet(staging))
        for s in closed:
            dst = fs.p(name, topic, s["partition"], 0, seg_name(s["start"], s["end"]))
            if fs.exists(dst):  # a previous run wrote it but crashed before its checkpoint
                fs.delete(dst)
            fs.rename(f"{staging}/_p={s['partition']}/_s={s['_seg']}", dst)
            written.append({"partition": s["partition"], "start": s["start"], "end": s["end"],
                            "records": s["records"], "bytes": s["bytes"]})
        fs.delete(fs.p(name, topic, "_staging"))
        for s in closed:
            ckpt[s["partition"]] = max(ckpt.get(s["partition"], 0), s["end"] + 1)
        fs.write_text_atomic(ckpt_path, json.dumps({"next_offset": {str(k): v for k, v in sorted(ckpt.items())},
                                                    "updated_ms": now_ms}))
    cut.unpersist()
    pending = sum(s["records"] for s in segs) - sum(s["records"] for s in closed)
    return {"cluster": name, "topic": topic, "segments_written": len(written),
            "records_archived": sum(w["records"] for w in written), "records_pending": pending,
            "checkpoint": {str(k): v for k, v in sorted(ckpt.items())}, "segments": written}


# ---------------------------------------------------------------- compact

def compact(spark, prefix: str, cluster: str | None = None, topic: str | None = None,
            target_bytes: int = 256 << 20, merge_all: bool = False) -> dict:
    """Merge level-0 segments into level-1 segments; return a summary."""
    fs = FS(spark, prefix)
    merged, deleted_stale = [], 0
    for c in ([cluster] if cluster else fs.dirs(fs.root)):
        for t in ([topic] if topic else [x for x in fs.dirs(fs.p(c)) if not x.startswith("_")]):
            for part, levels in sorted(list_segments(fs, c, t).items()):
                l1 = levels.get(1, [])
                l0 = []
                for s, e in levels.get(0, []):
                    if any(a <= s and e <= b for a, b in l1):  # already merged: crash leftover
                        fs.delete(fs.p(c, t, part, 0, seg_name(s, e)))
                        deleted_stale += 1
                    else:
                        l0.append((s, e))
                groups, cur, cur_bytes = [], [], 0
                for s, e in l0:
                    cur.append((s, e))
                    cur_bytes += fs.size(fs.p(c, t, part, 0, seg_name(s, e)))
                    if cur_bytes >= target_bytes:
                        groups.append(cur)
                        cur, cur_bytes = [], 0
                if cur and merge_all:
                    groups.append(cur)
                for g in groups:
                    merged.append(_merge(spark, fs, c, t, part, g))
    return {"merged_segments": merged, "level0_merged": sum(m["inputs"] for m in merged),
            "stale_level0_deleted": deleted_stale}


def _merge(spark, fs: FS, c: str, t: str, part: int, group: list[tuple[int, int]]) -> dict:
    srcs = [fs.p(c, t, part, 0, seg_name(s, e)) for s, e in group]
    start, end = group[0][0], group[-1][1]
    df = spark.read.parquet(*srcs)
    expected = df.count()
    tmp = fs.p(c, t, part, 1, f"_tmp-{seg_name(start, end)}-{uuid.uuid4().hex[:8]}")
    df.coalesce(1).sortWithinPartitions("offset").write.parquet(tmp)
    got = spark.read.parquet(tmp).count()
    if got != expected:
        fs.delete(tmp)
        raise RuntimeError(f"compaction of {c}/{t}/{part} wrote {got} of {expected} records")
    dst = fs.p(c, t, part, 1, seg_name(start, end))
    if fs.exists(dst):
        fs.delete(dst)
    fs.rename(tmp, dst)
    for s in srcs:  # only now: the level-1 segment is complete
        fs.delete(s)
    return {"cluster": c, "topic": t, "partition": part, "start": start, "end": end, "inputs": len(group),
            "records": expected}


# ---------------------------------------------------------------- restore

def read_archive(spark, prefix: str, cluster: str, topic: str):
    """DataFrame of every archived record of cluster/topic (None if none)."""
    fs = FS(spark, prefix)
    paths = []
    for part, levels in sorted(list_segments(fs, cluster, topic).items()):
        paths += [fs.p(cluster, topic, part, lvl, seg_name(s, e)) for lvl, s, e in live_segments(levels)]
    if not paths:
        return None
    return spark.read.parquet(*paths).dropDuplicates(["partition", "offset"])


def restore(spark, prefix: str, archived: str, brokers: str, topic: str) -> dict:
    """Produce the archive of archived/topic into `topic` at `brokers`."""
    from confluent_kafka import Consumer, TopicPartition
    from pyspark.sql import functions as F

    from kdsync.kafka.topic import ensure_topic
    from kdsync.observability.logs import client_log

    df = read_archive(spark, prefix, archived, topic)
    if df is None:
        raise UsageError(f"--path {prefix}: no archive of cluster {archived!r} topic {topic!r}")
    stats = {r["partition"]: r for r in df.groupBy("partition").agg(
        F.min("offset").alias("lo"), F.max("offset").alias("hi"), F.count(F.lit(1)).alias("n")).collect()}
    nparts = max(stats) + 1
    have = ensure_topic(brokers, topic, nparts)
    if have < nparts:
        raise UsageError(f"target topic {topic} has {have} partitions, the archive needs {nparts}")
    c = Consumer({"bootstrap.servers": brokers, "group.id": "kdsync-restore", "log_level": 3, "logger": client_log()})
    try:
        for p in range(nparts):
            _, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)
            if high > 0:
                raise UsageError(f"target topic {topic}[{p}] is not empty (restore needs an empty topic)")
    finally:
        c.close()
    conf = {"bootstrap.servers": brokers}

    def produce(rows):
        from confluent_kafka import Producer

        prod = Producer({**conf, "acks": "all", "max.in.flight.requests.per.connection": 1, "linger.ms": 5,
                         "log_level": 3, "logger": client_log()})
        errors = []

        def on_delivery(err, _msg):
            if err is not None:
                errors.append(err)

        for r in rows:
            prod.produce(topic, key=r["key"], value=r["value"], partition=r["partition"],
                         headers=[(h["key"], h["value"]) for h in (r["headers"] or [])],
                         timestamp=r["timestamp"] or 0, on_delivery=on_delivery)
            prod.poll(0)
            if errors:
                break
        left = prod.flush(60)
        if errors or left:
            raise RuntimeError(f"restore: {len(errors)} failed deliveries, {left} undelivered ({errors[:1]})")

    (df.repartition(nparts, "partition").sortWithinPartitions("partition", "offset")
     .foreachPartition(produce))
    preserved = {str(p): bool(s["lo"] == 0 and s["hi"] == s["n"] - 1) for p, s in sorted(stats.items())}
    return {"cluster": archived, "topic": topic, "target": brokers,
            "records": sum(s["n"] for s in stats.values()), "partitions": nparts,
            "positions_preserved": preserved}


# ---------------------------------------------------------------- commands

def _spark(master: str, name: str):
    from kdsync.spark.session import spark_session

    return spark_session(master, name)


def _report(prog: str, fn, *args) -> int:
    """Run `fn(*args)` and print its summary as JSON: 0; a failure: one line, 1."""
    ok, out = run_job(prog, fn, *args)  # a failed Spark job or broker: one line
    if not ok:
        return 1
    print(json.dumps(out, indent=2))
    return 0


app = new_app()
_CLUSTER = "NAME=BROKERS"


@app.command("archive", help="Write a cluster's global topic to Parquet segments (level 0), from the checkpoint to "
                             "partition EOF; prints a JSON summary.")
def _cmd_archive(
    cluster: list[str] = typer.Option(..., metavar=_CLUSTER, help="the cluster to read (bootstrap servers "
                                                                   "comma-separated)"),
    topic: str = typer.Option(..., metavar="TOPIC", help="the topic to archive (normally T-global)"),
    path: str = typer.Option(..., metavar="PREFIX", help="archive prefix (local path or any Hadoop URI)"),
    max_records: int = typer.Option(100_000, metavar="N", help="a segment ends every N records"),
    max_bytes: int = typer.Option(64 << 20, metavar="B", help="a segment ends every B bytes"),
    max_age_s: float = typer.Option(300.0, metavar="S", help="write a partition's last, partial segment once its "
                                                             "first record is S seconds old"),
    flush: bool = typer.Option(False, "--flush", show_default="off",
                               help="also close each partition's last, partial segment"),
    master: str = typer.Option("local[*]", metavar="URL", help="Spark master"),
) -> int:
    name, brokers = _cluster_arg(cluster)
    for opt, v in (("--max-records", max_records), ("--max-bytes", max_bytes), ("--max-age-s", max_age_s)):
        _positive(opt, v)
    _check_brokers(name, brokers)
    return _report("kdsync archive", lambda: archive(_spark(master, "kdsync-archive"), name, brokers, topic, path,
                                                     max_records, max_bytes, max_age_s, flush))


@app.command("compact", help="Merge runs of level-0 archive segments into level-1 segments; prints a JSON summary.")
def _cmd_compact(
    path: str = typer.Option(..., metavar="PREFIX", help="archive prefix (local path or any Hadoop URI)"),
    cluster: str | None = typer.Option(None, metavar="NAME", show_default="all", help="only this cluster"),
    topic: str | None = typer.Option(None, metavar="TOPIC", show_default="all", help="only this topic"),
    target_bytes: int = typer.Option(256 << 20, metavar="B", help="size of a level-1 segment"),
    all_: bool = typer.Option(False, "--all", show_default="off",
                              help="also merge the last run of segments below the target"),
    master: str = typer.Option("local[*]", metavar="URL", help="Spark master"),
) -> int:
    _positive("--target-bytes", target_bytes)
    if cluster and "=" in cluster:
        cluster = cluster.split("=", 1)[0]

    def go():
        spark = _spark(master, "kdsync-compact")
        if not FS(spark, path).exists(path):
            raise UsageError(f"--path {path}: does not exist")
        return compact(spark, path, cluster, topic, target_bytes, all_)

    return _report("kdsync compact", go)


@app.command("restore", help="Replay an archive into a cluster's (empty) global topic; prints a JSON summary.")
def _cmd_restore(
    path: str = typer.Option(..., metavar="PREFIX", help="archive prefix (local path or any Hadoop URI)"),
    cluster: list[str] = typer.Option(..., metavar=_CLUSTER, help="where to write; NAME also names the archived "
                                                                   "cluster unless --from is given"),
    topic: str = typer.Option(..., metavar="TOPIC", help="the topic to restore (normally T-global)"),
    from_: str | None = typer.Option(None, "--from", metavar="NAME", show_default="NAME of --cluster",
                                     help="archived cluster to replay"),
    master: str = typer.Option("local[*]", metavar="URL", help="Spark master"),
) -> int:
    name, brokers = _cluster_arg(cluster)
    _check_brokers(name, brokers)
    return _report("kdsync restore", lambda: restore(_spark(master, "kdsync-restore"), path, from_ or name, brokers,
                                                     topic))


def main_archive(argv: list[str]) -> int:
    """`kdsync archive ARGS`; returns the exit code (0 done, 1 failed, 2 bad input)."""
    return run_cli(command(app, "archive"), argv, "kdsync archive")


def main_compact(argv: list[str]) -> int:
    """`kdsync compact ARGS`; returns the exit code (0 done, 1 failed, 2 bad input)."""
    return run_cli(command(app, "compact"), argv, "kdsync compact")


def main_restore(argv: list[str]) -> int:
    """`kdsync restore ARGS`; returns the exit code (0 done, 1 failed, 2 bad input)."""
    return run_cli(command(app, "restore"), argv, "kdsync restore")


def main(argv: list[str]) -> int:
    """`python -m kdsync.spark.archive archive|compact|restore ARGS`; returns the exit code."""
    return run_cli(typer.main.get_group(app), argv, "python -m kdsync.spark.archive")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
