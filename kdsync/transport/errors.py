"""The transport's one exception (kdsync.transport), in a module of its own
so that framing, handshake and the transports import it without a circle."""

from __future__ import annotations

__all__ = ["TransportError"]


class TransportError(Exception):
    """A transport problem with a one-line, user-facing message."""
