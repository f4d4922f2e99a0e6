"""RDMA vs TCP section: figures from the soft-RoCE VM run of
infra/rdma-vm/run-tests.sh (results.json written by tests/rdma inside the
guest).  The VM is booted only with `--rdma` (it takes minutes)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bench.common import Headline, NotMeasured, Section, Table

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "build" / "rdma-vm"


def boot_vm(out: Path, timeout: float = 1200) -> str:
    """Run the VM tests; returns a one-line outcome."""
    script = ROOT / "infra" / "rdma-vm" / "run-tests.sh"
    if not script.exists():
        raise NotMeasured(f"{script.relative_to(ROOT)} does not exist")
    try:
        p = subprocess.run(["bash", str(script), str(out)], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout)
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


def rdma_section(boot: bool, results_dir: Path = DEFAULT_OUT) -> Section:
    sec = Section("rdma", "RDMA (soft-RoCE in a VM) vs TCP")
    outcome = boot_vm(results_dir) if boot else None
    path = results_dir / "results.json"
    if not path.is_file():
        raise NotMeasured(f"no VM results ({path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} "
                          f"missing); run `make test-rdma` or `python -m bench.run --rdma`")
    data = _flatten(json.loads(path.read_text()))
    rows = [{"key": k, "value": v} for k, v in sorted(data.items())]
    # explicit ratios, or rdma_X / tcp_X pairs
    ratios = {k: v for k, v in data.items() if "ratio" in k}
    for k, v in data.items():
        for a, b in (("rdma_", "tcp_"), ("rdma.", "tcp.")):
            if a in k and k.replace(a, b) in data and data[k.replace(a, b)]:
                ratios.setdefault(k.replace(a, "").strip("._") + " (rdma/tcp)", v / data[k.replace(a, b)])
    import datetime as _dt

    when = _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sec.intro.append(f"From {path.name} of a soft-RoCE VM run ({when}; qemu TCG emulation, so only ratios "
                     f"measured in the same VM mean anything)." + (f" This run: {outcome}." if outcome else ""))
    sec.tables.append(Table("rdma_vm", "Every figure the VM run recorded", rows))
    if ratios:
        rr = [{"figure": k, "ratio": round(v, 3)} for k, v in sorted(ratios.items())]
        sec.tables.append(Table("rdma_ratios", "RDMA relative to TCP (same VM)", rr))
        for r in rr:
            sec.headlines.append(Headline(f"RDMA/TCP {r['figure']}", r["ratio"], "", "rdma_ratios.csv"))
    else:
        sec.notes.append("the VM results hold no RDMA/TCP latency or throughput pair yet (keys: "
                         + ", ".join(sorted(data)[:12]) + ")")
    return sec
