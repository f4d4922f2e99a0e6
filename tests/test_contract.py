"""The group contract at the door (kdsync.contract, kdsync.transport.handshake):
members that disagree are refused by name at both ends, wire versions are
compared, an older release is let in, probes are never a member's link, two
processes claiming one id are named, one process per state directory, and
addresses that would dial the wrong member are a config error."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import pytest

from kdsync.config import ConfigError, config_from_dict
from kdsync.contract import GROUP_WIDE, differences, group_contract
from kdsync.fatal import FatalError
from kdsync.state import StateDirLock
from kdsync.transport.framing import FrameDecoder
from kdsync.transport.handshake import ContractError, DialerHandshake, HandshakeError, ListenerHandshake, Local
from kdsync.transport.tcp import TcpTransport, probe

pytestmark = pytest.mark.timeout(60)


def cfg(me="dc1", peers=("dc1", "dc2", "dc3"), **sections):
    data = {"member": {"id": me, "listen": f"127.0.0.1:{7400 + 10 * int(me[-1])}"},
            "peers": {p: f"127.0.0.1:{7400 + 10 * int(p[-1])}" for p in peers},
            "kafka": {"bootstrap.servers": "127.0.0.1:9092"},
            "topics": {"source": "events"}}
    for sec, vals in sections.items():
        data.setdefault(sec, {}).update(vals)
    return config_from_dict(data)


def frame(data: bytes):
    (f,) = FrameDecoder().feed(data)
    return f


def shake(d: DialerHandshake, lst: ListenerHandshake):
    """Both halves through real frames; returns (dialer error, listener error)."""
    to_listener = d.hello()
    while True:
        try:
            reply = lst.receive(frame(to_listener))
        except ContractError as e:
            if e.reply is None:
                return None, e
            try:
                d.receive(frame(e.reply))
            except HandshakeError as de:
                return de, e
            return None, e
        try:
            back = d.receive(frame(reply))
        except HandshakeError as e:
            return e, None
        if back is None:
            return None, None
        to_listener = back


# every row of the operator's table that reaches the handshake: the setting each must name
ODD = [
    ("protocol.name", dict(protocol={"name": "clock"}), "derecho", "clock"),
    ("protocol.commit_quorum", dict(protocol={"commit_quorum": 2}), "0", "2"),
    ("protocol.quiesce", dict(protocol={"quiesce": False}), "true", "false"),
    ("topics.source", dict(topics={"source": "orders"}), "events", "orders"),
    ("topics.global_suffix", dict(topics={"global_suffix": "-all"}), "-global", "-all"),
    ("topics.global_partitions", dict(topics={"global_partitions": 3}), "1", "3"),
]


@pytest.mark.parametrize("setting, odd, ours, theirs", ODD, ids=[o[0] for o in ODD])
def test_a_member_that_differs_is_refused_at_both_ends_naming_the_setting_and_both_values(setting, odd, ours, theirs):
    good, bad = cfg("dc1"), cfg("dc3", **odd)
    d = DialerHandshake("dc3", "dc1", b"s", local=Local(group_contract(bad)))
    lst = ListenerHandshake("dc1", {"dc1", "dc2", "dc3"}, b"s", local=Local(group_contract(good)))
    derr, lerr = shake(d, lst)
    assert isinstance(lerr, ContractError) and isinstance(derr, ContractError)
    assert f"{setting} = {ours} here, {theirs} at the peer" in str(lerr)
    assert f"{setting} = {theirs} here, {ours} at the peer" in str(derr)
    assert lerr.reason == derr.reason == f"contract:{setting}"
    assert not lst.done and not d.done


def test_a_peer_list_with_a_member_the_others_do_not_know_is_refused_naming_both_lists():
    good, bad = cfg("dc1"), cfg("dc3", peers=("dc0", "dc1", "dc2", "dc3"))
    assert differences(group_contract(good), group_contract(bad))[0][:] == (
        "members", "dc1,dc2,dc3", "dc0,dc1,dc2,dc3")
    derr, lerr = shake(DialerHandshake("dc3", "dc1", None, local=Local(group_contract(bad))),
                       ListenerHandshake("dc1", {"dc1", "dc2", "dc3"}, None, local=Local(group_contract(good))))
    assert "members = dc0,dc1,dc2,dc3 here, dc1,dc2,dc3 at the peer" in str(derr)
    assert "members = dc1,dc2,dc3 here, dc0,dc1,dc2,dc3 at the peer" in str(lerr)


def test_roles_shards_and_the_shard_index_are_in_the_contract_member_settings_are_not():
    base = group_contract(cfg("dc1"))
    assert set(base) <= set(GROUP_WIDE)
    witness = config_from_dict({"member": {"id": "dc1", "listen": "127.0.0.1:7401"},
                                "peers": {"dc1": "127.0.0.1:7401", "dc2": "127.0.0.1:7402",
                                          "dc3": {"address": "127.0.0.1:7403", "role": "witness"}},
                                "kafka": {"bootstrap.servers": "x:1"}, "topics": {"source": "events"}})
    assert group_contract(witness)["members"] == "dc1,dc2,dc3(witness)"
    assert group_contract(cfg("dc1", topics={"shards": 2}), 1)["shard"] == "1"
    assert [d.setting for d in differences(group_contract(cfg("dc1", topics={"shards": 2}), 0),
                                           group_contract(cfg("dc2", topics={"shards": 2}), 1))] == ["shard"]
    # a member's own settings may differ: id, listen, lead, timeouts, Kafka clients, coalescing
    mine = cfg("dc2", protocol={"clock_lead_ms": 30, "suspect_ms": 900, "tick_ms": 5},
               kafka={"linger.ms": 5}, member={"coalesce_us": 2000})
    assert differences(base, group_contract(mine)) == []
    # a witness without source topics compares what it has
    bare = config_from_dict({"member": {"id": "w", "listen": "127.0.0.1:7409", "role": "witness"},
                             "peers": {"dc1": "127.0.0.1:7401", "dc2": "127.0.0.1:7402", "dc3": "127.0.0.1:7403",
                                       "w": "127.0.0.1:7409"}})
    assert "topics.source" not in group_contract(bare)


def test_matching_contracts_pass_and_an_older_release_without_one_is_let_in():
    c = group_contract(cfg("dc1"))
    d = DialerHandshake("dc2", "dc1", b"k", local=Local(c, listen="127.0.0.1:7402"))
    lst = ListenerHandshake("dc1", {"dc1", "dc2"}, b"k", local=Local(c))
    assert shake(d, lst) == (None, None)
    assert d.done and lst.done and not d.legacy and not lst.legacy
    assert lst.peer_listen == "127.0.0.1:7402" and lst.peer_incarnation == d.local.incarnation
    # an older dialer (no wire, no contract) and an older listener
    old_d, new_l = DialerHandshake("dc2", "dc1", b"k"), ListenerHandshake("dc1", {"dc1", "dc2"}, b"k", local=Local(c))
    assert shake(old_d, new_l) == (None, None) and new_l.legacy
    new_d, old_l = DialerHandshake("dc2", "dc1", b"k", local=Local(c)), ListenerHandshake("dc1", {"dc1", "dc2"}, b"k")
    assert shake(new_d, old_l) == (None, None) and new_d.legacy


def test_wire_versions_without_overlap_are_refused_naming_both_ranges():
    c = group_contract(cfg("dc1"))
    d = DialerHandshake("dc2", "dc1", None, local=Local(c, wire=(3, 4)))
    lst = ListenerHandshake("dc1", {"dc1", "dc2"}, None, local=Local(c, wire=(1, 2)))
    derr, lerr = shake(d, lst)
    assert "this member speaks 1-2, dc2 speaks 3-4" in str(lerr) and lerr.reason == "wire_version"
    assert "this member speaks 3-4, dc1 speaks 1-2" in str(derr) and derr.reason == "wire_version"
    ok = shake(DialerHandshake("dc2", "dc1", None, local=Local(c, wire=(2, 3))),
               ListenerHandshake("dc1", {"dc1", "dc2"}, None, local=Local(c, wire=(1, 2))))
    assert ok == (None, None)


def test_only_a_probe_may_speak_as_the_listener_itself():
    c = group_contract(cfg("dc1"))
    with pytest.raises(HandshakeError, match="unknown member id 'dc1'"):
        ListenerHandshake("dc1", {"dc1", "dc2"}, None, local=Local(c)).receive(
            frame(DialerHandshake("dc1", "dc1", None, local=Local(c)).hello()))
    d = DialerHandshake("dc1", "dc1", b"k", local=Local(c), probe="status")
    lst = ListenerHandshake("dc1", {"dc1", "dc2"}, b"k", local=Local(c))
    assert shake(d, lst) == (None, None) and lst.probe == "status" and d.peer_contract == c
    with pytest.raises(HandshakeError, match="unknown probe"):
        ListenerHandshake("dc1", {"dc2"}, None).receive(frame(DialerHandshake("dc2", "dc1", None, probe="x").hello()))


def test_a_second_incarnation_that_comes_back_is_named_a_restart_is_not(caplog):
    t = TcpTransport("dc1", ("127.0.0.1", 1), {"dc2": ("127.0.0.1", 7402)}, lambda *_: None)
    with caplog.at_level(logging.ERROR, logger="kdsync.transport"):
        for inc in ("a", "b", "c"):  # restarts: a new incarnation each time, never an old one
            assert t.note_incarnation("dc2", inc, "127.0.0.1:7402", "127.0.0.1:5000")
        assert not caplog.records and not t.twins
        assert t.note_incarnation("dc2", "d", "127.0.0.1:7492", "127.0.0.1:6000")  # a copy: could be a restart
        assert t.note_incarnation("dc2", "c", "127.0.0.1:7402", "127.0.0.1:5001")  # the real one back: two
        # from now on the copy, not at dc2's configured address, is refused; the real one is not
        assert not t.note_incarnation("dc2", "d", "127.0.0.1:7492", "127.0.0.1:6001")
        assert t.note_incarnation("dc2", "c", "0.0.0.0:7402", "127.0.0.1:5002")
        assert t.note_incarnation("dc2", "e", "127.0.0.1:7402", "127.0.0.1:5003")  # the real one restarted
        # a copy at another address while the real one's link is up cannot be its restart: refused at once
        t2 = TcpTransport("dc1", ("127.0.0.1", 1), {"dc2": ("127.0.0.1", 7402)}, lambda *_: None)
        assert t2.note_incarnation("dc2", "x", "127.0.0.1:7402", "127.0.0.1:5000")
        assert not t2.note_incarnation("dc2", "y", "127.0.0.1:7492", "127.0.0.1:6000", live=True)
        assert "dc2" in t2.twins
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # one line a minute for each transport
    assert "two processes claim member dc2" in lines[0] and "127.0.0.1:7402" in lines[0] and "127.0.0.1:7492" in lines[0]
    assert "two processes claim member dc2" in t.twins["dc2"][0]


def test_refusals_are_counted_by_reason_and_logged_once_per_reason_until_admitted(caplog):
    t = TcpTransport("dc1", ("127.0.0.1", 1), {"dc2": ("127.0.0.1", 2)}, lambda *_: None)
    err = ContractError("group contract differs from dc2's: protocol.name = derecho here, clock at the peer",
                        "contract:protocol.name")
    with caplog.at_level(logging.INFO, logger="kdsync.transport"):
        for _ in range(5):
            t.note_refusal("dc2", "refused connection from x", err)
        t.note_admitted("dc2")
        t.note_refusal("dc2", "refused connection from x", err)
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]
    assert t.stats["dc2"].refused == 6 and t.stats["dc2"].refusals == {"contract:protocol.name": 6}


def test_real_sockets_refuse_a_member_with_another_contract_and_probes_are_answered(caplog):
    """Two TcpTransports on loopback: the odd one is refused, counted and
    named at both ends; a check probe and a status probe are answered by a
    running transport and never displace a member's link."""
    from tests.test_tcp_transport import FAST, free_ports

    async def main():
        pa, pb, pc = free_ports(3)
        peers = {"a": ("127.0.0.1", pa), "b": ("127.0.0.1", pb), "c": ("127.0.0.1", pc)}
        good = {"protocol.name": "derecho", "members": "a,b,c"}
        got = []
        logs = {n: logging.getLogger(f"kdsync.transport.{n}") for n in "abc"}
        ta = TcpTransport("a", peers["a"], peers, lambda p, m: got.append((p, m)), secret=b"k",
                          local=Local(good, listen=f"127.0.0.1:{pa}"), logger=logs["a"], **FAST)
        tb = TcpTransport("b", peers["b"], peers, lambda p, m: None, secret=b"k", local=Local(good),
                          logger=logs["b"], **FAST)
        tc = TcpTransport("c", peers["c"], peers, lambda p, m: None, secret=b"k",
                          local=Local({**good, "protocol.name": "clock"}), logger=logs["c"], **FAST)
        ta.status = lambda: {"member": "a", "hello": 1}
        for t in (ta, tb, tc):
            await t.start()
        try:
            for _ in range(200):
                if tb.stats["a"].connected and ta.stats["c"].refusals and tc.stats["a"].refusals:
                    break
                await asyncio.sleep(0.02)
            assert tb.stats["a"].connected and not tc.stats["a"].connected and not ta.stats["c"].connected
            assert ta.stats["c"].refusals.get("contract:protocol.name", 0) >= 1
            assert tc.stats["a"].refusals.get("contract:protocol.name", 0) >= 1
            tb.send("a", b"m1")
            # probes: a check answers the contract, a status the snapshot; b's link to a stays
            res = await probe(peers["a"], "b", "a", b"k", Local(good), "check")
            assert res.contract == good and res.status is None
            res = await probe(peers["a"], "a", "a", b"k", Local(good), "status")
            assert res.status == {"member": "a", "hello": 1}
            with pytest.raises(ContractError, match="protocol.name = clock here, derecho at the peer"):
                await probe(peers["a"], "c", "a", b"k", Local({**good, "protocol.name": "clock"}), "check")
            with pytest.raises(HandshakeError, match="secret"):
                await probe(peers["a"], "b", "a", b"wrong", Local(good), "check")
            tb.send("a", b"m2")
            for _ in range(200):
                if len(got) == 2:
                    break
                await asyncio.sleep(0.02)
            assert got == [("b", b"m1"), ("b", b"m2")]
        finally:
            for t in (ta, tb, tc):
                await t.close()

    with caplog.at_level(logging.INFO, logger="kdsync.transport"):
        asyncio.run(main())
    errors = [(r.name[-1], r.getMessage()) for r in caplog.records
              if r.levelno == logging.ERROR and r.name.startswith("kdsync.transport.")]
    # one line at each end for each pair (a's listener and dialer say the same: once); none for the probe
    assert sorted((n, m.split(": ", 1)[1]) for n, m in errors) == sorted([
        ("a", "group contract differs from c's: protocol.name = derecho here, clock at the peer (every member "
              "must use the same; docs/config.md)"),
        ("b", "group contract differs from c's: protocol.name = derecho here, clock at the peer (every member "
              "must use the same; docs/config.md)"),
        ("c", "group contract differs from a's: protocol.name = clock here, derecho at the peer (every member "
              "must use the same; docs/config.md)"),
        ("c", "group contract differs from b's: protocol.name = clock here, derecho at the peer (every member "
              "must use the same; docs/config.md)")]), errors


