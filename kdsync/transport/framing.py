"""Frames on a byte stream between two members (shared by TCP and RDMA).

Theory of operation.  A connection carries a sequence of frames.  A frame is a
fixed 16-byte header followed by `length` body bytes::

    offset size field
    0      2    magic     b"KD"
    2      1    version   1
    3      1    kind      HELLO=1, AUTH=2, BATCH=3, PING=4
    4      2    flags     reserved, must be 0
    6      2    reserved  must be 0
    8      4    length    body length, big-endian, <= max_frame_bytes
    12     4    checksum  CRC-32 (zlib.crc32, the IEEE/ISO-HDLC polynomial)
                          of header bytes 0..11 followed by the body

The checksum covers the header too, so a flipped kind or length is caught, not
just a flipped body byte.  CRC-32 rather than CRC-32C because zlib's is in the
standard library and runs at GB/s; it is an error check, not authentication
(that is the handshake's HMAC, and optionally TLS).

A BATCH body is a run of core messages, each prefixed by its length as a
4-byte big-endian integer; a transport puts everything queued for a peer into
one BATCH frame (up to its batch size cap).  HELLO and AUTH frames carry the
handshake, a sans-I/O state machine per side (`DialerHandshake`,
`ListenerHandshake`, in kdsync.transport.handshake) so that every transport
runs exactly the same one.  PING has an empty body and keeps an idle link
observable.

`FrameDecoder.feed()` is incremental: it accepts any split of the stream and
returns the complete frames, raising only `FrameError` on anything malformed
(the error's `frames` attribute holds the good frames that preceded the damage
in the same call).  After a FrameError the stream cannot be resynchronised:
the caller closes the connection, and further `feed()` calls raise FrameError
again.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

from kdsync.transport.errors import TransportError

__all__ = [
    "AUTH",
    "BATCH",
    "HEADER_SIZE",
    "HELLO",
    "KINDS",
    "MAGIC",
    "PING",
    "VERSION",
    "Frame",
    "FrameDecoder",
    "FrameError",
    "batch_overhead",
    "decode_batch",
    "encode_batch",
    "encode_batch_frame",
    "encode_frame",
]

MAGIC = b"KD"
VERSION = 1
HELLO = 1
AUTH = 2
BATCH = 3
PING = 4
KINDS = frozenset((HELLO, AUTH, BATCH, PING))

_HEAD = struct.Struct(">2sBBHHI")  # magic, version, kind, flags, reserved, length
_CRC = struct.Struct(">I")
_LEN = struct.Struct(">I")
HEADER_SIZE = _HEAD.size + _CRC.size  # 16
_crc32 = zlib.crc32


class FrameError(TransportError):
    """A malformed frame: bad magic, version, kind or length, checksum, or batch.

    When raised by `FrameDecoder.feed()`, `frames` holds the valid frames that
    preceded the damage in that call (deliver them, then close the stream).
    """

    frames: list["Frame"]

    def __init__(self, message: str, frames: list["Frame"] | None = None) -> None:
        super().__init__(message)
        self.frames = frames if frames is not None else []


class Frame(NamedTuple):
    kind: int
    flags: int
    body: bytes | memoryview  # bytes-like; may alias the decoder's input (see FrameDecoder)


def encode_frame(kind: int, body: bytes = b"") -> bytes:
    """Return header + body for one frame.  Raises FrameError on a bad kind."""
    if kind not in KINDS:
        raise FrameError(f"cannot encode unknown frame kind {kind}")
    head = _HEAD.pack(MAGIC, VERSION, kind, 0, 0, len(body))
    return head + _CRC.pack(_crc32(body, _crc32(head))) + body


def encode_batch(messages: list[bytes]) -> bytes:
    """Return the BATCH body carrying `messages` (each length-prefixed)."""
    parts: list[bytes] = []
    pack = _LEN.pack
    for m in messages:
        parts.append(pack(len(m)))
        parts.append(m)
    return b"".join(parts)


def encode_batch_frame(messages: list[bytes]) -> bytearray:
    """Return a whole BATCH frame carrying `messages`, built with one copy.

    Same bytes as `encode_frame(BATCH, encode_batch(messages))`.
    """
    pack = _LEN.pack
    parts: list[bytes] = [bytes(HEADER_SIZE)]
    length = 0
    for m in messages:
        parts.append(pack(len(m)))
        parts.append(m)
        length += 4 + len(m)
    out = bytearray().join(parts)
    _HEAD.pack_into(out, 0, MAGIC, VERSION, BATCH, 0, 0, length)
    with memoryview(out) as mv:
        _CRC.pack_into(out, 12, _crc32(mv[HEADER_SIZE:], _crc32(mv[:12])))
    return out


def batch_overhead(n_messages: int) -> int:
    """Bytes a frame adds around `n_messages` messages in one BATCH."""
    return HEADER_SIZE + _LEN.size * n_messages


def decode_batch(body: bytes | bytearray | memoryview) -> list[bytes]:
    """Split a BATCH body into its messages.  Raises FrameError if truncated."""
    out: list[bytes] = []
    mv = memoryview(body)
    n = len(mv)
    pos = 0
    unpack = _LEN.unpack_from
    while pos < n:
        if n - pos < 4:
            raise FrameError(f"truncated batch: {n - pos} stray bytes at offset {pos}")
        (size,) = unpack(mv, pos)
        pos += 4
        end = pos + size
        if end > n:
            raise FrameError(f"truncated batch: message of {size} bytes at offset {pos} overruns body of {n}")
        out.append(bytes(mv[pos:end]))
        pos = end
    return out


class FrameDecoder:
    """Incremental decoder of a frame stream.

    `feed(data)` returns the frames completed by `data` (possibly none) and
    raises only FrameError.  Bodies longer than `max_frame_bytes` are refused
    as soon as their header arrives, so a hostile peer cannot make us buffer
    more than one frame's worth.

    Copies are kept to a minimum because bodies can be tens of MB: a frame
    that arrives whole inside one `bytes` chunk is returned as a memoryview
    slice of that chunk (no copy); a frame split across chunks is assembled
    once into a buffer of its exact size.  `Frame.body` is therefore any
    bytes-like object (bytes or a read-only-by-contract memoryview); copy it
    with `bytes()` if you keep it.
    """

    __slots__ = ("max_frame_bytes", "_head", "_frame", "_fill", "_error")

    def __init__(self, max_frame_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_frame_bytes = int(max_frame_bytes)
        self._head = bytearray()  # a partial header (< HEADER_SIZE bytes)
        self._frame: bytearray | None = None  # the frame being assembled, header included
        self._fill = 0  # bytes of _frame received so far
        self._error: str | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._head) + (self._fill if self._frame is not None else 0)

    def _fail(self, why: str) -> FrameError:
        self._error = why
        self._head = bytearray()
        self._frame = None
        return FrameError(why)

    def _check_header(self, head, at: int) -> tuple[int, int, int]:
        """Validate the 16-byte header at `head[at:]`; return (kind, flags, length)."""
        magic, version, kind, flags, reserved, length = _HEAD.unpack_from(head, at)
        if magic != MAGIC:
            raise self._fail(f"bad magic {bytes(magic)!r} (not a kdsync peer?)")
        if version != VERSION:
            raise self._fail(f"unsupported frame version {version} (this member speaks {VERSION})")
        if kind not in KINDS:
            raise self._fail(f"unknown frame kind {kind}")
        if flags or reserved:
            raise self._fail(f"unknown frame flags {flags:#x}/{reserved:#x}")
        if length > self.max_frame_bytes:
            raise self._fail(f"frame of {length} bytes exceeds max_frame_bytes={self.max_frame_bytes}")
        return kind, flags, length

    def _verify(self, mv: memoryview, at: int, end: int, kind: int, flags: int) -> Frame:
        (crc,) = _CRC.unpack_from(mv, at + 12)
        body = mv[at + HEADER_SIZE : end]
        if _crc32(body, _crc32(mv[at : at + 12])) != crc:
            raise self._fail("frame checksum mismatch")
        return Frame(kind, flags, body)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._error is not None:
            raise FrameError(f"stream already failed: {self._error}")
        if not isinstance(data, bytes):
            data = bytes(data)  # frames may alias `data`: it must be immutable
        frames: list[Frame] = []
        try:
            self._feed(memoryview(data), frames)
        except FrameError as exc:
            exc.frames = frames
            raise
        return frames

    def _feed(self, mv: memoryview, frames: list[Frame]) -> None:
        n = len(mv)
        pos = 0
        while pos < n:
            if self._frame is not None:  # finish the frame being assembled
                frame = self._frame
                take = min(len(frame) - self._fill, n - pos)
                frame[self._fill : self._fill + take] = mv[pos : pos + take]
                self._fill += take
                pos += take
                if self._fill < len(frame):
                    return
                self._frame = None
                _, _, kind, flags, _, _ = _HEAD.unpack_from(frame, 0)
                frames.append(self._verify(memoryview(frame), 0, len(frame), kind, flags))
                continue
            if self._head:  # complete a partial header
                take = min(HEADER_SIZE - len(self._head), n - pos)
                self._head += mv[pos : pos + take]
                pos += take
                if len(self._head) < HEADER_SIZE:
                    return
                self._start_frame(self._head)
                self._head = bytearray()
                continue
            # Fast path: whole frames straight from `mv`, no copy.
            while n - pos >= HEADER_SIZE:
                kind, flags, length = self._check_header(mv, pos)
                end = pos + HEADER_SIZE + length
                if end > n:
                    break
                frames.append(self._verify(mv, pos, end, kind, flags))
                pos = end
            if pos < n:
                if n - pos >= HEADER_SIZE:
                    self._start_frame(mv[pos : pos + HEADER_SIZE])
                    pos += HEADER_SIZE
                else:
                    self._head = bytearray(mv[pos:])
                    return

    def _start_frame(self, head) -> None:
        """Allocate the buffer of a frame whose 16-byte header is `head`."""
        _, _, length = self._check_header(head, 0)
        frame = bytearray(HEADER_SIZE + length)
        frame[:HEADER_SIZE] = head
        self._frame = frame
        self._fill = HEADER_SIZE
