"""`kdsync-sim`: run one scenario, or a swarm of seeded random ones.

    kdsync-sim run SCENARIO.yaml [--seed N] [--out DIR]
    kdsync-sim swarm --seeds N [--first S] [--protocol P] [--out DIR] [--master URL | --local]

Exit codes: 0 every invariant holds, 1 a violation (each one printed with a
`repro:` line), 2 a bad scenario or bad arguments (one line naming what to fix).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sim.scenario import ScenarioError, load_scenario
from sim.swarm import member_states as _states


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (not argparse's usage dump)
        raise _UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kdsync-sim", description="SimPy simulator that runs the kdsync ordering core through faults.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    r = sub.add_parser("run", help="run one scenario file")
    r.add_argument("scenario", help="scenario YAML file (see shared/specs/scenario.md)")
    r.add_argument("--seed", type=int, default=None, help="run seed (default: the scenario's seed)")
    r.add_argument("--out", default=None, help="directory for summary.json and trace.parquet")
    w = sub.add_parser("swarm", help="N runs with topology, rates and faults drawn from seeds S..S+N-1")
    w.add_argument("--seeds", type=int, required=True, help="how many seeds")
    w.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    w.add_argument("--protocol", choices=("derecho", "sequencer", "mirror"), default="derecho")
    w.add_argument(
        "--out", default="swarm-failures", help="where failing runs' scenarios are written (default swarm-failures/)"
    )
    w.add_argument("--master", default=None, help="Spark master that runs the seeds as tasks (default local[*])")
    w.add_argument("--local", action="store_true", help="run the seeds in this process, one after another (no Spark)")
    return p


@contextmanager
def _progress(total: float, label: str) -> Iterator:
    """A rich progress bar when stdout is a terminal; otherwise nothing."""
    if not sys.stdout.isatty():
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f}"),
                  TimeElapsedColumn(), transient=True) as prog:
        task = prog.add_task(label, total=total)
        yield lambda done: prog.update(task, completed=done)


def write_outputs(result, out: Path) -> None:
    """DIR/summary.json and DIR/trace.parquet (columns and types of interfaces.md)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n", encoding="utf-8")
    t = result.trace
    schema = pa.schema(
        [
            ("run_id", pa.string()),
            ("member", pa.string()),
            ("event_id", pa.string()),
            ("origin", pa.string()),
            ("origin_partition", pa.int64()),
            ("origin_offset", pa.int64()),
            ("seq", pa.int64()),
            ("submit_ts", pa.float64()),
            ("deliver_ts", pa.float64()),
        ]
    )
    table = pa.table({name: t[name] for name in schema.names}, schema=schema)
    pq.write_table(table, out / "trace.parquet")


def _report(result, repro: str) -> None:
    s = result.summary
    lat = s["latency_ms"]
    delivered = " ".join(f"{m}={n}" for m, n in s["events_delivered"].items())
    print(
        f"{s['scenario']} seed={s['seed']} protocol={s['protocol']}: submitted={s['events_submitted']} "
        f"delivered[{delivered}] p50={lat['p50']}ms p99={lat['p99']}ms sim={s['sim_time_s']}s wall={s['wall_time_s']}s"
    )
    failing = {id(v) for v in result.failing}
    for v in result.violations:
        tag = "violation" if id(v) in failing else "violation (tolerated for mirror)"
        print(f"{tag}: {v.kind}: {v.detail}")
    if result.violations:
        print(f"members at the end: {_states(s)}")
        print(f"repro: {repro}")


def _cmd_run(args) -> int:
    from sim.runner import run_scenario

    scenario = load_scenario(args.scenario)
    seed = scenario.seed if args.seed is None else args.seed
    with _progress(scenario.duration_s + scenario.settle_s, f"{scenario.name} (sim s)") as tick:
        result = run_scenario(scenario, seed, progress=tick)
    if args.out:
        write_outputs(result, Path(args.out))
    _report(result, f"kdsync-sim run {args.scenario} --seed {seed}")
    return result.exit_code


def _cmd_swarm(args) -> int:
    from sim.swarm import run_swarm

    if args.seeds < 1:
        raise _UsageError("kdsync-sim swarm: --seeds must be at least 1")
    if args.local and args.master:
        raise _UsageError("kdsync-sim swarm: give --master URL or --local, not both")
    if not args.local:
        try:
            import pyspark  # noqa: F401
        except ImportError:
            raise _UsageError("kdsync-sim swarm: PySpark is not installed (pip install 'kdsync[spark]'), "
                              "or run in this process with --local") from None
    with _progress(args.seeds, "swarm (seeds)") as tick:
        try:
            return run_swarm(args.seeds, args.first, args.protocol, args.out, master=args.master, local=args.local,
                             progress=tick)
        except Exception as err:  # a Spark job or master that fails: one line
            if args.local:
                raise
            from kdsync.spark.audit import one_line

            print(f"kdsync-sim swarm: Spark failed: {one_line(err)}", file=sys.stderr)
            return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        if args.command is None:
            raise _UsageError("kdsync-sim: give a command: run SCENARIO.yaml or swarm --seeds N (see kdsync-sim --help)")
        if args.command == "run":
            return _cmd_run(args)
        return _cmd_swarm(args)
    except (ScenarioError, _UsageError) as err:
        print(str(err), file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
