"""`make bench` / `python -m bench.run`: compare derecho, sequencer and mirror
on latency, throughput and ordering guarantees; write results/.

    python -m bench.run [--quick] [--out DIR] [--rdma] [--sections core,sim,...]

Sections (each degrades to "not measured: <reason>" when its part is missing):
  core      ordering-core throughput (pytest-benchmark of tests/core)
  scale     simulator speed at 100 K events/s, messages per event, fifty sites, sequencer fail-over
  sim       the same workload under the three protocols, RTT x loss x seeds
  wan       WAN regions: five AWS regions, one far region, three sites (mirror / derecho / sequencer / clock)
  audit     the sim traces through the PySpark `kdsync audit` vs summary.json
  real      three embedded Tansu clusters + `kdsync run` members, end to end
  member    one member under paced load (bench.load): CPU per event, latency vs the Kafka floor, drain, idle
  simreal   kdsync-sim calibrate, then real vs simulated p50/p99 at 300 and 1 000 events/s x 10 and 25 ms between members
  geo       five real regions on loopback (delay proxies with wan-five-regions' delays) vs the simulator, mirror and clock; and clock through a kill -9 and a SIGTERM (bench.geo_faults)
  shards    real drain with [topics] shards = 2: kdsync run --workers 1 vs --workers 2
  topics    many topics per member (bench.topics): start-up and idle cost at 1 000 / 100 / 1 topics, CPU per event spread
  reliability  the nemesis suite on durable clusters
  rdma      RDMA/TCP ratios from a soft-RoCE VM run (boots it with --rdma)

Writes DIR/report.md (tables, plots embedded), DIR/*.png, DIR/*.csv.
Exit: 0 when at least the core and sim sections ran, 1 otherwise, 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from bench.common import NotMeasured, Section, Table, fmt, write_csv

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("core", "scale", "sim", "wan", "region", "audit", "real", "member", "simreal", "geo", "shards", "topics", "reliability",
            "rdma")
QUICK_SKIPS = {"audit": "skipped by --quick (Spark start-up alone takes tens of seconds here)",
               "real": "skipped by --quick (three brokers and members per protocol take minutes)",
               "member": "skipped by --quick (six paced loads on real brokers take minutes)",
               "simreal": "skipped by --quick (calibration and four real runs take minutes)",
               "geo": "skipped by --quick (five brokers and five members per protocol take minutes)",
               "shards": "skipped by --quick (three brokers and 1 then 2 workers per cluster take minutes)",
               "topics": "skipped by --quick (1 000 topics on three brokers take minutes)",
               "reliability": "skipped by --quick (minutes of faults per seed on durable clusters)"}
TITLES = {"core": "Ordering core throughput", "scale": "Core and simulator at Kafka scale", "sim": "Simulator: the same workload under derecho / sequencer / mirror",
          "wan": "WAN regions: ordering across regions (clock vs derecho vs the baselines)",
          "region": "Region failure: what one region's crash, stop, isolation or return costs the others",
          "audit": "PySpark audit of the simulator traces", "real": "Real brokers: three local clusters",
          "member": "The member under paced load: CPU per event, latency vs the Kafka floor, drain, idle",
          "simreal": "Simulator vs real: the four calibration points",
          "geo": "Real geo run: five regions on loopback through delay proxies vs the simulator",
          "shards": "Shards in processes: K = 2 shards, 1 worker vs 2 workers (real brokers)", "rdma": "RDMA (soft-RoCE in a VM) vs TCP",
          "topics": "Many topics per member: start-up, idle cost, CPU per event spread over topics",
          "reliability": "Reliability: the nemesis suite on durable clusters"}
GENERATED_PREFIXES = ("core_", "scale_", "sim_", "wan_", "region_", "geo_", "audit_", "real_", "member_", "rdma_", "simreal_", "shards_", "nemesis_",
                      "topics_",
                      "summary")


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise UsageError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="python -m bench.run", description="kdsync benchmark: writes report.md, *.png, *.csv")
    p.add_argument("--quick", action="store_true", help="tiny parameters (about a minute): core + sim only")
    p.add_argument("--out", default=str(ROOT / "results"), help="output directory (default results/)")
    p.add_argument("--rdma", action="store_true",
                   help="with --quick: boot the soft-RoCE VM (minutes) before reading its results (a full run "
                        "always boots it, so the RDMA section measures this commit)")
    p.add_argument("--sections", default=None,
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all; --quick: core,sim)")
    p.add_argument("--jobs", type=int, default=2, help="simulator runs in parallel (default 2)")
    p.add_argument("--keep-work", metavar="DIR", help="keep generated scenarios, sim runs and logs in DIR")
    a = p.parse_args(argv)
    if a.sections is not None:
        chosen = [s.strip() for s in a.sections.split(",") if s.strip()]
        bad = [s for s in chosen if s not in SECTIONS]
        if bad or not chosen:
            raise UsageError(f"--sections: unknown section {', '.join(bad) or '(none)'} "
                             f"(choose from {', '.join(SECTIONS)})")
        a.sections = chosen
    if not 1 <= a.jobs <= 64:
        raise UsageError("--jobs must be between 1 and 64")
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {a.out}: exists and is not a directory")
    return a


class Progress:
    """A rich progress bar when stdout is a terminal; plain log lines otherwise."""

    def __init__(self, total: int):
        self.total = total
        self._bar = None
        self._task = None
        self.tty = sys.stdout.isatty()

    @contextmanager
    def running(self) -> Iterator["Progress"]:
        if not self.tty:
            yield self
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RP, TextColumn, TimeElapsedColumn

        with RP(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
            self._bar = bar
            self._task = bar.add_task("bench", total=self.total)
            yield self
        self._bar = None

    def step(self, what: str = "", n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=n, description=what or None)

    def say(self, msg: str) -> None:
        stamp = dt.datetime.now().strftime("%H:%M:%S")
        if self._bar is not None:
            self._bar.console.log(msg)
            self._bar.update(self._task, description=msg[:40])
        else:
            print(f"[{stamp}] {msg}", flush=True)


def _guard(key: str, title: str, fn: Callable[[], Section], prog: Progress) -> Section:
    """Run one section; a missing part or any error turns into 'not measured'."""
    t0 = time.perf_counter()
    prog.say(f"{key}: running")
    try:
        sec = fn()
    except NotMeasured as e:
        sec = Section(key, title, status="not measured", reason=str(e))
    except Exception as e:  # a bug in a part the bench drives must not lose the other sections
        tb = traceback.format_exc().strip().splitlines()
        sec = Section(key, title, status="not measured", reason=f"{type(e).__name__}: {e} ({tb[-3].strip()[:160]})")
    sec.wall_s = time.perf_counter() - t0
    prog.say(f"{key}: {sec.status}{': ' + sec.reason if sec.reason else ''} ({sec.wall_s:.0f} s)")
    return sec


def _git_commit() -> str:
    """HEAD, with " + uncommitted changes" when the code the bench runs
    (members and simulations are started from this tree) differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD") or "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "kdsync", "sim", "bench")
        return head + (" + uncommitted changes" if dirty else "")
    except Exception:
        return "unknown"


