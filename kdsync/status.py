"""Where a member stands: the answer to `kdsync status`.

A running member answers a status probe (kdsync.transport.tcp.probe, over
its own listen address, proved with the group secret like any peer) with
`member_status(...)`: a JSON-able snapshot of what the member sees now.  The
snapshot is built from the parts it is given, on the member's loop, so it is
consistent; `render()` turns one or more snapshots (one per shard) into the
table a person reads, and `problems()` lists what is not healthy — the exit
code of `kdsync status`.

    member dc1 (derecho, pid 4242, up 3m12s, wire 1)
    peer   link  in view  refused
    dc2    tcp   yes      -
    dc3    none  no       contract:protocol.name  group contract differs ...
    topic   status  view  members      delivered  fetch  ordering  produce  report  stalled
    events  active  4     dc1,dc2      120345     0      12        0        3       -
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable

__all__ = ["KAFKA_ERROR_RECENT_S", "RECENT_S", "member_status", "problems", "render"]

KAFKA_ERROR_RECENT_S = 15.0  # a Kafka client error this recent makes the member's status unhealthy
RECENT_S = 15.0  # a refusal or a second process claiming a peer's id is shown this long after it was last seen


def member_status(me: str, protocol: str, shard: int | None, started: float, wire: tuple[int, int],
                  pipelines: Iterable, transport, source, stalled: list[tuple[str, str]],
                  kafka_error: tuple[str, float] | None) -> dict[str, Any]:
    """The snapshot (module doc).  `pipelines`: kdsync.pipeline.TopicPipeline
    values; `transport`: the member's (links, refusals, twins); `source`: its
    SourceConsumer or None; `stalled`: (topic, stage) stalled now;
    `kafka_error`: (message, time.monotonic()) of the last Kafka client error."""
    now = time.monotonic()
    peers = sorted(transport.peers) if transport is not None else []
    refusals = dict(getattr(transport, "refusals", {}))
    twins = dict(getattr(transport, "twins", {}))
    tcp = getattr(transport, "tcp", None)  # RDMA's TCP fallback: its refusals count too
    if tcp is not None:
        refusals.update(tcp.refusals)
        twins.update(tcp.twins)
    refusals = {p: r for p, r in refusals.items() if now - r[2] <= RECENT_S}  # a dialer retries every few seconds
    twins = {p: line for p, (line, seen) in twins.items() if now - seen <= RECENT_S}
    stalls: dict[str, list[str]] = {}
    for topic, stage in stalled:
        stalls.setdefault(topic, []).append(stage)
    topics = []
    delays: dict[str, int] = {}  # clock: one-way delays (us) this member measured to its peers
    for p in sorted(pipelines, key=lambda p: p.topic):
        view = getattr(p.node, "view", None)
        w = p.writer
        leads = getattr(p.node, "leads", None)
        if leads is not None:
            for peer, us in leads.row().items():
                delays.setdefault(peer, us)
        topics.append({
            "topic": p.topic,
            "global_topic": p.global_topic,
            "status": p.node.status,
            "view": view.view_id if view is not None else None,
            "members": list(view.members) if view is not None else [],
            # clock: members that stopped cleanly and are fenced, in the view until they return (kdsync.core.fence)
            "fenced": sorted(getattr(p.node, "fenced", ())),
            "delivered": p.durable_end,
            "lag": {"fetch": source.unfetched(p.topic) if source is not None and not source.held_back else 0,
                    "ordering": p.own_waiting(),
                    "produce": w.unproduced if w is not None else 0,
                    "delivery report": w.outstanding if w is not None else 0},
            "stalled": stalls.get(p.topic, []),
            # clock: the lead in use (chosen from measured delays unless configured; docs/wan.md)
            "lead_ms": None if leads is None else round(p.node.lead_us / 1000, 1),
        })
    in_view = set().union(*(t["members"] for t in topics)) if topics else set()
    fenced = set().union(*(t["fenced"] for t in topics)) if topics else set()
    return {
        "member": me,
        "shard": shard,
        "protocol": protocol,
        "pid": os.getpid(),
        "uptime_s": round(now - started, 1),
        "wire": list(wire),
        "peers": [{"peer": peer,
                   "link": transport.path(peer) or "none",
                   "in_view": peer in in_view,
                   "fenced": peer in fenced,
                   "refused": (refusals[peer][1] if peer in refusals else None),
                   "refused_why": (refusals[peer][0] if peer in refusals else None),
                   "refused_s_ago": (round(now - refusals[peer][2], 1) if peer in refusals else None),
                   "twin": twins.get(peer),
                   "one_way_ms": round(delays[peer] / 1000, 1) if peer in delays else None} for peer in peers],
        "topics": topics,
        "kafka_error": (None if kafka_error is None else
                        {"error": kafka_error[0], "s_ago": round(now - kafka_error[1], 1)}),
    }


def problems(snap: dict[str, Any]) -> list[str]:
    """What is not healthy in one snapshot, one line each (empty: healthy)."""
    out = []
    who = snap.get("member", "?") + (f" shard {snap['shard']}" if snap.get("shard") is not None else "")
    if "error" in snap:
        return [f"{who}: {snap['error']}"]
    if not snap["topics"]:
        out.append(f"{who}: no topic is ordered yet")
    for t in snap["topics"]:
        if t["status"] != "active":
            out.append(f"{who}: topic {t['topic']} is {t['status']}")
        for stage in t["stalled"]:
            out.append(f"{who}: topic {t['topic']} stalled in stage {stage}")
    for p in snap["peers"]:
        if p["link"] == "none":
            out.append(f"{who}: no link to {p['peer']}" + (f" (refused: {p['refused_why']})" if p["refused"] else ""))
        if p["twin"]:
            out.append(f"{who}: {p['twin']}")
    k = snap.get("kafka_error")
    if k is not None and k["s_ago"] <= KAFKA_ERROR_RECENT_S:
        out.append(f"{who}: Kafka client error {k['s_ago']:g}s ago: {k['error']}")
    return out


def _uptime(s: float) -> str:
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(snaps: list[dict[str, Any]]) -> str:
    """The table a person reads (module doc), one block per snapshot."""
    out: list[str] = []
    for snap in snaps:
        if "error" in snap:
            out += [f"member {snap.get('member', '?')}: {snap['error']}", ""]
            continue
        shard = f" shard {snap['shard']}," if snap.get("shard") is not None else ""
        wire = snap["wire"][0] if snap["wire"][0] == snap["wire"][1] else f"{snap['wire'][0]}-{snap['wire'][1]}"
        out.append(f"member {snap['member']} ({snap['protocol']},{shard} pid {snap['pid']}, "
                   f"up {_uptime(snap['uptime_s'])}, wire {wire})")
        clock = snap["protocol"] == "clock"  # its measured delays and leads get a column each
        rows = [["peer", "link", "in view", *(["one-way"] if clock else []), "refused"]]
        for p in snap["peers"]:
            refused = "-" if not p["refused"] else f"{p['refused']} ({p['refused_s_ago']:g}s ago): {p['refused_why']}"
            one_way = [] if not clock else ["-" if p.get("one_way_ms") is None else f"{p['one_way_ms']:g}ms"]
            in_view = "fenced" if p.get("fenced") else "yes" if p["in_view"] else "no"
            rows.append([p["peer"], p["link"], in_view, *one_way, refused])
        out += _table(rows)
        rows = [["topic", "status", "view", "members", *(["lead"] if clock else []), "delivered", "fetch", "ordering",
                 "produce", "report", "stalled"]]
        for t in snap["topics"]:
            lag = t["lag"]
            lead = [] if not clock else ["-" if t.get("lead_ms") is None else f"{t['lead_ms']:g}ms"]
            rows.append([t["topic"], t["status"], "-" if t["view"] is None else str(t["view"]),
                         ",".join(m + ("(fenced)" if m in t.get("fenced", ()) else "") for m in t["members"]) or "-",
                         *lead, str(t["delivered"]), str(lag["fetch"]),
                         str(lag["ordering"]), str(lag["produce"]), str(lag["delivery report"]),
                         ",".join(t["stalled"]) or "-"])
        out += [""] + _table(rows)
        k = snap.get("kafka_error")
        if k is not None:
            out.append(f"last Kafka client error {k['s_ago']:g}s ago: {k['error']}")
        out.append("")
    bad = [line for s in snaps for line in problems(s)]
    out += ["not healthy:"] + [f"  {line}" for line in bad] if bad else ["healthy: every topic active, every peer linked"]
    return "\n".join(out)
