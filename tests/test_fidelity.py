"""Byte fidelity through kdsync, on both embedded brokers (issue 41).

Three clusters, three `kdsync run` members (LocalGroup).  Into each cluster's
source topic, three partitions:

* p0: confluent-kafka, one producer per codec (none, gzip, snappy, lz4,
  zstd), linger on so batches hold several records;
* p1: kafka-python beside it, the same codecs;
* p2: transactions — plain records, a committed confluent-kafka transaction
  with a kafka-python one committed inside it, one more committed, then an
  aborted one from each library, plain records again.

Keys and values null, empty, binary and 100 KB (one ~900 KB value per library
and cluster); 0-20 headers with duplicate keys, null values (confluent-kafka:
kafka-python cannot send one) and non-UTF-8 bytes.  Every record of every
global topic is compared with what was written (by the offset each producer
was told): key, value, the source headers in order and then only `kdsync.*`
headers; every event once, each origin partition in offset order, the three
global topics identical.

What transactions give (kdsync.kafka.transactions):

* noida hides aborted records from read_committed readers: every committed
  record is ordered, no aborted one; the markers and aborted records are
  counted as gaps (`kdsync_source_gaps_total{kind="control"|"aborted"}`).
* Tansu hands them over: each member names its broker in one ERROR line at
  start, and p2 holds at its first transactional record with one `stalled:`
  line naming topic, partition, offset and the switch — the plain records
  before it ordered, nothing after it, nothing skipped.  Restarted with
  `[kafka] trust_read_committed = true`, the members order the rest of p2 as
  Tansu hands it over: aborted records included, each once.
"""

from __future__ import annotations

import random
import re
import time

import pytest

from kdsync.kafka.records import H_OOFF, H_OPART, H_ORIGIN
from kdsync.kafka.topic import iter_partition
from kdsync.kafka.transactions import PROBE_TOPIC
from kdsync.testing.local import LocalGroup, check_global_topics

from helpers import member_logs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CODECS = ["none", "gzip", "snappy", "lz4", "zstd"]
TOPIC = "fid"
PER_CODEC = 21  # records per codec and library: header counts 0..20


def _headers(rnd: random.Random, n: int, nulls: bool) -> list[tuple[str, bytes | None]]:
    """n headers: duplicate keys, null values (if `nulls`), non-UTF-8 and empty bytes."""
    keys = ["dup", "x-trace", "dup", "ключ", "dup", "k\u00e9y"]
    vals = [None if nulls else b"", b"", b"\xff\xfe\x80\x00", b"plain", None if nulls else b"\xc3", rnd.randbytes(40)]
    return [(keys[(j + n) % len(keys)], vals[(j * 5 + n) % len(vals)]) for j in range(n)]


def _cases(tag: str, nulls: bool) -> list[tuple[bytes | None, bytes | None, list]]:
    """PER_CODEC records: keys and values null / empty / binary / text / 100 KB, 0..20 headers."""
    rnd = random.Random(tag)
    keys = [None, b"", bytes(range(256)), f"{tag}-key".encode(), b"\x00\xff" * 9, rnd.randbytes(2000)]
    out = []
    for i in range(PER_CODEC):
        value = [None, b"", bytes(range(255, -1, -1)), f"v\u00fc\u20ac-{tag}-{i}".encode(), rnd.randbytes(300),
                 b"\x00" * 1000][i % 6]
        if i == 10:
            value = rnd.randbytes(100_000)
        key = keys[(i * 5) % len(keys)]
        if key is None and value is None and not nulls:  # kafka-python sends no record without key and value
            key = b""
        out.append((key, value, _headers(rnd, i, nulls)))
    return out


class _Written:
    """What one cluster's source topic was given: (partition, offset) -> record and fate."""

    def __init__(self):
        self.records: dict[tuple[int, int], tuple] = {}  # -> (key, value, headers, fate)
        self.errors: list[str] = []

    def confluent_cb(self, case, fate):
        def cb(err, msg):
            if err is not None:
                self.errors.append(str(err))
            else:
                self.records[(msg.partition(), msg.offset())] = (*case, fate)
        return cb


