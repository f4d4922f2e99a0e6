"""Reading a partition through a broker whose fetches stall (Tansu on S3):
kdsync.kafka.topic.iter_partition asks again with a new consumer, and gives
up only after six stalls in a row without a record; a consumer with a long
fetch wait is not called stalled before three of its waits have passed."""

from __future__ import annotations

import pytest

from kdsync.kafka import source, topic


class _Msg:
    def __init__(self, off: int):
        self._off = off

    def offset(self) -> int:
        return self._off


def _stalling_reader(script: list[int]):
    """read_to_eof stand-in: attempt k yields script[k] records from where it
    starts, then stalls; past the script it reads to the end (offset 30)."""
    calls = []

    def read(c, t, p, start, stop=None, **kw):
        k = len(calls)
        calls.append(start)
        n = script[k] if k < len(script) else 30 - start
        for off in range(start, min(start + n, 30)):
            yield _Msg(off)
        if k < len(script):
            raise topic.FetchStalledError("stalled")
        return 30

    return read, calls


@pytest.fixture
def fake_broker(monkeypatch):
    class C:
        def close(self):
            pass

    monkeypatch.setattr(topic, "partition_count", lambda conf, t, timeout=10.0: 1)
    monkeypatch.setattr(topic, "consumer", lambda conf, **kw: C())
    return monkeypatch


def test_a_read_that_progresses_between_stalls_goes_on_to_the_end(fake_broker):
    read, calls = _stalling_reader([2, 0, 3, 0, 0, 1, 0, 0, 0, 0, 0, 4])  # never six empty stalls in a row
    fake_broker.setattr(topic, "read_to_eof", read)
    got = [m.offset() for m in topic.iter_partition("x", "t")]
    assert got == list(range(30))
    assert calls[:3] == [0, 2, 2]  # each new consumer starts where the last one got


def test_six_stalls_in_a_row_without_a_record_give_up(fake_broker):
    read, calls = _stalling_reader([5, 0, 0, 0, 0, 0, 0, 9])
    fake_broker.setattr(topic, "read_to_eof", read)
    with pytest.raises(topic.FetchStalledError):
        list(topic.iter_partition("x", "t"))
    assert len(calls) == 7  # the productive attempt, then six empty ones


def test_a_long_fetch_wait_is_not_a_stall():
    sc = source.SourceConsumer.__new__(source.SourceConsumer)
    sc.stall_s = 2.0
    sc.conf = {"fetch.wait.max.ms": 500}
    assert sc._stall_after() == 2.0
    sc.conf["fetch.wait.max.ms"] = 5000
    assert sc._stall_after() == 15.0
