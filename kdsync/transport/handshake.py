"""The handshake of a connection between two members (TCP and RDMA alike).

Theory of operation.  Before any core message crosses a connection, both
ends prove they know the group secret and show each other their group
contract (kdsync.contract): a sans-I/O state machine per side, fed decoded
frames, returning the frame to send::

    dialer   -> HELLO {"v":1, "id": <dialer id>, "to": <expected peer id>, "nonce": <32 hex>,
                       "wire": [lo, hi], "probe": "check" | "status" (probes only)}
    listener -> HELLO {"v":1, "id": <listener id>, "nonce": <32 hex>, "wire": [lo, hi]}
    dialer   -> AUTH  {"proof": P_dialer, "contract": {...}, "inc": <incarnation>, "listen": "host:port"}
    listener -> AUTH  {"ok": true, "proof": P_listener, "contract": {...}}
             or AUTH  {"ok": false, "proof": P_listener, "contract": {...}, "refused": [settings]}

P_role = HMAC-SHA256(secret, "kdsync-v1/<role>", nonce_dialer, nonce_listener,
dialer_id, listener_id) in hex, or "" without a secret.  The dialer proves
first, so a listener never computes a proof for a stranger; the role label
keeps one side's proof from being replayed as the other's; fresh nonces on
both sides defeat replay of a recorded handshake.  (A proof is an HMAC over
public values, so use a long random secret.)

The wire version ranges are compared as soon as each side's HELLO arrives:
a listener that cannot speak the dialer's range answers its own HELLO (so
the dialer learns the range) and closes; each end raises `ContractError`
naming both ranges.  The contract travels in the AUTH frames, after the
dialer's proof, so only a member holding the secret learns it; the listener
compares it and answers `ok: false` with its own contract when it differs,
and the dialer compares the listener's in turn: both ends raise
`ContractError` naming every differing setting and both values.  A peer of
an older release sends no wire range and no contract: it is let in
(`legacy`), as before, so that a rolling upgrade keeps ordering.

A probe (`kdsync check`, `kdsync status`) is a dialer that proves the secret
under a member id of the group (its own config's) and says so in its HELLO:
the listener answers it but never treats the connection as that member's
link.  `inc` (a random incarnation per transport) and `listen` let a
listener notice two processes claiming one member id (kdsync.transport).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field
from typing import Any, Collection

from kdsync.contract import describe, differences, show_wire, wire_overlap, wire_range
from kdsync.transport.errors import TransportError
from kdsync.transport.framing import AUTH, HELLO, Frame, encode_frame

__all__ = ["HANDSHAKE_VERSION", "PROBES", "ContractError", "DialerHandshake", "HandshakeError", "ListenerHandshake",
           "Local", "handshake_field", "handshake_proof", "parse_handshake"]

HANDSHAKE_VERSION = 1
PROBES = ("check", "status")
_MAX_HANDSHAKE_BODY = 60 * 1024  # the contract names every member


class HandshakeError(TransportError):
    """The handshake with a peer failed; the message says why (one line).
    `reason` labels the refusal in `kdsync_peer_refused_total`."""

    reason = "handshake"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class ContractError(HandshakeError):
    """Refused because the peer speaks no common wire version or its group
    contract differs.  `reply` is the frame to send the peer before closing
    (it tells the peer why), if any."""

    def __init__(self, message: str, reason: str, reply: bytes | None = None) -> None:
        super().__init__(message, reason)
        self.reply = reply


@dataclass(frozen=True)
class Local:
    """What this end shows a peer beside its proof: its group contract, the
    wire versions it speaks, its incarnation and listen address."""

    contract: dict[str, str]
    listen: str = ""
    wire: tuple[int, int] = field(default_factory=wire_range)
    incarnation: str = field(default_factory=lambda: os.urandom(8).hex())


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
        raise HandshakeError(f"expected {what}, got frame kind {frame.kind}", "malformed")
    if len(frame.body) > _MAX_HANDSHAKE_BODY:
        raise HandshakeError(f"{what} of {len(frame.body)} bytes is too large", "malformed")
    try:
        obj = json.loads(bytes(frame.body))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise HandshakeError(f"malformed {what} (not JSON)", "malformed") from None
    if not isinstance(obj, dict):
        raise HandshakeError(f"malformed {what} (not an object)", "malformed")
    return obj


def handshake_field(obj: dict[str, Any], key: str, what: str) -> str:
    """A short string field of a handshake object.  Raises HandshakeError."""
    val = obj.get(key)
    if not isinstance(val, str) or len(val) > 256:
        raise HandshakeError(f"malformed {what}: field {key!r} missing or not a string", "malformed")
    return val


def _json_frame(kind: int, obj: dict[str, Any]) -> bytes:
    return encode_frame(kind, json.dumps(obj, separators=(",", ":")).encode())


def _hello_frame(member_id: str, nonce: str, local: Local | None, **extra: str) -> bytes:
    """A HELLO: who we are, our nonce, the wire versions we speak (and `extra`)."""
    body: dict[str, Any] = {"v": HANDSHAKE_VERSION, "id": member_id, **extra, "nonce": nonce}
    if local is not None:
        body["wire"] = list(local.wire)
    return _json_frame(HELLO, body)


def _wire_error(local: Local, peer: str, theirs: object, reply: bytes | None = None) -> ContractError:
    return ContractError(f"no common wire version: this member speaks {show_wire(local.wire)}, {peer} speaks "
                         f"{show_wire(theirs)} (upgrade the older one; docs/operations.md)", "wire_version", reply)


def _contract_error(local: Local, peer: str, theirs: object, reply: bytes | None = None) -> ContractError | None:
    diffs = differences(local.contract, theirs)
    if not diffs:
        return None
    return ContractError(f"group contract differs from {peer}'s: {describe(diffs)} (every member must use the same; "
                         f"docs/config.md)", "contract:" + diffs[0].setting, reply)


class _Half:
    """What both halves of the handshake share: this member's id, the group
    secret, what it shows (`local`), the two nonces, and the order of the
    frames: the peer's HELLO first, then its AUTH, then nothing (`done`).
    After `done`, `legacy`: the peer showed no contract (an older release)."""

    def __init__(self, member_id: str, secret: bytes | None, nonce: str | None, local: Local | None) -> None:
        self.member_id = member_id
        self.secret = secret
        self.local = local
        self.nonce = nonce or os.urandom(16).hex()
        self.peer_nonce: str | None = None
        self.legacy = False
        self.done = False

    def receive(self, frame: Frame) -> bytes | None:
        """Take the peer's next frame; return the frame to answer it with, if any.
        Raises HandshakeError (ContractError) when the peer is refused."""
        if self.done:
            raise HandshakeError("handshake already complete")
        if self.peer_nonce is None:
            return self._on_hello(parse_handshake(frame, HELLO, "HELLO"))
        return self._on_auth(parse_handshake(frame, AUTH, "AUTH"))

    def _on_hello(self, hello: dict[str, Any]) -> bytes | None:
        """Check the peer's HELLO (its JSON object) and set `peer_nonce`; the frame to answer with."""
        raise NotImplementedError

    def _on_auth(self, auth: dict[str, Any]) -> bytes | None:
        """Check the peer's AUTH (its JSON object) and set `done`; the frame to answer with, if any."""
        raise NotImplementedError


