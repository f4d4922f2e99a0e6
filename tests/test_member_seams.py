"""The member's parts are given what they need, not the member (issue 43).

- The import graph of kdsync/ and sim/ has no circle (imports under
  TYPE_CHECKING and inside functions included), and only the entry points
  import kdsync.member.
- A topic pipeline is opened and driven through the Ready handshake by a
  plain host object (kdsync.pipeline.PipelineHost, kdsync.handshake.HandshakeHost),
  with a fake producer and no broker: the hard state is on disk before the
  first delivery, the deliveries become records of the global topic, their
  reports make them durable.  (The producer recovery is driven the same way
  in tests/test_member_parts.py.)
"""

from __future__ import annotations

import ast
import asyncio
import graphlib
import logging
import random
from pathlib import Path

from kdsync.config import config_from_dict
from kdsync.core import Event, RemoteProtocolError, batches_from_events
from kdsync.handshake import ReadyHandshake
from kdsync.kafka.checkpoint import CheckpointRounds
from kdsync.kafka.records import H_SEQ, pack_payload
from kdsync.pipeline import Prepared, open_pipeline
from kdsync.state import StateLog

from test_member_parts import FakeProducer

ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = {"kdsync.cli", "kdsync.workers"}  # the modules that run a Member


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("kdsync", "sim"):
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for m, f in mods.items():
        deps = graph.setdefault(m, set())
        package = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps.update(r for r in map(resolve, names) if r and r != m)
    return graph


def test_no_import_circle_and_only_the_entry_points_import_the_member():
    graph = _import_graph()
    assert len(graph) > 80 and "kdsync.pipeline" in graph["kdsync.member"]  # the graph is the real one
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import circle: {' -> '.join(e.args[1])}") from None
    importers = {m for m, deps in graph.items() if "kdsync.member" in deps}
    assert importers <= ENTRY_POINTS, importers - ENTRY_POINTS


class _Host:
    """What kdsync.pipeline and kdsync.handshake may use of a member, and nothing else."""

    def __init__(self, d: Path):
        self.cfg = config_from_dict({"member": {"id": "dc1", "listen": "127.0.0.1:1"},
                                     "peers": {"dc1": "127.0.0.1:1"},
                                     "kafka": {"bootstrap.servers": "127.0.0.1:1"},  # never reached
                                     "topics": {"source": "t"}}, base_dir=str(d))
        self.pcfg = self.cfg.protocol
        self.me, self.shard, self.witness = "dc1", None, False
        self.kafka_conf = {"bootstrap.servers": "127.0.0.1:1"}
        self.rng = random.Random(7)
        self.metrics = None  # set by the test (MemberMetrics)
        self.trace = None
        self.producer = FakeProducer()
        self.loop = asyncio.get_running_loop()
        self.offsets_consumer = None
        self.checkpoint_rounds = CheckpointRounds()
        self.state_log = StateLog(d / "state")
        self.state_log.load()
        self.pipelines, self.starting, self.planned = {}, set(), set()
        self.fatals, self.frames, self.durables, self.on_disk_at_first_delivery = [], [], [], None
        self.handshake = ReadyHandshake(self, self.state_log)
        host = self

        class Transport:
            def send(self, peer, frame):
                host.frames.append((peer, frame))

        class Clock:
            def wake_if_busy(self, node):
                pass

        class Views:
            def set(self, topic, view_id):
                pass

        class Sleepers:
            views = Views()

        self.transport, self.clock, self.sleepers = Transport(), Clock(), Sleepers()

    async def retry(self, what, fn, *args):
        raise AssertionError(f"{what}: a prepared empty topic reads nothing of the broker")

    def before_input(self, p):
        pass

    def process(self, p):
        self.handshake.process(p)

    def fatal(self, msg):
        self.fatals.append(msg)

    def producer_failed(self, why):
        self.fatals.append(why)

    async def start_pipeline(self, topic, prepared=None):
        raise AssertionError("not asked here")

    def deliver(self, p, d):
        if self.on_disk_at_first_delivery is None:  # what a crash right now would find on disk
            self.on_disk_at_first_delivery = StateLog(self.state_log.path.parent).load()
        p.delivered_end = d.end_seq
        p.writer.write(d)
        p.checkpoint.delivered(d)

    def on_durable(self, p, end, commits):
        self.durables.append((end, commits))
        p.durable_end = end
        p.node.durable(end)
        p.checkpoint.durable(end)
        self.process(p)