def _write_confluent(bs: str, name: str, w: _Written) -> None:
    from confluent_kafka import Producer

    rnd = random.Random(f"big-{name}")
    for codec in CODECS:
        p = Producer({"bootstrap.servers": bs, "compression.type": codec, "linger.ms": 50,
                      "enable.idempotence": True})
        for case in _cases(f"ck-{name}-{codec}", nulls=True):
            p.produce(TOPIC, key=case[0], value=case[1], headers=case[2], partition=0,
                      on_delivery=w.confluent_cb(case, "plain"))
        if codec == "zstd":  # one ~900 KB value
            case = (b"big", rnd.randbytes(900_000), [("size", b"900000"), ("size", None)])
            p.produce(TOPIC, key=case[0], value=case[1], headers=case[2], partition=0,
                      on_delivery=w.confluent_cb(case, "plain"))
        assert p.flush(60) == 0


def _write_kafka_python(bs: str, name: str, w: _Written) -> None:
    from kafka import KafkaProducer

    rnd = random.Random(f"kp-big-{name}")
    for codec in CODECS:
        p = KafkaProducer(bootstrap_servers=bs, compression_type=None if codec == "none" else codec, linger_ms=50,
                          max_request_size=2_000_000)
        sent = [(case, p.send(TOPIC, key=case[0], value=case[1], headers=case[2], partition=1))
                for case in _cases(f"kp-{name}-{codec}", nulls=False)]
        if codec == "gzip":
            case = (None, rnd.randbytes(900_000), [("size", b"900000")])
            sent.append((case, p.send(TOPIC, key=case[0], value=case[1], headers=case[2], partition=1)))
        p.flush(60)
        for case, f in sent:
            md = f.get(60)
            w.records[(md.partition, md.offset)] = (*case, "plain")
        p.close(10)


def _write_transactions(bs: str, name: str, w: _Written) -> int:
    """Partition 2: plain records; a confluent-kafka transaction open while a kafka-python one
    commits inside it, then commits itself; one more committed; then each producer's last
    transaction aborted; plain records again.  Returns the offset of the first transactional record.

    Each producer aborts only in its last transaction: noida 0.2.3 lists every aborted transaction
    of a partition in a Fetch answer, also one that ended before the fetched offset, so a
    read_committed reader that starts after an abort loses that producer's later committed records
    (kdsync's gap accounting holds the partition there: test_noida_read_committed_gap_holds)."""
    from confluent_kafka import Producer
    from kafka import KafkaProducer

    rnd = random.Random(f"tx-{name}")

    def recs(tag, n, nulls=True):
        return [(f"{tag}-{i}".encode(), rnd.randbytes(50 + 40 * i), _headers(rnd, i * 3 % 21, nulls)) for i in range(n)]

    plain = Producer({"bootstrap.servers": bs, "enable.idempotence": True})
    tx = Producer({"bootstrap.servers": bs, "transactional.id": f"fid-ck-{name}", "compression.type": "lz4",
                   "linger.ms": 20})
    kp = KafkaProducer(bootstrap_servers=bs, transactional_id=f"fid-kp-{name}", compression_type="snappy")
    tx.init_transactions(30)
    kp.init_transactions()

    def plain_records(tag):
        for case in recs(tag, 3):
            plain.produce(TOPIC, key=case[0], value=case[1], headers=case[2], partition=2,
                          on_delivery=w.confluent_cb(case, "plain"))
        assert plain.flush(30) == 0

    def ck(tag, n, fate):
        for case in recs(tag, n):
            tx.produce(TOPIC, key=case[0], value=case[1], headers=case[2], partition=2,
                       on_delivery=w.confluent_cb(case, fate))
        assert tx.flush(30) == 0  # every record reached the broker before the marker

    def kp_txn(tag, n, commit):
        kp.begin_transaction()
        sent = [(case, kp.send(TOPIC, key=case[0], value=case[1], headers=case[2], partition=2))
                for case in recs(tag, n, nulls=False)]
        kp.flush(30)
        for case, f in sent:
            md = f.get(30)
            w.records[(md.partition, md.offset)] = (*case, "committed" if commit else "aborted")
        kp.commit_transaction() if commit else kp.abort_transaction()

    plain_records("pre")
    tx.begin_transaction()
    ck("ck-commit-a", 2, "committed")
    kp_txn("kp-commit", 3, True)  # commits while the confluent-kafka transaction is open around it
    ck("ck-commit-b", 2, "committed")
    tx.commit_transaction(30)
    tx.begin_transaction()
    ck("ck-commit2", 2, "committed")
    tx.commit_transaction(30)
    tx.begin_transaction()
    ck("ck-abort", 4, "aborted")
    tx.abort_transaction(30)
    kp_txn("kp-abort", 3, False)
    plain_records("post")
    kp.close(10)
    return min(o for (p, o), r in w.records.items() if p == 2 and r[3] != "plain")


