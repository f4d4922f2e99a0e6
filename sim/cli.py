"""`kdsync-sim`: run one scenario, or a swarm of seeded random ones.

    kdsync-sim run SCENARIO.yaml [--seed N] [--out DIR]
    kdsync-sim swarm --seeds N [--first S] [--protocol P] [--out DIR] [--master URL | --local]
    kdsync-sim calibrate [--out FILE] [--rates R1,R2,...] [--duration S] [--protocol P]

Exit codes: 0 every invariant holds, 1 a violation (each one printed with a
`repro:` line), 2 a bad scenario or bad arguments (one line naming what to fix).
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kdsync.core.types import ProtocolName

import typer

from kdsync.cli_style import UsageError, new_app
from kdsync.cli_style import run as run_cli
from sim.scenario import ScenarioError, load_scenario
from sim.swarm import member_states as _states


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
    """DIR/summary.json and DIR/trace.parquet (columns and types: docs/outputs.md)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n", encoding="utf-8")
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
    # one row group per (shard, member): memory holds one member's rows, not the run's
    with pq.ParquetWriter(out / "trace.parquet", schema) as w:
        wrote = False
        for t in result.trace_tables():
            if t.num_rows:
                w.write_table(t.select(schema.names).cast(schema))
                wrote = True
        if not wrote:
            w.write_table(schema.empty_table())


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


app = new_app("SimPy simulator that runs the kdsync ordering core through faults.  Exit 0 when every invariant "
              "holds, 1 on a violation (with a repro: line), 2 on a bad scenario or bad arguments.")


@app.callback(invoke_without_command=True)
def _top(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand is None:
        raise UsageError("give a command: run SCENARIO.yaml or swarm --seeds N (see kdsync-sim --help)")


@contextmanager
def _scenario_errors() -> Iterator[None]:
    """A ScenarioError (it names file, line and key) as the one line, exit 2."""
    try:
        yield
    except ScenarioError as err:
        raise UsageError(str(err), prefix=False) from None


@app.command("run", help="Run one scenario file.")
def _cmd_run(
    scenario_file: str = typer.Argument(..., metavar="SCENARIO",
                                        help="scenario YAML file (format: docs/scenario.md)"),
    seed: int | None = typer.Option(None, metavar="N", show_default="the scenario's seed", help="run seed"),
    out: str | None = typer.Option(None, metavar="DIR", show_default="none: nothing written",
                                   help="directory for summary.json and trace.parquet"),
) -> int:
    from sim.runner import run_scenario

    with _scenario_errors():
        scenario = load_scenario(scenario_file)
        seed = scenario.seed if seed is None else seed
        with _progress(scenario.duration_s + scenario.settle_s, f"{scenario.name} (sim s)") as tick:
            result = run_scenario(scenario, seed, progress=tick)
    if out:
        write_outputs(result, Path(out))
    _report(result, f"kdsync-sim run {scenario_file} --seed {seed}")
    return result.exit_code


@app.command("swarm", help="N runs with topology, rates and faults drawn from seeds S..S+N-1, as Spark tasks "
                           "(or in this process with --local).")
def _cmd_swarm(
    seeds: int = typer.Option(..., metavar="N", help="how many seeds"),
    first: int = typer.Option(0, metavar="S", help="first seed"),
    protocol: ProtocolName = typer.Option("derecho", help="ordering protocol"),
    out: str = typer.Option("swarm-failures", metavar="DIR", help="where failing runs' scenarios are written"),
    master: str | None = typer.Option(None, metavar="URL", show_default="local[*]",
                                      help="Spark master that runs the seeds as tasks"),
    local: bool = typer.Option(False, "--local", help="run the seeds in this process, one after another (no Spark)"),
) -> int:
    from sim.swarm import run_swarm

    if seeds < 1:
        raise UsageError("--seeds must be at least 1")
    if local and master:
        raise UsageError("give --master URL or --local, not both")
    if not local:
        try:
            import pyspark  # noqa: F401
        except ImportError:
            raise UsageError("PySpark is not installed (pip install 'kdsync[spark]'), "
                             "or run in this process with --local") from None
    with _progress(seeds, "swarm (seeds)") as tick, _scenario_errors():
        try:
            return run_swarm(seeds, first, protocol, out, master=master, local=local, progress=tick)
        except ScenarioError:
            raise
        except Exception as err:  # a Spark job or master that fails: one line
            if local:
                raise
            from kdsync.cli_style import error_line

            print(f"kdsync-sim swarm: Spark failed: {error_line(err)}", file=sys.stderr)
            return 1


@app.command("calibrate", help="Measure a real member's CPU per peer message, per event and per tick (3 embedded "
                               "Tansu clusters, one kdsync run each, paced load at each rate) and the broker's "
                               "produce and fetch latencies; write a profile scenarios name with  profile: FILE.")
def _cmd_calibrate(
    out: str = typer.Option("results/calibration.yaml", metavar="FILE", help="profile to write"),
    rates: str = typer.Option("20,300,1000", metavar="R1,R2,...", help="total events/s of each paced run (a low one pins the idle cost)"),
    duration: float = typer.Option(5.0, metavar="S", help="seconds of paced load per rate"),
    protocol: ProtocolName = typer.Option("derecho", help="ordering protocol"),
) -> int:
    from sim.calibrate import calibrate

    try:
        rate_list = [float(x) for x in rates.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--rates: give numbers separated by commas (got {rates!r})") from None
    if not rate_list or any(r <= 0 for r in rate_list):
        raise UsageError("--rates: give at least one rate, each > 0")
    if not 0.5 <= duration <= 600:
        raise UsageError("--duration must be between 0.5 and 600 seconds")
    prof = calibrate(Path(out), rate_list, duration, protocol, say=lambda m: print(m, flush=True))
    c, k = prof["member_cost"], prof["kafka"]
    print(f"member: {c['message_us']} us/message, {c['event_us']} us/event, {c['tick_us']} us/tick "
          f"(fit r2 {prof['calibration']['fit_r2']}); broker: produce {k['produce_ms']} ms, fetch overhead "
          f"{k['fetch_overhead_ms']} ms, check {k['fetch_check_ms']} ms; load average "
          f"{prof['calibration']['loadavg_1m']}")
    print(f"profile: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`kdsync-sim ARGS`; returns the exit code (0 invariants hold, 1 a violation, 2 bad scenario or usage)."""
    try:
        return run_cli(typer.main.get_group(app), argv, "kdsync-sim")
    except BrokenPipeError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
