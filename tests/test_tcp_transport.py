"""TCP transport: round trip, reconnect, back-pressure, refusals, TLS.

Everything runs on 127.0.0.1 with free ports, inside `asyncio.run` (no
pytest-asyncio needed).  Waits poll for a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import shutil
import socket
import subprocess
import sys
from collections import defaultdict
from collections.abc import AsyncIterator

import pytest

from kdsync.transport import TLSSettings, Transport, TransportError, make_transport
from kdsync.transport.framing import AUTH, HELLO, FrameDecoder, encode_frame
from kdsync.transport.handshake import DialerHandshake
from kdsync.transport.tcp import TcpTransport

pytestmark = pytest.mark.timeout(60)

FAST = dict(backoff_initial=0.02, backoff_max=0.2, handshake_timeout=2.0, ping_interval=0.2)


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def async_test(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 50))

    return wrapper


async def until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Inbox:
    def __init__(self) -> None:
        self.got: dict[str, list[bytes]] = defaultdict(list)

    def __call__(self, peer: str, data: bytes) -> None:
        self.got[peer].append(data)

    def count(self) -> int:
        return sum(len(v) for v in self.got.values())


def loopback(ids, ports=None) -> dict[str, tuple[str, int]]:
    """Each member's address: 127.0.0.1 and its port (free ones unless given)."""
    return {m: ("127.0.0.1", p) for m, p in zip(ids, ports if ports is not None else free_ports(len(ids)))}


def group(ids, ports=None, inboxes=None, **kw) -> dict[str, TcpTransport]:
    """A TcpTransport per member of `ids` on loopback (free ports unless
    given), delivering to its entry of `inboxes` (a fresh Inbox each unless
    given), with the FAST timings and `kw` on top."""
    peers = loopback(ids, ports)
    inboxes = inboxes if inboxes is not None else {m: Inbox() for m in ids}
    return {m: TcpTransport(m, peers[m], peers, inboxes[m], **{**FAST, **kw}) for m in ids}


async def start_all(ts) -> None:
    for t in ts.values():
        await t.start()


async def close_all(ts) -> None:
    for t in ts.values():
        await t.close()


async def all_connected(ts, timeout=10.0) -> None:
    await until(lambda: all(st.connected for t in ts.values() for st in t.stats.values()), timeout, "all links up")


@contextlib.asynccontextmanager
async def running(ts: dict[str, TcpTransport], connected: bool = True) -> AsyncIterator[dict[str, TcpTransport]]:
    """Start every transport of `ts` and wait until all their links are up,
    unless `connected` is False (a test with links that must not come up);
    when the block ends, however it ends, close every transport then in `ts`
    (one the test replaced included)."""
    await start_all(ts)
    try:
        if connected:
            await all_connected(ts)
        yield ts
    finally:
        await close_all(ts)


# ------------------------------------------------------------------ round trip


@async_test
async def test_three_members_round_trip_order_and_batching():
    ids = ["dc1", "dc2", "dc3"]
    inboxes = {m: Inbox() for m in ids}
    async with running(group(ids, inboxes=inboxes)) as ts:
        n = 3000
        for i in range(n):
            for src in ids:
                for dst in ids:
                    if src != dst:
                        assert ts[src].send(dst, f"{src}->{dst}:{i}".encode() + b"x" * (i % 50))
        await until(lambda: all(inboxes[m].count() == 2 * n for m in ids), 20, "all messages")
        for dst in ids:
            for src in ids:
                if src == dst:
                    continue
                got = inboxes[dst].got[src]
                assert [g.split(b":")[1].rstrip(b"x") for g in got] == [str(i).encode() for i in range(n)]
                assert all(g.startswith(f"{src}->{dst}:".encode()) for g in got)
                st = ts[src].stats[dst]
                # Batching: far fewer BATCH frames than messages.
                assert 0 < st.frames_out < n / 10, st
                assert ts[dst].stats[src].frames_in >= 1
                assert ts[dst].stats[src].bytes_in >= sum(len(g) for g in got)
                assert st.bytes_out >= sum(len(g) for g in got)


