"""archive -> compact -> restore on real Tansu brokers and a local archive:
the restored global topic holds the same records at the same positions."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from conftest_spark import get_spark

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOPIC = "t-global"


@pytest.fixture(scope="module")
def clusters():
    from kdsync.kafka.embedded import embedded_clusters

    with embedded_clusters(2, names=["dc1", "fresh"]) as cs:
        yield cs


def _write(cluster, first: int, n: int, partitions: int = 2):
    from confluent_kafka import Producer

    from kdsync.kafka.records import H_ORIGIN, H_SEQ
    from kdsync.kafka.topic import ensure_topic

    ensure_topic(cluster.bootstrap, TOPIC, partitions)
    p = Producer({"bootstrap.servers": cluster.bootstrap, "linger.ms": 5, "log_level": 3,
                  "max.in.flight.requests.per.connection": 1})
    now_ms = int(time.time() * 1000)
    for i in range(first, first + n):
        p.produce(TOPIC, key=b"k%d" % i, value=b"payload-%d" % i * 3, partition=i % partitions,
                  timestamp=now_ms + i,
                  headers=[(H_SEQ, str(i).encode()), (H_ORIGIN, b"dc1"), ("empty", None)])
    assert p.flush(30) == 0


def _cli(fn, argv, capsys):
    code = fn(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def _records(df):
    return sorted((r["partition"], r["offset"], r["timestamp"], r["key"], r["value"],
                   tuple((h["key"], h["value"]) for h in r["headers"]))
                  for r in df.select("partition", "offset", "timestamp", "key", "value", "headers").collect())


def _segments(root: Path, level: int):
    return sorted(p.name for p in root.glob(f"dc1/{TOPIC}/*/{level}/*") if p.is_dir() and "-" in p.name)


def test_archive_compact_restore_round_trip(clusters, tmp_path, capsys):
    from kdsync.spark.archive import main_archive, main_compact, main_restore, read_archive
    from kdsync.spark.kafka_source import read_topic

    src, fresh = clusters
    spark = get_spark()
    root = tmp_path / "archive"
    base = ["--cluster", f"dc1={src.bootstrap}", "--topic", TOPIC, "--path", str(root), "--master", "local[2]"]

    _write(src, 0, 250)
    out = _cli(main_archive, base + ["--max-records", "40", "--max-age-s", "3600"], capsys)
    # 125 records per partition: 3 full segments each, the partial tail waits
    assert out["segments_written"] == 6 and out["records_archived"] == 240 and out["records_pending"] == 10
    assert out["checkpoint"] == {"0": 120, "1": 120}
    assert _segments(root, 0)[:3] == ["00000000000000000000-00000000000000000039",
                                      "00000000000000000000-00000000000000000039",
                                      "00000000000000000040-00000000000000000079"]

    _write(src, 250, 60)  # more records arrive; the rerun continues at the checkpoint
    out = _cli(main_archive, base + ["--max-records", "40", "--flush"], capsys)
    assert out["records_archived"] == 310 - 240 and out["checkpoint"] == {"0": 155, "1": 155}
    archived = read_archive(spark, str(root), "dc1", TOPIC)
    original = _records(read_topic(spark, src.bootstrap, TOPIC))
    assert len(original) == 310 and _records(archived) == original

    keep = root / "dc1" / TOPIC / "0" / "0" / _segments(root, 0)[0]
    shutil.copytree(keep, tmp_path / "crash-leftover")
    out = _cli(main_compact, ["--path", str(root), "--target-bytes", "6000", "--all", "--master", "local[2]"], capsys)
    assert out["level0_merged"] == 8 and _segments(root, 0) == []
    assert len(_segments(root, 1)) >= 2
    assert _records(read_archive(spark, str(root), "dc1", TOPIC)) == original
    # a crash between the level-1 rename and the level-0 delete leaves a covered
    # segment: readers ignore it, the next compaction removes it
    shutil.copytree(tmp_path / "crash-leftover", keep)
    assert _records(read_archive(spark, str(root), "dc1", TOPIC)) == original
    out = _cli(main_compact, ["--path", str(root), "--master", "local[2]"], capsys)
    assert out["stale_level0_deleted"] == 1 and _segments(root, 0) == []

    out = _cli(main_restore, ["--path", str(root), "--cluster", f"new={fresh.bootstrap}", "--from", "dc1",
                              "--topic", TOPIC, "--master", "local[2]"], capsys)
    assert out["records"] == 310 and out["positions_preserved"] == {"0": True, "1": True}
    assert _records(read_topic(spark, fresh.bootstrap, TOPIC)) == original

    # restoring twice would break positions: refused with one line, exit 2
    assert main_restore(["--path", str(root), "--cluster", f"dc1={fresh.bootstrap}", "--topic", TOPIC,
                         "--master", "local[2]"]) == 2
    assert "not empty" in capsys.readouterr().err


def test_bad_arguments_exit_2(capsys):
    from kdsync.spark.archive import main_archive, main_restore

    assert main_archive(["--topic", "t", "--path", "/tmp/x"]) == 2
    assert "--cluster" in capsys.readouterr().err
    assert main_archive(["--cluster", "noequals", "--topic", "t", "--path", "/tmp/x"]) == 2
    assert "NAME=HOST:PORT" in capsys.readouterr().err
    assert main_archive(["--cluster", "a=h:1", "--topic", "t", "--path", "/tmp/x", "--max-records", "0"]) == 2
    assert "--max-records" in capsys.readouterr().err
    assert main_restore(["--cluster", "a=h:1", "--topic", "t"]) == 2
    assert "--path" in capsys.readouterr().err
