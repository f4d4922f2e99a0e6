"""Swarm testing: one seed → one random scenario (topology, rates, network, faults).

Each run has a safety phase (`duration_s`, faults on) and a liveness phase
(`settle_s`, everything healed and every crashed member restarted); the
checkers then demand agreement, integrity, origin order and no loss at every
member.  The workload is small on purpose: a run takes well under a second of
wall time, so CI can afford hundreds of seeds.  The generated scenario is an
ordinary `Scenario`, so a failing seed is written out as YAML and replayed with
`kdsync-sim run`.
"""

from __future__ import annotations

import random

from sim.scenario import Scenario

SAFETY_S = 3.0
LIVENESS_S = 4.0


def swarm_scenario(seed: int, protocol: str = "derecho") -> Scenario:
    """The scenario for swarm seed `seed` (pure function of its arguments)."""
    rng = random.Random(f"swarm/{seed}")
    n = rng.randint(3, 5)
    ids = [f"m{i}" for i in range(n)]
    members = [{"id": m} for m in ids]
    if n >= 4 and rng.random() < 0.35:
        members[-1]["role"] = "witness"
    clusters = [m["id"] for m in members if m.get("role") != "witness"]

    latency = rng.choice([1.0, 5.0, 20.0, 40.0, 60.0])
    default = {
        "latency_ms": latency,
        "jitter_ms": round(latency * rng.random() * 0.2, 3),
        "bandwidth_mbps": rng.choice([100.0, 1000.0, 10000.0]),
    }
    for key, top in (("loss", 0.05), ("duplicate", 0.05), ("reorder", 0.05)):
        if rng.random() < 0.4:
            default[key] = round(rng.random() * top, 4)
    links = []
    if rng.random() < 0.4:  # one far-away member
        far = rng.choice(ids)
        extra = rng.choice([30.0, 80.0, 120.0])
        for other in ids:
            if other != far:
                links.append({"from": far, "to": other, "latency_ms": latency + extra})
                links.append({"from": other, "to": far, "latency_ms": latency + extra})

    workload = [
        {
            "member": "all",
            "rate_eps": float(rng.choice([5, 10, 20, 40])),
            "partitions": rng.randint(1, 3),
            "payload_bytes": rng.choice([16, 100, 512]),
            "start_s": 0.0,
            "stop_s": SAFETY_S,
        }
    ]
    for _ in range(rng.randint(0, 2)):  # concurrent bursts
        workload.append(
            {"member": rng.choice(["all", *clusters]), "burst": rng.randint(5, 60), "at_s": round(rng.random() * SAFETY_S * 0.9, 3)}
        )

    faults: list[dict] = []
    minority = (n - 1) // 2  # at most this many members may be away at once
    t = round(0.1 + rng.random() * 0.4, 3)
    for _ in range(rng.randint(0, 4)):
        if t >= SAFETY_S - 0.3:
            break
        kind = rng.choice(["crash", "crash", "partition", "asym", "link", "pause"])
        span = round(0.1 + rng.random() * 0.9, 3)
        end = min(round(t + span, 3), SAFETY_S - 0.05)
        if kind == "crash":
            victim = rng.choice(ids)
            faults.append({"at_s": t, "crash": victim})
            faults.append({"at_s": end, "restart": victim})
        elif kind == "partition":
            away = rng.sample(ids, rng.randint(1, max(1, minority)))
            rest = [m for m in ids if m not in away]
            faults.append({"at_s": t, "partition": [away, rest], "until_s": end})
        elif kind == "asym":
            a, b = rng.sample(ids, 2)
            faults.append({"at_s": t, "link": {"from": a, "to": b, "loss": 1.0}, "until_s": end})
        elif kind == "link":
            a, b = rng.sample(ids, 2)
            faults.append(
                {
                    "at_s": t,
                    "link": {"from": a, "to": b, "loss": round(rng.random() * 0.5, 3), "latency_ms": latency * rng.choice([2, 5, 10])},
                    "until_s": end,
                }
            )
        else:
            faults.append({"at_s": t, "clock_pause": rng.choice(ids), "for_s": span})
        t = round(end + 0.05 + rng.random() * 0.3, 3)  # faults one after another

    return Scenario.model_validate(
        {
            "name": f"swarm-{seed}",
            "seed": seed,
            "protocol": protocol,
            "duration_s": SAFETY_S,
            "settle_s": LIVENESS_S,
            "members": members,
            "network": {"default": default, "links": links},
            "kafka": {
                "produce_ms": float(rng.choice([1, 2, 5])),
                "consume_ms": float(rng.choice([1, 2])),
                "poll_ms": float(rng.choice([0, 2, 10])),
            },
            "workload": workload,
            "faults": faults,
        }
    )