@async_test
async def test_one_loop_iteration_of_sends_leaves_as_one_frame_without_the_writer_task():
    ids = ["dc1", "dc2"]
    inboxes = {m: Inbox() for m in ids}
    async with running(group(ids, inboxes=inboxes, ping_interval=60)) as ts:  # no PING in the way
        st = ts["dc1"].stats["dc2"]
        link = ts["dc1"]._links["dc2"]
        for round_ in range(3):
            before = st.frames_out
            for i in range(50):  # one loop iteration: no await between the sends
                assert ts["dc1"].send("dc2", b"r%d-%d" % (round_, i))
            assert not link.wakeup.is_set()  # the connected fast path does not wake the writer task
            await asyncio.sleep(0)  # the scheduled flush runs
            assert st.frames_out == before + 1 and link.queued == 0 and not link.queue
            await until(lambda: len(inboxes["dc2"].got["dc1"]) == 50 * (round_ + 1), 10, "round delivered")
        assert inboxes["dc2"].got["dc1"] == [b"r%d-%d" % (r, i) for r in range(3) for i in range(50)]


@async_test
async def test_flush_now_writes_inside_a_long_pass_and_nothing_twice():
    """Transport.flush_now (the member's Pulse): what a pass queued so far is
    written to the socket before the pass yields, each message once."""
    from kdsync.ticks import Pulse

    ids = ["dc1", "dc2"]
    inboxes = {m: Inbox() for m in ids}
    async with running(group(ids, inboxes=inboxes, ping_interval=60)) as ts:
        st = ts["dc1"].stats["dc2"]
        before = st.frames_out
        pulse = Pulse(ts["dc1"].flush_now, 0.0)  # every call beats
        pulse.start()
        for i in range(30):  # one long pass: no await
            assert ts["dc1"].send("dc2", b"p%d" % i)
            if i % 10 == 9:
                pulse()
                assert st.frames_out == before + (i + 1) // 10  # on the socket now, not after the pass
        ts["dc1"].send("dc2", b"tail")
        await until(lambda: len(inboxes["dc2"].got["dc1"]) == 31, 10, "every message")
        await asyncio.sleep(0.05)
        assert inboxes["dc2"].got["dc1"] == [b"p%d" % i for i in range(30)] + [b"tail"]  # once each, in order
        assert st.frames_out == before + 4  # the flush scheduled for the pass found only the tail


@async_test
async def test_on_heard_says_the_peer_is_alive_before_its_messages_are_delivered():
    """Bytes from a peer mark it alive (the member's liveness) before the
    messages they carry reach on_message, which gets them all in order."""
    ids = ["a", "b"]
    got: list[bytes] = []
    heard: list[int] = []  # how many messages were delivered when bytes arrived
    ts = group(ids, inboxes={"a": Inbox(), "b": lambda peer, data: got.append(data)}, ping_interval=60)
    ts["b"].on_heard = lambda peer: heard.append(len(got))
    async with running(ts):
        n = 3000
        for i in range(n):
            assert ts["a"].send("b", b"m%d" % i)
        await until(lambda: len(got) == n, 20, "all messages")
        assert got == [b"m%d" % i for i in range(n)]
        assert heard and heard[0] == 0  # heard before the first message was delivered


# ------------------------------------------------------------------ reconnect


@async_test
async def test_reconnect_after_peer_restart():
    ids = ["a", "b"]
    ports = free_ports(2)
    inboxes = {m: Inbox() for m in ids}
    async with running(group(ids, ports, inboxes)) as ts:
        assert ts["a"].send("b", b"before")
        await until(lambda: inboxes["b"].got["a"] == [b"before"], what="first message")
        await ts["b"].close()
        await until(lambda: not ts["a"].stats["b"].connected, what="a notices b is gone")
        # b comes back on the same port, as a fresh process would.
        inbox2 = Inbox()
        peers = loopback(ids, ports)
        ts["b"] = TcpTransport("b", peers["b"], peers, inbox2, **FAST)
        await ts["b"].start()
        await all_connected(ts)
        for i in range(100):
            assert ts["a"].send("b", b"after%d" % i)
            assert ts["b"].send("a", b"back%d" % i)
        await until(lambda: inbox2.got["a"][-1:] == [b"after99"], what="a->b after restart")
        await until(lambda: inboxes["a"].got["b"][-1:] == [b"back99"], what="b->a after restart")
        assert inbox2.got["a"][-100:] == [b"after%d" % i for i in range(100)]
        assert inboxes["a"].got["b"] == [b"back%d" % i for i in range(100)]


