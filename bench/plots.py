"""matplotlib figures of the report (Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"derecho": "#1f77b4", "clock": "#2ca02c", "clock+fence": "#d62728", "clock+lift": "#9467bd",
          "sequencer": "#ff7f0e", "mirror": "#7f7f7f"}
PROTOCOLS = ("derecho", "sequencer", "mirror")


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def sim_latency(agg: list[dict], p, out: Path) -> list[tuple[str, str]]:
    """p50 and p99 against RTT, one panel per loss rate."""
    losses = sorted({a["loss"] for a in agg})
    fig, axes = plt.subplots(1, len(losses), figsize=(5.5 * len(losses), 4.2), squeeze=False)
    for ax, loss in zip(axes[0], losses):
        for proto in PROTOCOLS:
            rs = sorted((a for a in agg if a["protocol"] == proto and a["loss"] == loss), key=lambda a: a["rtt_ms"])
            if not rs:
                continue
            x = [a["rtt_ms"] for a in rs]
            ax.plot(x, [a["p50_ms"] for a in rs], "o-", color=COLORS[proto], label=f"{proto} p50")
            ax.plot(x, [a["p99_ms"] for a in rs], "s--", color=COLORS[proto], alpha=0.7, label=f"{proto} p99")
            ax.fill_between(x, [a["p50_ms_min"] for a in rs], [a["p50_ms_max"] for a in rs], color=COLORS[proto],
                            alpha=0.12)
        ax.set_xlabel("WAN round-trip time (ms)")
        ax.set_ylabel("latency to every global topic (ms)")
        ax.set_title(f"simulated, loss {loss:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return [(_save(fig, out, "sim_latency_vs_rtt.png"),
             "Simulated latency (source ack -> global topic) against WAN RTT; shaded: p50 range over seeds")]


def sim_violations(agg: list[dict], p, out: Path) -> list[tuple[str, str]]:
    """Ordering-guarantee violations per protocol and kind (summed over the sweep)."""
    kinds = ["agreement", "integrity", "loss", "origin_order", "split_brain"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.25
    for i, proto in enumerate(PROTOCOLS):
        vals = [sum(a[f"v_{k}"] for a in agg if a["protocol"] == proto) for k in kinds]
        ax.bar([j + (i - 1) * width for j in range(len(kinds))], vals, width, color=COLORS[proto], label=proto)
    ax.set_xticks(range(len(kinds)), kinds, rotation=15)
    ax.set_ylabel("violations reported (all runs)")
    ax.set_title("invariant violations by kind")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    labels, vals, cols = [], [], []
    for proto in PROTOCOLS:
        for a in sorted((a for a in agg if a["protocol"] == proto), key=lambda a: (a["loss"], a["rtt_ms"])):
            labels.append(f"{proto[:3]} {a['rtt_ms']:g}ms/{a['loss']:g}")
            v = a["disagreeing_pct"]
            vals.append(0 if v is None or (isinstance(v, float) and math.isnan(v)) else v)
            cols.append(COLORS[proto])
    ax2.bar(range(len(vals)), vals, color=cols)
    ax2.set_xticks(range(len(vals)), labels, rotation=70, fontsize=7)
    ax2.set_ylabel("% of positions that differ between clusters")
    ax2.set_title("agreement: positions holding different events")
    ax2.grid(axis="y", alpha=0.3)
    return [(_save(fig, out, "sim_violations.png"),
             "Left: violations the simulator's checkers report, summed over every run. "
             "Right: share of global-topic positions where clusters hold different events (from trace.parquet)")]


def latency_cdf(samples: dict[str, list[float]], title: str, out: Path, name: str) -> list[tuple[str, str]]:
    fig, ax = plt.subplots(figsize=(6, 4))
    for proto, xs in samples.items():
        if not xs:
            continue
        xs = sorted(xs)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], color=COLORS.get(proto), label=proto)
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of deliveries")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return [(_save(fig, out, name), title)]


def bars(rows: list[dict], metrics: list[tuple[str, str]], title: str, out: Path, name: str,
         label_key: str = "protocol") -> list[tuple[str, str]]:
    """One panel per metric, one bar per row (colour by protocol)."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.8), squeeze=False)
    for ax, (key, ylabel) in zip(axes[0], metrics):
        labels = [str(r[label_key]) for r in rows]
        vals = [r.get(key) if isinstance(r.get(key), (int, float)) else 0 for r in rows]
        ax.bar(range(len(rows)), vals, color=[COLORS.get(r.get("protocol"), "#2ca02c") for r in rows])
        ax.set_xticks(range(len(rows)), labels, rotation=20, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        for i, v in enumerate(vals):
            ax.annotate(f"{v:,.3g}" if v < 1000 else f"{v:,.0f}", (i, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(title)
    return [(_save(fig, out, name), title)]


def shard_scaling(rows: list[dict], out: Path) -> list[tuple[str, str]]:
    """Drain throughput against the number of shards, next to linear scaling."""
    rs = [r for r in rows if r.get("records_per_s")]
    if not rs:
        return []
    fig, ax = plt.subplots(figsize=(6, 4.2))
    x = [r["shards"] for r in rs]
    y = [r["records_per_s"] / 1000.0 for r in rs]
    ax.plot(x, y, "o-", color=COLORS["derecho"], label="derecho, simulated")
    ax.plot(x, [y[0] * k / x[0] for k in x], ":", color="#999999", label="linear")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(k) for k in x])
    ax.set_xlabel(f"shards (3 sites, {rs[0]['cores_per_site']} modelled cores each)")
    ax.set_ylabel("drain throughput (thousand records/s)")
    ax.set_title("scale-out: independent ordering groups")
    ax.grid(alpha=0.3)
    ax.legend()
    return [(_save(fig, out, "scale_shards.png"),
             "Simulated drain throughput of a backlog against the number of shards, with the member CPU model")]


def wan_regions(rows: list[dict], labels: list[str], out: Path) -> list[tuple[str, str]]:
    """p50 per origin region, one bar per protocol, the clock bound as a mark."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(rows))]
        proto = label.split()[0]
        ax.bar(xs, [r.get(f"{label} p50") or 0 for r in rows], width, label=label,
               color=COLORS.get(proto, "#2ca02c"), alpha={"clock": 0.6, "clock defaults": 0.3}.get(label, 1.0))
    ax.scatter(range(len(rows)), [r["model clock q=2 p50"] for r in rows], marker="_", s=600, color="k",
               label="clock q=2 model (bench/wan.py)", zorder=3)
    ax.set_xticks(range(len(rows)), [r["origin"] for r in rows])
    ax.set_xlabel("origin region")
    ax.set_ylabel("p50 latency, ms")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    title = "Five regions: p50 per origin region (simulated)"
    ax.set_title(title)
    return [(_save(fig, out, "wan_regions.png"), title)]
