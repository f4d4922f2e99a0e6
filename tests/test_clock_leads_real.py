"""Issue 42, no hand tuning, on real processes: three Tansu clusters and three
`kdsync run` members on `clock` with no lead configured; every link of the
far member dc3 goes through a delay proxy (40 ms each way), dc1 and dc2 are
1 ms apart.  dc3 measures its delays and chooses a lead by docs/wan.md's rule
(capped at 3/4 of its nearest delay: about 30 ms), dc1 and dc2 choose none
(or a few ms on a loaded box, under 3/4 of their nearest delay as measured);
`kdsync status` shows the measured delays and the leads; every cluster holds
the same sequence, exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kdsync.core.leads import NEAR_FRACTION
from kdsync.testing.delay_proxy import start_proxies, stop_proxies
from kdsync.kafka.topic import ensure_topic
from kdsync.testing.load import PacedWriters
from kdsync.testing.local import LocalGroup, check_global_topics
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(600)

FAR_MS = 40.0


def status(g: LocalGroup, i: int) -> dict:
    r = subprocess.run([sys.executable, "-m", "kdsync.cli", "status", "--config", str(g.config_path(i)), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return json.loads(r.stdout)["members"][0] if r.stdout.strip() else {}


def lead_ms(g: LocalGroup, i: int) -> float | None:
    topics = status(g, i).get("topics") or [{}]
    return topics[0].get("lead_ms")


def test_a_far_member_chooses_its_lead_and_status_shows_it(tmp_path: Path):
    names = ["dc1", "dc2", "dc3"]
    proxies: dict[tuple[int, int], str] = {}
    g = LocalGroup(3, tmp_path, protocol="clock", names=names, metrics=True,
                   peer_address=lambda i, j: proxies[(i, j)])
    proxy = None
    try:
        with g:
            links = [(i, j) for i in range(3) for j in range(3) if i != j]
            delay = {link: FAR_MS if 2 in link else 1.0 for link in links}
            proxy, ports = start_proxies(0, [f"{g.ports[j]}:{delay[(i, j)]}" for i, j in links])
            proxies.update({link: f"127.0.0.1:{port}" for link, port in zip(links, ports)})
            for c in g.clusters:
                c.start()
            for i in range(3):
                ensure_topic(g.bootstrap(i), g.topic, 2)
                g.start_member(i)  # no clock_lead_ms: chosen
            g.wait_ready(timeout=120)
            per = 400
            w = PacedWriters([g.bootstrap(i) for i in range(3)], g.topic, per, "p", 150.0)
            w.warm()
            w.go()
            wait_until(lambda: (lead_ms(g, 2) or 0) >= 20, 60, "dc3 to choose a lead of 20 ms or more")
            w.join()
            total = 3 * per + 3  # and each cluster's warm-up record
            got = g.wait_for(total, 120)
            ok, detail = check_global_topics(got, expected=total)
            assert ok, detail
            near = [status(g, i) for i in range(2)]
            leads = [(near[i].get("topics") or [{}])[0].get("lead_ms") for i in range(2)] + [lead_ms(g, 2)]
            for i in range(2):  # near members: the rule's gap is ~0, and the clamp holds it under 3/4 of their
                # nearest delay as measured (a loaded CI box measured dc1-dc2 at up to ~7 ms: dc2 chose 5.6 once)
                measured = [p["one_way_ms"] for p in near[i]["peers"] if p.get("one_way_ms") is not None]
                nearest = min(measured, default=0.0)
                assert leads[i] <= NEAR_FRACTION * nearest + 1 and leads[i] < leads[2] / 3, (leads, nearest)
            far = status(g, 2)
            one_way = {p["peer"]: p["one_way_ms"] for p in far["peers"]}
            assert all(FAR_MS - 5 <= one_way[p] <= FAR_MS + 30 for p in ("dc1", "dc2")), one_way
            # 3/4 of its nearest delay at most: the delay it measured (a loaded box measures 40 ms as up to
            # 47: CI chose 35.1 once), never less than the proxies' own
            cap = NEAR_FRACTION * max(FAR_MS, min(one_way[p] for p in ("dc1", "dc2")))
            assert 20 <= leads[2] <= cap + 5, (leads, one_way)
            text = subprocess.run([sys.executable, "-m", "kdsync.cli", "status", "--config", str(g.config_path(2))],
                                  capture_output=True, text=True, timeout=60).stdout
            print(f"leads {leads}; dc3 one-way {one_way}\n{text}")
            assert "one-way" in text and "lead" in text, text
    finally:
        if proxy is not None:
            stop_proxies(proxy, {})
