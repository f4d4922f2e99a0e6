"""kdsync.stopping: a member's stop is timed step by step and bounded
([member] stop_timeout_ms).  Unit tests on a fake clock; the real process
(a member whose broker stops answering while it stops) is in
tests/test_member_group.py::test_a_stop_stuck_on_a_paused_broker_ends_within_stop_timeout."""

from __future__ import annotations

import logging
import signal
import threading

import pytest

import tomllib

from kdsync.config import ConfigError, config_from_dict
from kdsync.stopping import SLOW_STEP_S, StopClock


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_slow_step_is_logged_with_its_duration_a_quick_one_is_not(caplog):
    clock = FakeClock()
    sc = StopClock(30.0, exit=lambda code: None, clock=clock)
    caplog.set_level(logging.INFO, logger="kdsync.member")
    with sc.step("delivery reports"):
        clock.t += SLOW_STEP_S / 2
    with sc.step("final checkpoints and Kafka clients"):
        clock.t += 12.5
    assert sc.slow == [("final checkpoints and Kafka clients", 12.5)]
    slow = [r for r in caplog.records if r.getMessage() == "stop step slow"]
    assert len(slow) == 1 and slow[0].kv == {"step": "final checkpoints and Kafka clients", "seconds": 12.5}


def test_a_step_that_raises_is_still_timed_and_the_error_goes_on():
    clock = FakeClock()
    sc = StopClock(30.0, exit=lambda code: None, clock=clock)
    with pytest.raises(OSError):
        with sc.step("peer links"):
            clock.t += 3.0
            raise OSError("closed")
    assert sc.slow == [("peer links", 3.0)]


def test_expiry_names_the_step_dumps_every_stack_and_exits_1(capfd, caplog):
    clock = FakeClock()
    codes: list[int] = []
    sc = StopClock(20.0, exit=codes.append, clock=clock)
    sc._started = clock.t
    caplog.set_level(logging.INFO, logger="kdsync.member")
    with sc.step("source offsets commit and consumer close"):
        clock.t += 20.0
        sc.expire()  # what the timer thread calls at the deadline
    assert codes == [1]
    err = capfd.readouterr().err
    assert "the stop did not finish within 20 s (stuck in: source offsets commit and consumer close)" in err
    assert "Current thread" in err or "Thread 0x" in err  # faulthandler's dump of every thread
    rec = [r for r in caplog.records if r.getMessage() == "stop did not finish"]
    assert rec and rec[0].kv["step"] == "source offsets commit and consumer close" and rec[0].kv["waited_s"] == 20.0


def test_the_timer_fires_once_started_and_never_when_cancelled():
    fired = threading.Event()
    sc = StopClock(0.05, exit=lambda code: fired.set())
    sc.start()
    assert fired.wait(5), "the deadline passed without the clock ending the stop"
    sc.start()  # armed once: a second signal neither re-arms nor moves the deadline
    assert sc._timer is not None and not sc._timer.is_alive()
    quiet = threading.Event()
    sc2 = StopClock(0.05, exit=lambda code: quiet.set())
    sc2.start()
    sc2.cancel()
    assert not quiet.wait(0.3)


def _member_config(extra: str) -> str:
    return ("[member]\nid = \"a\"\nlisten = \"127.0.0.1:7001\"\n" + extra
            + "\n[peers]\na = \"127.0.0.1:7001\"\nb = \"127.0.0.1:7002\"\n\n[kafka]\n\"bootstrap.servers\" = \"127.0.0.1:9092\"\n\n"
              "[topics]\nsource = \"events\"\n")


def parse_config(text: str):
    return config_from_dict(tomllib.loads(text), base_dir=".")


def test_stop_timeout_ms_defaults_to_45_s_and_out_of_range_is_a_config_error():
    assert parse_config(_member_config("")).member.stop_timeout_ms == 45_000
    assert parse_config(_member_config("stop_timeout_ms = 5000\n")).member.stop_timeout_ms == 5000
    for bad in ("999", "3600001", "\"soon\""):
        with pytest.raises(ConfigError, match="stop_timeout_ms"):
            parse_config(_member_config(f"stop_timeout_ms = {bad}\n"))


def test_a_stop_signal_arriving_inside_wait_ends_the_wait_without_taking_a_lock(monkeypatch):
    """The supervisor's SIGTERM must end its loop whenever it lands.  A signal
    handler runs in the main thread between two bytecodes; the old handler
    set a threading.Event, and a signal landing while the main thread held
    that event's lock inside Event.wait hung the supervisor for ever (seen in
    CI).  Here the "signal" lands inside wait() itself, at its sleep."""
    import time as _time

    from kdsync.stopping import StopSignal

    stop = StopSignal()
    real_sleep = _time.sleep
    calls = []

    def sleep_then_signal(s):
        if threading.current_thread().name != "waiter":
            return real_sleep(s)  # another thread's sleep (the patch is on the time module): not counted
        calls.append(s)
        if len(calls) == 3:
            stop.handler(signal.SIGTERM)
        real_sleep(0)

    monkeypatch.setattr("kdsync.stopping.time.sleep", sleep_then_signal)
    done = []
    t = threading.Thread(target=lambda: done.append(stop.wait(30.0)), daemon=True, name="waiter")
    t.start()
    t.join(5.0)
    assert done == [True] and len(calls) == 3
    assert stop.signal == signal.SIGTERM and stop.is_set()


def test_a_real_sigterm_ends_a_stop_signal_wait_at_once_and_no_signal_times_out():
    import os
    import time as _time

    from kdsync.stopping import StopSignal

    stop = StopSignal()
    old = signal.getsignal(signal.SIGTERM)
    try:
        stop.install((signal.SIGTERM,))
        t0 = _time.monotonic()
        assert stop.wait(0.1) is False
        assert _time.monotonic() - t0 >= 0.1
        timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        assert stop.wait(30.0) is True
        assert _time.monotonic() - t0 < 5.0
        assert stop.signal == signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, old)
