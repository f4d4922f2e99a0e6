"""Members with plain configs on durable Tansu (issue 41): no fetch wait, no
linger — the settings a user's config has, not the harness's durable tuning
(`LocalGroup(durable_tuning=False)`).

Tansu on S3 lists a partition's objects within the fetch's wait, so a
partition that already holds many small batches when its member starts
answers every 10 ms fetch with nothing.  The source consumer's stalled-fetch
escalation (a new client with a longer wait) never started for it: it
counted only partitions librdkafka knew a position of, and a partition
nothing was consumed from has none — 0 records ordered, for ever.  Here the
records are written before the members start, more are written while they
run, and dc2's broker is killed (SIGKILL) and restarted mid-stream; every
acknowledged event must be ordered, once, the same everywhere.  The second
test takes the same plain configs through a data-centre outage (a cluster's
broker and member killed -9 together, then back) and a member crash-restart
(kill -9), writers running through both.

Each member's broker fails the transaction probe (Tansu shows aborted
records), so every source run is checked by a look at its batch headers
(kdsync.kafka.transactions, through kdsync.kafka.wire): with one 100 ms wait
those looks came back empty on S3 ("the look read up to offset 0 of 445"):
with 1 000 records per cluster written before the start, one run ordered
the backlog after minutes, another not within 240 s (226 such lines); the
look now asks again with a longer wait (42 s, no such line).
"""

from __future__ import annotations

import signal
import signal
import time

import pytest

from kdsync.testing.local import LocalGroup, Writers, check_global_topics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _logs(g: LocalGroup) -> str:
    out = []
    for i, n in enumerate(g.names):
        lines = g.log_text(i).splitlines()
        loud = [x for x in lines if "level=warning" in x or "level=error" in x][-12:]
        out.append(f"--- {n}: warnings and errors\n" + "\n".join(loud) + f"\n--- {n}: last lines\n"
                   + "\n".join(lines[-10:]))
    return "\n".join(out)


def _assert_everything_ordered(g, total: int) -> None:
    """Every source record acknowledged is in the sources, and every global
    topic holds each of them once, identically (check_global_topics)."""
    src = g.read_sources(timeout=60)
    present = sum(len(v) for v in src.values())
    assert present == total, f"{present} source records for {total} acknowledged\n" + _logs(g)
    got = g.wait_for(total, 300, poll=1)
    ok, detail = check_global_topics(got, expected=total)
    assert ok, detail + "\n" + _logs(g)
    keys = {k for v in src.values() for (_, _, k) in v}
    assert {r.key for r in got["dc1"]} == keys


def test_plain_configs_on_durable_tansu_order_everything_through_a_broker_kill(tmp_path):
    g = LocalGroup(3, tmp_path, durable=True, durable_tuning=False, metrics=True, expect_stalls=True,
                   tick_ms=20, heartbeat_ms=60, suspect_ms=1000, retransmit_ms=100)
    try:
        g.start_brokers()
        text = g.config_text(0)
        assert "fetch.wait.max.ms" not in text and "linger" not in text, text
        # one small batch per record, paced: 1 500 objects in each partition before any member reads it
        before = Writers(g, 1500, "pre", 200.0, linger_ms=0)
        pre = before.join(300, strict=True)
        g.start_members()
        g.wait_ready(90)
        during = Writers(g, 900, "run", 60.0, timeout=300)
        got = g.wait_for(pre, 240, members=[1], poll=0.5)
        assert len(got["dc2"]) >= pre, f"dc2 ordered {len(got['dc2'])} of {pre} in 240 s\n" + _logs(g)
        g.clusters[1].kill()  # SIGKILL: the log stays in the S3 store
        time.sleep(2)  # the outage: dc2's writes wait in their producer, dc1 and dc3 go on
        g.clusters[1].start()
        total = pre + during.join(400, strict=True)
        _assert_everything_ordered(g, total)
        for i in range(3):  # the escalation is what got them going
            assert g.metrics(i).get(("kdsync_source_restarts_total", ()), 0) >= 1, _logs(g)
        stalls = [s for s in g.stalls() if "stage=fetch" not in s and not s.startswith("dc2:")]
        assert not stalls, stalls
    finally:
        g.close()


def test_plain_configs_on_durable_tansu_order_everything_through_an_outage_and_a_crash_restart(tmp_path):
    """The same plain configs through the two other faults of issue 41, with
    writers running in every cluster through each: a data-centre outage
    (dc3's broker and member killed -9 together; dc1 and dc2 keep ordering;
    then both started on their data) and a member crash-restart (dc1's member
    killed -9; dc2 and dc3 keep ordering; then started again: it resumes from
    its checkpoint and its global topic).  Records are also written before
    the members start (many small objects per partition).  Every
    acknowledged event ordered, once, identical everywhere; no global-topic
    read failed."""
    g = LocalGroup(3, tmp_path, durable=True, durable_tuning=False, metrics=True, expect_stalls=True,
                   tick_ms=20, heartbeat_ms=60, suspect_ms=1000, retransmit_ms=100)
    t0 = time.monotonic()
    try:
        g.start_brokers()
        text = g.config_text(0)
        assert "fetch.wait.max.ms" not in text and "linger" not in text, text
        total = Writers(g, 500, "pre", 200.0, linger_ms=0).join(300, strict=True)
        g.start_members()
        g.wait_ready(90)

        # a data-centre outage: dc3's broker and member down together; dc1 and dc2 (a majority) go on
        w = Writers(g, 300, "outage", 60.0, timeout=300)  # dc3's writes wait in their producer
        g.signal_member(2, signal.SIGKILL)
        g.clusters[2].kill()
        g.wait_member(2)
        got = g.wait_for(0, 5, members=[0])
        at = len(got["dc1"])
        got = g.wait_for(at + 150, 120, members=[0], poll=0.2)
        assert len(got["dc1"]) >= at + 150, "dc1 and dc2 stopped ordering while dc3 was down\n" + _logs(g)
        g.clusters[2].start()
        g.start_member(2)
        g.wait_ready(90, members=[2])
        total += w.join(400, strict=True)

        # a member crash-restart: dc1's member killed -9; dc2 and dc3 go on, dc1 resumes from its checkpoint
        w = Writers(g, 300, "crash", 60.0, timeout=300)  # dc1's records wait in its source topic
        g.signal_member(0, signal.SIGKILL)
        g.wait_member(0)
        at = len(g.wait_for(0, 5, members=[1])["dc2"])
        got = g.wait_for(at + 150, 120, members=[1], poll=0.2)
        assert len(got["dc2"]) >= at + 150, "dc2 and dc3 stopped ordering while dc1 was down\n" + _logs(g)
        g.start_member(0)
        g.wait_ready(90, members=[0])
        total += w.join(400, strict=True)
        _assert_everything_ordered(g, total)
        for i in range(3):
            assert g.procs[i] is not None and g.procs[i].poll() is None, f"{g.names[i]} exited\n" + _logs(g)
            failed = g.metrics(i).get(("kdsync_global_read_gaps_total", (("kind", "failed"),)), 0)
            assert failed == 0, _logs(g)
        print(f"\nplain configs on durable Tansu: {total} of {total} ordered through a data-centre outage and a "
              f"member kill -9, {time.monotonic() - t0:.0f} s")
    finally:
        g.close()