def _commit_of_run(at_start: str) -> str:
    """The commit a run measured: the one at its start, or both when the tree
    moved meanwhile (processes started later ran the newer code: run make
    bench from a clone, or keep the tree still, to measure one commit)."""
    now = _git_commit()
    return at_start if now == at_start else f"{at_start}, then {now} (the tree changed during the run)"


def _md_table(t: Table) -> list[str]:
    cols = t.cols()
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in t.rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    return lines


def write_report(out: Path, sections: list[Section], meta: dict) -> Path:
    """report.md plus one CSV per table (and summary.csv of the headline figures)."""
    heads = [h for s in sections for h in s.headlines]
    summary = Table("summary", "Headline figures", [
        {"figure": h.figure, "value": h.value, "goal": h.goal, "csv": h.source} for h in heads])
    write_csv(summary, out)
    for s in sections:
        for t in s.tables:
            write_csv(t, out)
    L = ["# kdsync benchmark", ""]
    L.append(f"Generated {meta['when']} by `{meta['command']}` at commit `{meta['commit']}` "
             f"({meta['mode']} mode, {meta['wall_s']:.0f} s wall).")
    L.append("")
    L.append(f"**Read the ratios, not the absolute times.** Every figure was measured in this one run on the same "
             f"box: {os.cpu_count()} cores, load average {meta['load_before']} at start and {meta['load_after']} "
             f"at the end — other engineers' tests ran concurrently, so wall-clock figures (core events/s, real "
             f"brokers, simulator speed) are noisy and pessimistic. Simulated latencies are in simulated time and "
             f"do not depend on the load.")
    L.append("")
    L.append("## Summary")
    L.append("")
    L += _md_table(Table("summary", "", [{"figure": h.figure, "value": h.value, "goal": h.goal, "csv": h.source}
                                         for h in heads]))
    L.append("")
    L.append("| section | status | wall (s) |")
    L.append("|---|---|---|")
    for s in sections:
        L.append(f"| {s.title} | {'measured' if s.ok else 'not measured: ' + s.reason.replace('|', '/')} "
                 f"| {s.wall_s:.0f} |")
    L.append("")
    for s in sections:
        L.append(f"## {s.title}")
        L.append("")
        if not s.ok:
            L.append(f"not measured: {s.reason}")
            L.append("")
            continue
        for line in s.intro:
            L += [line, ""]
        for t in s.tables:
            if t.show:
                L += [f"**{t.title}** ([{t.name}.csv]({t.name}.csv))", ""]
                L += _md_table(t)
                L.append("")
            else:
                L += [f"{t.title}: {len(t.rows)} rows in [{t.name}.csv]({t.name}.csv).", ""]
        for png, caption in s.plots:
            L += [f"![{caption}]({png})", "", f"*{caption}*", ""]
        for n in s.notes:
            L += [f"  - {n.strip()}" if n.startswith("  ") else f"- {n}"]
        if s.notes:
            L.append("")
    path = out / "report.md"
    path.write_text("\n".join(L) + "\n", encoding="utf-8")
    return path