class DialerHandshake(_Half):
    """The dialer's half.  Send `hello()`, then for each frame received call
    `receive(frame)`, send what it returns (if anything) until `done`.

    `awaiting_accept` is True once our proof is sent: a connection closed then
    means the listener refused our proof (most likely a wrong group secret).
    After `done`: `legacy` (the peer showed no contract: an older release),
    `peer_contract`.  `probe` ("check", "status"): this connection is a probe.
    """

    def __init__(self, member_id: str, peer: str, secret: bytes | None, nonce: str | None = None, *,
                 local: Local | None = None, probe: str | None = None) -> None:
        super().__init__(member_id, secret, nonce, local)
        self.peer = peer
        self.probe = probe
        self.peer_contract: dict[str, str] | None = None
        self.awaiting_accept = False

    def hello(self) -> bytes:
        return _hello_frame(self.member_id, self.nonce, self.local, to=self.peer,
                            **({"probe": self.probe} if self.probe is not None else {}))

    def _on_hello(self, hello: dict[str, Any]) -> bytes:
        """The listener's HELLO: check who answered, then prove the secret first."""
        answered = handshake_field(hello, "id", "HELLO")
        if answered != self.peer:
            raise HandshakeError(f"answered as member {answered!r}, expected {self.peer!r}", "identity")
        if self.local is not None and "wire" in hello and not wire_overlap(self.local.wire, hello["wire"]):
            raise _wire_error(self.local, self.peer, hello["wire"])
        self.peer_nonce = handshake_field(hello, "nonce", "HELLO")
        self.awaiting_accept = True
        proof = handshake_proof(self.secret, "dialer", self.nonce, self.peer_nonce, self.member_id, self.peer)
        auth: dict[str, Any] = {"proof": proof}
        if self.local is not None:
            auth.update(contract=self.local.contract, inc=self.local.incarnation, listen=self.local.listen)
        return _json_frame(AUTH, auth)

    def _on_auth(self, ok: dict[str, Any]) -> None:
        """The listener's AUTH: its proof, its contract, and whether it let us in."""
        want = handshake_proof(self.secret, "listener", self.nonce, self.peer_nonce, self.member_id, self.peer)
        if not _check_proof(ok.get("proof"), want):
            raise HandshakeError("peer could not prove it knows the group secret", "secret")
        self.awaiting_accept = False
        theirs = ok.get("contract")
        if self.local is not None and theirs is not None:
            err = _contract_error(self.local, self.peer, theirs)
            if err is not None:
                raise err
        if ok.get("ok") is not True:
            raise HandshakeError(f"{self.peer} refused us: {str(ok.get('refused'))[:200]}", "refused")
        self.peer_contract = theirs if isinstance(theirs, dict) else None
        self.legacy = theirs is None
        self.done = True
        return None