# ---------------------------------------------------------------- one process per state directory
def test_a_second_process_on_a_state_directory_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from kdsync.state import StateDirLock; "
                               f"StateDirLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        lock = StateDirLock(tmp_path)
        with pytest.raises(FatalError, match=f"in use by process {holder.pid} "):
            lock.acquire()
        assert lock.held_by_other() == holder.pid
    finally:
        holder.stdin.close()
        holder.wait(10)
    lock = StateDirLock(tmp_path)  # the holder ended (however it ends, the kernel drops the lock)
    assert lock.held_by_other() is None
    lock.acquire()
    assert (tmp_path / "lock").read_text().strip() == str(os.getpid())
    lock.release()


# ---------------------------------------------------------------- addresses that would dial the wrong member
@pytest.mark.parametrize("change, message", [
    (dict(peers={"dc3": "127.0.0.1:7402"}), "peers.dc3: '127.0.0.1:7402': dc2 and dc3 are at the same address"),
    (dict(peers={"dc1": "10.0.0.1:7401", "dc2": "localhost:7401"}),
     "peers.dc2: 'localhost:7401' is this member's own listen address"),
    (dict(member={"listen": "0.0.0.0:7401"}, peers={"dc1": "10.0.0.1:7401", "dc2": "127.0.0.1:7401"}),
     "peers.dc2: '127.0.0.1:7401' is this member's own listen address"),
    (dict(topics={"shards": 2}), "peers.dc2: '127.0.0.1:7402': dc1 and dc2 are at overlapping ports"),
])
def test_two_members_at_one_address_is_a_config_error(change, message):
    data = {"member": {"id": "dc1", "listen": "127.0.0.1:7401"},
            "peers": {"dc1": "127.0.0.1:7401", "dc2": "127.0.0.1:7402", "dc3": "127.0.0.1:7403"},
            "kafka": {"bootstrap.servers": "x:1"}, "topics": {"source": "events"}}
    for sec, vals in change.items():
        data[sec] = {**data[sec], **vals}
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value).startswith(f"config error: {message}"), str(e.value)
    assert "\n" not in str(e.value)