def _read_global(g: LocalGroup, i: int) -> list:
    return list(iter_partition(g.bootstrap(i), g.global_topic, 0, timeout=60))


def _check_bytes(g: LocalGroup, written: dict[str, _Written], expected: dict[str, set]) -> dict[str, list]:
    """Every global topic holds exactly the `expected` events (origin -> {(partition, offset)}), each
    byte for byte as written, each origin partition in offset order; returns the event ids per cluster."""
    ids = {}
    for i in g.data:
        seen, last = [], {}
        for m in _read_global(g, i):
            hs = m.headers() or []
            kd = {k: v for k, v in hs if k.startswith("kdsync.")}
            origin, part, off = kd[H_ORIGIN].decode(), int(kd[H_OPART]), int(kd[H_OOFF])
            key, value, headers, fate = written[origin].records[(part, off)]
            where = f"{g.names[i]} offset {m.offset()}: {origin}[{part}]@{off} ({fate})"
            assert m.key() == key and m.value() == value, where
            n = len(headers)
            assert [(k, v) for k, v in hs[:n]] == [(k, v) for k, v in headers], where
            assert all(k.startswith("kdsync.") for k, _ in hs[n:]) and len(hs) - n == len(kd), where
            assert off > last.get((origin, part), -1), f"{where}: origin partition order"
            last[(origin, part)] = off
            seen.append((origin, part, off))
        assert len(seen) == len(set(seen)), f"{g.names[i]}: an event twice"
        got = {o: {(p, off) for oo, p, off in seen if oo == o} for o in written}
        for o in written:
            assert got[o] == expected[o], (f"{g.names[i]}: from {o}: {len(got[o] - expected[o])} unexpected "
                                          f"{sorted(got[o] - expected[o])[:5]}, {len(expected[o] - got[o])} missing "
                                          f"{sorted(expected[o] - got[o])[:5]}")
        ids[g.names[i]] = seen
    first = next(iter(ids.values()))
    assert all(v == first for v in ids.values()), "the global topics differ"
    return ids


def _stalled_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if 'msg="stalled: a source partition holds at a transactional' in ln]


@pytest.mark.parametrize("broker", ["noida", "tansu"])
def test_every_byte_of_every_record_reaches_every_global_topic(tmp_path, broker):
    t0 = time.monotonic()
    g = LocalGroup(3, tmp_path, topic=TOPIC, broker=broker, source_partitions=3, metrics=True,
                   expect_stalls=broker == "tansu")
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready(60)
        written = {n: _Written() for n in g.names}
        first_txn = {}
        for i, n in enumerate(g.names):  # one cluster after the other: each its own producers
            _write_confluent(g.bootstrap(i), n, written[n])
            _write_kafka_python(g.bootstrap(i), n, written[n])
            first_txn[n] = _write_transactions(g.bootstrap(i), n, written[n])
            assert not written[n].errors, written[n].errors
        fates = {n: {k: r[3] for k, r in w.records.items()} for n, w in written.items()}
        assert all(sum(f == "aborted" for f in v.values()) == 7 for v in fates.values())
        if broker == "noida":
            expected = {n: {k for k, f in v.items() if f != "aborted"} for n, v in fates.items()}
        else:  # Tansu: p2 holds at its first transactional record
            expected = {n: {k for k in v if k[0] != 2 or k[1] < first_txn[n]} for n, v in fates.items()}
        total = sum(map(len, expected.values()))
        got = g.wait_for(total, 90)
        ok, detail = check_global_topics(got, expected=total)
        assert ok, detail + "\n" + member_logs(g)
        _check_bytes(g, written, expected)
        if broker == "noida":
            for i in g.data:
                text = g.log_text(i)
                assert "transaction probe: the broker hides aborted records" in text and not _stalled_lines(text)
                m = g.metrics(i)
                gaps = {k: m.get(("kdsync_source_gaps_total", (("kind", k),)), 0) for k in ("control", "aborted")}
                assert gaps["control"] >= 1 and gaps["aborted"] >= 1, gaps  # the markers and aborted records
            print(f"\nnoida: {total} records byte-identical, 21 aborted never copied, {time.monotonic() - t0:.1f} s")
            return
        # Tansu: the broker named once, p2 held with one line naming the switch; nothing after it ordered
        time.sleep(0.5)  # not a synchronisation: a last look that nothing more arrives after the count was met
        assert sum(map(len, g.wait_for(total, 0.1).values())) == 3 * total
        for i, n in enumerate(g.names):
            text = g.log_text(i)
            probe = [ln for ln in text.splitlines() if "hands aborted transactions' records" in ln]
            assert len(probe) == 1 and "level=error" in probe[0] and f"broker={g.bootstrap(i)}" in probe[0], probe
            held = _stalled_lines(text)
            assert len(held) == 1 and "level=error" in held[0], held
            assert re.search(rf"topic={TOPIC} partition=2 offset={first_txn[n]}\b", held[0]), held[0]
            assert "trust_read_committed = true" in held[0]
            assert PROBE_TOPIC not in {r.origin for r in got[n]}
        t1 = time.monotonic()
        # restarted with the switch: the rest of p2 as Tansu hands it over, aborted records included, once each
        marks = [len(g.log_text(i)) for i in range(g.n)]
        for i in range(g.n):
            assert g.stop_member(i) == 0, member_logs(g)
        for i in range(g.n):
            g.start_member(i, kafka={"trust_read_committed": True})
        everything = {n: set(v) for n, v in fates.items()}
        total = sum(map(len, everything.values()))
        got = g.wait_for(total, 90)
        ok, detail = check_global_topics(got, expected=total)
        assert ok, detail + "\n" + member_logs(g)
        _check_bytes(g, written, everything)
        for i in range(g.n):
            later = g.log_text(i)[marks[i]:]
            assert not _stalled_lines(later) and "hands aborted transactions' records" not in later, later[-2000:]
        print(f"\ntansu: held then, with the switch, {total} records byte-identical (21 aborted copied); "
              f"{t1 - t0:.1f} s + {time.monotonic() - t1:.1f} s")
    finally:
        g.close()


