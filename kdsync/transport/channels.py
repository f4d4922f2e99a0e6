"""Channels: the messages of several ordering nodes (one per source topic) on
one connection per peer.  A channel message is ``len(topic) topic data``:
one byte of length, the topic name in UTF-8, then the core message."""

from __future__ import annotations

from kdsync.core import RemoteProtocolError

__all__ = ["frame_channel", "split_channel"]


def frame_channel(topic: str, data: bytes) -> bytes:
    """Core message `data` of `topic`'s node, framed for the shared connection."""
    t = topic.encode()
    return bytes((len(t),)) + t + data


def split_channel(data: bytes) -> tuple[str, bytes]:
    """(topic, core message) of a channel message; raises RemoteProtocolError
    when it is malformed."""
    if not data:
        raise RemoteProtocolError("empty message")
    n = data[0]
    if len(data) < 1 + n or n == 0:
        raise RemoteProtocolError("bad channel header")
    try:
        return bytes(data[1:1 + n]).decode(), data[1 + n:]
    except UnicodeDecodeError:
        raise RemoteProtocolError("bad channel name") from None
