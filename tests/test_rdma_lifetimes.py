"""The RDMA transport's verbs-object lifetime rule (issue 44), on any host.

pyverbs 44 wraps librdmacm's shared verbs context and PD in every CMID's
Context/PD objects, which close what they wrap when finalized unless the
CMID's close() ran first; Cython's cyclic-GC clear of a CMID does not run
it.  kdsync.transport.rdma therefore closes every pyverbs object explicitly,
in dependency order, closes what an owner holds in the owner's finalizer
(run by the collector before it clears any reference), and parks an object
whose close() failed for the life of the process.  Checked here with fake
pyverbs objects that record what happens to them (the real ones are in the
soft-RoCE guest: tests/rdma, make test-rdma-stress)."""

from __future__ import annotations

import asyncio
import gc
import sys
import weakref

import pytest

from kdsync.transport import rdma
from kdsync.transport.handshake import Local

EVENTS: list[str] = []


class FakeError(Exception):
    pass


class Fake:
    """A pyverbs object: close() once; `fail` makes close() raise (as CMID.close does when
    rdma_destroy_id fails) and leaves it open."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail, self.open = name, fail, True

    def close(self) -> None:
        if not self.open:
            return
        if self.fail:
            EVENTS.append(f"close-failed {self.name}")
            raise FakeError(f"cannot close {self.name}")
        self.open = False
        EVENTS.append(f"close {self.name}")


class FakeCMID(Fake):
    """A CMID holding its Context/PD wrappers (as pyverbs' does); close() makes them inert."""

    def __init__(self, name: str, fail: bool = False) -> None:
        super().__init__(name, fail)
        self.ctx = Fake(f"{name}.ctx")

    def close(self) -> None:
        super().close()
        self.ctx.open = False  # NULLed: finalizing it closes nothing

    def disconnect(self) -> None:
        EVENTS.append(f"disconnect {self.name}")


class FakePV:
    Error = FakeError


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, msg, *args) -> None:
        self.lines.append(msg % args)

    debug = info = warning


def _transport(loop) -> rdma.RdmaTransport:
    """An RdmaTransport as start() leaves it, without a device: fakes for the listener, its
    event channel, the completion channel and the CQ."""
    t = rdma.RdmaTransport.__new__(rdma.RdmaTransport)
    t.member_id, t.secret, t.local = "a", b"s", Local({})
    t.peers = {"b": ("10.0.0.2", 7000)}
    t.recv_depth = t.send_depth = 4
    t.max_frame_bytes = 1 << 20
    t.log = _Log()
    t._pv = FakePV()
    t._loop = loop
    t._conns, t._by_qpn, t._in, t._peers, t.stats = set(), {}, {}, {}, {}
    t._closing = False
    t._cq, t._cc, t._listener, t._lchan = Fake("cq"), Fake("cc"), FakeCMID("listener"), Fake("lchan")
    t._cc_fd = t._lchan_fd = -1
    t.device_up = True
    return t


def _conn(t, name: str, role: str = "dialer", fail: bool = False) -> rdma._Conn:
    c = rdma._Conn(t, role, "b" if role == "dialer" else None)
    c.cmid = FakeCMID(name, fail)
    c.chan = Fake(f"{name}.chan") if role == "dialer" else None
    t._conns.add(c)  # the transport holds its connections, each connection its transport: a cycle
    return c


@pytest.fixture
def loop():
    EVENTS.clear()
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_a_transport_collected_unclosed_closes_its_cm_ids_before_the_cq(loop):
    """Dropped without close(), in a reference cycle: the collector's finalizers close every
    connection's cm id, then the CQ, the completion channel, the listener and its channel --
    none of them is left for Cython's clear, which would drop the Context/PD wrappers first."""
    t = _transport(loop)
    cmids = [_conn(t, "out-b").cmid, _conn(t, "in-b", role="listener").cmid]
    listener = t._listener
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is None
    assert all(not c.open and not c.ctx.open for c in cmids + [listener])
    order = [e for e in EVENTS if not e.endswith(".chan")]
    assert sorted(order[:2]) == ["close in-b", "close out-b"]  # the connections' cm ids (their QPs) first
    assert order[2:] == ["close cq", "close cc", "close listener", "close lchan"]
    assert EVENTS.index("close out-b") < EVENTS.index("close out-b.chan")  # an id before its event channel


def test_a_connection_collected_unclosed_closes_its_cm_id(loop):
    t = _transport(loop)
    c = _conn(t, "out-b")
    cmid = c.cmid
    t._conns.discard(c)
    c.peer_ref = c  # a cycle of its own
    del c
    gc.collect()
    assert not cmid.open and not cmid.ctx.open
    assert EVENTS == ["close out-b", "close out-b.chan"]


def test_fail_closes_the_cm_id_then_its_channel_and_drops_every_buffer(loop):
    t = _transport(loop)
    c = _conn(t, "out-b")
    c.connected = True
    c.recv_posted.append(Fake("mr"))
    c.send_free.append(Fake("mr2"))
    cmid = c.cmid
    t._fail(c, "test")
    assert EVENTS == ["disconnect out-b", "close out-b", "close out-b.chan"]
    assert c.cmid is None and c.chan is None and not c.recv_posted and not c.send_free
    assert not cmid.ctx.open and c not in t._conns
    t._release()


def test_a_cm_id_whose_close_fails_is_parked_never_finalized(loop):
    """CMID.close() raising leaves its Context/PD wrappers holding librdmacm's shared context:
    the object is kept for the life of the process (one reference that nothing drops)."""
    t = _transport(loop)
    c = _conn(t, "out-b", fail=True)
    bad = c.cmid
    finalized = []
    weakref.finalize(bad, finalized.append, True)
    before = len(rdma._PARKED)
    refs = sys.getrefcount(bad)
    t._fail(c, "test")
    assert rdma._PARKED[before:] == [bad]
    assert sys.getrefcount(bad) >= refs + 1  # the parked list and the extra reference
    assert any("kept open until the process exits" in line for line in t.log.lines)
    del bad, c
    gc.collect()
    assert finalized == []
    t._release()


def test_release_closes_cq_channel_listener_in_order_and_parks_a_failure(loop):
    t = _transport(loop)
    t._cc = Fake("cc", fail=True)
    cc = t._cc
    t._release()
    assert EVENTS == ["close cq", "close-failed cc", "close listener", "close lchan"]
    assert t._cq is t._cc is t._listener is t._lchan is None and not t.device_up
    assert rdma._PARKED[-1] is cc


def test_rdma_module_keeps_every_pyverbs_close_behind_the_rule():
    """No `.close()` of a pyverbs object outside _close_verbs: a new one would bypass the rule."""
    import inspect

    src = inspect.getsource(rdma)
    body = src[src.index("class _Conn"):]
    allowed = {"obj.close()"}
    calls = {line.strip() for line in body.splitlines() if ".close()" in line and "await" not in line}
    assert calls <= allowed | {"t.close()"}, calls - allowed