def _clean(out: Path) -> None:
    """Remove what an earlier run generated (so no stale figure survives)."""
    repro = out / "repro"
    if repro.is_dir():
        for f in repro.glob("*.yaml"):
            f.unlink()
    for f in out.iterdir():
        if f.is_file() and (f.name == "report.md" or (f.suffix in (".csv", ".png")
                                                         and f.name.startswith(GENERATED_PREFIXES))):
            f.unlink()


def simreal_section(out: Path, work: Path, prog: "Progress") -> Section:
    """`kdsync-sim calibrate` (writes OUT/calibration.yaml), then the four
    calibration points real vs sim (bench/simreal.py)."""
    from bench.simreal import REAL_RUNS, SIM_SEEDS
    from bench.simreal import simreal_section as points_section
    from sim.calibrate import calibrate

    profile = out / "calibration.yaml"
    prog.say("simreal: kdsync-sim calibrate -> " + str(profile))
    calibrate(profile, [20.0, 300.0, 1000.0], 5.0, say=prog.say)
    sec = points_section(profile, 8.0, work, out, say=prog.say)
    sec.intro.insert(0, f"`make bench` first runs `kdsync-sim calibrate --out {profile}` (3 paced runs at 20, 300 "
                        f"and 1 000 events/s and a broker probe), then each point below {REAL_RUNS} times for real and with "
                        f"{SIM_SEEDS} seeds in the simulator (the median of each).")
    return sec


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    wanted = args.sections or (["core", "scale", "sim", "rdma"] if args.quick else list(SECTIONS))
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"bench: --out {args.out}: cannot create ({e.strerror})", file=sys.stderr)
        return 2
    _clean(out)
    t_start = time.perf_counter()
    commit_at_start = _git_commit()
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())

    from bench import plots as plot
    from bench.audit import audit_section
    from bench.core import core_section
    from bench.member import PROTOCOLS as PROTOCOLS_MEMBER, MemberParams, member_section
    from bench.rdma import rdma_section
    from bench.scale import scale_section
    from bench.real import RealParams, real_section
    from bench.sim import FULL, QUICK, run_job, sweep_jobs, sweep_section, yardstick_jobs, yardstick_rows

    params = QUICK if args.quick else FULL
    real_params = RealParams()
    with tempfile.TemporaryDirectory(prefix="kdsync-bench-") as tmp:
        work = Path(args.keep_work) if args.keep_work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        jobs = sweep_jobs(params, work) if "sim" in wanted or "audit" in wanted else []
        yjobs = yardstick_jobs(work) if "sim" in wanted and not args.quick else []
        member_params = MemberParams()
        member_steps = (3 * len(member_params.rates) + member_params.drain_runs - 1 + member_params.cpu_pairs
                        + len(PROTOCOLS_MEMBER))
        total = (len(wanted) + len(jobs) + len(yjobs) + (3 * len(real_params.brokers) if "real" in wanted else 0)
                 + (member_steps if "member" in wanted else 0) + (2 if "shards" in wanted else 0)
                 + (5 if "topics" in wanted else 0))
        prog = Progress(total)
        sections: list[Section] = []
        skipped: dict[str, str] = {}
        with prog.running():
            if "core" in wanted:
                sections.append(_guard("core", "Ordering core throughput",
                                       lambda: core_section(work, args.quick, plot, out), prog))
                prog.step("core")
            if "scale" in wanted:
                sections.append(_guard("scale", "Core and simulator at Kafka scale",
                                       lambda: scale_section(args.quick, plot, out), prog))
                prog.step("scale")
            all_jobs = yjobs + jobs  # the long yardstick first, so it overlaps the short runs
            all_res: list[dict] = []
            if all_jobs:
                prog.say(f"sim: {len(all_jobs)} kdsync-sim runs, {args.jobs} at a time")
                with ProcessPoolExecutor(max_workers=args.jobs) as pool:
                    futs = [pool.submit(run_job, j) for j in all_jobs]
                    for f in futs:
                        try:
                            res = f.result()
                        except Exception as e:  # a worker died
                            res = {"exit": -1, "wall_s": 0.0, "output": f"worker failed: {e}"}
                        all_res.append(res)
                        prog.step("sim runs")
            yres = all_res[:len(yjobs)]
            results = all_res[len(yjobs):len(yjobs) + len(jobs)]
            if "sim" in wanted:
                sections.append(_guard("sim", "Simulator: the same workload under derecho / sequencer / mirror",
                                       lambda: sweep_section(jobs, results, params, out, plot,
                                                             yardstick_rows(yjobs, yres)), prog))
                prog.step("sim")
            if "wan" in wanted:
                from bench.wan import wan_section

                sections.append(_guard("wan", TITLES["wan"],
                                       lambda: wan_section(work, plot, out, args.jobs), prog))
                prog.step("wan")
            if "region" in wanted:
                from bench.region import region_section

                sections.append(_guard("region", TITLES["region"],
                                       lambda: region_section(work, out, args.jobs), prog))
                prog.step("region")
            if "audit" in wanted:
                if args.quick and args.sections is None:
                    skipped["audit"] = QUICK_SKIPS["audit"]
                else:
                    sections.append(_guard("audit", "PySpark audit of the simulator traces",
                                           lambda: audit_section([Path(j.out) for j in jobs if j.seed == params.seeds[0]],
                                                                        work), prog))
                prog.step("audit")
            real = None
            if "real" in wanted:
                real = _guard("real", "Real brokers: three local clusters",
                              lambda: real_section(real_params, plot, out, progress=lambda: prog.step("real")),
                              prog)
                sections.append(real)
                prog.step("real")
            if "member" in wanted:
                sections.append(_guard("member", TITLES["member"],
                                       lambda: member_section(member_params, out, progress=lambda: prog.step("member")),
                                       prog))
                prog.step("member")
            if "simreal" in wanted:
                sections.append(_guard("simreal", "Simulator vs real: the four calibration points",
                                       lambda: simreal_section(out, work, prog), prog))
                prog.step("simreal")
            if "geo" in wanted:
                from bench.geo_section import geo_section

                sections.append(_guard("geo", TITLES["geo"], lambda: geo_section(lambda: None), prog))
                prog.step("geo")
            if "shards" in wanted:
                from bench.shards import shards_section

                sections.append(_guard("shards", TITLES["shards"],
                                       lambda: shards_section(out, args.quick, progress=lambda: prog.step("shards")),
                                       prog))
            if "topics" in wanted:
                from bench.topics import topics_section

                sections.append(_guard("topics", TITLES["topics"],
                                       lambda: topics_section(progress=lambda: prog.step("topics")), prog))
            if "reliability" in wanted:
                from bench.reliability import reliability_section

                sections.append(_guard("reliability", TITLES["reliability"],
                                       lambda: reliability_section(out, progress=lambda: prog.step("reliability")),
                                       prog))
            if "rdma" in wanted:
                sections.append(_guard("rdma", "RDMA (soft-RoCE in a VM) vs TCP",
                                       lambda: rdma_section(args.rdma or not args.quick), prog))
                prog.step("rdma")
        for key in SECTIONS:
            if key not in wanted or key in skipped:
                reason = skipped.get(key) or (QUICK_SKIPS.get(key) if args.quick and args.sections is None else None)
                sections.append(Section(key, TITLES[key], status="not measured",
                                        reason=reason or "not selected by --sections"))
        sections.sort(key=lambda s: SECTIONS.index(s.key) if s.key in SECTIONS else len(SECTIONS))
        meta = {"when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "command": "python -m bench.run " + " ".join(argv), "commit": _commit_of_run(commit_at_start),
                "mode": "quick" if args.quick else "full", "wall_s": time.perf_counter() - t_start,
                "load_before": load_before, "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg())}
        report = write_report(out, sections, meta)
    by = {s.key: s for s in sections}
    for s in sections:
        print(f"{s.key:8} {'ok' if s.ok else 'not measured: ' + s.reason}")
    print(f"report: {report}")
    ok = all(by.get(k) is not None and by[k].ok for k in ("core", "sim"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
