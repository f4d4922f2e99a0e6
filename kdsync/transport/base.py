"""The transport's base (kdsync.transport's docstring): `Transport`, the
per-peer queue and counters, TLS settings.  The implementations
(kdsync.transport.tcp, kdsync.transport.rdma) build on it; kdsync.transport
re-exports it and chooses one (`make_transport`)."""

from __future__ import annotations

import abc
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kdsync.transport.errors import TransportError
from kdsync.transport.framing import HEADER_SIZE

__all__ = ["OnMessage", "PeerQueue", "PeerStats", "TLSSettings", "Transport", "TransportError"]

log = logging.getLogger("kdsync.transport")

OnMessage = Callable[[str, bytes], None]


@dataclass
class TLSSettings:
    """Certificates for TLS between members (PEM files).

    Every member presents `certfile`/`keyfile`.  When `cafile` is set, TLS is
    mutual: each side requires the other's certificate to be signed by that
    CA.  Without `cafile` the link is encrypted but the peer's certificate is
    not verified (the group secret still authenticates members).
    """

    certfile: str
    keyfile: str
    cafile: str | None = None


@dataclass
class PeerStats:
    """Counters for one peer, kept up to date by the transport.

    Bytes and frames count what crossed the wire (frame headers included), in
    both directions over every connection with that peer.  `connected` is True
    while the outgoing (sending) link to the peer is authenticated and up.
    `refused` counts connections with this peer that failed the handshake
    (wrong secret, malformed HELLO, failed TLS, another group contract), in
    either direction, and `refusals` by reason (`kdsync_peer_refused_total`'s
    label: secret, tls, malformed, identity, wire_version, contract:<setting>).
    `dropped` counts messages `send()` refused because the queue was full.
    """

    bytes_in: int = 0
    bytes_out: int = 0
    frames_in: int = 0
    frames_out: int = 0
    connected: bool = False
    refused: int = 0
    dropped: int = 0
    refusals: dict[str, int] = field(default_factory=dict)


class PeerQueue:
    """The send queue of one peer: messages waiting and their bytes."""

    __slots__ = ("peer", "queue", "queued")

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.queue: collections.deque[bytes] = collections.deque()
        self.queued = 0

    def take(self, budget: int) -> list[bytes]:
        """Messages from the head of the queue that fit one BATCH frame of
        `budget` bytes (4 length bytes each), at least one."""
        queue = self.queue
        if self.queued + 4 * len(queue) <= budget:  # common case: take everything
            msgs = list(queue)
            queue.clear()
            self.queued = 0
            return msgs
        msgs = []
        size = 0
        while queue:
            n = len(queue[0]) + 4
            if msgs and size + n > budget:
                break
            msgs.append(queue.popleft())
            size += n
        self.queued -= size - 4 * len(msgs)
        return msgs


def _nothing(_peer: str) -> None:
    pass