def test_a_topic_pipeline_opened_and_driven_without_a_member(tmp_path):
    from kdsync.observability.metrics import MemberMetrics

    class Offset:
        def __init__(self, off):
            self.off = off

        def partition(self):
            return 0

        def offset(self):
            return self.off

    async def scenario():
        h = _Host(tmp_path)
        h.metrics = MemberMetrics(dict, dict, lambda: ({}, None))
        p, start, hs = await open_pipeline(h, "t", Prepared(1, empty=True))
        assert (p.global_topic, start.end, hs, p.writer is not None) == ("t-global", 0, None, True)
        for _ in range(100):  # a group of one forms alone
            p.node.tick()
            h.process(p)
            await asyncio.sleep(0)  # the iteration ends: held hard states are saved
            if p.node.status == "active":
                break
        assert p.node.status == "active", p.node.status
        events = [Event("dc1", 0, o, pack_payload(f"k{o}".encode(), b"v", []), 1000 + o) for o in range(3)]
        p.node.submit(list(batches_from_events(events)))
        for _ in range(20):
            p.node.tick()
            h.process(p)
            await asyncio.sleep(0)
        recs = h.producer.records
        assert [(t, k) for t, k, *_ in recs] == [("t-global", b"k0"), ("t-global", b"k1"), ("t-global", b"k2")]
        assert [dict(r[3])[H_SEQ] for r in recs] == [b"0", b"1", b"2"]
        assert "t" in h.on_disk_at_first_delivery  # the view's hard state was on disk before any delivery
        for i, r in enumerate(recs):
            r[5](None, Offset(i))
        for _ in range(10):
            await asyncio.sleep(0)
        assert h.durables == [(3, {0: 3})] and p.durable_end == 3 and h.fatals == []
        await p.close()
        h.state_log.close()

    asyncio.run(scenario())


class _Node:
    def __init__(self, bad: bytes = b"bad"):
        self.got: list[tuple[str, bytes]] = []
        self.clocks = 0
        self.bad = bad

    def clock(self, now_us: int) -> None:
        self.clocks += 1

    def receive(self, peer: str, data: bytes) -> None:
        if data == self.bad:
            raise RemoteProtocolError("malformed")
        self.got.append((peer, data))


class _Pipe:
    def __init__(self):
        self.node = _Node()


def test_the_peer_inbox_routes_keeps_early_frames_and_drops_bad_ones_without_a_member(caplog):
    from kdsync.inbox import EARLY_MESSAGES, PeerInbox
    from kdsync.transport.channels import frame_channel

    pipes: dict[str, _Pipe] = {"t1": _Pipe()}
    calls: list[tuple] = []
    started: list[str] = []

    async def start(topic: str) -> None:
        started.append(topic)

    async def scenario() -> None:
        inbox = PeerInbox(pipes, heard=lambda peer, topic, body: body == b"ping", orders=lambda t: t != "other",
                          known=lambda t: t in pipes or t in started, start=start,
                          due=lambda: calls.append(("due",)), wake=lambda p: calls.append(("wake", p)),
                          process=lambda p: calls.append(("process", p)), bad=lambda peer: calls.append(("bad", peer)))
        inbox.on_message("b", frame_channel("t1", b"m1"))
        assert pipes["t1"].node.got == [("b", b"m1")] and pipes["t1"].node.clocks == 1
        assert calls == [("due",), ("wake", pipes["t1"]), ("process", pipes["t1"])]  # ticks due first, then drained
        calls.clear()
        inbox.on_message("b", frame_channel("t1", b"ping"))  # the liveness layer's: not the node's
        inbox.on_message("c", frame_channel("other", b"x"))  # a topic this member does not order: dropped
        assert pipes["t1"].node.got == [("b", b"m1")] and not inbox.early and not calls
        for i in range(EARLY_MESSAGES + 2):  # a peer formed t2 first: kept (bounded) and t2 started once
            inbox.on_message("c", frame_channel("t2", b"e%d" % i))
        await asyncio.sleep(0)
        assert started == ["t2"] and len(inbox.early["t2"]) == EARLY_MESSAGES
        pipes["t2"] = _Pipe()
        inbox.replay("t2", pipes["t2"].node)
        got = pipes["t2"].node.got
        assert got[0] == ("c", b"e2") and got[-1] == ("c", b"e%d" % (EARLY_MESSAGES + 1)) and "t2" not in inbox.early
        with caplog.at_level(logging.WARNING, logger="kdsync.member"):
            inbox.on_message("d", b"")  # no channel header
            inbox.on_message("d", frame_channel("t1", b"bad"))  # the node's codec refuses it
        assert calls == [("bad", "d"), ("due",), ("wake", pipes["t1"]), ("bad", "d")]
        assert len([r for r in caplog.records if "malformed message from peer" in r.getMessage()]) == 1  # 1 a second

    asyncio.run(scenario())


class _Err:
    def __init__(self, code: int, text: str, fatal: bool = False):
        self._code, self._text, self._fatal = code, text, fatal

    def code(self) -> int:
        return self._code

    def str(self) -> str:
        return self._text

    def fatal(self) -> bool:
        return self._fatal


