"""Log recovery for Tansu's S3 storage, run before a durable embedded broker restarts.

Kafka recovers its log after a crash: the tail is truncated to the last
whole batch and each idempotent producer's state is rebuilt from the batches
the log holds.  Tansu's S3 engine (the build kdsync embeds; checked in
`tansu-storage/src/dynostore.rs`) does not: a produce first advances the
producer's sequence in `meta.json`, then the partition's high watermark in
`watermark.json`, and only then writes the batch object.  A broker killed
between those steps comes back with

- a high watermark above the last stored batch: offsets that hold nothing,
  so a reader positioned there waits for ever (its fetches return nothing
  while the watermark says records wait) and the next batch lands after the
  hole, at an offset that differs from every other cluster's;
- a producer sequence above its last stored batch: the producer retries the
  batch that never landed, the broker calls it a duplicate and acknowledges
  it — an acknowledged write that is not in the log.

`recover(s3, bucket, cluster)` does what Kafka's recovery does, on the
objects, while the broker is down: every partition's high watermark is set
to the end of its last stored batch, and every producer sequence of a
partition to the end of that producer's last stored batch there.  It returns
one line per repair.  docs/durable.md tells the story.
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict

__all__ = ["recover", "batch_header"]

# Kafka record batch v2 header as Tansu stores it (base offset first): 61 bytes
_HEADER = struct.Struct(">qiibIhiqqqhiI")
SCAN = 64  # batches read back from a partition's end to find a producer's last one


def batch_header(raw: bytes) -> dict:
    (base, _len, _epoch, _magic, _crc, _attrs, last_delta, _ts0, _ts1, pid, pepoch, base_seq,
     count) = _HEADER.unpack_from(raw)
    return {"base": base, "last_delta": last_delta, "pid": pid, "epoch": pepoch, "base_seq": base_seq,
            "count": count}


def _keys(s3, bucket: str, prefix: str):
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", ()):
            yield o["Key"]


def _get(s3, bucket: str, key: str, head_only: bool = False) -> bytes | None:
    try:
        kw = {"Range": f"bytes=0-{_HEADER.size - 1}"} if head_only else {}
        return s3.get_object(Bucket=bucket, Key=key, **kw)["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None


def recover(s3, bucket: str, cluster: str) -> list[str]:
    """Repair `cluster`'s log in `bucket` (the broker must be down); returns what was repaired."""
    root = f"clusters/{cluster}/"
    batches: dict[tuple[str, int], list[int]] = defaultdict(list)
    marks: set[tuple[str, int]] = set()
    for key in _keys(s3, bucket, root + "topics/"):
        parts = key[len(root) + len("topics/"):].split("/")
        # TOPIC/partitions/NNNNNNNNNN/records/OFFSET.batch or TOPIC/partitions/NNNNNNNNNN/watermark.json
        if len(parts) == 5 and parts[1] == "partitions" and parts[3] == "records" and parts[4].endswith(".batch"):
            batches[(parts[0], int(parts[2]))].append(int(parts[4][:-6]))
        elif len(parts) == 4 and parts[1] == "partitions" and parts[3] == "watermark.json":
            marks.add((parts[0], int(parts[2])))
    raw = _get(s3, bucket, root + "meta.json")
    meta = json.loads(raw) if raw else {}
    meta_changed = False
    fixes: list[str] = []
    for topic, part in sorted(marks | set(batches)):
        pdir = f"{root}topics/{topic}/partitions/{part:0>10}/"
        offs = sorted(batches.get((topic, part), ()))
        tail = []  # headers of the last SCAN batches, newest first
        for off in reversed(offs[-SCAN:]):
            h = _get(s3, bucket, f"{pdir}records/{off:0>20}.batch", head_only=True)
            if h is not None and len(h) >= _HEADER.size:
                tail.append({**batch_header(h), "base": off})
        wm_raw = _get(s3, bucket, pdir + "watermark.json")
        if wm_raw is not None:
            wm = json.loads(wm_raw)
            end = tail[0]["base"] + tail[0]["last_delta"] + 1 if tail else (wm.get("low") or 0)
            if wm.get("high") is not None and wm["high"] > end:
                fixes.append(f"{topic}[{part}]: high watermark {wm['high']} -> {end} (the end of its last stored "
                             f"batch: offsets {end}..{wm['high'] - 1} hold nothing)")
                wm["high"] = end
                wm["timestamps"] = None
                s3.put_object(Bucket=bucket, Key=pdir + "watermark.json", Body=json.dumps(wm).encode())
        whole = len(offs) <= SCAN  # the scan saw every batch of the partition
        for pid, detail in meta.get("producers", {}).items():
            for epoch, topics in detail.get("sequences", {}).items():
                seqs = topics.get(topic, {})
                seq = seqs.get(str(part))
                if seq is None:
                    continue
                last = next((h for h in tail if str(h["pid"]) == pid and str(h["epoch"]) == epoch), None)
                stored = last["base_seq"] + last["last_delta"] + 1 if last else (0 if whole else None)
                if stored is not None and seq > stored:
                    fixes.append(f"{topic}[{part}]: producer {pid} epoch {epoch} sequence {seq} -> {stored} "
                                 f"(its last stored batch; the rest never landed)")
                    seqs[str(part)] = stored
                    meta_changed = True
    if meta_changed:
        s3.put_object(Bucket=bucket, Key=root + "meta.json", Body=json.dumps(meta).encode())
    return fixes
