"""The nemesis suite (kdsync.testing.nemesis): its schedule is the seed's alone,
and one short seed runs for real — durable clusters, members behind fault
proxies, every kind of fault — with no anomaly."""

import pytest

from kdsync.testing.nemesis import FAULTS, Fault, run, schedule


def test_the_schedule_is_drawn_from_the_seed_alone():
    a, b = schedule(7, 600), schedule(7, 600)
    assert a == b and a != schedule(8, 600)
    assert {f.kind for f in a} == set(FAULTS)  # ten minutes draw every kind
    for f in a:
        assert isinstance(f, Fault) and 2.0 <= f.duration <= 8.0 and 1.0 <= f.gap <= 4.0
        assert len(set(f.targets)) == len(f.targets) and all(0 <= t < 3 for t in f.targets)
        if f.kind in ("kill_majority", "cut_link"):
            assert len(f.targets) == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed,minutes,protocol,delay_ms,faults", [
    # every kind of fault in one minute, one rolling restart (seed 3's 1.5 minutes drew three and no cut link:
    # 340-380 s of CI for fewer kinds)
    (937, 1.0, "derecho", 0.0, 10),
    # the WAN protocol with regions 20 ms apart (a delay proxy behind every fault proxy): kill -9 (twice),
    # a black-holed member and link, a paused member, a broker killed and restarted
    (2, 0.67, "clock", 20.0, 6),
])
def test_a_short_seed_on_durable_clusters_has_no_anomaly(tmp_path, seed, minutes, protocol, delay_ms, faults):
    report = run(seed=seed, minutes=minutes, workdir=tmp_path, log=print, protocol=protocol, delay_ms=delay_ms)
    print("\n".join(report.lines()))
    assert report.anomalies == []
    assert report.protocol == protocol and report.delay_ms == delay_ms
    assert sum(report.faults.values()) >= faults and report.converge_s is not None
    assert report.in_sources >= 0.95 * report.acknowledged > 0
    assert all(n == report.in_sources for n in report.ordered.values())
