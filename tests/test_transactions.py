"""The start-up probe of kdsync.kafka.transactions on real brokers: Tansu 0.6
shows aborted records to read_committed readers, noida hides them, and a
cluster that cannot be asked is a WARNING (the guard then checks batches).
The member's hold and the switch: tests/test_fidelity.py."""

from __future__ import annotations

import logging
import time

import pytest

from kdsync.kafka.embedded import EmbeddedCluster, free_port
from kdsync.kafka.gaps import GapLook
from kdsync.kafka.transactions import PROBE_TOPIC, TxnGuard, probe

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("broker, verdict", [("tansu", "shows"), ("noida", "hides")])
def test_the_probe_tells_a_broker_that_shows_aborted_records(tmp_path, broker, verdict):
    with EmbeddedCluster("tx", log_dir=tmp_path, broker=broker) as c:
        r = probe({"bootstrap.servers": c.bootstrap}, "probe-test")
        assert (r.verdict, r.broker) == (verdict, c.bootstrap), r
        assert r.seconds < 5
        again = probe({"bootstrap.servers": c.bootstrap}, "probe-test")  # a restart: the same answer
        assert again.verdict == verdict, again


def test_a_probe_that_cannot_be_made_is_one_warning_and_the_batches_are_checked(caplog):
    conf = {"bootstrap.servers": f"127.0.0.1:{free_port()}", "socket.connection.setup.timeout.ms": 1000}
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="kdsync.source"):
        g = TxnGuard(conf, GapLook(conf), "probe-test")
        r = g.start()
    assert r.verdict == "failed" and g.on and time.monotonic() - t0 < 15, r
    lines = [x for x in caplog.records if x.name == "kdsync.source"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [x.getMessage() for x in lines]
    assert "transaction probe failed" in lines[0].getMessage()
    assert "trust_read_committed = true" in lines[0].getMessage()
    assert PROBE_TOPIC.startswith("__")  # never taken for a source topic (TopicsSection.matches)


def test_a_failed_look_is_a_stall_only_while_it_keeps_failing(caplog, monkeypatch):
    """A look that failed once is tried again with the partition's next fetch;
    a fetch that lasts (durable Tansu: seconds) is no stall of the look, a look
    that keeps failing for STALL_S is one line, once."""
    from kdsync.kafka import transactions

    clock = [100.0]
    monkeypatch.setattr(transactions.time, "monotonic", lambda: clock[0])
    conf = {"bootstrap.servers": f"127.0.0.1:{free_port()}"}
    g = TxnGuard(conf, GapLook(conf), "probe-test")
    tp = ("src", 0)
    stalls = lambda: [x for x in caplog.records if "cannot be read" in x.getMessage()]  # noqa: E731
    with caplog.at_level(logging.INFO, logger="kdsync.source"):
        g._failed(tp, 7, "timed out")
        assert g.stopped(tp) and g.due(clock[0]) == []
        clock[0] += 1.0
        assert g.due(clock[0]) == [(tp, 7)] and not g.stopped(tp)  # handed back to the consumer's fetch
        clock[0] += transactions.STALL_S * 3  # the fetch carrying the retry takes long
        assert g.due(clock[0]) == [] and stalls() == []
        g._failed(tp, 7, "timed out")  # the look fails again, long after the first failure
        assert g.due(clock[0]) == [] and len(stalls()) == 1
        assert (stalls()[0].kv["offset"], stalls()[0].kv["tries"]) == (7, 2)
        clock[0] += 5.0
        g.due(clock[0])
        g._failed(tp, 7, "timed out")
        g.due(clock[0])
        assert len(stalls()) == 1  # once per held offset
