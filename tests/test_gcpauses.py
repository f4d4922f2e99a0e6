"""kdsync.observability.gcpauses: `kdsync run` freezes its long-lived
objects after start-up and reports its longest collection; members run
inside another process (tests) leave its collector alone."""

import gc

from kdsync.observability import gcpauses


def test_the_longest_collection_is_measured_and_taken_once():
    p = gcpauses.GcPauses()
    try:
        junk = [[] for _ in range(200_000)]  # tracked objects for a full collection to walk
        gc.collect()
        worst = p.take()
        assert worst > 0
        assert p.take() == 0.0  # taken: reset
        del junk
    finally:
        p.close()
    assert p._on_gc not in gc.callbacks


def test_freeze_only_in_a_process_tuned_for_a_member(monkeypatch):
    before = gc.get_threshold()
    monkeypatch.setattr(gcpauses, "_tuned", False)
    frozen = gc.get_freeze_count()
    gcpauses.freeze()
    assert gc.get_freeze_count() == frozen  # a test process: untouched
    try:
        gcpauses.tune()
        assert gc.get_threshold() == gcpauses.THRESHOLDS
        keep = [{} for _ in range(1000)]
        gcpauses.freeze()
        assert gc.get_freeze_count() >= frozen + len(keep)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
        monkeypatch.setattr(gcpauses, "_tuned", False)
