"""Interaction transcripts (etcd raft's datadriven tests for kdsync).

A transcript is a text file of commands, each line starting with `> `,
followed by what the command printed.  `run_transcript(text)` replays the
commands against a fresh `InMemoryNetwork` and returns the text it should
contain; the test compares, and KDSYNC_REWRITE=1 rewrites the files.

Commands:
  add-nodes N [witness=ID] [protocol=P] [seed=S]   create the group m0..mN-1
  submit ID COUNT [partition=P]                    local source events
  tick [N]                                         N ticks everywhere (then stabilize)
  tick-raw [N] / step [N]                          ticks without exchanging / one exchange round
  stabilize                                        exchange messages until quiet
  crash ID | restart ID                            kill (memory lost) / restart
  isolate ID | partition A B | C D | cut A B | recover
  drop A B PROB | duplicate PROB | reorder
  status                                           view, status and position per node
  topics                                           each member's global topic
  check [live=ID,ID]                               the outside checker
  messages                                         peer messages sent since the last `messages`, by type
"""

from __future__ import annotations

from kdsync.testing.network import InMemoryNetwork, check_invariants


def _fmt_topic(evs) -> str:
    out, run = [], None
    for e in evs:
        key = (e.origin, e.partition)
        if run and run[0] == key and run[2] + 1 == e.offset:
            run[2] = e.offset
        else:
            if run:
                out.append(run)
            run = [key, e.offset, e.offset]
    if run:
        out.append(run)
    parts = []
    for (o, p), a, b in out:
        tag = f"{o}" + (f"/{p}" if p else "")
        parts.append(f"{tag}:{a}" if a == b else f"{tag}:{a}-{b}")
    return " ".join(parts) if parts else "(empty)"


def _message_names(protocol: str) -> dict[int, str]:
    from kdsync.core import messages as m
    from kdsync.core.mirror import MIRROR_MESSAGES

    classes = {"mirror": MIRROR_MESSAGES, "clock": m.CLOCK_MESSAGES}.get(protocol, m.SEQUENCER_MESSAGES)
    return {c.TYPE: c.__name__.lower() for c in classes}


def run_transcript(text: str) -> str:
    net: InMemoryNetwork | None = None
    submitted: set = set()
    out: list[str] = []
    for line in text.splitlines():
        if not line.startswith("> "):
            continue
        cmd = line[2:].strip()
        out.append(line)
        args = cmd.split()
        name, rest = args[0], args[1:]
        kv = dict(a.split("=", 1) for a in rest if "=" in a)
        pos = [a for a in rest if "=" not in a]
        mark = len(net.log) if net else 0
        if name == "add-nodes":
            n = int(pos[0])
            wit = tuple(kv["witness"].split(",")) if "witness" in kv else ()
            net = InMemoryNetwork(
                [f"m{i}" for i in range(n)],
                protocol=kv.get("protocol", "derecho"),
                seed=int(kv.get("seed", 0)),
                witnesses=wit,
                suspect_ticks=8,
                heartbeat_ticks=2,
                retransmit_ticks=3,
            )
            mark = 0
        elif name == "submit":
            evs = net.submit(pos[0], int(pos[1]), int(kv.get("partition", 0)))
            submitted |= {(e.origin, e.partition, e.offset) for e in evs}
        elif name == "tick":
            net.tick(int(pos[0]) if pos else 1)
        elif name == "stabilize":
            net.stabilize()
        elif name == "tick-raw":
            for _ in range(int(pos[0]) if pos else 1):
                for i in net.ids:
                    if net.node(i) is not None:
                        net.node(i).tick()
        elif name == "step":
            for _ in range(int(pos[0]) if pos else 1):
                net._process_ready()
                n = net.deliver_msgs()
                out.append(f"  ({n} messages delivered)")
        elif name == "crash":
            net.crash(pos[0])
        elif name == "restart":
            net.restart(pos[0])
        elif name == "isolate":
            net.isolate(pos[0])
        elif name == "partition":
            groups = " ".join(pos).split("|")
            net.partition(*[g.split() for g in groups])
        elif name == "cut":
            net.cut(pos[0], pos[1])
        elif name == "recover":
            net.recover()
        elif name == "drop":
            net.drop(pos[0], pos[1], float(pos[2]))
        elif name == "duplicate":
            net.dup_prob = float(pos[0])
        elif name == "reorder":
            net.reorder = True
        elif name == "status":
            for i in net.ids:
                nd = net.node(i)
                if nd is None:
                    out.append(f"{i}: down")
                    continue
                sn = nd.snapshot()
                out.append(
                    f"{i}: {sn['status']} view={sn.get('view', '-')} members={','.join(sn.get('members', []))} next={sn['next_seq']}"
                )
        elif name == "topics":
            for i in net.ids:
                if net.roles.get(i) == "witness":
                    out.append(f"{i}: (witness)")
                else:
                    out.append(f"{i}: {_fmt_topic(net.topic(i))}")
        elif name == "messages":
            counts, net.sent_by_type = net.sent_by_type, {}
            total = sum(counts.values())
            names = _message_names(net.protocol)
            parts = [f"{names.get(t, t)}={n}" for t, n in sorted(counts.items())]
            out.append(f"{total} messages" + (": " + " ".join(parts) if parts else ""))
        elif name == "check":
            live = kv["live"].split(",") if "live" in kv else None
            problems = check_invariants(net, submitted=submitted, live=live)
            out.extend(problems or ["ok: agreement, integrity, origin order, no loss"])
        else:
            raise ValueError(f"unknown transcript command {name!r}")
        out.extend(f"  {entry}" for entry in net.log[mark:])
    return "\n".join(out) + "\n"
