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
