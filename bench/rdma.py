"""RDMA vs TCP section: figures from the soft-RoCE VM run of
infra/rdma-vm/run-tests.sh with KDSYNC_VM_SUITE=bench (results.json written
by tests/rdma's measurements inside the guest: test_rdma_perf.py, and
test_member_perf.py's four kdsync run groups; make test's "ci" suite does not
run them).  The VM is booted only with `--rdma` (it takes minutes)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bench.common import Headline, NotMeasured, Section, Table

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "build" / "rdma-vm-bench"


def boot_vm(out: Path, timeout: float = 1500) -> str:
    """Run the VM tests; returns a one-line outcome."""
    import os

    script = ROOT / "infra" / "rdma-vm" / "run-tests.sh"
    if not script.exists():
        raise NotMeasured(f"{script.relative_to(ROOT)} does not exist")
    # the guest's "bench" suite: the measurements (tests/rdma/test_rdma_perf.py, test_member_perf.py)
    env = dict(os.environ, KDSYNC_VM_SUITE="bench")
    env.pop("KDSYNC_VM_CMD", None)
    try:
        p = subprocess.run(["bash", str(script), str(out)], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise NotMeasured(f"the soft-RoCE VM run did not finish in {timeout:.0f} s") from None
    if p.returncode == 3:
        raise NotMeasured("VM " + ((p.stderr.strip().splitlines() or ["skipped"])[-1])[:200])
    return f"infra/rdma-vm/run-tests.sh exited {p.returncode}"


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


# (results.json key, headline): RDMA relative to TCP, measured in the same guest
HEADLINES = (
    ("member.p50_ms_ratio_rdma_over_tcp", "RDMA/TCP kdsync run latency p50 (source -> global topic)"),
    ("member.p99_ms_ratio_rdma_over_tcp", "RDMA/TCP kdsync run latency p99 (source -> global topic)"),
    ("member.cpu_us_per_event_ratio_rdma_over_tcp", "RDMA/TCP kdsync run member CPU per event"),
    ("perf.rtt_p50_rdma_over_tcp", "RDMA/TCP transport round trip p50"),
    ("perf.throughput_rdma_over_tcp", "RDMA/TCP transport throughput"),
)


def rdma_section(boot: bool, results_dir: Path = DEFAULT_OUT) -> Section:
    sec = Section("rdma", "RDMA (soft-RoCE in a VM) vs TCP")
    outcome = boot_vm(results_dir) if boot else None
    path = results_dir / "results.json"
    if not path.is_file():
        raise NotMeasured(f"no VM results ({path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} "
                          f"missing); run `python -m bench.run --rdma` (KDSYNC_VM_SUITE=bench)")
    data = _flatten(json.loads(path.read_text()))
    run_file = results_dir / "run.json"
    commit = json.loads(run_file.read_text()).get("commit", "unknown") if run_file.is_file() else "unknown"
    rows = [{"key": k, "value": v} for k, v in sorted(data.items())]
    import datetime as _dt

    when = _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sec.intro.append(f"From {path.name} of a soft-RoCE VM run on commit {commit} ({when}; qemu TCG emulation, "
                     f"so only ratios measured in the same VM mean anything)."
                     + (f" This run: {outcome}." if outcome else " Read, not re-run: `--rdma` boots the VM."))
    sec.intro.append("kdsync run rows: three embedded Tansu clusters and three `kdsync run` members (derecho, "
                     "default timing) in the guest, paced writes in every cluster (kdsync.testing.load.run_load, "
                     "as the member section), `[transport] kind` = rdma or tcp in alternating rounds "
                     "(tests/rdma/test_member_perf.py); transport rows: one RDMA and one TCP link in one process "
                     "(tests/rdma/test_rdma_perf.py).")
    sec.tables.append(Table("rdma_vm", "Every figure the VM run recorded", rows))
    rr = [{"figure": title, "ratio": round(data[key], 3), "key": key} for key, title in HEADLINES
          if data.get(key) is not None]
    if rr:
        sec.tables.append(Table("rdma_ratios", "RDMA relative to TCP (same VM)", rr))
        for r in rr:
            sec.headlines.append(Headline(r["figure"], r["ratio"], "", "rdma_ratios.csv"))
    missing = [key for key, _ in HEADLINES if data.get(key) is None]
    if missing:
        sec.notes.append("the VM results lack " + ", ".join(missing))
    return sec
