"""bench.geo_faults' windows: which events count for a fault (created in the
AFTER_S after it, neither from nor at the faulted region) and the steady p99."""

from bench.geo_faults import AFTER_S, FAULTS, STEADY, _windows


def test_a_faults_window_counts_the_live_regions_events_created_after_it():
    (crash, who, _, at, back), (stop, who2, _, at2, _) = FAULTS
    live = "fra" if "fra" not in (who, who2) else "ie"
    samples = [(STEADY[0] + 0.5, live, live, 100.0),
               (at + 0.1, live, live, 2500.0),  # counts for the crash
               (at + 0.2, who, live, 9000.0),  # from the crashed region: not counted
               (at + 0.3, live, who, 8000.0),  # at the crashed region: not counted
               (at + AFTER_S + 0.1, live, live, 7000.0),  # after the window
               (back + 0.1, live, live, 600.0),  # the return
               (at2 + 1.0, live, live, 900.0)]
    w = _windows(samples)
    assert w["steady_p99_ms"] == 100.0
    assert w[f"{crash}_worst_ms"] == 2500.0
    assert w[f"{crash}_return_worst_ms"] == 600.0
    assert w[f"{stop}_worst_ms"] == 900.0
    assert w[f"{stop}_return_worst_ms"] is None
