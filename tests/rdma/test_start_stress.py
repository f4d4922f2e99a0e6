"""Member starts under stress, in the soft-RoCE guest (issue 44): RDMA
members started and stopped KDSYNC_STRESS_STARTS times (default 300), in
the ways a start meets its peers.  KDSYNC_STRESS_KIND says what a member is:
"transport" (the default: the member's transport start-up in a process of
its own, tests/rdma/stress_member.py -- make_transport("rdma") with a group
contract, start, links, messages, close on SIGTERM -- with another thread
allocating and collections far more frequent than a member's; about a
second a start under emulation) or "member" (real `kdsync run` members with
three Tansu clusters: the whole start-up, ten times the cost).  The patterns:

- together: all three members started at the same moment (each one's
  listener takes the others' connection requests while its own dialers
  connect), stopped once each has an RDMA link up to both peers;
- rejoin: one member of a running group killed (SIGKILL) or stopped
  (SIGTERM) and started again while its peers dial it;
- alone: one member started with no peer up (every connect refused), and
  stopped once it listens;
- busy: `together` while rping keeps rxe0 busy.

A start that ends in a signal we did not send (SIGSEGV, SIGABRT, SIGBUS, ...)
is a native crash: its log (faulthandler's stack of every thread: the
members run with PYTHONFAULTHANDLER=1) is copied to
$KDSYNC_VM_OUT/stress-crashes/, and the guest keeps its core
(infra/rdma-vm/guest-init.sh: ulimit -c, core_pattern, gdb's stacks in
artifacts/).  results.json's "stress" says how many starts, how many
crashes, how many other failures (a member that did not stop cleanly or
did not come up), per pattern.

Run: `make test-rdma-stress` (STARTS=N)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdsync.testing.local import LocalGroup

VENV_SITE = Path(__file__).resolve().parents[2] / ".venv" / "lib" / "python3.11" / "site-packages"
KIND = os.environ.get("KDSYNC_STRESS_KIND", "transport")
pytestmark = [pytest.mark.stress,
              pytest.mark.skipif(KIND == "member" and not (VENV_SITE / "confluent_kafka").is_dir(),
                                 reason=f"the project's virtualenv is not shared with the guest ({VENV_SITE})")]

STARTS = int(os.environ.get("KDSYNC_STRESS_STARTS", "300"))
HERE = Path(__file__).resolve().parent
UP_S = 30.0  # a start that shows no RDMA listener in this long failed
MEET_S = 15.0  # how long a start waits to meet its running peers (an RDMA link up, or a TCP fall-back decided)
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}


def _links(text: str) -> set[str]:
    return set(re.findall(r'peer (\S+): RDMA link up via rxe0', text))


class TransportGroup:
    """The members of KIND "transport": tests/rdma/stress_member.py processes (LocalGroup's
    interface, as much of it as the stress uses)."""

    def __init__(self, n: int, workdir: Path, addr: str, base_port: int) -> None:
        self.n, self.dir = n, workdir
        self.names = [f"dc{i + 1}" for i in range(n)]
        self.peers = {m: (addr, base_port + i) for i, m in enumerate(self.names)}
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.logs = [workdir / f"member-{m}.log" for m in self.names]

    def start_brokers(self) -> None:
        pass

    def start_member(self, i: int) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
        with open(self.logs[i], "ab") as log:
            self.procs[i] = subprocess.Popen([sys.executable, str(HERE / "stress_member.py"), self.names[i],
                                              json.dumps(self.peers)], stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self.procs[i]

    def log_text(self, i: int) -> str:
        try:
            return self.logs[i].read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


class Stress:
    def __init__(self, g: LocalGroup, out: Path | None) -> None:
        self.g = g
        self.out = out
        self.starts = 0
        self.crashes: list[dict] = []
        self.failures: list[str] = []
        self.by_pattern: dict[str, int] = {}
        self.lives = [0] * g.n
        self.killed: set[int] = set()  # members we sent SIGKILL: their -9 is ours
        self.slow = 0  # starts that met no running peer within MEET_S

    def start(self, i: int, pattern: str) -> None:
        g = self.g
        self.lives[i] += 1
        g.logs[i] = g.dir / f"member-{g.names[i]}-{self.lives[i]}.log"  # one log per life
        g.start_member(i)
        self.starts += 1
        self.by_pattern[pattern] = self.by_pattern.get(pattern, 0) + 1

    def _ended(self, i: int, rc: int, how: str) -> None:
        """Member i's process ended with rc; judge it, keep its log if it crashed."""
        g = self.g
        log = g.logs[i]
        if rc < 0 and -rc in CRASH_SIGNALS:
            name = signal.Signals(-rc).name
            tail = log.read_text(errors="replace")[-6000:] if log.exists() else ""
            self.crashes.append({"member": g.names[i], "life": self.lives[i], "signal": name, "start": self.starts,
                                 "log": log.name})
            if self.out is not None:
                dest = self.out / "stress-crashes"
                dest.mkdir(exist_ok=True)
                shutil.copy(log, dest / f"{len(self.crashes):03d}-{log.name}")
            print(f"NATIVE CRASH: {g.names[i]} life {self.lives[i]} {name} ({how})\n{tail}")
        elif rc < 0 and -rc == signal.SIGKILL and i in self.killed:
            pass
        elif rc < 0 and -rc == signal.SIGTERM and how.endswith("SIGTERM"):
            pass  # stopped before it installed its signal handlers (still importing): SIGTERM's default
        elif rc != 0:
            self._fail(f"{g.names[i]} life {self.lives[i]}: exit {rc} ({how})", log)
        elif log.exists() and log.stat().st_size < 2_000_000:
            log.unlink()  # a clean life: its log is not worth keeping
        self.killed.discard(i)

    def _fail(self, what: str, log: Path | None = None) -> None:
        self.failures.append(what)
        tail = log.read_text(errors="replace")[-1500:] if log is not None and log.exists() else ""
        print(f"FAILURE: {what}\n{tail}", flush=True)

    def check_running(self) -> None:
        """Any member that ended by itself since it started."""
        for i, p in enumerate(self.g.procs):
            if p is not None and p.poll() is not None:
                self.g.procs[i] = None
                self._ended(i, p.returncode, "ended by itself")

    def stop(self, i: int, sig: int = signal.SIGTERM) -> None:
        p = self.g.procs[i]
        if p is None:
            return
        if p.poll() is None:
            if sig == signal.SIGKILL:
                self.killed.add(i)
            p.send_signal(sig)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                self._fail(f"{self.g.names[i]} life {self.lives[i]}: did not stop in 30 s after {sig}", self.g.logs[i])
                self.killed.add(i)
                p.kill()
                p.wait()
        self.g.procs[i] = None
        self._ended(i, p.returncode, f"stopped with {signal.Signals(sig).name}")

    def wait_up(self, members: list[int], need_links: bool) -> None:
        """Until each member listens over RDMA and, with `need_links`, has met its running peers
        (an RDMA link up, or its dialer's TCP fall-back: a peer that was not up yet); not
        listening in UP_S is a failure, not meeting in MEET_S only counted."""
        g = self.g
        t0 = time.monotonic()
        waiting = set(members)
        while waiting and time.monotonic() - t0 < UP_S:
            self.check_running()
            for i in list(waiting):
                if g.procs[i] is None:
                    waiting.discard(i)  # ended: judged by check_running
                    continue
                text = g.log_text(i)
                if "transport rdma listening" not in text:
                    continue
                if not need_links or not any(g.procs[j] is not None for j in range(g.n) if j != i):
                    waiting.discard(i)
                elif _links(text) or "using TCP because" in text:
                    waiting.discard(i)
                elif time.monotonic() - t0 > MEET_S:
                    self.slow += 1
                    waiting.discard(i)
            time.sleep(0.1)
        for i in waiting:
            p = g.procs[i]
            if KIND == "transport" and p is not None and p.poll() is None:
                p.send_signal(signal.SIGUSR1)  # stress_member.py: faulthandler's stack of every thread, where it is
                time.sleep(1.0)
            self._fail(f"{g.names[i]} life {self.lives[i]}: not listening over RDMA in {UP_S:.0f} s", g.logs[i])


