"""RDMA transport between kdsync members (rdma-core's pyverbs, RC queue pairs).

Theory of operation.

Where it runs.  Any RDMA device rdma_cm can reach a peer through: hardware
RoCE/InfiniBand or soft-RoCE (`rdma link add rxe0 type rxe netdev eth0`).
pyverbs comes from the distribution (Debian's `python3-pyverbs`); it is
imported lazily, so a machine without it imports kdsync and runs TCP.
`unavailable_reason()` says why RDMA cannot be used here (None when it can);
`rdma_usable(host)` says whether rdma_cm resolves `host` to a local RDMA
device, and which.

Connections.  As in the TCP transport, every member dials one outgoing
connection per peer and sends only on it; connections peers dial to us carry
their messages in, and only flow-control credits go back on them.  Setup is
rdma_cm (pyverbs.cmid) in asynchronous mode: the dialer resolves address and
route, creates an RC QP, registers its buffers, pre-posts its receives and
connects; the listener gets CONNECT_REQUEST, does the same and accepts.  Then
the handshake runs over the QP, frame for frame -- the very state machines TCP
uses (`framing.DialerHandshake` / `ListenerHandshake`: HMAC-SHA256 proofs of
the group secret over both nonces) -- and only then BATCH frames flow.  The
frames are exactly the TCP frames (`framing.py`): the sender writes the frame
byte stream into its registered send buffers, the receiver feeds what arrives
into a `FrameDecoder`.

Large frames are fragmented, not RDMA-WRITTEN: a frame longer than one buffer
simply continues in the next SEND (the frame stream is a byte stream, the
decoder reassembles any split).  Fragmenting needs no extra registration
rendezvous, keeps a single credit mechanism covering every byte on the wire,
and pipelines a big frame through `recv_depth` buffers; an RDMA WRITE path
would pay a round trip per large frame to learn a remote region, for frames
(catch-up chunks) that are rare next to the small ordering traffic.

Buffers and credits.  Each connection registers `recv_depth` receive and
`send_depth` send buffers of `buf_size` bytes (one MR each: pyverbs' CMID
posts a whole MR).  Every SEND starts with a 4-byte header: op (DATA or
CREDIT) and the number of receive buffers the sender re-posted since it last
said so.  A side starts with `recv_depth` credits (the peer pre-posts that
many receives before the connection is established), spends one per SEND, and
earns them back from the headers.  DATA needs 2 credits, a credit-only
message needs 1: the last credit is kept for returning credits, so the two
sides can never both be stuck at zero (whoever is at zero is owed a full
window, and the other side always has a credit to say so).  A side returns
credits by piggybacking on DATA, or with a CREDIT message once it owes half
a window.  So a sender never overruns the receiver's posted buffers; QPs are
created with rnr_retry=0 by default, which makes any overrun a loud error
instead of a silent stall.  When credits or send buffers run out, messages
wait in the per-peer queue (bounded by `max_queue_bytes`; `send()` returns
False when full, like TCP).

Completions are event-driven.  One completion channel and one CQ serve all
QPs of the transport; the channel's fd is registered with the asyncio loop
(`loop.add_reader`).  On readiness: get the CQ event, ack it, re-arm
notification, then poll the CQ dry (re-arming before the last poll closes
the race with a completion that lands in between).  Nothing polls while
idle.  RC completes receives and sends in posting order, so each connection
finds its buffers by FIFO, keyed by the QP number in the WC.  Sends are
signalled selectively (every send_depth/2-th, or each one while free send
buffers are scarce): one completion frees every buffer posted before it, and a
message costs one wake-up at the receiver instead of one at each end.
rdma_cm event channels are registered the same way (their fds are
non-blocking, so a spurious wake-up costs one EAGAIN).  pyverbs 44 does not
expose these fds; they are found as the new /proc/self/fd entries pointing at
/dev/infiniband/rdma_cm or anon_inode:[infinibandevent] right after creation
(everything runs in the loop thread, and pyverbs holds the GIL in its calls).

Failures.  A send or receive completing in error (retry exceeded: the peer
vanished; flush: the QP went to error), a DISCONNECTED event, a handshake
failure or timeout, or a malformed frame closes that connection only; the
dialer reconnects with exponential backoff and jitter.  Listener-side
connections cannot be matched to their rdma_cm events in pyverbs, so on any
DISCONNECTED seen by the listener we send a credit probe on every incoming
connection: a dead one fails within the ACK timeout.  That timeout
(`ack_timeout`, 4.096 us * 2**16 = 268 ms, `retry_count` 5 tries) bounds how
long a peer that vanished without a word (host down, cable cut) takes to
notice; a process that dies is noticed at once (its kernel sends a DREQ).
Shorter timeouts made soft-RoCE under emulation retransmit whole messages
whose ACKs were merely late.

Device loss.  When the RDMA device goes away under a running member
(`rdma link delete`, a driver reset, a hot-unplugged NIC), rdma_cm reports
DEVICE_REMOVAL on every id.  The transport then logs one warning, closes
every connection, releases everything it holds on the device (QPs, MRs, CQ,
completion channel, listener) and stops dialing: every peer goes on over the
TCP fallback (the core retransmits what was in flight on the lost links)
until the member restarts.  `device_up` turns False; `fallbacks[peer]`
counts the peers whose messages moved from a lost RDMA link to TCP.  Why not
return to RDMA by itself: librdmacm keeps its own verbs context of a removed
device open for the life of the process (rdma-core 44: the device stays
listed, marked dead, while the kernel waits for that context), so on a
driver without disassociation support (soft-RoCE) `rdma link delete` itself
completes only when the member exits, and no device can come back under a
running member; hardware drivers disassociate and do not wait, but a return
path tested on neither is not one to ship.  docs/rdma.md says what to do.

Mixed groups.  With `tcp_fallback` (default), the transport also runs a TCP
transport on the same host:port (rdma_cm ports are a separate port space).
Per peer, messages go over RDMA while the RDMA link is up, else over TCP: a
peer without RDMA (its rdma_cm rejects or cannot be resolved) is served by
TCP with one log line saying why, and an RDMA peer whose link is down keeps
talking over TCP while the dialer reconnects.

Threading: everything runs in one asyncio loop; `send()` and `on_message`
are used from that loop's thread.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import select
import socket
import struct
import sys
from typing import Any

from kdsync.transport.base import PeerQueue, Transport, TransportError
from kdsync.transport.framing import (
    BATCH,
    HEADER_SIZE,
    PING,
    Frame,
    FrameDecoder,
    FrameError,
    decode_batch,
    encode_batch_frame,
)
from kdsync.transport.handshake import ContractError, DialerHandshake, HandshakeError, ListenerHandshake

__all__ = ["RdmaTransport", "rdma_usable", "unavailable_reason"]

_OP_DATA = 1
_OP_CREDIT = 2
_HDR = struct.Struct(">BxH")  # op, pad, credits returned
_CM_DEVICE = "/dev/infiniband/rdma_cm"
_COMP_CHANNEL = "anon_inode:[infinibandevent]"
_SYSFS = "/sys/class/infiniband"
_WC_STATUS = {
    1: "local length error",
    2: "local QP operation error",
    4: "local protection error",
    5: "flushed (QP in error)",
    9: "remote invalid request",
    10: "remote access error",
    11: "remote operation error",
    12: "transport retry counter exceeded (peer gone?)",
    13: "RNR retry counter exceeded (receiver overrun)",
}


class _PV:
    """The pyverbs names this module uses, imported once, lazily."""

    def __init__(self) -> None:
        import pyverbs.cm_enums as ce
        import pyverbs.enums as e
        from pyverbs.cmid import CMID, AddrInfo, CMEvent, CMEventChannel, ConnParam
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QPCap, QPInitAttr

        self.ce, self.e = ce, e
        self.CMID, self.AddrInfo, self.CMEvent, self.CMEventChannel, self.ConnParam = (
            CMID,
            AddrInfo,
            CMEvent,
            CMEventChannel,
            ConnParam,
        )
        self.CQ, self.CompChannel, self.MR = CQ, CompChannel, MR
        self.QPCap, self.QPInitAttr = QPCap, QPInitAttr
        self.Error = PyverbsError


_pv_cache: _PV | None = None


def _pyverbs() -> _PV:
    """Import pyverbs; raise TransportError saying what to install if missing."""
    global _pv_cache
    if _pv_cache is None:
        try:
            _pv_cache = _PV()
        except ImportError as exc:
            raise TransportError(
                f"pyverbs is not importable ({exc}); install rdma-core's python3-pyverbs (Debian/Ubuntu package)"
            ) from None
    return _pv_cache


def _devices() -> list[str]:
    try:
        return sorted(os.listdir(_SYSFS))
    except OSError:
        return []


def _active_ports(dev: str) -> list[str]:
    out = []
    try:
        ports = sorted(os.listdir(f"{_SYSFS}/{dev}/ports"))
    except OSError:
        return out
    for p in ports:
        try:
            with open(f"{_SYSFS}/{dev}/ports/{p}/state") as f:
                if "ACTIVE" in f.read():
                    out.append(p)
        except OSError:
            pass
    return out


def unavailable_reason() -> str | None:
    """Why RDMA cannot be used on this machine, or None when it can.

    Checks that pyverbs imports and that some RDMA device has an ACTIVE port.
    Whether a particular peer is reachable is `rdma_usable(host)`.
    """
    try:
        _pyverbs()
    except TransportError as exc:
        return str(exc)
    devs = _devices()
    if not devs:
        return f"no RDMA device ({_SYSFS} is empty: no RDMA NIC, and no soft-RoCE link added)"
    if not any(_active_ports(d) for d in devs):
        return f"no RDMA port is ACTIVE (devices: {', '.join(devs)})"
    return None


def _fd_set() -> dict[int, str]:
    """{fd: link target} of this process (the listing's own fd shows up too,
    and the next open may reuse its number, hence the targets)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
    return out