@async_test
async def test_messages_queued_while_peer_down_are_sent_when_it_comes_up():
    ids = ["a", "b"]
    inboxes = {m: Inbox() for m in ids}
    ts = group(ids, inboxes=inboxes)
    await ts["a"].start()
    try:
        for i in range(10):
            assert ts["a"].send("b", b"m%d" % i)
        assert ts["a"].queued_bytes("b") > 0
        # While b is down only max_offline_queue_bytes are kept: no stale backlog.
        assert not ts["a"].send("b", b"x" * ts["a"].max_offline_queue_bytes)
        assert ts["a"].stats["b"].dropped == 1
        await ts["b"].start()
        await until(lambda: len(inboxes["b"].got["a"]) == 10, what="queued messages")
        assert inboxes["b"].got["a"] == [b"m%d" % i for i in range(10)]
        assert ts["a"].queued_bytes("b") == 0
    finally:
        await close_all(ts)


# ------------------------------------------------------------------ back-pressure


async def stuck_listener(member_id: str, port: int, dialer_id: str):
    """A peer that completes the handshake (no secret) and then never reads again."""
    accepted = asyncio.Event()
    writers = []

    async def handle(reader, writer):
        writers.append(writer)
        dec = FrameDecoder()
        frames = []
        while len(frames) < 2:
            data = await reader.read(65536)
            if not data:
                return
            frames += dec.feed(data)
            if len(frames) == 1:
                hello = json.loads(bytes(frames[0].body))
                assert hello["id"] == dialer_id
                reply = {"v": 1, "id": member_id, "nonce": "00" * 16}
                writer.write(encode_frame(HELLO, json.dumps(reply).encode()))
        writer.write(encode_frame(AUTH, b'{"ok":true,"proof":""}'))
        accepted.set()
        try:
            await asyncio.Event().wait()  # never read again
        except asyncio.CancelledError:
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    # Tiny receive buffer so the sender's socket fills quickly.
    for s in server.sockets:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return server, accepted, writers


@async_test
async def test_back_pressure_slow_peer_bounded_and_others_unaffected():
    ids = ["a", "slow", "c"]
    inboxes = {m: Inbox() for m in ids}
    peers = loopback(ids)
    qmax = 1 << 20
    a = TcpTransport("a", peers["a"], peers, inboxes["a"], max_queue_bytes=qmax, max_frame_bytes=1 << 20, **FAST)
    c = TcpTransport("c", peers["c"], peers, inboxes["c"], **FAST)
    server, accepted, writers = await stuck_listener("slow", peers["slow"][1], "a")
    try:
        async with running({"a": a, "c": c}, connected=False):
            await asyncio.wait_for(accepted.wait(), 10)
            await until(lambda: a.stats["slow"].connected, what="link to slow peer")
            chunk = b"z" * 32768
            sent = 0
            refused_at = None
            for i in range(2000):  # 64 MiB offered, far more than socket buffers + queue
                if not a.send("slow", chunk):
                    refused_at = i
                    break
                sent += 1
                if i % 16 == 0:
                    await asyncio.sleep(0)  # let the writer push into the socket
            assert refused_at is not None, "send() never reported back-pressure"
            assert a.queued_bytes("slow") <= qmax
            assert a.stats["slow"].dropped == 1
            # Memory stays bounded: queue + what asyncio holds for the socket.
            lw = a._links["slow"].writer
            assert lw is not None and lw.transport.get_write_buffer_size() <= (1 << 20) + 65536
            # The slow peer does not hold up the others, in either direction.
            for i in range(500):
                assert a.send("c", b"c%d" % i)
                assert c.send("a", b"a%d" % i)
            await until(lambda: len(inboxes["c"].got["a"]) == 500 and len(inboxes["a"].got["c"]) == 500,
                        what="c traffic")
            assert inboxes["c"].got["a"] == [b"c%d" % i for i in range(500)]
            assert a.queued_bytes("slow") <= qmax
    finally:
        for w in writers:
            w.close()
        server.close()


