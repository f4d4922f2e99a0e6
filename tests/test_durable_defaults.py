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
acknowledged event must be ordered, once, the same everywhere.
"""

from __future__ import annotations

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
        src = g.read_sources(timeout=60)
        present = sum(len(v) for v in src.values())
        assert present == total, f"{present} source records for {total} acknowledged\n" + _logs(g)
        got = g.wait_for(total, 300, poll=1)
        ok, detail = check_global_topics(got, expected=total)
        assert ok, detail + "\n" + _logs(g)
        keys = {k for v in src.values() for (_, _, k) in v}
        assert {r.key for r in got["dc1"]} == keys
        for i in range(3):  # the escalation is what got them going
            assert g.metrics(i).get(("kdsync_source_restarts_total", ()), 0) >= 1, _logs(g)
        stalls = [s for s in g.stalls() if "stage=fetch" not in s and not s.startswith("dc2:")]
        assert not stalls, stalls
    finally:
        g.close()
