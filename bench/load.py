"""Paced load on real processes: what one `kdsync run` member costs and adds.

    python -m bench.load --protocol derecho --rate 1000 --duration 5 [--backlog 3000] [--idle 3] [--coalesce-us 2000] [--json]

The runner is kdsync.testing.load.run_load (its docstring says what it
measures and how); this is its command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import get_args

from kdsync.core.types import ProtocolName
from kdsync.testing.load import run_load

__all__ = ["main", "run_load"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--protocol", default="derecho", choices=list(get_args(ProtocolName)))
    p.add_argument("--rate", type=float, default=1000.0, help="total events/s over every cluster")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of paced load")
    p.add_argument("--clusters", type=int, default=3)
    p.add_argument("--partitions", type=int, default=2, help="source topic partitions")
    p.add_argument("--backlog", type=int, default=0, help="events per cluster written before the members start (drain)")
    p.add_argument("--idle", type=float, default=0.0, help="seconds of idle CPU measurement after the load")
    p.add_argument("--fast-timing", action="store_true", help="the demo's fast tick/heartbeat instead of the defaults")
    p.add_argument("--coalesce-us", type=int, default=0, help="[member] coalesce_us of every member (docs/config.md)")
    p.add_argument("--keep", metavar="DIR", help="keep configs and member logs in DIR")
    p.add_argument("--json", action="store_true", help="one JSON line instead of a summary")
    a = p.parse_args(argv)
    timing = dict(tick_ms=5, heartbeat_ms=20, suspect_ms=300, retransmit_ms=30) if a.fast_timing else None
    r = run_load(a.protocol, a.rate, a.duration, clusters=a.clusters, partitions=a.partitions, workdir=a.keep,
                 backlog=a.backlog, idle_s=a.idle, timing=timing,
                 extra={"member": {"coalesce_us": a.coalesce_us}} if a.coalesce_us else None)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{a.protocol} at {a.rate:g} events/s for {a.duration:g} s ({r['events']} events, load avg {r['loadavg_1m']})")
    print(f"  latency  p50 {r['p50_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms   "
          f"floor p50 {r.get('floor_p50_ms', float('nan')):.1f} ms  p99 {r.get('floor_p99_ms', float('nan')):.1f} ms")
    print(f"  member   {r['cpu_us_per_event']:.0f} µs CPU per ordered event {r['cpu_us_per_event_by_member']}, "
          f"{r['member_cpu_pct']:.0f} % of a core, {r['frames_out_per_event']:.2f} frames out per event")
    if "drain_eps" in r:
        print(f"  drain    {r['drain_eps']:.0f} events/s ({a.backlog} per cluster)")
    if "idle_cpu_pct" in r:
        print(f"  idle     {r['idle_cpu_pct']:.2f} % of a core {r['idle_cpu_pct_by_member']}")
    if "agreement" in r:
        print(f"  agree    {'yes' if r['agreement'] else 'NO'}: {r['agreement_detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
