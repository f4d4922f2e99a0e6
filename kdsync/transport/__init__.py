"""kdsync/transport — moving core messages between members.

A transport carries opaque core messages (bytes produced by the ordering core)
from this member to its peers and hands every message received from an
authenticated peer to `on_message(peer_id, data)`, in the event-loop thread.
It never interprets the messages: ordering, retransmission and failure
detection are the core's job.  Delivery is best effort: messages to one peer
arrive in the order they were sent over one connection, but may be lost when a
connection breaks or when `send()` refuses them (back-pressure); the core
retransmits.

Implementations: `kdsync.transport.tcp.TcpTransport` (asyncio streams, optional
TLS) and `kdsync.transport.rdma.RdmaTransport` (optional).  Both frame their
byte streams with `kdsync.transport.framing`.

Contract for the optional RDMA module (imported lazily by `make_transport`):
it exports `RdmaTransport` (a `Transport` subclass with the same constructor)
and may export `unavailable_reason() -> str | None`, returning why RDMA cannot
be used on this machine (no device, no pyverbs...) or None when it can.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kdsync.transport.base import OnMessage, PeerQueue, PeerStats, TLSSettings, Transport
from kdsync.transport.errors import TransportError

if TYPE_CHECKING:
    from kdsync.config import Config

__all__ = [
    "OnMessage",
    "PeerQueue",
    "PeerStats",
    "TLSSettings",
    "Transport",
    "TransportError",
    "make_transport",
    "member_transport",
]

log = logging.getLogger("kdsync.transport")


def _make_tcp(*args, **kwargs) -> Transport:
    from kdsync.transport.tcp import TcpTransport

    return TcpTransport(*args, **kwargs)


def make_transport(kind: str, *args, **kwargs) -> Transport:
    """Build the transport named by `kind`: "tcp", "rdma" or "auto".

    "auto" uses RDMA when `kdsync.transport.rdma` is importable and reports
    itself usable, else TCP (with one log line saying why).  Raises
    TransportError for "rdma" when RDMA cannot be used, and for an unknown kind.
    """
    if kind == "tcp":
        return _make_tcp(*args, **kwargs)
    if kind not in ("rdma", "auto"):
        raise TransportError(f"unknown transport {kind!r} (expected tcp, rdma or auto)")
    reason: str | None
    try:
        from kdsync.transport import rdma  # type: ignore[attr-defined]
    except ImportError as exc:
        rdma = None
        reason = f"RDMA transport not available ({exc})"
    else:
        check = getattr(rdma, "unavailable_reason", None)
        reason = check() if callable(check) else None
    if reason is None and rdma is not None:
        try:
            return rdma.RdmaTransport(*args, **kwargs)
        except TransportError as exc:
            if kind == "rdma":
                raise
            reason = str(exc)
    if kind == "rdma":
        raise TransportError(f"transport = \"rdma\" cannot be used: {reason}; set transport = \"tcp\" or \"auto\"")
    logger = kwargs.get("logger") or log
    logger.info("transport auto: using TCP because %s", reason)
    return _make_tcp(*args, **kwargs)


def member_transport(cfg: Config, shard: int | None, on_message: OnMessage) -> Transport:
    """The transport of member `cfg.member.id` (of shard `shard`, None when
    unsharded) as its config says: kind, listen address, peers, group secret,
    TLS, frame limit, and the group contract its handshake shows.  Raises
    TransportError (e.g. transport = "rdma" where RDMA cannot be used)."""
    from kdsync.config import parse_address
    from kdsync.contract import group_contract
    from kdsync.transport.handshake import Local

    tls = cfg.resolved_tls()
    return make_transport(cfg.transport.kind, cfg.member.id, parse_address(cfg.member.listen), cfg.peer_addresses(),
                          on_message, secret=cfg.secret_bytes(),
                          tls=TLSSettings(tls.certfile, tls.keyfile, tls.cafile) if tls else None,
                          max_frame_bytes=cfg.transport.max_frame_bytes, logger=log,
                          local=Local(group_contract(cfg, shard), listen=cfg.member.listen))
