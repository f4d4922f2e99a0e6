"""Start-up time of a member against the length of its global topic.

    python -m bench.startup [--records 10000 1000000] [--partitions 1] [--out results/startup.csv]

For each length N: one embedded Tansu broker; N records written to
`events-global` with a plain producer, exactly as members write them (the
kdsync headers, three origins taking turns); then the start-up read
(`kdsync.kafka.reader.load_start`, what `kdsync run` does before it orders
anything) is timed

* without a checkpoint topic (a version without checkpoints: the whole topic
  is read),
* with a checkpoint 10 000 positions before the end (a member killed that
  long after its last checkpoint: `[checkpoint] positions` bounds it),
* with a checkpoint at the end (a clean stop writes an exact one),

and, for the last case, the whole `kdsync run` process from its start to its
"topic ready" line (Python start-up, broker connections, the same read).
Median of `--repeat` runs.  Writes one CSV row per (N, case) and prints a
Markdown table.  Not part of `make bench`: it writes a million records.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORIGINS = ("dc1", "dc2", "dc3")
GT = "events-global"


def write_global(bootstrap: str, n: int, partitions: int) -> None:
    """n global records at positions 0..n-1, as members write them."""
    from confluent_kafka import Producer

    from kdsync.kafka.records import global_headers, global_partition
    from kdsync.kafka.topic import ensure_topic

    ensure_topic(bootstrap, GT, partitions)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1_000_000, "acks": "all",
                  "queue.buffering.max.messages": 1_000_000, "log_level": 3, "compression.type": "none"})
    for seq in range(n):
        origin = ORIGINS[seq % 3]
        key = _key(seq)
        while True:
            try:
                p.produce(GT, key=key, value=b"x" * 32, partition=global_partition(key, seq, partitions),
                          headers=[("app", b"bench")] + global_headers(seq, origin, 0, seq // 3, 1_700_000_000_000))
                break
            except BufferError:
                p.poll(0.05)
        if seq % 10_000 == 0:
            p.poll(0)
    if p.flush(300):
        raise RuntimeError("records not acknowledged")


def _key(seq: int) -> bytes:
    return f"{ORIGINS[seq % 3]}-{seq // 3}".encode()


def write_checkpoint(bootstrap: str, seq: int, partitions: int) -> None:
    """The checkpoint a member holds at position `seq`: per partition the
    offset of its first record at or after `seq` (the topic was written from
    offset 0 without gaps, so: how many of its records come before)."""
    from confluent_kafka import Producer

    from kdsync.kafka.checkpoint import Checkpoint, checkpoint_topic, ensure_checkpoint_topic
    from kdsync.kafka.records import global_partition

    offsets = [0] * partitions
    if partitions == 1:
        offsets[0] = seq
    else:
        for s in range(seq):
            offsets[global_partition(_key(s), s, partitions)] += 1
    wm = {(ORIGINS[s % 3], 0): s // 3 for s in range(max(0, seq - 3), seq)}
    ensure_checkpoint_topic({"bootstrap.servers": bootstrap}, GT)
    p = Producer({"bootstrap.servers": bootstrap, "log_level": 3})
    p.produce(checkpoint_topic(GT), key=GT.encode(), value=Checkpoint(GT, seq, tuple(offsets), wm, "dc1").encode(),
              partition=0)
    if p.flush(30):
        raise RuntimeError("checkpoint not acknowledged")


def time_load(bootstrap: str, partitions: int, repeat: int) -> tuple[float, int, int]:
    """(median seconds, records read, start position) of load_start."""
    from kdsync.kafka.reader import load_start

    times, s = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        s = load_start({"bootstrap.servers": bootstrap, "group.id": "bench-start", "log_level": 3}, GT, partitions)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), s.records, s.end


def time_member(bootstrap: str, partitions: int, workdir: Path, repeat: int) -> float:
    """Median seconds from spawning `kdsync run` (a one-member group) to its "topic ready" line."""
    from kdsync.kafka.embedded import free_port
    from kdsync.kafka.topic import ensure_topic

    ensure_topic(bootstrap, "events")
    times = []
    for i in range(repeat):
        listen = f"127.0.0.1:{free_port()}"
        cfg = workdir / f"m{i}.toml"
        cfg.write_text(f'state_dir = "{workdir / f"state{i}"}"\n[member]\nid = "dc1"\nlisten = "{listen}"\n'
                       f'[peers]\ndc1 = "{listen}"\n[kafka]\n"bootstrap.servers" = "{bootstrap}"\n'
                       f'[topics]\nsource = "events"\nglobal_partitions = {partitions}\n'
                       f'[checkpoint]\ninterval_ms = 3600000\n')
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "kdsync.cli", "run", "--config", str(cfg)], cwd=workdir,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            for line in p.stderr:
                if 'msg="topic ready"' in line:
                    times.append(time.perf_counter() - t0)
                    break
            else:
                raise RuntimeError(f"kdsync run exited with {p.wait()} before it was ready")
        finally:
            p.terminate()
            p.wait(30)
    return statistics.median(times)


def measure(n: int, partitions: int, repeat: int) -> list[dict]:
    from kdsync.kafka.embedded import EmbeddedCluster

    rows = []
    with tempfile.TemporaryDirectory(prefix="kdsync-startup-") as d, EmbeddedCluster("bench", log_dir=d) as c:
        t0 = time.perf_counter()
        write_global(c.bootstrap, n, partitions)
        print(f"{n} records written in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        cases = [("no checkpoint (whole topic)", None), ("checkpoint 10000 before the end", max(0, n - 10_000)),
                 ("checkpoint at the end", n)]
        for case, seq in cases:
            if seq is not None:
                write_checkpoint(c.bootstrap, seq, partitions)
            secs, read, end = time_load(c.bootstrap, partitions, repeat if seq is not None else 1)
            assert end == n, (case, end)
            rows.append({"records": n, "partitions": partitions, "case": case, "records_read": read,
                         "load_start_s": round(secs, 3), "kdsync_run_ready_s": ""})
            print(rows[-1], file=sys.stderr)
        rows[-1]["kdsync_run_ready_s"] = round(time_member(c.bootstrap, partitions, Path(d), repeat), 3)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, nargs="+", default=[10_000, 1_000_000], help="global topic lengths")
    ap.add_argument("--partitions", type=int, default=1, help="global partitions (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the median is reported (default 3)")
    ap.add_argument("--out", default=str(ROOT / "results" / "startup.csv"), help="CSV written (default results/startup.csv)")
    a = ap.parse_args(argv)
    rows = []
    for n in a.records:
        rows += measure(n, a.partitions, a.repeat)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