def _busy(addr: str) -> list[subprocess.Popen]:
    """rping server and client moving 64 KiB messages over rxe0 until killed."""
    srv = subprocess.Popen(["rping", "-s", "-a", addr, "-p", "7990", "-P"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    cli = subprocess.Popen(["rping", "-c", "-a", addr, "-p", "7990", "-S", "65536", "-C", "100000000"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [cli, srv]


def test_member_starts_stress(addr, ports, tmp_path, results):
    t0 = time.monotonic()
    out = Path(os.environ["KDSYNC_VM_OUT"]) if os.environ.get("KDSYNC_VM_OUT") else None
    if KIND == "member":
        g = LocalGroup(3, tmp_path, tick_ms=20, heartbeat_ms=200, suspect_ms=3000, retransmit_ms=200,
                       extra={"transport": {"kind": "rdma"}}, host=addr, expect_stalls=True)
    else:
        assert KIND == "transport", f"KDSYNC_STRESS_KIND={KIND!r}: transport or member"
        g = TransportGroup(3, tmp_path, addr, ports[0])
    s = Stress(g, out)
    busy: list[subprocess.Popen] = []
    cycle = 0
    try:
        g.start_brokers()
        while s.starts < STARTS:
            cycle += 1
            # together (every other cycle with rxe0 busy)
            pattern = "busy" if cycle % 2 == 0 else "together"
            if pattern == "busy":
                busy = _busy(addr)
            for i in range(g.n):
                s.start(i, pattern)
            s.wait_up(list(range(g.n)), need_links=True)
            for p in busy:
                p.kill()
                p.wait()
            busy = []
            # rejoin: each member in turn killed or stopped, and started while its peers dial it
            for i in range(g.n):
                if s.starts >= STARTS:
                    break
                s.stop(i, signal.SIGKILL if (cycle + i) % 2 else signal.SIGTERM)
                s.start(i, "rejoin")
                s.wait_up([i], need_links=True)
            for i in range(g.n):
                s.stop(i)
            # alone: no peer up, every connect refused
            if s.starts < STARTS:
                i = cycle % g.n
                s.start(i, "alone")
                s.wait_up([i], need_links=False)
                s.stop(i, signal.SIGTERM if cycle % 3 else signal.SIGKILL)
            print(f"stress cycle {cycle}: {s.starts} starts, {len(s.crashes)} native crashes, "
                  f"{len(s.failures)} other failures, {s.slow} slow to meet peers, {time.monotonic() - t0:.0f} s",
                  flush=True)
    finally:
        for p in busy:
            p.kill()
        for i in range(g.n):
            if g.procs[i] is not None:
                s.stop(i)
        g.close()
        seconds = time.monotonic() - t0
        results["stress"] = {"kind": KIND, "starts": s.starts, "native_crashes": len(s.crashes), "crashes": s.crashes,
                             "other_failures": len(s.failures), "failures": s.failures[:50],
                             "by_pattern": s.by_pattern, "cycles": cycle, "slow_to_meet_peers": s.slow, "seconds": round(seconds, 1),
                             "seconds_per_start": round(seconds / max(1, s.starts), 2)}
    assert not s.crashes, f"{len(s.crashes)} native crashes in {s.starts} starts: {s.crashes}"
    assert not s.failures, f"{len(s.failures)} failures in {s.starts} starts: {s.failures[:20]}"