def test_noida_read_committed_gap_holds(tmp_path):
    """noida 0.2.3 answers a read_committed Fetch with every aborted transaction of the
    partition, also one whose abort marker lies before the fetched offset; librdkafka then takes
    that producer's later committed records for aborted and drops them.  A member whose fetch
    starts after an abort marker thus never gets the producer's next committed transaction:
    the gap accounting finds committed records missing, fetches them again (in vain) and the
    partition holds with one `stalled:` line — the records after the gap are not ordered,
    nothing is skipped."""
    from confluent_kafka import Producer

    with LocalGroup(3, tmp_path, topic=TOPIC, broker="noida", metrics=True, expect_stalls=True) as g:
        g.start_brokers()
        g.start_members()
        g.wait_ready(60)
        bs = g.bootstrap(0)
        tx = Producer({"bootstrap.servers": bs, "transactional.id": "gap-a"})
        plain = Producer({"bootstrap.servers": bs})
        tx.init_transactions(30)

        def txn(value: bytes, commit: bool) -> None:
            tx.begin_transaction()
            tx.produce(TOPIC, value=value, partition=0)
            assert tx.flush(30) == 0
            tx.commit_transaction(30) if commit else tx.abort_transaction(30)

        def one(value: bytes) -> None:
            plain.produce(TOPIC, value=value, partition=0)
            assert plain.flush(30) == 0

        txn(b"committed-1", True)  # offsets 0, marker 1
        txn(b"aborted", False)  # 2, marker 3
        one(b"plain-1")  # 4: once ordered, the member fetches from 5, after the abort marker
        got = g.wait_for(2, 30)
        assert [r.value for r in got["dc1"]] == [b"committed-1", b"plain-1"], got["dc1"]
        txn(b"committed-2", True)  # 5, marker 6: noida's answer from 5 lists the abort at 2
        one(b"plain-2")  # 7: the run after the gap
        line = wait_line(g, 0, 'msg="stalled: a source partition holds at records the broker does not hand over"', 40)
        assert f"topic={TOPIC} partition=0 offsets=5..6 missing=5..5" in line, line
        assert [r.value for r in g.wait_for(2, 1)["dc1"]] == [b"committed-1", b"plain-1"]  # plain-2 not past it


def wait_line(g: LocalGroup, i: int, text: str, timeout: float) -> str:
    """The first line of member i's log holding `text`, waited for up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        found = [ln for ln in g.log_text(i).splitlines() if text in ln]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no {text!r} in {g.names[i]}'s log:\n" + member_logs(g)
        time.sleep(0.2)