# ------------------------------------------------------------------ refusals


@async_test
async def test_wrong_secret_refused_and_logged_others_keep_going(caplog):
    caplog.set_level(logging.INFO, logger="kdsync")
    ids = ["a", "b", "c"]
    inboxes = {m: Inbox() for m in ids}
    peers = loopback(ids)
    ts = {
        m: TcpTransport(m, peers[m], peers, inboxes[m], secret=(b"s3cret" if m != "c" else b"guess"), **FAST)
        for m in ids
    }
    async with running(ts, connected=False):
        await until(lambda: ts["a"].stats["b"].connected and ts["b"].stats["a"].connected, what="a<->b")
        await until(lambda: ts["a"].stats["c"].refused >= 1 and ts["c"].stats["a"].refused >= 1, what="c refused")
        for i in range(50):
            ts["a"].send("b", b"%d" % i)
            ts["c"].send("a", b"intruder")
        await until(lambda: len(inboxes["b"].got["a"]) == 50, what="a->b with secret")
        r0 = ts["a"].stats["c"].refused
        await until(lambda: ts["a"].stats["c"].refused >= r0 + 2, what="the intruder retries and is refused again")
        assert inboxes["a"].got["c"] == [] and inboxes["b"].got["c"] == []
        assert not ts["c"].stats["a"].connected and not ts["a"].stats["c"].connected
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("refused connection from 127.0.0.1:" in w and "'c' could not prove it knows the group secret" in w for w in warnings), warnings
        assert any("handshake with c at" in w and "refused our proof (wrong group secret?)" in w for w in warnings), warnings
        assert not any("s3cret" in r.getMessage() or "guess" in r.getMessage() for r in caplog.records)


@async_test
async def test_secret_on_one_side_only_is_refused():
    peers = loopback(["a", "b"])
    a = TcpTransport("a", peers["a"], peers, Inbox(), secret=b"k", **FAST)
    b = TcpTransport("b", peers["b"], peers, Inbox(), **FAST)
    async with running({"a": a, "b": b}, connected=False):
        # Each side refuses the other's dialer proof (empty vs. HMAC), and each dialer sees
        # its connection closed: two refusals per side.
        await until(lambda: a.stats["b"].refused >= 2 and b.stats["a"].refused >= 2, what="refusals")
        assert not a.stats["b"].connected and not b.stats["a"].connected