def test_each_refusal_reason_is_logged_once_until_the_peer_is_admitted(caplog):
    """A contract refusal is one ERROR per peer until it is admitted, also
    when another reason (a reset connection, a timeout) came between two of
    them — a busy box resets links between a dial and the peer's own dial
    (CI logged one contract error twice that way)."""
    peers = {"a": ("127.0.0.1", 1), "c": ("127.0.0.1", 2)}
    t = TcpTransport("a", peers["a"], peers, lambda p, m: None, secret=b"k", local=Local({"members": "a,c"}),
                     logger=logging.getLogger("kdsync.transport.a"))
    contract = ContractError("group contract differs from c's: protocol.name = derecho here, clock at the peer",
                             "contract:protocol.name")
    with caplog.at_level(logging.INFO, logger="kdsync.transport"):
        t.note_refusal("c", "refused connection from 127.0.0.1:5", contract)
        t.note_refusal("c", "handshake with c failed", HandshakeError("peer closed the connection"))
        t.note_refusal("c", "handshake with c failed", contract)
        t.note_refusal("c", "handshake with c failed", HandshakeError("peer closed the connection"))
        assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.WARNING]
        assert t.stats["c"].refusals == {"contract:protocol.name": 2, "handshake": 2}
        assert t.refusals["c"][0] == "peer closed the connection"  # status shows the last one
        t.note_admitted("c")
        t.note_refusal("c", "handshake with c failed", contract)  # admitted, then refused again: said again
        assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.WARNING, logging.ERROR]