def test_kafka_errors_and_the_report_poller_without_a_member(caplog):
    from confluent_kafka import KafkaException

    from kdsync.kafka.sink import REPORT_POLL_S, ReportPoller
    from kdsync.observability.logs import KafkaErrors

    fatal: list[str] = []
    errors = KafkaErrors(fatal.append, logging.getLogger("kdsync.member"))
    with caplog.at_level(logging.WARNING, logger="kdsync.member"):
        for _ in range(3):  # a broker down: one line per error code per 5 s
            errors(_Err(-195, "broker transport failure"))
        errors(_Err(-187, "all brokers down"))
    assert [r.kv["error"] for r in caplog.records] == ["broker transport failure", "all brokers down"]
    assert errors.last[0] == "all brokers down" and not fatal
    errors(_Err(-150, "fenced", fatal=True))
    assert fatal == ["kafka: fenced"]

    class Producer:
        polls = 0
        raise_next = False

        def poll(self, timeout: float) -> None:
            Producer.polls += 1
            if Producer.raise_next:
                Producer.raise_next = False
                raise KafkaException(_Err(-150, "out of order sequence", fatal=True))

    failed: list[str] = []
    outstanding = [3]

    def take_one() -> bool:  # three polls' worth of reports outstanding
        outstanding[0] -= 1
        return outstanding[0] > 0

    producer = Producer()
    poller = ReportPoller(lambda: producer, failed.append, take_one, lambda: False)
    Producer.raise_next = True
    poller.poll()
    assert failed == ["kafka producer: out of order sequence"]  # raised by poll(), not error_cb

    async def scenario() -> None:
        before = Producer.polls
        poller.soon()
        poller.soon()  # one timer, not two
        await asyncio.sleep(REPORT_POLL_S * 10)
        assert Producer.polls - before == 3  # on while reports are outstanding, then stops

    asyncio.run(scenario())


def test_a_producer_error_is_routed_and_the_last_reports_are_drained_without_a_member():
    from kdsync.kafka.sink import ReportPoller
    from kdsync.observability.logs import KafkaErrors

    fatal, recovered = [], []
    errors = KafkaErrors(fatal.append, logging.getLogger("kdsync.member"))
    producer_cb = errors.routed(recovered.append)
    producer_cb(_Err(-195, "broker transport failure"))
    producer_cb(_Err(-150, "fenced", fatal=True))
    assert recovered == ["fenced"] and not fatal  # the producer's fatal error is recovered, not the member's
    assert errors.last[0] == "fenced"

    class Writer:
        def __init__(self, reports: int) -> None:
            self.outstanding, self.reported = reports, False

        def report_durable(self) -> None:
            self.reported = True

    writers = [Writer(2), Writer(1)]

    class Producer:
        def poll(self, timeout: float) -> None:  # each poll serves one report of every writer
            for w in writers:
                w.outstanding = max(0, w.outstanding - 1)

    poller = ReportPoller(lambda: Producer(), recovered.append, lambda: True, lambda: True)
    asyncio.run(poller.drain(writers, timeout=5.0))
    assert [(w.outstanding, w.reported) for w in writers] == [(0, True), (0, True)]
    stuck = [Writer(1)]
    asyncio.run(ReportPoller(lambda: _Silent(), recovered.append, lambda: True, lambda: True).drain(stuck, 0.2))
    assert stuck[0].outstanding == 1 and stuck[0].reported  # bounded: what is durable is still reported


class _Silent:
    def poll(self, timeout: float) -> None:
        pass


def test_the_tick_pass_over_groups_without_a_member():
    """kdsync.ticks.GroupTicks: sleeping groups are neither asked nor ticked,
    an awake group is ticked n times and drained, a group in a view change
    waits for a forming slot, and the pass ends with `after(now)`."""
    from kdsync.ticks import FormingSlots, GroupTicks, Sleepers

    class Node:
        def __init__(self, status: str) -> None:
            self.status, self.ticks, self.heard_ago, self.busy = status, 0, None, False

        def clock(self, us: int) -> None:
            pass

        def tick(self) -> None:
            self.ticks += 1

        def heard(self, ago: dict) -> None:
            self.heard_ago = ago

        def quiet(self) -> bool:
            return not self.busy

    class P:
        def __init__(self, topic: str, status: str) -> None:
            self.topic, self.node = topic, Node(status)

    groups = {"a": P("a", "active"), "b": P("b", "forming"), "c": P("c", "forming")}
    sleepers = Sleepers(["dc2"], 2, 10, lambda peer, frame: None, sleep=False)
    drained, after = [], []
    ticks = GroupTicks(groups, sleepers, FormingSlots(1, 40), lambda p: drained.append(p.topic), after.append)
    assert ticks.quiet()
    groups["a"].node.busy = True
    assert not ticks.quiet()
    ticks(3, 1.5)
    assert groups["a"].node.ticks == 3 and after == [1.5]
    assert groups["a"].node.heard_ago is not None  # the member's liveness, before its ticks
    ticks(1, 1.6)  # one forming slot: the first group in line runs, the other waits
    formed = [t for t in "bc" if groups[t].node.ticks]
    assert len(formed) == 1 and drained.count(formed[0]) == 1 and drained.count("a") == 2
