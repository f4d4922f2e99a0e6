"""TCP transport between kdsync members (asyncio, optional TLS).

Theory of operation.

Connections.  Every member dials one outgoing connection to each peer and
uses it only to send; the connections peers dial to us are used only to
receive.  So a pair of members holds two TCP connections, one per direction.
This avoids the classic race of "both sides dial at once, which connection
wins?", needs no tie-breaking by member id, and lets each side reconnect on
its own schedule: the dialer owns its link and redials it with exponential
backoff plus jitter (`backoff_initial` doubling up to `backoff_max`, each delay
scaled by a random factor in [0.5, 1)); the backoff starts over only after a
link stayed up for 5 s, so a peer that accepts and then drops us is not
hammered.  When a peer dials again (it restarted, or its link broke), the
older incoming connection from that peer is closed, so a half-open leftover
never lingers.  TCP_USER_TIMEOUT (= `idle_timeout`) breaks a link whose data
stays unacknowledged (partition, dead host), so we redial promptly after
healing instead of waiting out TCP's retransmission backoff.

Sending: batching and back-pressure.  Each peer has a bounded queue (bytes,
`max_queue_bytes`) filled by `send()`.  Everything queued in one loop
iteration goes out as one BATCH frame (`framing.py`) right after it: `send()`
schedules one `_flush` per link with `call_soon`, which writes the frame
straight to the socket (no task switch, no timer per frame).  When the
socket's buffer is backed up (the kernel did not take the last frame), `_flush` leaves the queue
to the link's writer task, which awaits `drain()`; meanwhile new messages
accumulate and go out together in the next frame.  A batch is cut at
`max_batch_bytes` (4 MiB; a bigger single message still goes alone, up to
`max_frame_bytes`): frames of tens of MB cost more in allocation and copying
than they save, and smaller ones let the receiver decode one batch while the
next is on the wire.  When the queue is full, `send()` returns False and drops
the message (the core retransmits); memory per peer is bounded by
`max_queue_bytes` plus one frame in the socket buffer.  While the link to a
peer is down, the queue only takes `max_offline_queue_bytes` (1 MiB): enough
for what was sent just before the link came up or across a short blip
(queued messages survive a reconnect), without a backlog of stale
retransmissions piling up for a peer that is gone.

Liveness of links.  An idle writer sends a PING every `ping_interval` seconds,
and so does the listener on each incoming connection (its only traffic): each
side closes a connection on which nothing arrived for `idle_timeout` seconds,
and middleboxes never see a flow that is silent one way.

Receiving.  The handshake runs on asyncio streams; once it succeeds, the
socket is handed to a plain `asyncio.Protocol` (`_Inbound`) that feeds each
chunk straight into the frame decoder and calls `on_message` for each
message, in the loop callback itself (no stream-buffer copies, no task switch
per read).  A malformed frame closes that connection only.

Handshake (over the framed stream, before any BATCH): the HELLO / AUTH
exchange of kdsync.transport.handshake — both ends prove the group secret
(HMAC over fresh nonces; the dialer first, so a listener never computes a
proof for a stranger) and show each other their wire versions and group
contract (kdsync.contract).  A peer that claims an unknown member id, cannot
prove the secret, fails TLS, times out (`handshake_timeout`), sends anything
malformed, speaks no common wire version or shows another contract is
refused: only that connection is closed, with one line naming its address
and the reason (once per peer and reason until it is admitted; an ERROR for
a contract or a version), counted in `kdsync_peer_refused_total{peer,reason}`.
A probe (`probe()`: `kdsync check`, `kdsync status`) is answered and closed,
never taken for the member it speaks for.

TLS.  With `TLSSettings`, the listener upgrades each accepted socket itself
(`loop.start_tls`, so that a failed TLS handshake is logged like any other
refusal) and the dialer connects with stdlib `ssl`; TLS 1.2 or newer.  With
`cafile` set, both sides require a certificate signed by that CA (mutual TLS).
Hostnames are not checked: members are addressed by IP and identify
themselves in the handshake above.

Threading.  Everything runs in one asyncio event loop; `send()` and
`on_message` run in that loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import socket
import ssl
from typing import NamedTuple, cast

from kdsync.transport.base import PeerQueue, TLSSettings, Transport, TransportError
from kdsync.transport.framing import (
    BATCH,
    HEADER_SIZE,
    PING,
    Frame,
    FrameDecoder,
    FrameError,
    decode_batch,
    encode_batch_frame,
    encode_frame,
)
from kdsync.transport.handshake import (
    ContractError,
    DialerHandshake,
    HandshakeError,
    ListenerHandshake,
    handshake_field,
    handshake_proof,
    parse_handshake,
)

__all__ = ["HandshakeError", "ProbeResult", "TcpTransport", "probe"]

_READ_CHUNK = 1 << 20
_STABLE_LINK_S = 5.0
_HANDSHAKE_FRAME_BYTES = 64 * 1024  # largest frame accepted before authentication
_PING_FRAME = encode_frame(PING)


class _ClosedDuringHandshake(HandshakeError):
    pass


class _Frames:
    """The read side of a connection, frame by frame: the stream, its decoder
    (small frames only until the peer is authenticated: a stranger must not
    make us allocate a max_frame_bytes buffer) and the frames a read decoded
    beyond the one asked for, kept for the next ask."""

    __slots__ = ("reader", "dec", "pending")

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.dec = FrameDecoder(_HANDSHAKE_FRAME_BYTES)
        self.pending: list[Frame] = []

    async def next(self) -> Frame:
        """The next frame; _ClosedDuringHandshake if the peer closes first."""
        while not self.pending:
            data = await self.reader.read(_READ_CHUNK)
            if not data:
                raise _ClosedDuringHandshake("connection closed during handshake")
            self.pending.extend(self.dec.feed(data))
        return self.pending.pop(0)


# Older names, kept for modules that imported them from here.
_proof = handshake_proof
_parse_json = parse_handshake
_field = handshake_field


class _Link(PeerQueue):
    """Outgoing side of one peer: its queue and the task that dials it."""

    __slots__ = ("addr", "wakeup", "task", "writer", "last_error", "flush_due", "legacy_noted")

    def __init__(self, peer: str, addr: tuple[str, int]) -> None:
        super().__init__(peer)
        self.addr = addr
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_error: str | None = None
        self.flush_due = False  # a _flush of this link is scheduled on the loop
        self.legacy_noted = False  # said once that the peer shows no group contract (an older release)


class _Probe(NamedTuple):
    """An authenticated probe connection (`kdsync check`, `kdsync status`)."""

    kind: str
    claimed: str


def _peername(writer: asyncio.StreamWriter) -> str:
    addr = writer.get_extra_info("peername")
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


class _Accept(asyncio.Protocol):
    """Protocol of a just-accepted socket: hold reading and let TcpTransport._accept take over."""

    def __init__(self, owner: "TcpTransport") -> None:
        self.owner = owner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # an asyncio.Transport in behaviour (uvloop's is not a subclass of it)
        transport = cast(asyncio.Transport, transport)
        transport.pause_reading()
        if self.owner._closing:
            transport.abort()
            return
        asyncio.get_running_loop().create_task(self.owner._accept(transport))

    def connection_lost(self, exc: Exception | None) -> None:
        pass


class _Inbound(asyncio.Protocol):
    """Receiving side of an authenticated incoming connection.

    Bytes go straight from the socket into the frame decoder and the messages
    to `on_message`, in the event-loop callback itself: no stream buffer, no
    task switch per read.  `done` resolves when the connection is gone.
    """

    def __init__(self, owner: "TcpTransport", peer: str, transport: asyncio.Transport, dec: FrameDecoder) -> None:
        self.owner = owner
        self.peer = peer
        addr = transport.get_extra_info("peername")
        self.addr_s = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        self.transport = transport
        self.dec = dec
        self.stats = owner.stats[peer]
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.done: asyncio.Future[None] = loop.create_future()
        self.last_rx = loop.time()
        self._idle = loop.call_later(owner.idle_timeout / 2, self._check_idle)
        self._ping = loop.call_later(owner.ping_interval, self._send_ping)

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        self.stats.bytes_in += len(data)
        self.last_rx = self.loop.time()
        self.owner.on_heard(self.peer)
        try:
            frames = self.dec.feed(data)
        except FrameError as exc:
            self.handle(exc.frames, exc)
            return
        if frames:
            self.handle(frames)

    def handle(self, frames: list[Frame], error: FrameError | None = None) -> None:
        """Deliver `frames`; on a malformed frame (or `error`), log it and drop the connection."""
        try:
            self.owner._deliver(self.peer, frames)
            if error is not None:
                raise error
        except FrameError as exc:
            self.owner.log.warning("closed connection from %s at %s: malformed frame: %s", self.peer, self.addr_s, exc)
            self.transport.abort()
            self.connection_lost(None)

    def eof_received(self) -> bool:
        return False  # close our side too

    def _check_idle(self) -> None:
        if self.done.done():
            return
        idle = self.owner.idle_timeout
        if self.loop.time() - self.last_rx >= idle:
            self.owner.log.info("closing silent connection from %s at %s (nothing for %.0fs)", self.peer, self.addr_s, idle)
            self.transport.abort()
            return
        self._idle = self.loop.call_later(max(0.01, self.last_rx + idle - self.loop.time()), self._check_idle)

    def _send_ping(self) -> None:
        """Keep the listener -> dialer direction alive too: the dialer notices a dead
        listener, and middleboxes (NAT, proxies) do not expire a one-way-silent flow."""
        if self.done.done():
            return
        if self.transport.get_write_buffer_size() == 0:  # never pile pings up
            self.transport.write(_PING_FRAME)
            self.stats.frames_out += 1
            self.stats.bytes_out += len(_PING_FRAME)
        self._ping = self.loop.call_later(self.owner.ping_interval, self._send_ping)

    def connection_lost(self, exc: Exception | None) -> None:
        self._idle.cancel()
        self._ping.cancel()
        if not self.done.done():
            self.done.set_result(None)


class TcpTransport(Transport):
    """The Transport over TCP; see the module docstring for the design.

    Extra keyword options (all optional), besides those of every Transport:
    `ping_interval` (s), `idle_timeout` (s), `max_batch_bytes` (soft cap of
    one BATCH frame, default 4 MiB), `max_pending_handshakes` (incoming connections allowed to be mid-handshake
    at once, 64; more are closed at once, so a connection flood cannot exhaust
    file descriptors).
    """

    kind = "tcp"

    def __init__(self, *args, ping_interval: float = 1.0, idle_timeout: float = 15.0,
                 max_batch_bytes: int = 4 << 20, max_pending_handshakes: int = 64, **common) -> None:
        super().__init__(*args, **common)  # Transport's arguments and options
        self.ping_interval = ping_interval
        self.idle_timeout = idle_timeout
        self.max_batch_bytes = int(max_batch_bytes)
        self.max_pending_handshakes = int(max_pending_handshakes)
        self._unauthenticated: set[object] = set()
        self._flood_logged = float("-inf")
        self.refused_unknown = 0  # refused connections that named no known member (or failed TLS)
        self._links = {p: _Link(p, a) for p, a in sorted(self.peers.items())}
        self._inbound: dict[str, asyncio.StreamWriter] = {}
        self._conn_tasks: set[asyncio.Task] = set()
        self._server: asyncio.base_events.Server | None = None
        self._rng = random.Random(os.urandom(16))
        self._server_ssl: ssl.SSLContext | None = None
        self._client_ssl: ssl.SSLContext | None = None
        self.bound: tuple[str, int] | None = None  # actual listen address after start()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ public API

    async def start(self) -> None:
        if self.tls is not None:
            self._server_ssl, self._client_ssl = self._ssl_contexts(self.tls)
        host, port = self.listen
        loop = self._loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _Accept(self), host, port, reuse_address=True
            )
        except OSError as exc:
            raise TransportError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; check [member] listen"
            ) from None
        sock = self._server.sockets[0]
        self.bound = sock.getsockname()[:2]
        for link in self._links.values():
            link.task = asyncio.create_task(self._dial_loop(link), name=f"kdsync-tcp-dial-{link.peer}")
        self.log.info(
            "transport tcp listening on %s:%s%s%s",
            self.bound[0],
            self.bound[1],
            " with TLS" if self._server_ssl else "",
            " with group secret" if self.secret is not None else "",
        )

    def send(self, peer: str, data: bytes) -> bool:
        link = self._links.get(peer)
        if link is None:
            raise TransportError(f"cannot send to unknown member {peer!r}")
        if not self._enqueue(link, data, link.writer is not None):
            return False
        if link.writer is None:
            link.wakeup.set()  # the write loop sends the queue once connected
        elif not link.flush_due:
            # everything sent in this loop iteration leaves as one frame, right after it
            link.flush_due = True
            self._loop.call_soon(self._flush, link)
        return True

    def flush_now(self) -> None:
        for link in self._links.values():
            if link.flush_due:
                self._flush(link)  # the call_soon already scheduled finds the queue empty, or what came since

    def _flush(self, link: _Link) -> None:
        """Write the queue of a connected link straight to its socket (one
        BATCH frame, or a few when large), without waking the write loop; when
        the socket's buffer is backed up, leave it to the write loop, which
        waits for it to drain."""
        link.flush_due = False
        w = link.writer
        if not link.queue or self._closing:
            return
        if w is None or w.transport.is_closing():
            link.wakeup.set()
            return
        st = self.stats[link.peer]
        budget = min(self.max_frame_bytes, self.max_batch_bytes) - HEADER_SIZE
        tr = w.transport
        # the kernel took everything so far: at most one frame ever waits in asyncio's buffer
        while link.queue and tr.get_write_buffer_size() == 0:
            frame = encode_batch_frame(link.take(budget))
            w.write(frame)
            st.frames_out += 1
            st.bytes_out += len(frame)
        if link.queue:
            link.wakeup.set()  # backed up: the write loop waits for drain()

    def queued_bytes(self, peer: str) -> int:
        """Bytes waiting in the send queue of `peer`."""
        return self._links[peer].queued

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._server is not None:
            self._server.close()
        tasks = [lk.task for lk in self._links.values() if lk.task is not None] + list(self._conn_tasks)
        for lk in self._links.values():
            if lk.writer is not None:
                lk.writer.close()
        for w in list(self._inbound.values()):
            w.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except (asyncio.TimeoutError, Exception):
                pass
        for st in self.stats.values():
            st.connected = False

    # ------------------------------------------------------------ TLS

    @staticmethod
    def _ssl_contexts(tls: TLSSettings) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        try:
            server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            for ctx in (server, client):
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                ctx.load_cert_chain(tls.certfile, tls.keyfile)
            client.check_hostname = False
            if tls.cafile:
                for ctx in (server, client):
                    ctx.load_verify_locations(cafile=tls.cafile)
                    ctx.verify_mode = ssl.CERT_REQUIRED
            else:
                server.verify_mode = ssl.CERT_NONE
                client.verify_mode = ssl.CERT_NONE
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(
                f"cannot load TLS certificates (certfile={tls.certfile}, keyfile={tls.keyfile}, "
                f"cafile={tls.cafile}): {getattr(exc, 'strerror', None) or exc}; check the [tls] settings"
            ) from None
        return server, client

    # ------------------------------------------------------------ helpers

    def _set_sockopts(self, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is None:
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if hasattr(socket, "TCP_USER_TIMEOUT"):
                # Data unacknowledged for idle_timeout (a partition, a dead host) breaks the
                # connection, so we redial promptly after healing instead of waiting out
                # TCP's retransmission backoff (minutes).
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.idle_timeout * 1000))
        except OSError:
            pass

    def _deliver(self, peer: str, frames: list[Frame]) -> None:
        """Hand the messages of `frames` to on_message.  Raises FrameError on a bad frame."""
        st = self.stats[peer]
        st.frames_in += len(frames)
        for f in frames:
            if f.kind == BATCH:
                for msg in decode_batch(f.body):
                    try:
                        self.on_message(peer, msg)
                    except Exception:  # the member's bug must not kill the link
                        self.log.exception("on_message failed for a message from %s", peer)
            elif f.kind != PING:
                raise FrameError(f"unexpected frame kind {f.kind} after handshake")

    # ------------------------------------------------------------ listener side

    async def _accept(self, transport: asyncio.Transport) -> None:
        """Upgrade a fresh connection to TLS (if configured) and hand it to _on_incoming.

        asyncio.start_server(ssl=...) would hide TLS handshake failures (they are
        logged at DEBUG at most); doing the upgrade here lets us log them as one
        WARNING line like every other refusal.
        """
        if self._closing:
            transport.abort()
            return
        addr = transport.get_extra_info("peername")
        addr_s = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        if len(self._unauthenticated) >= self.max_pending_handshakes:
            # A flood of connections that never finish the handshake must not exhaust
            # file descriptors; drop newcomers (one log line per 10 s) until they time out.
            now = asyncio.get_running_loop().time()
            if now - self._flood_logged >= 10.0:
                self._flood_logged = now
                self.log.warning(
                    "refused connection from %s: %d connections already awaiting their handshake "
                    "(max_pending_handshakes); further refusals are not logged for 10s",
                    addr_s,
                    len(self._unauthenticated),
                )
            transport.abort()
            return
        slot = object()  # this connection's place among the unauthenticated
        self._unauthenticated.add(slot)
        task = asyncio.current_task()
        if task is not None:
            self._conn_tasks.add(task)
        try:
            reader = asyncio.StreamReader(limit=_READ_CHUNK)
            proto = asyncio.StreamReaderProtocol(reader, functools.partial(self._on_incoming, slot=slot))
            if self._server_ssl is not None:
                try:
                    transport = await asyncio.get_running_loop().start_tls(
                        transport,
                        proto,
                        self._server_ssl,
                        server_side=True,
                        ssl_handshake_timeout=self.handshake_timeout,
                    )
                except (OSError, ssl.SSLError, asyncio.TimeoutError) as exc:
                    why = str(exc) or repr(exc)
                    if isinstance(exc, ConnectionResetError):
                        why = "connection reset by the peer (did it reject our certificate?)"
                    self.refused_unknown += 1
                    self.log.warning("refused connection from %s: TLS handshake failed: %s", addr_s, why)
                    transport.abort()
                    self._unauthenticated.discard(slot)
                    return
                if transport is None:  # closed during the handshake
                    self._unauthenticated.discard(slot)
                    return
                proto.connection_made(transport)
            else:
                transport.set_protocol(proto)
                proto.connection_made(transport)
                transport.resume_reading()
        except asyncio.CancelledError:
            transport.abort()
            self._unauthenticated.discard(slot)
        finally:
            if task is not None:
                self._conn_tasks.discard(task)

    async def _on_incoming(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, slot: object) -> None:
        if self._closing:
            self._unauthenticated.discard(slot)
            writer.close()
            return
        task = asyncio.current_task()
        if task is not None:
            self._conn_tasks.add(task)
        addr = writer.get_extra_info("peername")
        addr_s = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        peer: str | None = None
        try:
            self._set_sockopts(writer)
            try:
                inbound = await asyncio.wait_for(self._listener_handshake(_Frames(reader), writer),
                                                 self.handshake_timeout)
            except asyncio.TimeoutError:
                self.log.warning("refused connection from %s: no valid handshake within %.1fs", addr_s, self.handshake_timeout)
                return
            except HandshakeError as exc:
                if getattr(exc, "probe", None):  # `kdsync check` from a member that disagrees: it says so itself
                    self.log.info("refused a %s probe from %s: %s", exc.probe, addr_s, exc)
                else:
                    self.note_refusal(getattr(exc, "peer", None), f"refused connection from {addr_s}", exc)
                return
            finally:
                self._unauthenticated.discard(slot)
            if isinstance(inbound, _Probe):
                await self._answer_probe(inbound, writer)
                return
            peer = inbound.peer
            old = self._inbound.get(peer)
            if old is not None:
                old.close()  # the peer dialed again; its previous connection is stale
            self._inbound[peer] = writer
            self.log.debug("accepted connection from %s at %s", peer, addr_s)
            try:
                await inbound.done
            finally:
                if self._inbound.get(peer) is writer:
                    del self._inbound[peer]
        except (ConnectionError, OSError, ssl.SSLError) as exc:
            self.log.debug("connection from %s (%s) ended: %s", addr_s, peer, exc)
        except asyncio.CancelledError:
            pass
        finally:
            writer.close()
            if task is not None:
                self._conn_tasks.discard(task)

    async def _listener_handshake(self, frames: _Frames, writer: asyncio.StreamWriter) -> "_Inbound | _Probe":
        """Run the listener half of the handshake; return the protocol now receiving from the peer."""
        hs = ListenerHandshake(self.member_id, self.peers, self.secret, local=self.local)
        sent = 0
        try:
            while True:
                reply = hs.receive(await frames.next())
                if reply is not None:
                    writer.write(reply)
                    sent += len(reply)
                if hs.done:
                    break
                await writer.drain()
            if hs.probe is not None:  # `kdsync check` / `kdsync status`: never this peer's link
                return _Probe(hs.probe, hs.peer or "")
            assert hs.peer is not None
            live = hs.peer in self._inbound and not self._inbound[hs.peer].is_closing()
            if not self.note_incarnation(hs.peer, hs.peer_incarnation, hs.peer_listen, _peername(writer), live):
                raise HandshakeError(f"another process claims member {hs.peer} at {hs.peer_listen}, where "
                                     f"{hs.peer} is not configured (the one at its configured address keeps the "
                                     f"link)", "identity")
            # The dialer sends nothing until it has our accept, so the stream reader
            # holds no unread bytes now: hand the socket to a plain protocol, with no
            # await in between (no StreamReader copies on the hot receive path).
            assert hs.peer is not None
            frames.dec.max_frame_bytes = self.max_frame_bytes  # authenticated: full-size frames from now on
            inbound = _Inbound(self, hs.peer, writer.transport, frames.dec)
            writer.transport.set_protocol(inbound)
            inbound.handle(list(frames.pending))  # frames that came with AUTH (a well-behaved dialer sends none)
            frames.pending.clear()
        except (FrameError, HandshakeError) as exc:
            if isinstance(exc, ContractError) and exc.reply is not None:
                writer.write(exc.reply)  # tell the dialer why, so that both ends say it
                with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                    await asyncio.wait_for(writer.drain(), 1.0)
            if hs.unknown_member:
                self.refused_unknown += 1
            if isinstance(exc, FrameError):
                exc = HandshakeError(f"malformed frame: {exc}", "malformed")
            exc.peer = hs.peer if hs.probe is None else None  # counted against the member it claimed to be
            exc.probe = hs.probe
            raise exc from None
        st = self.stats[hs.peer]
        st.frames_out += 2
        st.bytes_out += sent
        st.frames_in += 2
        self.note_admitted(hs.peer)
        return inbound

    async def _answer_probe(self, probe: "_Probe", writer: asyncio.StreamWriter) -> None:
        """A `kdsync status` probe is answered the member's status as one
        BATCH frame of JSON; a `kdsync check` probe had its answer in the
        handshake."""
        if probe.kind == "status":
            status = self.status() if self.status is not None else {"error": "this member serves no status"}
            writer.write(encode_batch_frame([json.dumps(status, separators=(",", ":"), default=str).encode()]))
            with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.drain(), self.handshake_timeout)

    # ------------------------------------------------------------ dialer side

    async def _dial_loop(self, link: _Link) -> None:
        attempt = 0
        st = self.stats[link.peer]
        host, port = link.addr
        while not self._closing:
            writer: asyncio.StreamWriter | None = None
            reason: str | None = None
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        host,
                        port,
                        ssl=self._client_ssl,
                        ssl_handshake_timeout=self.handshake_timeout if self._client_ssl else None,
                        limit=_READ_CHUNK,
                    ),
                    self.connect_timeout,
                )
                self._set_sockopts(writer)
                frames = _Frames(reader)  # a listener only ever sends small frames
                try:
                    await asyncio.wait_for(self._dialer_handshake(link, frames, writer), self.handshake_timeout)
                except HandshakeError as exc:
                    link.last_error = None
                    self.note_refusal(link.peer, f"handshake with {link.peer} at {host}:{port} failed", exc)
                    raise
                self.note_admitted(link.peer)
                connected_at = asyncio.get_running_loop().time()
                link.writer = writer
                link.last_error = None
                st.connected = True
                self.log.info("connected to %s at %s:%s", link.peer, host, port)
                reason = await self._pump(link, frames, writer)
                # Back off afresh only after a link that held for a while, so a peer
                # that accepts and then drops us at once is not hammered.
                if asyncio.get_running_loop().time() - connected_at >= _STABLE_LINK_S:
                    attempt = 0
            except asyncio.CancelledError:
                raise
            except HandshakeError:
                pass
            except asyncio.TimeoutError:
                self._note_failure(link, f"connecting to {link.peer} at {host}:{port} timed out", logging.INFO)
            except ssl.SSLError as exc:
                self.note_refusal(link.peer, f"TLS handshake with {link.peer} at {host}:{port} failed",
                                  HandshakeError(str(exc), "tls"))
            except (OSError, TransportError) as exc:
                self._note_failure(link, f"cannot reach {link.peer} at {host}:{port}: {exc}", logging.INFO)
            finally:
                was_connected = st.connected
                st.connected = False
                link.writer = None
                if writer is not None:
                    writer.close()
                if was_connected and not self._closing:
                    self.log.info("link to %s lost: %s", link.peer, reason or "closed")
            if self._closing:
                return
            delay = min(self.backoff_max, self.backoff_initial * (2 ** min(attempt, 30))) * self._rng.uniform(0.5, 1.0)
            attempt += 1
            await asyncio.sleep(delay)

    def _note_failure(self, link: _Link, msg: str, level: int) -> None:
        """Log a dial failure once per distinct reason (retries would repeat it every backoff)."""
        if msg != link.last_error:
            link.last_error = msg
            self.log.log(level, "%s", msg)

    async def _dialer_handshake(self, link: _Link, frames: _Frames, writer: asyncio.StreamWriter) -> None:
        st = self.stats[link.peer]
        hs = DialerHandshake(self.member_id, link.peer, self.secret, local=self.local)
        hello = hs.hello()
        writer.write(hello)
        sent = len(hello)
        try:
            while not hs.done:
                try:
                    frame = await frames.next()
                except _ClosedDuringHandshake:
                    if hs.awaiting_accept:
                        raise HandshakeError("peer closed the connection: it refused our proof (wrong group secret?)",
                                             "secret") from None
                    raise
                reply = hs.receive(frame)
                if reply is not None:
                    writer.write(reply)
                    sent += len(reply)
                    await writer.drain()
        except FrameError as exc:
            raise HandshakeError(f"malformed frame: {exc}", "malformed") from None
        if hs.legacy and not link.legacy_noted:
            link.legacy_noted = True
            self.log.info("peer %s runs an older release: its group contract is not compared", link.peer)
        st.frames_out += 2
        st.bytes_out += sent
        st.frames_in += 2

    async def _pump(self, link: _Link, frames: _Frames, writer: asyncio.StreamWriter) -> str:
        """Run the writer and a watcher of the read side until the connection ends; return why."""
        wtask = asyncio.create_task(self._write_loop(link, writer))
        rtask = asyncio.create_task(self._watch_loop(link, frames))
        try:
            done, _ = await asyncio.wait((wtask, rtask), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (wtask, rtask):
                t.cancel()
            await asyncio.gather(wtask, rtask, return_exceptions=True)
        for t in done:
            exc = t.exception()
            if exc is not None:
                return str(exc) or type(exc).__name__
            return t.result()
        return "closed"

    async def _write_loop(self, link: _Link, writer: asyncio.StreamWriter) -> str:
        st = self.stats[link.peer]
        queue = link.queue
        budget = min(self.max_frame_bytes, self.max_batch_bytes) - HEADER_SIZE
        while not self._closing:
            if not queue:
                link.wakeup.clear()
                try:
                    async with asyncio.timeout(self.ping_interval):
                        await link.wakeup.wait()
                except TimeoutError:
                    writer.write(_PING_FRAME)
                    st.frames_out += 1
                    st.bytes_out += len(_PING_FRAME)
                    await writer.drain()
                continue
            await writer.drain()  # _flush may have left a frame in the buffer: at most one waits there
            if not queue:
                continue
            frame = encode_batch_frame(link.take(budget))
            writer.write(frame)
            st.frames_out += 1
            st.bytes_out += len(frame)
            await writer.drain()
        return "closing"

    async def _watch_loop(self, link: _Link, frames: _Frames) -> str:
        """The listener only sends PINGs after accepting: read them to notice EOF,
        errors, and a listener that went silent (dead host, half-open socket)."""
        reader, dec = frames.reader, frames.dec
        st = self.stats[link.peer]
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.idle_timeout) as idle:
                while True:
                    data = await reader.read(_READ_CHUNK)
                    if not data:
                        return "peer closed the connection"
                    st.bytes_in += len(data)
                    for f in dec.feed(data):
                        st.frames_in += 1
                        if f.kind != PING:
                            raise FrameError(f"unexpected frame kind {f.kind} from listener")
                    idle.reschedule(loop.time() + self.idle_timeout)
        except TimeoutError:
            return f"nothing from the peer for {self.idle_timeout:.0f}s"


class ProbeResult(NamedTuple):
    """What a probe learned of a member: its contract (None: an older
    release that shows none) and, for a status probe, its status."""

    contract: dict | None
    status: dict | None


async def probe(addr: tuple[str, int], member_id: str, peer: str, secret: bytes | None, local, kind: str, *,
                tls: TLSSettings | None = None, timeout: float = 5.0, max_bytes: int = 64 << 20) -> ProbeResult:
    """Dial member `peer` at `addr` as a probe (`kind` "check" or "status")
    under `member_id`, prove the secret and show `local`'s contract: the
    member's answer.  Raises HandshakeError (a refusal, with its reason),
    TransportError (cannot connect) or asyncio.TimeoutError."""
    client_ssl = TcpTransport._ssl_contexts(tls)[1] if tls is not None else None

    async def run() -> ProbeResult:
        reader, writer = await asyncio.open_connection(addr[0], addr[1], ssl=client_ssl, limit=_READ_CHUNK)
        try:
            hs = DialerHandshake(member_id, peer, secret, local=local, probe=kind)
            frames = _Frames(reader)
            writer.write(hs.hello())
            while not hs.done:
                try:
                    reply = hs.receive(await frames.next())
                except _ClosedDuringHandshake:
                    if hs.awaiting_accept:
                        raise HandshakeError(f"{peer} closed the connection: it refused our proof (wrong group "
                                             f"secret?)", "secret") from None
                    raise
                if reply is not None:
                    writer.write(reply)
            status = None
            if kind == "status":
                frames.dec.max_frame_bytes = max_bytes
                frame = await frames.next()
                (body,) = decode_batch(frame.body)
                status = json.loads(body)
            return ProbeResult(hs.peer_contract, status)
        finally:
            writer.close()

    try:
        return await asyncio.wait_for(run(), timeout)
    except FrameError as exc:
        raise HandshakeError(f"malformed answer: {exc}", "malformed") from None
    except (OSError, ssl.SSLError) as exc:
        raise TransportError(f"cannot reach {peer} at {addr[0]}:{addr[1]}: {getattr(exc, 'strerror', None) or exc}") \
            from None
