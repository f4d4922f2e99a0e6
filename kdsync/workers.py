"""Shards in processes: `kdsync run --config X [--workers W]` with `[topics] shards = K`.

Theory of operation
-------------------
With `[topics] shards = K > 1` each source topic is ordered by K independent
ordering groups (docs/shards.md).  Shard s is one `kdsync.member.Member` per
cluster, exactly the member of a single group, with the config
`Config.for_shard(s)`: it listens on the `listen` port + s, reaches peer j's
shard s on peer j's port + s, keeps its hard state in `state_dir/shard-s`,
consumes the source partitions p with p mod K = s and writes partition s of
the global topic.  Shards share nothing but the process that runs them, so a
shard's members fail over, restart and rejoin exactly as a single group does.

`run_shards(cfg, shards)` runs some shards in this process, on one asyncio
loop (a worker).  SIGINT/SIGTERM stop every shard cleanly; when one shard
stops with a fatal error the others are stopped too and the worker exits 1
(its supervisor restarts it, and every shard resumes from its global
partition and checkpoint, as a restarted member does).

`Supervisor` (``--workers W``) starts W worker processes, shard s in worker
s mod W among the shards this host serves (`[topics] serve_shards`), and
watches them: a worker that exits without being asked is restarted after a
backoff (0.5 s doubling to 10 s; back to 0.5 s once it ran 60 s), each restart
logged and counted (`kdsync_worker_restarts_total{worker}`).  A worker that
died `MAX_RESTARTS` times within `RESTART_WINDOW_S` is given up: the
supervisor stops the others and exits 1 with one line naming it.  SIGTERM or
SIGINT to the supervisor is passed on to every worker; it exits 0 when each
stopped cleanly.  Workers die with the supervisor (PR_SET_PDEATHSIG).

Metrics: with `[metrics] listen = HOST:PORT` the supervisor serves
`kdsync_worker_up{worker}` and `kdsync_worker_restarts_total{worker}` on
PORT, and worker w serves the metrics of its shards on PORT + 1 + w, each
sample with the label `shard`.  Without ``--workers`` (shards run in the
`kdsync run` process itself) the shards' metrics are served on PORT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from kdsync.config import Config
from kdsync.kafka.embedded import die_with_parent
from kdsync.observability.logs import kv
from kdsync.stopping import StopSignal

__all__ = ["MAX_RESTARTS", "RESTART_WINDOW_S", "ShardMetrics", "Supervisor", "assign_shards", "run_shards"]

log = logging.getLogger("kdsync.workers")

MAX_RESTARTS = 5  # deaths of one worker within RESTART_WINDOW_S before the supervisor gives up
RESTART_WINDOW_S = 60.0
BACKOFF_FIRST_S, BACKOFF_MAX_S, BACKOFF_RESET_S = 0.5, 10.0, 60.0
STOP_MARGIN_S = 5.0  # a worker ends itself within [member] stop_timeout_ms (kdsync.stopping); SIGKILL past that and this


def assign_shards(shards: list[int], workers: int) -> list[list[int]]:
    """The shards of each worker: the i-th served shard goes to worker i mod W
    (W is capped at the number of shards; no worker runs nothing)."""
    w = max(1, min(workers, len(shards)))
    return [shards[i::w] for i in range(w)]


# ---------------------------------------------------------------- metrics
class ShardMetrics:
    """A Prometheus collector exposing the registries of several shards'
    members, each sample with the label ``shard``."""

    def __init__(self, members: dict[int, object]):
        self.members = members  # shard -> Member (its .metrics is set once it runs)

    def collect(self):
        from prometheus_client.metrics_core import Metric

        merged: dict[str, Metric] = {}
        for s, m in sorted(self.members.items()):
            mm = getattr(m, "metrics", None)
            if mm is None:
                continue
            for fam in mm.registry.collect():
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for smp in fam.samples:
                    out.add_sample(smp.name, {**smp.labels, "shard": str(s)}, smp.value, smp.timestamp,
                                   smp.exemplar)
        yield from merged.values()


def _serve_metrics(listen: tuple[str, int], collector) -> object:
    from prometheus_client import CollectorRegistry, start_http_server

    reg = CollectorRegistry()
    reg.register(collector)
    server, _ = start_http_server(listen[1], addr=listen[0], registry=reg)
    return server


# ---------------------------------------------------------------- one worker
async def _run_shards(cfg: Config, shards: list[int], metrics_listen: tuple[str, int] | None,
                      trace_latency: str | None = None) -> int:
    from kdsync.fatal import FatalError
    from kdsync.member import Member

    loop = asyncio.get_running_loop()
    members = {s: Member(cfg.for_shard(s), shard=s, signals=False, trace_latency=trace_latency) for s in shards}
    stopping = asyncio.Event()

    def stop_all(sig=None) -> None:
        if sig is not None and not stopping.is_set():
            log.info("stopping", **kv(signal=signal.Signals(sig).name, shards=",".join(map(str, shards))))
        stopping.set()
        for m in members.values():
            m.stop(deadline=sig is not None)  # a signal: the process must end within stop_timeout_ms

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_all, sig)
    server = None
    if metrics_listen is not None:
        try:
            server = _serve_metrics(metrics_listen, ShardMetrics(members))
        except OSError as e:
            raise FatalError(f"metrics.listen: cannot listen on {metrics_listen[0]}:{metrics_listen[1]}: "
                             f"{e.strerror}") from None

    async def one(s: int, m) -> int:
        try:
            rc = await m.run()
        except FatalError as e:
            print(f"kdsync run: shard {s}: {e}", file=sys.stderr)
            rc = 1
        if rc != 0 and not stopping.is_set():  # one shard failed: the worker stops and is restarted whole
            log.error("shard stopped with an error; stopping the worker's other shards", **kv(shard=s, exit=rc))
            stop_all()
        return rc

    try:
        codes = await asyncio.gather(*(one(s, m) for s, m in members.items()))
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    return max(codes, default=0)


def run_shards(cfg: Config, shards: list[int], metrics_listen: tuple[str, int] | None = None,
               trace_latency: str | None = None) -> int:
    """Run the members of `shards` (K > 1) in this process until SIGINT/SIGTERM
    or a fatal error of one of them; return the exit code (0 clean, 1 fatal).
    `metrics_listen`: serve their metrics (label `shard`) there;
    `trace_latency`: shard S appends its latency trace to FILE.shard-S."""
    try:
        from kdsync.eventloop import run as run_loop

        return run_loop(_run_shards(cfg, shards, metrics_listen, trace_latency), cfg.member.coalesce_us)
    except KeyboardInterrupt:
        return 0


# ---------------------------------------------------------------- the supervisor
@dataclass
class _Worker:
    index: int
    shards: list[int]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    deaths: list[float] = field(default_factory=list)
    backoff: float = BACKOFF_FIRST_S
    restart_at: float | None = None
    restarts: int = 0


class Supervisor:
    """Runs the served shards of `cfg` in `workers` processes (module doc).
    `run()` returns the exit code."""

    def __init__(self, cfg: Config, config_path: str, workers: int, log_level: str | None = None,
                 trace_latency: str | None = None):
        self.cfg = cfg
        self.config_path = os.path.abspath(config_path)
        self.log_level = log_level
        self.trace_latency = os.path.abspath(trace_latency) if trace_latency else None
        groups = assign_shards(cfg.served_shards(), workers) if cfg.shards() > 1 else [[]]
        self.workers = [_Worker(i, g) for i, g in enumerate(groups)]
        self._stop = StopSignal()
        self.metrics_listen = None
        if cfg.metrics.listen:
            from kdsync.config import parse_address

            self.metrics_listen = parse_address(cfg.metrics.listen)

    # ------------------------------------------------------------ workers
    def _argv(self, w: _Worker) -> list[str]:
        argv = [sys.executable, "-m", "kdsync.workers", "--config", self.config_path, "--worker", str(w.index)]
        if w.shards:
            argv += ["--shards", ",".join(map(str, w.shards))]
        if self.log_level:
            argv += ["--log-level", self.log_level]
        if self.trace_latency:
            argv += ["--trace-latency", self.trace_latency]
        if self.metrics_listen is not None:
            argv += ["--metrics", f"{self.metrics_listen[0]}:{self.metrics_listen[1] + 1 + w.index}"]
        return argv

    def _start(self, w: _Worker) -> None:
        w.proc = subprocess.Popen(self._argv(w), stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        w.started = time.monotonic()
        w.restart_at = None
        log.info("worker started", **kv(worker=w.index, pid=w.proc.pid, shards=",".join(map(str, w.shards)) or "-"))

    def _on_exit(self, w: _Worker, rc: int) -> str | None:
        """A worker exited unasked: schedule its restart; return the one line
        to stop with when it keeps dying."""
        now = time.monotonic()
        ran = now - w.started
        w.proc = None
        w.deaths = [t for t in w.deaths if now - t < RESTART_WINDOW_S] + [now]
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
        if len(w.deaths) >= MAX_RESTARTS:
            return (f"worker {w.index} (shards {','.join(map(str, w.shards)) or '-'}) died {len(w.deaths)} times "
                    f"within {RESTART_WINDOW_S:.0f} s (last: {how}); see its log lines above")
        if ran > BACKOFF_RESET_S:
            w.backoff = BACKOFF_FIRST_S
        w.restart_at = now + w.backoff
        log.warning("worker died; restarting it", **kv(worker=w.index, shards=",".join(map(str, w.shards)) or "-",
                                                       how=how, ran_s=f"{ran:.1f}", restart_in=f"{w.backoff:.1f}s"))
        w.backoff = min(w.backoff * 2, BACKOFF_MAX_S)
        return None

    # ------------------------------------------------------------ run
    def run(self) -> int:
        """Start the workers, watch them until SIGINT/SIGTERM (exit 0 when
        every worker stopped cleanly) or one keeps dying (exit 1)."""
        from kdsync.fatal import FatalError
        from kdsync.state import StateDirLock

        lock = StateDirLock(self.cfg.state_path(), "supervisor.lock")  # one supervisor per state directory
        try:
            lock.acquire()
        except FatalError as e:
            print(f"kdsync run: {e}", file=sys.stderr)
            return 1
        self._stop.install()
        restarts = up = server = None
        if self.metrics_listen is not None:
            from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

            reg = CollectorRegistry()
            restarts = Counter("kdsync_worker_restarts", "workers restarted after they died", ["worker"],
                               registry=reg)
            up = Gauge("kdsync_worker_up", "1 while the worker process runs", ["worker"], registry=reg)
            try:
                server, _ = start_http_server(self.metrics_listen[1], addr=self.metrics_listen[0], registry=reg)
            except OSError as e:
                print(f"kdsync run: metrics.listen: cannot listen on {self.cfg.metrics.listen}: {e.strerror}",
                      file=sys.stderr)
                return 1
            for w in self.workers:
                restarts.labels(str(w.index))
        log.info("supervisor started", **kv(workers=len(self.workers), shards=self.cfg.shards(),
                                            served=",".join(map(str, self.cfg.served_shards()))))
        failure: str | None = None
        try:
            for w in self.workers:
                self._start(w)
            while not self._stop.is_set() and failure is None:
                now = time.monotonic()
                for w in self.workers:
                    if w.proc is not None:
                        rc = w.proc.poll()
                        if rc is not None:
                            failure = self._on_exit(w, rc)
                            if failure:
                                break
                    elif w.restart_at is not None and now >= w.restart_at:
                        self._start(w)
                        w.restarts += 1
                        if restarts is not None:
                            restarts.labels(str(w.index)).inc()
                    if up is not None:
                        up.labels(str(w.index)).set(1 if w.proc is not None else 0)
                self._stop.wait(0.1)
        finally:
            clean = self._stop_workers()
            if server is not None:
                server.shutdown()
                server.server_close()
        if failure:
            log.error(failure, **kv(fatal=True))
            print(f"kdsync run: {failure}", file=sys.stderr)
            return 1
        log.info("supervisor stopped", **kv(clean=clean,
                                            signal=signal.Signals(self._stop.signal).name if self._stop.signal else "-"))
        return 0 if clean else 1

    def _stop_workers(self) -> bool:
        """SIGTERM to every running worker, then wait (SIGKILL after its
        own stop deadline and STOP_MARGIN_S); True when each exited 0."""
        running = [w for w in self.workers if w.proc is not None]
        for w in running:
            w.proc.send_signal(signal.SIGTERM)
        clean = True
        deadline = time.monotonic() + self.cfg.member.stop_timeout_ms / 1000.0 + STOP_MARGIN_S
        for w in running:
            try:
                rc = w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker did not stop; killing it", **kv(worker=w.index))
                w.proc.kill()
                rc = w.proc.wait()
            if rc != 0:
                clean = False
                log.warning("worker stopped with an error", **kv(worker=w.index, exit=rc))
        return clean


# ---------------------------------------------------------------- worker entry point (internal)
def main(argv: list[str] | None = None) -> int:
    """``python -m kdsync.workers --config X --worker W [--shards 0,2]``: one
    worker of a Supervisor (not a user command)."""
    from kdsync.config import ConfigError, load_config, parse_address
    from kdsync.fatal import FatalError
    from kdsync.observability.logs import setup_logging

    ap = argparse.ArgumentParser(prog="kdsync-worker")
    ap.add_argument("--config", required=True)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--shards", default="")
    ap.add_argument("--log-level")
    ap.add_argument("--metrics")
    ap.add_argument("--trace-latency")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    setup_logging(f"{cfg.member.id}/w{a.worker}", cfg.log.format, a.log_level or cfg.log.level)
    metrics = parse_address(a.metrics) if a.metrics else None
    try:
        if not a.shards:  # shards = 1: the one member, restarted by its supervisor
            from kdsync.member import Member

            if metrics is not None:
                cfg = cfg.model_copy(update={"metrics": cfg.metrics.model_copy(
                    update={"listen": f"{metrics[0]}:{metrics[1]}"})})
            from kdsync.eventloop import run as run_loop

            return run_loop(Member(cfg, trace_latency=a.trace_latency).run(), cfg.member.coalesce_us)
        return run_shards(cfg, [int(x) for x in a.shards.split(",")], metrics, a.trace_latency)
    except FatalError as e:
        print(f"kdsync run: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
