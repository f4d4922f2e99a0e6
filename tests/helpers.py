"""Shared helpers of the tests: a stand-in for a confluent_kafka Message (the
unit tests of the member's parts), and for the tests that run real `kdsync
run` members on real brokers (tests/test_member_*.py,
tests/test_topic_settings.py): waiting for a condition, writing to clusters at
once, a member killed -9 mid-stream, checking agreement with the members'
logs at hand, one-member configs and the command that runs a member."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from kdsync.kafka.embedded import free_port
from kdsync.testing.local import LocalGroup, check_global_topics, read_global, write_events


class FakeMessage:
    """The read-only face of a confluent_kafka Message: key(), value(),
    headers(), topic(), partition(), offset(), timestamp() and error() return
    what it was made with."""

    def __init__(self, key=None, value=b"v", headers=None, topic="t", partition=0, offset=0, ts=(1, 1234),
                 error=None):
        fields = {"key": key, "value": value, "headers": headers, "topic": topic, "partition": partition,
                  "offset": offset, "timestamp": ts, "error": error}
        for name, v in fields.items():
            setattr(self, name, _returns(v))


def _returns(v):
    return lambda: v


# ---------------------------------------------------------------- real members, real brokers
def wait_until(cond, timeout: float, what: str, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def write_in_parallel(writes) -> None:
    """`write_events(*args)` for each args tuple, each in its own thread, all at
    once; fails in the calling thread with the writers' errors."""
    errors: list[Exception] = []

    def w(args):
        try:
            write_events(*args)
        except Exception as e:  # re-raised in the test thread below
            errors.append(e)

    ts = [threading.Thread(target=w, args=(args,)) for args in writes]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


def write_all(g: LocalGroup, n: int, tag: str, rate: float | None = None, idx=None) -> int:
    """n events (tag f"{tag}-{name}") to the source topic of each cluster in idx (all by default), at once;
    returns how many were written in all."""
    idx = list(range(g.n)) if idx is None else list(idx)
    write_in_parallel([(g.bootstrap(i), g.topic, n, f"{tag}-{g.names[i]}", rate) for i in idx])
    return n * len(idx)


def kill_9(g: LocalGroup, i: int) -> None:
    """kill -9 member i and check that this is what ended it (a crash, not a clean stop)."""
    g.signal_member(i, signal.SIGKILL)
    assert g.wait_member(i) == -signal.SIGKILL


def kill_9_mid_stream(g: LocalGroup, i: int, n: int, tag: str, rate: float, seen: int,
                      timeout: float) -> threading.Thread:
    """Start writing n events into every cluster at `rate` events/s each
    (write_all, `tag`) in a thread; once member i's cluster's global topic
    holds more than `seen` records, kill -9 member i.  Returns the writer
    thread, still writing: the caller restarts the member, then joins it."""
    writers = threading.Thread(target=write_all, args=(g, n, tag, rate))
    writers.start()
    wait_until(lambda: len(read_global(g.bootstrap(i), g.global_topic)) > seen, timeout,
               f"{g.names[i]} to write some events")
    kill_9(g, i)
    return writers


def member_logs(g: LocalGroup) -> str:
    """The last 25 lines of each member's log."""
    return "\n".join(f"--- {n}\n" + "\n".join(g.log_text(i).splitlines()[-25:]) for i, n in enumerate(g.names))


def assert_agree(g: LocalGroup, expected: int, timeout: float = 60.0, members=None):
    got = g.wait_for(expected, timeout, members=members)
    ok, detail = check_global_topics(got, expected=expected)
    assert ok, detail + "\n" + member_logs(g)
    return got


def member_command(cfg) -> list[str]:
    """`kdsync run --config cfg`, run by this Python."""
    return [sys.executable, "-m", "kdsync.cli", "run", "--config", str(cfg)]


def solo_config(path: Path, bootstrap: str, source: str, extra: str = "", state_dir: Path | None = None) -> Path:
    """Write the config of a one-member group (member "solo" on a free port)
    reading `source` at `bootstrap` to `path`, with `extra` TOML after its
    [topics] line; state in path's folder/state unless told."""
    listen = f"127.0.0.1:{free_port()}"
    path.write_text(textwrap.dedent(f"""\
        state_dir = "{path.parent / 'state' if state_dir is None else state_dir}"
        [member]
        id = "solo"
        listen = "{listen}"
        [peers]
        solo = "{listen}"
        [kafka]
        "bootstrap.servers" = "{bootstrap}"
        [topics]
        source = "{source}"
        """) + textwrap.dedent(extra))
    return path


def refused_start(cfg, timeout: float) -> tuple[str, str]:
    """Run a member that must refuse to start: exit 1, no traceback.  Returns
    (the last line on its stderr, all of its stderr)."""
    r = subprocess.run(member_command(cfg), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    return r.stderr.strip().splitlines()[-1], r.stderr