class ListenerHandshake(_Half):
    """The listener's half: call `receive(frame)` for each frame received and
    send what it returns, until `done`; then `peer` is the authenticated
    member.  A `ContractError` carries the frame to send before closing.

    `peer` is set as soon as a HELLO names a known member (for per-peer
    counters of refusals); `unknown_member` is True when the HELLO named a
    member outside `members`.  After `done`: `probe` (None for a member's
    link), `legacy`, `peer_incarnation` and `peer_listen` (what the dialer
    said of itself).
    """

    def __init__(self, member_id: str, members: Collection[str], secret: bytes | None, nonce: str | None = None, *,
                 local: Local | None = None) -> None:
        super().__init__(member_id, secret, nonce, local)
        self.members = members
        self.peer: str | None = None
        self.probe: str | None = None
        self.unknown_member = False
        self.peer_incarnation = ""
        self.peer_listen = ""

    def _hello(self) -> bytes:
        return _hello_frame(self.member_id, self.nonce, self.local)

    def _on_hello(self, hello: dict[str, Any]) -> bytes:
        """The dialer's HELLO: who it claims to be and whom it meant to reach; answer with ours."""
        claimed = handshake_field(hello, "id", "HELLO")
        if hello.get("v") != HANDSHAKE_VERSION:
            raise HandshakeError(f"unsupported handshake version {hello.get('v')!r}", "malformed")
        probe = hello.get("probe")
        if probe is not None and probe not in PROBES:
            raise HandshakeError(f"unknown probe {str(probe)[:40]!r}", "malformed")
        if (claimed == self.member_id and probe is None) or (claimed not in self.members
                                                              and claimed != self.member_id):
            self.unknown_member = True
            raise HandshakeError(f"unknown member id {claimed!r}", "unknown_member")
        self.peer = claimed
        self.probe = probe
        target = handshake_field(hello, "to", "HELLO")
        if target != self.member_id:
            raise HandshakeError(f"member {claimed!r} meant to reach {target!r}, this is {self.member_id!r}",
                                 "identity")
        self.peer_nonce = handshake_field(hello, "nonce", "HELLO")
        if self.local is not None and "wire" in hello and not wire_overlap(self.local.wire, hello["wire"]):
            raise _wire_error(self.local, claimed, hello["wire"], reply=self._hello())
        return self._hello()

    def _on_auth(self, auth: dict[str, Any]) -> bytes:
        """The dialer's AUTH: its proof and contract; answer with ours, or refuse."""
        assert self.peer is not None
        want = handshake_proof(self.secret, "dialer", self.peer_nonce, self.nonce, self.peer, self.member_id)
        if not _check_proof(auth.get("proof"), want):
            raise HandshakeError(f"member {self.peer!r} could not prove it knows the group secret", "secret")
        proof = handshake_proof(self.secret, "listener", self.peer_nonce, self.nonce, self.peer, self.member_id)
        theirs = auth.get("contract")
        answer: dict[str, Any] = {"ok": True, "proof": proof}
        if self.local is not None:
            answer["contract"] = self.local.contract
            if theirs is not None:
                diffs = differences(self.local.contract, theirs)
                if diffs:
                    answer.update(ok=False, refused=[d.setting for d in diffs])
                    err = _contract_error(self.local, self.peer, theirs, reply=_json_frame(AUTH, answer))
                    assert err is not None
                    raise err
        self.legacy = theirs is None
        inc, listen = auth.get("inc"), auth.get("listen")
        self.peer_incarnation = inc[:64] if isinstance(inc, str) else ""
        self.peer_listen = listen[:256] if isinstance(listen, str) else ""
        self.done = True
        return _json_frame(AUTH, answer)