class Transport(abc.ABC):
    """Abstract transport between the members of one kdsync group.

    `member_id`: this member.  `listen`: (host, port) to bind.  `peers`:
    {member_id: (host, port)} of ALL members (this one included, ignored).
    `on_message(peer_id, data)` is called in the event-loop thread for every
    core message received from an authenticated peer.  `secret`: the group
    secret (bytes) every member must prove it knows; None disables the check.
    `tls`: optional TLS certificates.  `max_frame_bytes`: the largest frame
    accepted or sent; a core message must fit in one frame.  Options every
    transport has: `max_queue_bytes` (per-peer send queue bound, default =
    max_frame_bytes), `max_offline_queue_bytes` (the bound while the peer's
    link is down, 1 MiB: the core retransmits what matters, so no stale
    backlog piles up), `handshake_timeout`, `connect_timeout`,
    `backoff_initial` and `backoff_max` (s, reconnect delays).
    """

    kind: str = "?"

    def __init__(
        self,
        member_id: str,
        listen: tuple[str, int],
        peers: dict[str, tuple[str, int]],
        on_message: OnMessage,
        *,
        secret: bytes | None = None,
        tls: TLSSettings | None = None,
        max_frame_bytes: int = 64 * 1024 * 1024,
        logger: logging.Logger | None = None,
        max_queue_bytes: int | None = None,
        max_offline_queue_bytes: int = 1 << 20,
        handshake_timeout: float = 5.0,
        connect_timeout: float = 5.0,
        backoff_initial: float = 0.05,
        backoff_max: float = 2.0,
        local: Any = None,
    ) -> None:
        if isinstance(secret, str):
            raise TypeError("secret must be bytes")
        self.member_id = member_id
        self.listen = (listen[0], int(listen[1]))
        self.peers = {p: (a[0], int(a[1])) for p, a in peers.items() if p != member_id}
        self.on_message = on_message
        # any bytes from an authenticated peer, before their messages reach
        # on_message (they may wait their turn): the peer is alive (the
        # member's liveness, kdsync.ticks.Sleepers)
        self.on_heard: Callable[[str], None] = _nothing
        self.secret = secret
        self.tls = tls
        self.max_frame_bytes = int(max_frame_bytes)
        self.log = logger or log
        self.stats: dict[str, PeerStats] = {p: PeerStats() for p in sorted(self.peers)}
        self.max_queue_bytes = int(max_queue_bytes if max_queue_bytes is not None else max_frame_bytes)
        self.max_offline_queue_bytes = min(int(max_offline_queue_bytes), self.max_queue_bytes)
        self.max_message_bytes = self.max_frame_bytes - HEADER_SIZE - 4  # the largest message one BATCH frame holds
        self.handshake_timeout = handshake_timeout
        self.connect_timeout = connect_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        # kdsync.transport.handshake.Local: the group contract, wire versions and
        # incarnation shown to every peer (None: none shown, as an older release)
        self.local = local
        self.status: Callable[[], dict] | None = None  # answers a `kdsync status` probe (the member's view)
        self.refusals: dict[str, tuple[str, str, float]] = {}  # peer -> (why, reason, time.monotonic()) of its last
        self._refusals_logged: dict[str, set[str]] = {}  # peer -> the reasons logged since it was last admitted
        self.twins: dict[str, tuple[str, float]] = {}  # peer -> (the line: two processes claim it, last seen)
        self._incarnations: dict[str, list[tuple[str, str, str]]] = {}  # peer -> (incarnation, where, listen)
        self._twin_logged: dict[str, float] = {}
        self._closing = False

    # ------------------------------------------------------------ admission (both transports)
    def note_refusal(self, peer: str | None, where: str, exc: Exception, level: int = logging.WARNING) -> None:
        """Count one refused handshake with `peer` (None: it named no known
        member) by its reason and log it: once per peer and distinct reason
        until the peer is admitted (a dialer retries every few seconds); a
        wire version or group contract that differs is an ERROR."""
        reason = getattr(exc, "reason", "handshake")
        why = str(exc)
        if peer in self.stats:
            st = self.stats[peer]
            st.refused += 1
            st.refusals[reason] = st.refusals.get(reason, 0) + 1
            self.refusals[peer] = (why, reason, time.monotonic())
            logged = self._refusals_logged.setdefault(peer, set())
            if len(logged) > 64:  # reasons that name something new each time: log them afresh now and then
                logged.clear()
            if why in logged:  # every distinct reason once: a reset between two dials is not a new contract error
                return
            logged.add(why)
        if reason == "wire_version" or reason.startswith("contract"):
            level = logging.ERROR
        self.log.log(level, "%s: %s", where, why)

    def note_admitted(self, peer: str) -> None:
        """`peer` passed a handshake: a later refusal is logged again."""
        self.refusals.pop(peer, None)
        self._refusals_logged.pop(peer, None)

    def note_incarnation(self, peer: str, incarnation: str, listen: str, addr: str, live: bool = False) -> bool:
        """An authenticated link from `peer`'s process `incarnation`, which
        says it listens at `listen`; returns whether to take it.  A process
        displaced by another incarnation of the same id that comes back is
        not a restart (a restarted process never comes back): two processes
        claim the id.  One ERROR a minute names both; from then on, a
        process whose listen address is not the one configured for `peer`
        is refused while one that is exists (a copied config with another
        port stays out; the real member keeps its link).  `live`: the link
        of the last incarnation taken is still up — a newcomer that is not
        at the configured address while that one is cannot be its restart."""
        if not incarnation:
            return True
        seen = self._incarnations.get(peer, [])
        where = f"{listen or '?'} (connecting from {addr})"
        if seen and seen[-1][0] != incarnation and (
                any(x[0] == incarnation for x in seen[:-1])
                or (live and self._configured_at(peer, seen[-1][2]) and not self._configured_at(peer, listen))):
            other = seen[-1][1]
            line = (f"two processes claim member {peer}: one at {where}, the other at {other}; each member needs "
                    f"its own [member] id: stop the one that should not run")
            self.twins[peer] = (line, time.monotonic())
            if self.twins[peer][1] - self._twin_logged.get(peer, float("-inf")) >= 60.0:
                self._twin_logged[peer] = self.twins[peer][1]
                self.log.error("%s", line)
        self._incarnations[peer] = ([x for x in seen if x[0] != incarnation] + [(incarnation, where, listen)])[-4:]
        if peer in self.twins and not self._configured_at(peer, listen) and any(
                self._configured_at(peer, x[2]) for x in self._incarnations[peer]):
            self.twins[peer] = (self.twins[peer][0], time.monotonic())  # still knocking
            return False
        return True

    def _configured_at(self, peer: str, listen: str) -> bool:
        """Whether a process listening at `listen` is where `peer` is configured."""
        host, _, port = listen.rpartition(":")
        want = self.peers.get(peer)
        return want is not None and port == str(want[1]) and host.strip("[]") in (want[0], "0.0.0.0", "::", "")

    def _enqueue(self, q: PeerQueue, data: bytes, up: bool) -> bool:
        """Queue one message for `q`'s peer, whose link is `up` or not: False
        (the message dropped and counted) when the queue is full or the
        transport closing.  Raises TransportError for a message no frame
        can carry."""
        size = len(data)
        if size > self.max_message_bytes:
            raise TransportError(
                f"message of {size} bytes does not fit in a frame (max_frame_bytes={self.max_frame_bytes})"
            )
        if self._closing or q.queued + size > (self.max_queue_bytes if up else self.max_offline_queue_bytes):
            self.stats[q.peer].dropped += 1
            return False
        q.queue.append(data)
        q.queued += size
        return True

    @abc.abstractmethod
    async def start(self) -> None:
        """Bind and start (re)connecting to peers; return once listening.

        Raises TransportError when the listen address cannot be bound.
        """

    @abc.abstractmethod
    def send(self, peer: str, data: bytes) -> bool:
        """Queue one core message for `peer`; never blocks.

        Returns False when that peer's queue is full (the message is dropped;
        the core retransmits).  Raises TransportError for an unknown peer or a
        message larger than a frame can carry.
        """

    def flush_now(self) -> None:
        """Write what `send` queued so far now rather than after the loop
        iteration (the member's long passes: kdsync.ticks.Pulse).  Default:
        nothing (a transport that writes at once)."""

    def path(self, peer: str) -> str | None:
        """The link `send(peer)` uses now: the transport's kind while the
        link is up, None while it is down (RDMA says "rdma" or "tcp")."""
        return self.kind if self.stats[peer].connected else None

    def rdma_links(self) -> tuple[bool, dict[str, int]] | None:
        """RDMA transports: (a device serves the listen address, {peer: times
        its messages moved from a lost RDMA link to TCP}); others None."""
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop every task and close every socket.  Idempotent."""