async def raw_exchange(port: int, payload: bytes, timeout: float = 5.0) -> bytes:
    """Send `payload` on a raw connection; return what came back before the server closed it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    got = b""
    try:
        while True:
            data = await asyncio.wait_for(reader.read(65536), timeout)
            if not data:
                break
            got += data
    except ConnectionResetError:
        pass
    writer.close()
    return got


@async_test
async def test_unknown_member_garbage_and_silence_close_only_that_connection(caplog):
    caplog.set_level(logging.INFO, logger="kdsync")
    ids = ["a", "b"]
    inboxes = {m: Inbox() for m in ids}
    async with running(group(ids, inboxes=inboxes, handshake_timeout=0.5)) as ts:
        hello = json.dumps({"v": 1, "id": "mallory", "to": "a", "nonce": "11" * 16}).encode()
        bad = [
            encode_frame(HELLO, hello),  # unknown member id
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # garbage
            encode_frame(HELLO, b"{not json"),  # malformed HELLO
            encode_frame(HELLO, b"x" * 10)[:8] + b"\xff\xff\xff\xff" + b"\x00" * 4,  # oversized length
            encode_frame(HELLO, b"x" * 10)[:8] + (1 << 20).to_bytes(4, "big") + b"\x00" * 4,  # 1 MiB before auth
            encode_frame(HELLO, json.dumps({"v": 1, "id": "b", "to": "zz", "nonce": "1"}).encode()),  # wrong target
            b"",  # silence: handshake timeout
        ]
        results = await asyncio.gather(*(raw_exchange(ts["a"].listen[1], p) for p in bad))
        # Every bad connection was closed by a (no reply to the bad ones at all).
        assert results == [b""] * len(bad)
        # ...while a and b kept exchanging.
        for i in range(200):
            assert ts["b"].send("a", b"%d" % i)
        await until(lambda: len(inboxes["a"].got["b"]) == 200, what="b->a after attacks")
        assert ts["a"].stats["b"].connected and ts["b"].stats["a"].connected
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        for needle in (
            "unknown member id 'mallory'",
            "bad magic",
            "malformed HELLO",
            "frame of 4294967295 bytes exceeds max_frame_bytes",
            "frame of 1048576 bytes exceeds max_frame_bytes=65536",  # strangers get no big buffers
            "meant to reach 'zz'",
            "no valid handshake",
        ):
            assert any(needle in w and "refused connection from 127.0.0.1:" in w for w in warnings), (needle, warnings)
        assert ts["a"].refused_unknown == 1


@async_test
async def test_malformed_frame_after_handshake_closes_that_connection(caplog):
    """An authenticated peer whose stream turns bad is cut off; it reconnects and recovers."""
    caplog.set_level(logging.INFO, logger="kdsync")
    ids = ["a", "b"]
    inboxes = {m: Inbox() for m in ids}
    async with running(group(ids, inboxes=inboxes)) as ts:
        assert ts["b"].send("a", b"one")
        await until(lambda: inboxes["a"].got["b"] == [b"one"], what="first")
        # Corrupt b's outgoing stream directly.
        ts["b"]._links["a"].writer.write(b"\x00" * 64)
        await until(lambda: any("closed connection from b" in r.getMessage() for r in caplog.records), what="warning")
        await until(lambda: ts["b"].stats["a"].connected, what="b reconnects")
        assert ts["b"].send("a", b"two")
        await until(lambda: inboxes["a"].got["b"][-1:] == [b"two"], what="after reconnect")


# ------------------------------------------------------------------ API edges


@async_test
async def test_send_errors_and_bind_failure():
    ids = ["a", "b"]
    ports = free_ports(2)
    ts = group(ids, ports, max_frame_bytes=1024)
    with pytest.raises(TransportError, match="unknown member 'zz'"):
        ts["a"].send("zz", b"x")
    with pytest.raises(TransportError, match="does not fit in a frame"):
        ts["a"].send("b", b"x" * 2000)
    await ts["a"].start()
    try:
        clash = TcpTransport("b", ("127.0.0.1", ports[0]), {"a": ("127.0.0.1", ports[0])}, Inbox())
        with pytest.raises(TransportError, match=f"cannot listen on 127.0.0.1:{ports[0]}"):
            await clash.start()
    finally:
        await ts["a"].close()
    assert ts["a"].send("b", b"x") is False  # closed


def test_make_transport_kinds(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="kdsync")
    args = ("a", ("127.0.0.1", 0), {"a": ("127.0.0.1", 0)}, Inbox())
    t = make_transport("tcp", *args)
    assert isinstance(t, Transport) and t.kind == "tcp"
    monkeypatch.setitem(sys.modules, "kdsync.transport.rdma", None)  # as if the module did not exist
    t = make_transport("auto", *args)
    assert t.kind == "tcp"
    assert any("transport auto: using TCP because" in r.getMessage() for r in caplog.records)
    with pytest.raises(TransportError, match='transport = "rdma" cannot be used'):
        make_transport("rdma", *args)
    with pytest.raises(TransportError, match="unknown transport 'udp'"):
        make_transport("udp", *args)


# ------------------------------------------------------------------ TLS


def make_certs(tmp_path, names):
    """A throwaway CA and one cert per name (openssl CLI); returns {name: TLSSettings}."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    tmp_path.mkdir(parents=True, exist_ok=True)

    def run(*cmd):
        subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path)

    run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=kdsync-test-ca")
    out = {}
    for n in names:
        run("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{n}.key", "-out", f"{n}.csr", "-subj", f"/CN={n}")
        (tmp_path / f"{n}.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
        run("openssl", "x509", "-req", "-in", f"{n}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{n}.pem", "-days", "1", "-extfile", f"{n}.ext")
        out[n] = TLSSettings(str(tmp_path / f"{n}.pem"), str(tmp_path / f"{n}.key"), str(tmp_path / "ca.pem"))
    return out


def test_tls_mutual_round_trip_and_plaintext_refused(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kdsync")
    certs = make_certs(tmp_path, ["a", "b"])
    rogue = make_certs(tmp_path / "rogue", ["b"])["b"]  # signed by another CA

    @async_test
    async def body():
        ids = ["a", "b", "c"]
        inboxes = {m: Inbox() for m in ids}
        peers = loopback(ids)
        ts = {m: TcpTransport(m, peers[m], peers, inboxes[m], tls=certs[m], secret=b"k", **FAST) for m in ("a", "b")}
        # c has the secret but no TLS: it must not get in.
        ts["c"] = TcpTransport("c", peers["c"], peers, inboxes["c"], secret=b"k", **FAST)
        async with running(ts, connected=False):
            await until(lambda: ts["a"].stats["b"].connected and ts["b"].stats["a"].connected, what="TLS links")
            for i in range(300):
                assert ts["a"].send("b", b"tls%d" % i)
                assert ts["b"].send("a", b"slt%d" % i)
                ts["c"].send("a", b"plain")
            await until(lambda: len(inboxes["b"].got["a"]) == 300 and len(inboxes["a"].got["b"]) == 300, what="TLS msgs")
            assert inboxes["b"].got["a"] == [b"tls%d" % i for i in range(300)]
            assert ts["a"]._links["b"].writer.get_extra_info("ssl_object") is not None
            await raw_exchange(peers["a"][1], b"\x16\x03\x01garbage" * 50)  # whatever TLS alert comes back
            # A member whose certificate comes from another CA is refused, even with the secret.
            r = TcpTransport("b", ("127.0.0.1", 0), peers, Inbox(), tls=rogue, secret=b"k", **FAST)
            await r.start()
            await until(lambda: r.stats["a"].refused >= 1 and ts["c"].stats["a"].refused >= 2, what="rogue and plaintext refused")
            await until(lambda: ts["a"].refused_unknown >= 3, what="a counts the TLS refusals")
            assert inboxes["a"].got["c"] == [] and not ts["c"].stats["a"].connected
            assert not r.stats["a"].connected
            await r.close()
            warnings = [m.getMessage() for m in caplog.records if m.levelno == logging.WARNING]
            tls_refusals = [w for w in warnings if "refused connection from 127.0.0.1:" in w and "TLS handshake failed" in w]
            assert len(tls_refusals) >= 3, warnings  # plaintext c, garbage, rogue certificate
            assert any("certificate verify failed" in w for w in warnings), warnings  # the rogue's own view
            # The good pair still talks.
            assert ts["a"].send("b", b"still")
            await until(lambda: inboxes["b"].got["a"][-1:] == [b"still"], what="a->b after attacks")

    body()


def test_tls_bad_certificate_paths_give_one_line_error(tmp_path):
    tls = TLSSettings(str(tmp_path / "missing.pem"), str(tmp_path / "missing.key"))
    t = TcpTransport("a", ("127.0.0.1", 0), {}, Inbox(), tls=tls)
    with pytest.raises(TransportError, match="cannot load TLS certificates") as info:
        asyncio.run(t.start())
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------ liveness of idle links


@async_test
async def test_pings_keep_idle_link_open_and_silent_link_is_closed(caplog):
    caplog.set_level(logging.INFO, logger="kdsync")
    peers = loopback(["a", "b"])
    opts = {**FAST, "idle_timeout": 1.0}
    # a pings every 0.1 s (as writer and as listener); b never does (interval 30 s).
    a = TcpTransport("a", peers["a"], peers, Inbox(), **{**opts, "ping_interval": 0.1})
    b = TcpTransport("b", peers["b"], peers, Inbox(), **{**opts, "ping_interval": 30})
    async with running({"a": a, "b": b}, connected=False):
        await until(lambda: a.stats["b"].connected and b.stats["a"].connected, what="links up")
        await until(lambda: any("closing silent connection from b" in r.getMessage() for r in caplog.records), 5, "a closes b's silent link")
        # b's listener pings as rarely as its writer, so a's dialer sees a silent listener and redials.
        await until(lambda: any("link to b lost: nothing from the peer" in r.getMessage() for r in caplog.records), 5, "a drops a silent listener")
        assert not any("closing silent connection from a" in r.getMessage() for r in caplog.records)
        assert b.stats["a"].frames_in >= 3  # pings from a
        await until(lambda: b.stats["a"].connected, what="b redials")  # and the link comes back


# ------------------------------------------------------------------ more edges


@async_test
async def test_new_connection_from_a_peer_replaces_its_stale_one():
    ids = ["a", "b"]
    ports = free_ports(2)
    inboxes = {m: Inbox() for m in ids}
    ts = group(ids, ports, inboxes)
    await ts["b"].start()
    # A leftover connection that authenticated as "a" (e.g. from a's previous run).
    reader, writer = await asyncio.open_connection("127.0.0.1", ports[1])
    hs = DialerHandshake("a", "b", None)
    writer.write(hs.hello())
    dec = FrameDecoder()
    while not hs.done:
        for f in dec.feed(await asyncio.wait_for(reader.read(65536), 5)):
            reply = hs.receive(f)
            if reply:
                writer.write(reply)
    try:
        await ts["a"].start()  # the real a dials b
        await until(lambda: ts["a"].stats["b"].connected, what="a -> b")
        # b closed the stale connection: it reads (maybe some PINGs, then) EOF.
        async def drained() -> bool:
            while await reader.read(65536):
                pass
            return True
        assert await asyncio.wait_for(drained(), 5)
        assert ts["a"].send("b", b"fresh")
        await until(lambda: inboxes["b"].got["a"] == [b"fresh"], what="message over the new link")
    finally:
        writer.close()
        await close_all(ts)


@async_test
async def test_messages_bigger_than_a_batch_go_alone_and_arrive_whole():
    ids = ["a", "b"]
    inboxes = {m: Inbox() for m in ids}
    ts = group(ids, inboxes=inboxes, max_batch_bytes=1 << 20, max_frame_bytes=8 << 20, max_queue_bytes=16 << 20)
    async with running(ts):
        big = [bytes([i]) * (3 << 20) for i in range(3)]  # 3 MiB each, batch cap 1 MiB
        frames0 = ts["a"].stats["b"].frames_out
        for m in big:
            assert ts["a"].send("b", m)
        await until(lambda: len(inboxes["b"].got["a"]) == 3, what="big messages")
        assert inboxes["b"].got["a"] == big
        assert ts["a"].stats["b"].frames_out - frames0 >= 3  # one frame each (plus any PINGs)


@async_test
async def test_connection_flood_is_capped_and_members_get_in_once_it_clears(caplog):
    caplog.set_level(logging.INFO, logger="kdsync")
    ids = ["a", "b"]
    ports = free_ports(2)
    inboxes = {m: Inbox() for m in ids}
    ts = group(ids, ports, inboxes, max_pending_handshakes=3, handshake_timeout=5.0)
    await ts["a"].start()
    silent = [await asyncio.open_connection("127.0.0.1", ports[0]) for _ in range(3)]
    try:
        await until(lambda: len(ts["a"]._unauthenticated) == 3, what="3 pending handshakes")
        # The 4th connection is closed at once (long before the 5 s handshake timeout).
        assert await asyncio.wait_for(raw_exchange(ports[0], b"", timeout=3), 3) == b""
        assert any("connections already awaiting their handshake" in r.getMessage() for r in caplog.records)
        for _, w in silent:
            w.close()
        await until(lambda: not ts["a"]._unauthenticated, what="slots freed")
        await ts["b"].start()
        await all_connected(ts)
        assert ts["b"].send("a", b"in")
        await until(lambda: inboxes["a"].got["b"] == [b"in"], what="b -> a")
    finally:
        for _, w in silent:
            w.close()
        await close_all(ts)