def _created_fd(before: dict[int, str], target: str, what: str) -> int:
    after = _fd_set()
    for fd in sorted(after):
        if after[fd] == target and before.get(fd) != target:
            return fd
    raise TransportError(f"cannot find the file descriptor of the new {what} in /proc/self/fd")


def _new_cm_channel(pv: _PV) -> tuple[Any, int]:
    """A CMEventChannel and its (now non-blocking) fd."""
    before = _fd_set()
    chan = pv.CMEventChannel()
    fd = _created_fd(before, _CM_DEVICE, "rdma_cm event channel")
    os.set_blocking(fd, False)
    return chan, fd


def _resolve_ipv4(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise TransportError(f"cannot resolve {host!r}: {exc}") from None


# ------------------------------------------------------------ verbs lifetimes (issue 44)
#
# pyverbs 44 wraps librdmacm's own objects: a CMID's `context` (a pyverbs
# Context) is librdmacm's ibv_context of the device, shared by every cm_id
# of the process, and its `pd` is librdmacm's shared protection domain.  A
# listener's connection ids even share the listener's very wrappers.  Only
# CMID.close() makes those wrappers inert (it NULLs their pointers); a
# wrapper finalized before that closes what it wraps: Context's finalizer
# closes every CQ and completion channel made on it and then
# ibv_close_device()s librdmacm's context, PD's ibv_dealloc_pd()s the shared
# PD -- under every other cm_id, QP and MR of the process, which then crash
# in native code (SIGSEGV) at their next use.  Cython's cyclic-GC clear of a
# CMID drops its `ctx`/`pd` references *without* calling close() first, so a
# CMID reached only through a reference cycle, or whose close() raised, is
# enough.  The rule this module keeps, so that never happens:
#
#   every pyverbs object is owned by a _Conn or by the transport, closed
#   explicitly in dependency order (a connection's CMID -- its QP, its MRs --
#   before the CQ, the completion channel, the listener, the event
#   channels); an owner collected without being closed closes what it owns
#   in its finalizer, which the collector runs before it clears any
#   reference; an object whose close() fails is parked for the life of the
#   process (never finalized, not even at exit); and all of it happens on
#   the transport's loop thread (a finalizer only runs on garbage).

_PARKED: list = []  # pyverbs objects whose close() failed: kept, never finalized


def _park(obj: Any) -> None:
    """Keep `obj` for the life of the process: its close() failed, so its
    Context/PD wrappers may still point at librdmacm's shared context and PD,
    and finalizing it would close them under every other cm_id."""
    _PARKED.append(obj)
    try:  # one reference more than anything will ever drop: not freed at interpreter exit either
        import ctypes

        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    except Exception:  # pragma: no cover - CPython always has it
        pass


def _close_verbs(objs: Any, log: Any = None) -> None:
    """Close pyverbs objects in the order given (dependents first); one whose
    close() fails is parked, never left to the garbage collector."""
    for obj in objs:
        if obj is None:
            continue
        try:
            obj.close()
        except Exception as exc:  # pyverbs' errors, or anything else: the object must not be finalized
            _park(obj)
            if log is not None:
                log.warning("rdma: closing %s failed (%s); kept open until the process exits", type(obj).__name__, exc)


def rdma_usable(peer_host: str, timeout: float = 1.0) -> tuple[bool, str]:
    """Can this machine reach `peer_host` over RDMA?

    Returns (True, device name) when rdma_cm resolves the address to a local
    RDMA device, else (False, one-line reason).  Blocks for at most about
    `timeout` seconds; never raises.
    """
    reason = unavailable_reason()
    if reason is not None:
        return False, reason
    pv = _pyverbs()
    try:
        ip = _resolve_ipv4(peer_host)
    except TransportError as exc:
        return False, str(exc)
    chan = cmid = None
    try:
        chan, fd = _new_cm_channel(pv)
        cmid = pv.CMID(creator=chan, port_space=pv.ce.RDMA_PS_TCP)
        try:
            cmid.resolve_addr(pv.AddrInfo(dst=ip, dst_service="1", port_space=pv.ce.RDMA_PS_TCP), int(timeout * 1000))
        except pv.Error as exc:
            return False, f"rdma_cm cannot resolve {ip}: {exc}"
        ready, _, _ = select.select([fd], [], [], timeout + 0.5)
        if not ready:
            return False, f"rdma_cm address resolution of {ip} timed out"
        ev = pv.CMEvent(chan)
        kind, text = ev.event_type, ev.event_str()
        ev.ack_cm_event()
        if kind != pv.ce.RDMA_CM_EVENT_ADDR_RESOLVED:
            return False, f"no RDMA route to {ip} ({text})"
        return True, cmid.dev_name
    except (pv.Error, TransportError, OSError) as exc:
        return False, f"RDMA address resolution of {ip} failed: {exc}"
    finally:
        _close_verbs((cmid, chan))


class _Conn:
    """One RC connection (either direction) and its buffers."""

    def __init__(self, tr: "RdmaTransport", role: str, peer: str | None, cmid: Any = None) -> None:
        self.tr = tr
        self.role = role  # "dialer" (we send on it) | "listener" (peer sends to us)
        self.peer = peer  # known from the start for dialers, after HELLO for listeners
        self.cmid = cmid
        self.chan: Any = None  # dialers own an event channel; listener conns share the listener's
        self.chan_fd = -1
        self.qpn: int | None = None
        self.state = "connecting"  # -> handshake -> up -> dead
        self.was_up = False
        self.connected = False  # rdma_cm connection established (disconnect on close)
        self.recv_posted: collections.deque = collections.deque()
        self.send_free: list = []
        self.send_busy: collections.deque = collections.deque()  # (mr, signalled), in posting order
        self.unsignalled = 0
        self.credits = tr.recv_depth
        self.owed = 0
        self.out = bytearray()
        self.out_pos = 0
        self.decoder = FrameDecoder(tr.max_frame_bytes)
        self.hs: DialerHandshake | ListenerHandshake = (
            DialerHandshake(tr.member_id, peer, tr.secret, local=tr.local)
            if role == "dialer"
            else ListenerHandshake(tr.member_id, tuple(tr.peers), tr.secret, local=tr.local)
        )
        self.timer: asyncio.TimerHandle | None = None
        self.finished: asyncio.Future = tr._loop.create_future()
        self.addr_info: Any = None
        self.fail_reason = ""

    @property
    def pending_out(self) -> int:
        return len(self.out) - self.out_pos

    def close_verbs(self) -> None:
        """Close the cm id (its QP, its MRs; it makes its Context/PD wrappers
        inert) and then the event channel; the lifetime rule above."""
        cmid, chan = self.cmid, self.chan
        self.cmid = self.chan = None
        # the QP goes with the cm id, before the buffers its work requests name
        _close_verbs((cmid, chan), self.tr.log if self.tr is not None else None)
        self.recv_posted.clear()
        self.send_free.clear()
        self.send_busy.clear()

    def __del__(self) -> None:
        # Collected without _fail (its transport dropped unclosed): close the
        # cm id now -- the collector runs this before it clears any reference,
        # so the CMID's Context/PD wrappers are inert before they can go.
        if getattr(self, "cmid", None) is not None or getattr(self, "chan", None) is not None:
            try:
                self.close_verbs()
            except Exception:  # interpreter exit: module globals gone; nothing better to do
                pass

    def __repr__(self) -> str:
        return f"<rdma {self.role} {self.peer} qpn={self.qpn} {self.state}>"



class _Peer(PeerQueue):
    """One peer as RDMA sees it: its send queue, how it is served (probing,
    rdma, or tcp once RDMA connects failed) and the RDMA connection we dialed
    (None while down)."""

    __slots__ = ("mode", "out")

    def __init__(self, peer: str) -> None:
        super().__init__(peer)
        self.mode = "probing"
        self.out: _Conn | None = None

class RdmaTransport(Transport):
    """The Transport over RDMA (RC QPs, rdma_cm); see the module docstring.

    Extra keyword options (all optional): `buf_size` (bytes per registered
    buffer, default 64 KiB), `recv_depth` / `send_depth` (buffers per
    connection, default 16 / 16), `max_queue_bytes` (per-peer send queue,
    default max_frame_bytes), `max_offline_queue_bytes` (the bound while the
    peer's RDMA link is down, 1 MiB), `batch_bytes` (target BATCH frame size, 1 MiB),
    `handshake_timeout`, `connect_timeout`, `backoff_initial`, `backoff_max`
    (s), `ack_timeout` (rdma_cm ACK timeout exponent, default 16),
    `retry_count` (default 5), `rnr_retry` (default 0), `tcp_fallback`
    (default True: serve peers without RDMA over an embedded TcpTransport),
    `tcp_options` (dict of extra TcpTransport options).

    Raises TransportError at construction when RDMA cannot serve the listen
    address (pyverbs missing, no device behind it) or TLS is requested.
    """

    kind = "rdma"

    def __init__(self, *args, buf_size: int = 64 * 1024, recv_depth: int = 16, send_depth: int = 16,
                 batch_bytes: int = 1 << 20, ack_timeout: int = 16, retry_count: int = 5, rnr_retry: int = 0,
                 tcp_fallback: bool = True, tcp_options: dict | None = None, **common) -> None:
        super().__init__(*args, **common)  # Transport's arguments and options
        if self.tls is not None:
            raise TransportError("TLS is not available over RDMA; set transport = \"tcp\" to use [tls]")
        if buf_size < 256 or recv_depth < 2 or send_depth < 2:
            raise TransportError("rdma buffers too small: need buf_size >= 256, recv_depth >= 2, send_depth >= 2")
        self.buf_size = int(buf_size)
        self.recv_depth = int(recv_depth)
        self.send_depth = int(send_depth)
        self.batch_bytes = int(batch_bytes)
        self.ack_timeout = int(ack_timeout)
        self.retry_count = int(retry_count)
        self.rnr_retry = int(rnr_retry)
        self.tcp_fallback = tcp_fallback
        self.tcp_options = dict(tcp_options or {})
        self._pv = _pyverbs()
        host = self.listen[0]
        if host in ("", "0.0.0.0", "::"):
            raise TransportError(
                f"RDMA needs a specific listen address on an RDMA device, not {host!r}; set [member] listen"
            )
        ok, what = rdma_usable(host)
        if not ok:
            raise TransportError(f"no RDMA device serves the listen address {host}: {what}")
        self.device = what
        self.counters: collections.Counter = collections.Counter()
        self.tcp: Transport | None = None
        self._peers = {p: _Peer(p) for p in self.peers}
        self._in: dict[str, _Conn] = {}
        self._by_qpn: dict[int, _Conn] = {}
        self._conns: set[_Conn] = set()
        self._flush_due: set[str] = set()
        self._flush_handle: asyncio.Handle | None = None
        self._tasks: list[asyncio.Task] = []
        self._started = False
        self._rng = random.Random(os.urandom(16))
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._listener = self._lchan = None
        self._lchan_fd = -1
        self._cq = self._cc = None
        self._cc_fd = -1
        self.bound: tuple[str, int] | None = None
        self.device_up = False  # a device serves the listen address (False after DEVICE_REMOVAL)
        self.fallbacks: collections.Counter = collections.Counter()  # peer -> RDMA link lost while TCP carried on

    # ------------------------------------------------------------ public API

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        host, port = self.listen
        try:
            self._listen()
        except (self._pv.Error, OSError, TransportError) as exc:
            self._release()
            raise TransportError(f"cannot listen for RDMA on {host}:{port}: {exc}; check [member] listen") from None
        self._started = True
        self.bound = (host, port)
        if self.tcp_fallback:
            from kdsync.transport.tcp import TcpTransport

            opts = dict(self.tcp_options)
            opts.setdefault("max_queue_bytes", self.max_queue_bytes)
            self.tcp = TcpTransport(
                self.member_id,
                self.listen,
                {**self.peers, self.member_id: self.listen},
                self.on_message,
                secret=self.secret,
                max_frame_bytes=self.max_frame_bytes,
                logger=self.log,
                local=self.local,
                **opts,
            )
            self.tcp.status = self.status  # `kdsync status` probes come over TCP
            try:
                await self.tcp.start()
            except TransportError:
                await self.close()
                raise
        for peer in sorted(self.peers):
            self._tasks.append(asyncio.create_task(self._dial_loop(peer), name=f"kdsync-rdma-dial-{peer}"))
        self.log.info(
            "transport rdma listening on %s:%s via %s%s%s",
            host,
            port,
            self.device,
            " with group secret" if self.secret is not None else "",
            ", TCP fallback on the same port" if self.tcp is not None else "",
        )

    def _listen(self) -> None:
        """Listener, completion channel and CQ on the device serving the
        listen address; raises pyverbs' Error or OSError."""
        pv = self._pv
        host, port = self.listen
        try:
            self._lchan, self._lchan_fd = _new_cm_channel(pv)
            self._listener = pv.CMID(creator=self._lchan, port_space=pv.ce.RDMA_PS_TCP)
            ai = pv.AddrInfo(src=host, src_service=str(port), port_space=pv.ce.RDMA_PS_TCP, flags=pv.ce.RAI_PASSIVE)
            self._listener.bind_addr(ai)
            ctx = self._listener.context
            before = _fd_set()
            self._cc = pv.CompChannel(ctx)
            self._cc_fd = _created_fd(before, _COMP_CHANNEL, "completion channel")
            os.set_blocking(self._cc_fd, False)
            # Room for every WR of every connection we may hold (in + out per peer, plus one spare each).
            cqe = max(256, 4 * max(1, len(self.peers)) * (self.recv_depth + self.send_depth))
            self._cq = pv.CQ(ctx, cqe, None, self._cc, 0)
            self._cq.req_notify()
            self._listener.listen(64)
        except (pv.Error, OSError, TransportError):
            self._release()
            raise
        self._loop.add_reader(self._cc_fd, self._on_cq_event)
        self._loop.add_reader(self._lchan_fd, self._on_listener_events)
        self.device_up = True

    def send(self, peer: str, data: bytes) -> bool:
        p = self._peers.get(peer)
        if p is None:
            raise TransportError(f"cannot send to unknown member {peer!r}")
        conn = p.out
        rdma_up = conn is not None and conn.state == "up"
        if not rdma_up and self.tcp is not None and not self._closing and len(data) <= self.max_message_bytes:
            # RDMA link down: TCP carries the message if it is up, or if this
            # peer is served by TCP anyway; otherwise wait for RDMA.
            if self.tcp.stats[peer].connected or p.mode == "tcp":
                return self.tcp.send(peer, data)
        if not self._enqueue(p, data, rdma_up):
            return False
        if rdma_up:
            self._flush_due.add(peer)
            if self._flush_handle is None:
                self._flush_handle = self._loop.call_soon(self._flush)
        return True

    def path(self, peer: str) -> str | None:
        """"rdma" or "tcp": the link `send(peer)` uses now (None: neither is up)."""
        p = self._peers.get(peer)
        if p is not None and p.out is not None and p.out.state == "up":
            return "rdma"
        if self.tcp is not None and self.tcp.stats[peer].connected:
            return "tcp"
        return None

    def rdma_links(self) -> tuple[bool, dict[str, int]]:
        return self.device_up, {p: self.fallbacks[p] for p in sorted(self.peers)}

    def queued_bytes(self, peer: str) -> int:
        """Bytes waiting in the RDMA send queue of `peer`."""
        return self._peers[peer].queued

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        # Stop taking connection requests first: a child created after the
        # connections are torn down would keep a QP on our CQ.
        if self._loop is not None and self._lchan_fd >= 0:
            self._loop.remove_reader(self._lchan_fd)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.tcp is not None:
            await self.tcp.close()
        for conn in sorted(self._conns, key=id):
            self._fail(conn, "transport closed", quiet=True)
        self._release()
        for st in self.stats.values():
            st.connected = False

    def _release(self) -> None:
        loop = self._loop
        if loop is not None:
            for fd in (self._cc_fd, self._lchan_fd):
                if fd >= 0:
                    loop.remove_reader(fd)
        # QPs are gone (connections closed); now the CQ, its channel, the listener.
        objs = (self._cq, self._cc, self._listener, self._lchan)
        self._cq = self._cc = self._listener = self._lchan = None
        _close_verbs(objs, self.log)
        self._cc_fd = self._lchan_fd = -1
        self.device_up = False

    def __del__(self) -> None:
        # Collected without close(): every connection's cm id first (its QP
        # holds the CQ), then the CQ, its channel, the listener -- before the
        # collector clears any reference (the lifetime rule, module top).
        if getattr(self, "_cq", None) is None and getattr(self, "_listener", None) is None \
                and getattr(self, "_lchan", None) is None and getattr(self, "_cc", None) is None:
            return
        for conn in sorted(getattr(self, "_conns", ()), key=id):
            conn.close_verbs()
        objs = (self._cq, self._cc, self._listener, self._lchan)
        self._cq = self._cc = self._listener = self._lchan = None
        _close_verbs(objs, getattr(self, "log", None))

    # ------------------------------------------------------------ device loss

    def _lose_device(self, why: str) -> None:
        """The device is gone (DEVICE_REMOVAL): release all of it, stop
        dialing, say so once; TCP carries every peer from now on."""
        if not self.device_up or self._closing:
            return
        self.counters["device_lost"] += 1
        peers = [p for p in sorted(self._peers) if self._peers[p].out is not None]
        self.log.warning("RDMA device %s is gone (%s): %s until this member restarts",
                         self.device, why,
                         "every peer goes on over TCP" if self.tcp is not None else "no TCP fallback: peers unreachable")
        for conn in sorted(self._conns, key=id):
            self._fail(conn, f"RDMA device {self.device} removed", quiet=True)
        for p in peers:
            self.fallbacks[p] += 1
        self._release()
        if self.tcp is not None:
            for peer in sorted(self._peers):
                self._serve_over_tcp(peer)

    # ------------------------------------------------------------ dialing

    async def _dial_loop(self, peer: str) -> None:
        delay = self.backoff_initial
        failures = 0
        while not self._closing and self.device_up:
            conn = self._dial(peer)
            if conn is not None:
                await asyncio.shield(conn.finished)
                if self._closing:
                    return
                if conn.was_up:
                    delay, failures = self.backoff_initial, 0
                else:
                    failures += 1
                    if failures == 2 and self._peers[peer].mode == "probing" and self.tcp is not None:
                        self._to_tcp(peer, conn.fail_reason)
            else:
                failures += 1
            await asyncio.sleep(delay * (0.5 + 0.5 * self._rng.random()))
            delay = min(delay * 2, self.backoff_max)

    def _to_tcp(self, peer: str, why: str) -> None:
        """Serve `peer` over TCP from now on (until an RDMA link comes up)."""
        self.log.info("peer %s: using TCP because RDMA connect failed: %s", peer, why)
        self._serve_over_tcp(peer)

    def _serve_over_tcp(self, peer: str) -> None:
        """`send(peer)` goes over TCP from now on; what waited for RDMA goes first, in order."""
        p = self._peers[peer]
        p.mode = "tcp"
        for m in p.take(sys.maxsize):
            self.tcp.send(peer, m)

    def _dial(self, peer: str) -> _Conn | None:
        pv = self._pv
        host, port = self.peers[peer]
        conn = _Conn(self, "dialer", peer)
        try:
            ip = _resolve_ipv4(host)
            conn.chan, conn.chan_fd = _new_cm_channel(pv)
            conn.cmid = pv.CMID(creator=conn.chan, port_space=pv.ce.RDMA_PS_TCP)
            self._conns.add(conn)
            self._loop.add_reader(conn.chan_fd, self._on_dialer_events, conn)
            conn.addr_info = pv.AddrInfo(
                src=self.listen[0], dst=ip, dst_service=str(port), port_space=pv.ce.RDMA_PS_TCP
            )
            conn.cmid.resolve_addr(conn.addr_info, int(self.connect_timeout * 1000))
        except (pv.Error, TransportError, OSError) as exc:
            self._conns.add(conn)
            self._fail(conn, f"cannot start RDMA connect to {host}:{port}: {exc}", quiet=True)
            return conn
        conn.timer = self._loop.call_later(self.connect_timeout * 2, self._timeout, conn, "connect timed out")
        return conn

    def _on_dialer_events(self, conn: _Conn) -> None:
        pv = self._pv
        ce = pv.ce
        while conn.state != "dead":
            try:
                ev = pv.CMEvent(conn.chan)
            except pv.Error:
                return  # EAGAIN: drained
            kind, text = ev.event_type, ev.event_str()
            ev.ack_cm_event()
            self.log.debug("rdma: dialer %s: %s", conn.peer, text)
            try:
                if kind == ce.RDMA_CM_EVENT_ADDR_RESOLVED:
                    conn.cmid.resolve_route(int(self.connect_timeout * 1000))
                elif kind == ce.RDMA_CM_EVENT_ROUTE_RESOLVED:
                    if conn.cmid.dev_name != self.device:
                        self._fail(conn, f"route goes through {conn.cmid.dev_name}, not {self.device}")
                        return
                    self._setup_qp(conn)
                    conn.cmid.connect(self._conn_param())
                elif kind == ce.RDMA_CM_EVENT_ESTABLISHED:
                    conn.connected = True
                    conn.state = "handshake"
                    self._restart_timer(conn, self.handshake_timeout, "handshake timed out")
                    self._send_frame(conn, conn.hs.hello())
                elif kind == ce.RDMA_CM_EVENT_TIMEWAIT_EXIT:
                    pass
                elif kind == ce.RDMA_CM_EVENT_DEVICE_REMOVAL:
                    self._lose_device(f"rdma_cm {text} on the link to {conn.peer}")
                    return
                else:  # ADDR/ROUTE/CONNECT errors, UNREACHABLE, REJECTED, DISCONNECTED, DEVICE_REMOVAL
                    self._fail(conn, f"rdma_cm {text}")
                    return
            except pv.Error as exc:
                self._fail(conn, f"rdma_cm setup failed after {text}: {exc}")
                return

    def _conn_param(self) -> Any:
        return self._pv.ConnParam(resources=1, depth=1, retry=self.retry_count, rnr_retry=self.rnr_retry)

    def _setup_qp(self, conn: _Conn) -> None:
        """Create the QP on our CQ, register buffers, pre-post every receive."""
        pv = self._pv
        e = pv.e
        cmid = conn.cmid
        try:
            cmid.set_option(pv.ce.RDMA_OPTION_ID, pv.ce.RDMA_OPTION_ID_ACK_TIMEOUT, self.ack_timeout, 1)
        except (pv.Error, AttributeError) as exc:  # older kernels: keep the default timeout
            self.log.debug("rdma: cannot set ACK timeout: %s", exc)
        cap = pv.QPCap(
            max_send_wr=self.send_depth, max_recv_wr=self.recv_depth, max_send_sge=1, max_recv_sge=1
        )
        cmid.create_qp(pv.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._cq, rcq=self._cq, cap=cap, sq_sig_all=0))
        conn.qpn = cmid.qpn
        self._by_qpn[conn.qpn] = conn
        for _ in range(self.recv_depth):
            mr = pv.MR(cmid, self.buf_size, e.IBV_ACCESS_LOCAL_WRITE)
            cmid.post_recv(mr, self.buf_size)
            conn.recv_posted.append(mr)
        conn.send_free = [pv.MR(cmid, self.buf_size, e.IBV_ACCESS_LOCAL_WRITE) for _ in range(self.send_depth)]

    # ------------------------------------------------------------ listening

    def _on_listener_events(self) -> None:
        pv = self._pv
        ce = pv.ce
        while self._listener is not None:
            try:
                ev = pv.CMEvent(self._lchan)
            except pv.Error:
                return
            kind = ev.event_type
            if kind != ce.RDMA_CM_EVENT_CONNECT_REQUEST:
                text = ev.event_str()
                ev.ack_cm_event()
                if kind == ce.RDMA_CM_EVENT_DISCONNECTED:
                    self._probe_incoming()
                elif kind == ce.RDMA_CM_EVENT_DEVICE_REMOVAL:
                    self._lose_device(f"rdma_cm {text}")
                    return
                continue
            conn = _Conn(self, "listener", None)
            try:
                conn.cmid = pv.CMID(creator=ev, listen_id=self._listener)
            except pv.Error as exc:
                ev.ack_cm_event()
                self.log.warning("rdma: cannot take a connection request: %s", exc)
                continue
            ev.ack_cm_event()
            if self._closing:
                try:
                    conn.cmid.reject()
                except pv.Error:
                    pass
                conn.close_verbs()
                continue
            self._conns.add(conn)
            try:
                self._setup_qp(conn)
                conn.cmid.accept(self._conn_param())
            except pv.Error as exc:
                self._fail(conn, f"cannot accept an RDMA connection: {exc}")
                continue
            conn.connected = True
            conn.state = "handshake"
            self._restart_timer(conn, self.handshake_timeout, "no valid handshake in time")

    def _probe_incoming(self) -> None:
        """Some incoming connection was disconnected; a credit message on each
        finds which (a dead QP fails its send within the ACK timeout)."""
        for conn in list(self._in.values()):
            if conn.state == "up" and conn.credits >= 1 and conn.send_free:
                self._post(conn, _OP_CREDIT, b"")

    # ------------------------------------------------------------ completions

    def _on_cq_event(self) -> None:
        pv = self._pv
        if self._cq is None or self._cc is None:
            return  # released (device lost, closing): pyverbs would take None for a CQ
        try:
            self._cc.get_cq_event(self._cq)
        except pv.Error:
            return  # spurious wake-up (EAGAIN)
        self.counters["cq_events"] += 1
        self._cq.ack_events(1)
        self._cq.req_notify()
        self._drain_cq()

    def _drain_cq(self) -> None:
        touched: dict[int, _Conn] = {}
        while self._cq is not None:
            self.counters["cq_polls"] += 1
            n, wcs = self._cq.poll(64)
            for wc in wcs:
                conn = self._by_qpn.get(wc.qp_num)
                if conn is None or conn.state == "dead":
                    continue  # a connection closed meanwhile
                self._on_wc(conn, wc)
                touched[id(conn)] = conn
            if n < 64:
                break
        for conn in touched.values():
            if conn.state != "dead":
                self._pump(conn)

    def _on_wc(self, conn: _Conn, wc: Any) -> None:
        e = self._pv.e
        if wc.status != e.IBV_WC_SUCCESS:
            why = _WC_STATUS.get(wc.status, f"status {wc.status}")
            self._fail(conn, f"work completion failed: {why}")
            return
        if wc.opcode & e.IBV_WC_RECV:
            mr = conn.recv_posted.popleft()
            data = mr.read(wc.byte_len, 0)
            try:
                conn.cmid.post_recv(mr, self.buf_size)
            except self._pv.Error as exc:
                self._fail(conn, f"cannot re-post a receive: {exc}")
                return
            conn.recv_posted.append(mr)
            conn.owed += 1
            self.counters["recvs"] += 1
            if len(data) < _HDR.size:
                self._fail(conn, "runt RDMA message")
                return
            op, credits = _HDR.unpack_from(data)
            conn.credits += credits
            if op == _OP_DATA:
                self._on_bytes(conn, data[_HDR.size :])
            elif op != _OP_CREDIT:
                self._fail(conn, f"unknown RDMA message op {op}")
        else:
            # A signalled SEND completed: it and every unsignalled one posted
            # before it are done (RC completes in order).
            busy = conn.send_busy
            while busy:
                mr, signalled = busy.popleft()
                conn.send_free.append(mr)
                if signalled:
                    break

    # ------------------------------------------------------------ sending

    def _post(self, conn: _Conn, op: int, payload: bytes) -> bool:
        mr = conn.send_free.pop()
        msg = _HDR.pack(op, conn.owed) + payload
        # Selective signalling: a completion (and a wake-up) for every
        # send_depth/2-th SEND, or for each one once free buffers run low.
        signalled = conn.unsignalled + 1 >= self.send_depth // 2 or len(conn.send_free) < self.send_depth // 2
        try:
            mr.write(msg, len(msg))
            conn.cmid.post_send(mr, self._pv.e.IBV_SEND_SIGNALED if signalled else 0, len(msg))
        except self._pv.Error as exc:
            conn.send_free.append(mr)
            self._fail(conn, f"cannot post a send: {exc}")
            return False
        conn.send_busy.append((mr, signalled))
        conn.unsignalled = 0 if signalled else conn.unsignalled + 1
        conn.owed = 0
        conn.credits -= 1
        self.counters["sends"] += 1
        if op == _OP_CREDIT:
            self.counters["credit_msgs"] += 1
        return True

    def _send_frame(self, conn: _Conn, frame: bytes) -> None:
        if conn.out_pos and conn.out_pos == len(conn.out):
            conn.out.clear()
            conn.out_pos = 0
        conn.out += frame
        if conn.peer is not None and conn.peer in self.stats and conn.role == "dialer":
            st = self.stats[conn.peer]
            st.frames_out += 1
            st.bytes_out += len(frame)
        self._pump(conn)

    def _pump(self, conn: _Conn) -> None:
        """Post what credits and free buffers allow; return credits if owed."""
        if conn.state == "dead":
            return
        chunk = self.buf_size - _HDR.size
        while True:
            if conn.pending_out == 0:
                if conn.role == "dialer" and conn.state == "up" and self._peers[conn.peer].queue:
                    self._refill(conn)
                if conn.pending_out == 0:
                    break
            if conn.credits < 2 or not conn.send_free:
                if conn.credits < 2:
                    self.counters["credit_waits"] += 1
                break
            end = min(len(conn.out), conn.out_pos + chunk)
            payload = bytes(conn.out[conn.out_pos : end])
            if not self._post(conn, _OP_DATA, payload):
                return
            conn.out_pos = end
        if conn.owed >= max(1, self.recv_depth // 2) and conn.credits >= 1 and conn.send_free:
            self._post(conn, _OP_CREDIT, b"")

    def _refill(self, conn: _Conn) -> None:
        conn.out.clear()
        conn.out_pos = 0
        peer = conn.peer
        frame = encode_batch_frame(self._peers[peer].take(min(self.batch_bytes, self.max_frame_bytes - HEADER_SIZE)))
        conn.out += frame
        st = self.stats[peer]
        st.frames_out += 1
        st.bytes_out += len(frame)

    def flush_now(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush()
        if self.tcp is not None:
            self.tcp.flush_now()

    def _flush(self) -> None:
        self._flush_handle = None
        due, self._flush_due = self._flush_due, set()
        for peer in sorted(due):
            conn = self._peers[peer].out
            if conn is not None and conn.state == "up":
                self._pump(conn)

    # ------------------------------------------------------------ frames

    def _on_bytes(self, conn: _Conn, data: bytes) -> None:
        if conn.peer is not None and conn.state == "up" and conn.role == "listener":
            self.stats[conn.peer].bytes_in += len(data)
        try:
            frames = conn.decoder.feed(data)
        except FrameError as exc:
            self._on_frames(conn, exc.frames)
            self._refuse(conn, f"malformed frame: {exc}")
            return
        if frames:
            self._on_frames(conn, frames)

    def _on_frames(self, conn: _Conn, frames: list[Frame]) -> None:
        for f in frames:
            if conn.state == "dead":
                return
            if conn.state == "up":
                if f.kind == BATCH and conn.role == "listener":
                    self.on_heard(conn.peer)
                    st = self.stats[conn.peer]
                    st.frames_in += 1
                    try:
                        msgs = decode_batch(f.body)
                    except FrameError as exc:
                        self._refuse(conn, f"malformed batch: {exc}")
                        return
                    for m in msgs:
                        try:
                            self.on_message(conn.peer, m)
                        except Exception:  # the member's bug must not kill the link
                            self.log.exception("on_message failed for a message from %s", conn.peer)
                elif f.kind != PING:
                    self._refuse(conn, f"unexpected frame kind {f.kind} after handshake")
                    return
                continue
            try:
                self._handshake(conn, f)
            except TransportError as exc:
                if isinstance(exc, ContractError) and exc.reply is not None:
                    self._send_frame(conn, exc.reply)  # tell the peer why, so that both ends say it
                self._refuse(conn, exc)
                return

    def _handshake(self, conn: _Conn, f: Frame) -> None:
        """Feed one frame to the connection's handshake (framing.py's state
        machines, the same as TCP's); raises HandshakeError."""
        hs = conn.hs
        reply = hs.receive(f)
        if conn.role == "listener" and conn.peer is None:
            conn.peer = hs.peer  # named a known member: refusals count against it
        if isinstance(hs, ListenerHandshake) and hs.probe is not None:
            conn.peer = None
            raise HandshakeError("probes are answered over TCP, not RDMA", "malformed")
        if reply is not None:
            self._send_frame(conn, reply)
        if not hs.done:
            return
        self._up(conn)
        peer = conn.peer
        self.note_admitted(peer)
        if conn.role == "listener":
            live = peer in self._in and self._in[peer].state == "up"
            if not self.note_incarnation(peer, hs.peer_incarnation, hs.peer_listen, "rdma", live):
                raise HandshakeError(f"another process claims member {peer} at {hs.peer_listen}, where {peer} "
                                     f"is not configured", "identity")
            old = self._in.get(peer)
            self._in[peer] = conn
            if old is not None and old is not conn:
                self._fail(old, "replaced by a new connection from the same peer", quiet=True)
            return
        p = self._peers[peer]
        p.out = conn
        self.stats[peer].connected = True
        if p.mode != "rdma":
            self.log.info("peer %s: RDMA link up via %s", peer, self.device)
        p.mode = "rdma"
        self._pump(conn)

    def _up(self, conn: _Conn) -> None:
        conn.state = "up"
        conn.was_up = True
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    # ------------------------------------------------------------ failure

    def _restart_timer(self, conn: _Conn, delay: float, why: str) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = self._loop.call_later(delay, self._timeout, conn, why)

    def _timeout(self, conn: _Conn, why: str) -> None:
        conn.timer = None
        if conn.state != "up":
            self._fail(conn, why)

    def _refuse(self, conn: _Conn, why: str | Exception) -> None:
        exc = why if isinstance(why, Exception) else HandshakeError(why, "malformed")
        self.note_refusal(conn.peer, f"rdma: closing connection {conn.role} {conn.peer or '(unidentified)'}", exc)
        self._fail(conn, str(exc), quiet=True)

    def _fail(self, conn: _Conn, why: str, quiet: bool = False) -> None:
        """Close one connection and release its resources."""
        if conn.state == "dead":
            return
        was_up = conn.state == "up"
        conn.state = "dead"
        conn.fail_reason = why
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        if conn.qpn is not None and self._by_qpn.get(conn.qpn) is conn:
            del self._by_qpn[conn.qpn]
        if conn.chan_fd >= 0 and self._loop is not None:
            self._loop.remove_reader(conn.chan_fd)
        peer = conn.peer
        if conn.role == "dialer" and peer in self._peers and self._peers[peer].out is conn:
            self._peers[peer].out = None
            self.stats[peer].connected = False
        if conn.role == "listener" and peer is not None and self._in.get(peer) is conn:
            del self._in[peer]
        # A link that was up going down is news; a connect attempt failing is
        # not (the dial loop logs the one line when it falls back to TCP).
        log = self.log.info if (was_up and not quiet and not self._closing) else self.log.debug
        log("rdma: %s link %s closed: %s", conn.role, peer, why)
        pv = self._pv
        if conn.cmid is not None and conn.connected:
            try:
                conn.cmid.disconnect()
            except pv.Error:
                pass
        conn.close_verbs()  # the cm id (QP, MRs), then its event channel; a failure parks it
        self._conns.discard(conn)
        if not conn.finished.done():
            conn.finished.set_result(was_up)
