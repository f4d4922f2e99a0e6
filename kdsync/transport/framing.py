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
`ListenerHandshake`, at the end of this module) so that every transport runs
exactly the same one.  PING has an empty body and keeps an idle link
observable.

`FrameDecoder.feed()` is incremental: it accepts any split of the stream and
returns the complete frames, raising only `FrameError` on anything malformed
(the error's `frames` attribute holds the good frames that preceded the damage
in the same call).  After a FrameError the stream cannot be resynchronised:
the caller closes the connection, and further `feed()` calls raise FrameError
again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import zlib
from typing import Any, Collection, NamedTuple

from kdsync.transport import TransportError

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
    "DialerHandshake",
    "HandshakeError",
    "ListenerHandshake",
    "handshake_proof",
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


# ---------------------------------------------------------------------------
# Handshake: a sans-I/O state machine per side, shared by TCP and RDMA.
#
#     dialer   -> HELLO {"v":1, "id": <dialer id>, "to": <expected peer id>, "nonce": <32 hex>}
#     listener -> HELLO {"v":1, "id": <listener id>, "nonce": <32 hex>}
#     dialer   -> AUTH  {"proof": P_dialer}
#     listener -> AUTH  {"ok": true, "proof": P_listener}
#
# P_role = HMAC-SHA256(secret, "kdsync-v1/<role>", nonce_dialer, nonce_listener,
# dialer_id, listener_id) in hex, or "" without a secret.  The dialer proves
# first, so a listener never computes a proof for a stranger; the role label
# keeps one side's proof from being replayed as the other's; fresh nonces on
# both sides defeat replay of a recorded handshake.  The transport feeds
# decoded frames in with `receive()` and writes whatever frame it returns.

HANDSHAKE_VERSION = 1
_MAX_HANDSHAKE_BODY = 4096


class HandshakeError(TransportError):
    """The handshake with a peer failed; the message says why (one line)."""


def handshake_proof(secret: bytes | None, role: str, n_dialer: str, n_listener: str, dialer: str, listener: str) -> str:
    """The hex HMAC-SHA256 proof of `role` ("dialer" or "listener"); "" without a secret."""
    if secret is None:
        return ""
    msg = "\x00".join(("kdsync-v1/" + role, n_dialer, n_listener, dialer, listener)).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def _check_proof(got: object, want: str) -> bool:
    return isinstance(got, str) and hmac.compare_digest(got.encode("utf-8", "replace"), want.encode())


def parse_handshake(frame: Frame, kind: int, what: str) -> dict[str, Any]:
    """The JSON object in a HELLO/AUTH frame.  Raises HandshakeError."""
    if frame.kind != kind:
        raise HandshakeError(f"expected {what}, got frame kind {frame.kind}")
    if len(frame.body) > _MAX_HANDSHAKE_BODY:
        raise HandshakeError(f"{what} of {len(frame.body)} bytes is too large")
    try:
        obj = json.loads(bytes(frame.body))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise HandshakeError(f"malformed {what} (not JSON)") from None
    if not isinstance(obj, dict):
        raise HandshakeError(f"malformed {what} (not an object)")
    return obj


def handshake_field(obj: dict[str, Any], key: str, what: str) -> str:
    """A short string field of a handshake object.  Raises HandshakeError."""
    val = obj.get(key)
    if not isinstance(val, str) or len(val) > 256:
        raise HandshakeError(f"malformed {what}: field {key!r} missing or not a string")
    return val


def _json_frame(kind: int, obj: dict[str, Any]) -> bytes:
    return encode_frame(kind, json.dumps(obj, separators=(",", ":")).encode())


class DialerHandshake:
    """The dialer's half.  Send `hello()`, then for each frame received call
    `receive(frame)`, send what it returns (if anything) until `done`.

    `awaiting_accept` is True once our proof is sent: a connection closed then
    means the listener refused our proof (most likely a wrong group secret).
    """

    def __init__(self, member_id: str, peer: str, secret: bytes | None, nonce: str | None = None) -> None:
        self.member_id = member_id
        self.peer = peer
        self.secret = secret
        self.nonce = nonce or os.urandom(16).hex()
        self.peer_nonce: str | None = None
        self.awaiting_accept = False
        self.done = False

    def hello(self) -> bytes:
        return _json_frame(HELLO, {"v": HANDSHAKE_VERSION, "id": self.member_id, "to": self.peer, "nonce": self.nonce})

    def receive(self, frame: Frame) -> bytes | None:
        if self.done:
            raise HandshakeError("handshake already complete")
        if self.peer_nonce is None:
            hello = parse_handshake(frame, HELLO, "HELLO")
            answered = handshake_field(hello, "id", "HELLO")
            if answered != self.peer:
                raise HandshakeError(f"answered as member {answered!r}, expected {self.peer!r}")
            self.peer_nonce = handshake_field(hello, "nonce", "HELLO")
            self.awaiting_accept = True
            proof = handshake_proof(self.secret, "dialer", self.nonce, self.peer_nonce, self.member_id, self.peer)
            return _json_frame(AUTH, {"proof": proof})
        ok = parse_handshake(frame, AUTH, "AUTH")
        want = handshake_proof(self.secret, "listener", self.nonce, self.peer_nonce, self.member_id, self.peer)
        if ok.get("ok") is not True or not _check_proof(ok.get("proof"), want):
            raise HandshakeError("peer could not prove it knows the group secret")
        self.awaiting_accept = False
        self.done = True
        return None


class ListenerHandshake:
    """The listener's half: call `receive(frame)` for each frame received and
    send what it returns, until `done`; then `peer` is the authenticated member.

    `peer` is set as soon as a HELLO names a known member (for per-peer
    counters of refusals); `unknown_member` is True when the HELLO named a
    member outside `members`.
    """

    def __init__(self, member_id: str, members: Collection[str], secret: bytes | None, nonce: str | None = None) -> None:
        self.member_id = member_id
        self.members = members
        self.secret = secret
        self.nonce = nonce or os.urandom(16).hex()
        self.peer: str | None = None
        self.peer_nonce: str | None = None
        self.unknown_member = False
        self.done = False

    def receive(self, frame: Frame) -> bytes | None:
        if self.done:
            raise HandshakeError("handshake already complete")
        if self.peer_nonce is None:
            hello = parse_handshake(frame, HELLO, "HELLO")
            claimed = handshake_field(hello, "id", "HELLO")
            if hello.get("v") != HANDSHAKE_VERSION:
                raise HandshakeError(f"unsupported handshake version {hello.get('v')!r}")
            if claimed == self.member_id or claimed not in self.members:
                self.unknown_member = True
                raise HandshakeError(f"unknown member id {claimed!r}")
            self.peer = claimed
            target = handshake_field(hello, "to", "HELLO")
            if target != self.member_id:
                raise HandshakeError(f"member {claimed!r} meant to reach {target!r}, this is {self.member_id!r}")
            self.peer_nonce = handshake_field(hello, "nonce", "HELLO")
            return _json_frame(HELLO, {"v": HANDSHAKE_VERSION, "id": self.member_id, "nonce": self.nonce})
        auth = parse_handshake(frame, AUTH, "AUTH")
        assert self.peer is not None
        want = handshake_proof(self.secret, "dialer", self.peer_nonce, self.nonce, self.peer, self.member_id)
        if not _check_proof(auth.get("proof"), want):
            raise HandshakeError(f"member {self.peer!r} could not prove it knows the group secret")
        self.done = True
        proof = handshake_proof(self.secret, "listener", self.peer_nonce, self.nonce, self.peer, self.member_id)
        return _json_frame(AUTH, {"ok": True, "proof": proof})
