"""Framing and handshake: unit tests and hypothesis fuzz of FrameDecoder and the handshake machines.

The fuzz tests together feed well over 100 000 generated frames per run
(valid, mutated, truncated, random bytes, split at random points); the count
is asserted at the end of the module.
"""

from __future__ import annotations

import random
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdsync.transport import TransportError
from kdsync.transport.framing import (
    AUTH,
    BATCH,
    HEADER_SIZE,
    HELLO,
    KINDS,
    PING,
    Frame,
    FrameDecoder,
    FrameError,
    decode_batch,
    encode_batch,
    encode_batch_frame,
    encode_frame,
)
from kdsync.transport.handshake import DialerHandshake, HandshakeError, ListenerHandshake, handshake_proof

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FRAMES_FED = {"n": 0}


def make_frames(rng: random.Random, n: int) -> list[Frame]:
    frames = []
    for _ in range(n):
        kind = rng.choice((HELLO, AUTH, BATCH, BATCH, BATCH, PING))
        if kind == BATCH:
            msgs = [rng.randbytes(rng.choice((0, 1, 5, 40, 300))) for _ in range(rng.randint(0, 6))]
            body = encode_batch(msgs)
        elif kind == PING:
            body = b""
        else:
            body = rng.randbytes(rng.randint(0, 80))
        frames.append(Frame(kind, 0, body))
    return frames


def stream_of(frames: list[Frame]) -> tuple[bytes, list[int]]:
    """Encoded stream and the start offset of each frame."""
    parts, starts, pos = [], [], 0
    for f in frames:
        b = encode_frame(f.kind, f.body)
        starts.append(pos)
        parts.append(b)
        pos += len(b)
    return b"".join(parts), starts


def feed_split(dec: FrameDecoder, data: bytes, rng: random.Random) -> list[Frame]:
    """Feed `data` in random chunks (including empty ones); return frames decoded."""
    out: list[Frame] = []
    pos = 0
    while pos < len(data):
        step = rng.choice((0, 1, 2, 7, 15, 16, 17, 100, 1000, 1 << 20))
        chunk = data[pos : pos + step]
        # Alternate bytes / bytearray / memoryview inputs.
        chunk = rng.choice((bytes, bytearray, memoryview))(chunk)
        out.extend(dec.feed(chunk))
        pos += step
    return norm(out)


def norm(frames: list[Frame]) -> list[Frame]:
    """Bodies as bytes (the decoder may hand out memoryviews; comparing those is slow)."""
    return [Frame(f.kind, f.flags, bytes(f.body)) for f in frames]


# ---------------------------------------------------------------- unit tests


def test_round_trip_every_kind():
    frames = [Frame(k, 0, bytes([k]) * k) for k in sorted(KINDS)]
    data, _ = stream_of(frames)
    assert FrameDecoder().feed(data) == frames


def test_header_layout_and_checksum_covers_header():
    body = b"hello"
    f = encode_frame(BATCH, body)
    assert len(f) == HEADER_SIZE + len(body)
    magic, version, kind, flags, reserved, length, crc = struct.unpack(">2sBBHHII", f[:HEADER_SIZE])
    assert (magic, version, kind, flags, reserved, length) == (b"KD", 1, BATCH, 0, 0, 5)
    assert crc == zlib.crc32(body, zlib.crc32(f[:12]))
    # Changing only the kind (BATCH -> PING, both valid) must be caught by the checksum.
    forged = f[:3] + bytes([PING]) + f[4:]
    with pytest.raises(FrameError, match="checksum"):
        FrameDecoder().feed(forged)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda f: b"XX" + f[2:], "magic"),
        (lambda f: f[:2] + b"\x09" + f[3:], "version"),
        (lambda f: f[:3] + b"\x77" + f[4:], "kind"),
        (lambda f: f[:4] + b"\x00\x01" + f[6:], "flags"),
        (lambda f: f[:-1] + bytes([f[-1] ^ 1]), "checksum"),
    ],
)
def test_malformed_header_raises_frame_error(mutate, match):
    f = encode_frame(BATCH, encode_batch([b"abc", b"defg"]))
    with pytest.raises(FrameError, match=match):
        FrameDecoder().feed(mutate(f))


def test_oversized_length_refused_from_header_alone():
    dec = FrameDecoder(max_frame_bytes=1000)
    head = encode_frame(BATCH, b"x" * 1001)[:HEADER_SIZE]
    with pytest.raises(FrameError, match="exceeds max_frame_bytes=1000"):
        dec.feed(head)
    # The decoder stays failed: the stream cannot be resynchronised.
    with pytest.raises(FrameError, match="already failed"):
        dec.feed(encode_frame(PING))


def test_frame_error_is_a_transport_error():
    assert issubclass(FrameError, TransportError)


def test_frames_before_damage_in_same_chunk_are_kept():
    good = [encode_frame(PING), encode_frame(BATCH, encode_batch([b"m"]))]
    with pytest.raises(FrameError) as info:
        FrameDecoder().feed(b"".join(good) + b"garbage-garbage-garbage")
    assert [f.kind for f in info.value.frames] == [PING, BATCH]


def test_incomplete_frame_is_buffered_not_an_error():
    f = encode_frame(BATCH, encode_batch([b"a" * 100]))
    dec = FrameDecoder()
    assert dec.feed(f[:50]) == []
    assert dec.buffered == 50
    (frame,) = dec.feed(f[50:])
    assert decode_batch(frame.body) == [b"a" * 100]
    assert dec.buffered == 0


def test_batch_round_trip_and_empty():
    msgs = [b"", b"x", bytes(range(256)) * 10]
    assert decode_batch(encode_batch(msgs)) == msgs
    assert decode_batch(b"") == []
    assert decode_batch(memoryview(encode_batch(msgs))) == msgs


@pytest.mark.parametrize("body", [b"\x00", b"\x00\x00\x00", b"\x00\x00\x00\x05abcd", encode_batch([b"ok"]) + b"\x00"])
def test_truncated_batch_raises_frame_error(body):
    with pytest.raises(FrameError, match="truncated batch"):
        decode_batch(body)


@pytest.mark.parametrize("msgs", [[], [b""], [b"a", b"bc" * 1000, b""]])
def test_encode_batch_frame_matches_two_step_encoding(msgs):
    assert bytes(encode_batch_frame(msgs)) == encode_frame(BATCH, encode_batch(msgs))


def test_large_frame_across_many_chunks_and_zero_copy_whole_frame():
    msgs = [bytes([i]) * 100_000 for i in range(30)]
    wire = bytes(encode_batch_frame(msgs))
    dec = FrameDecoder()
    frames = []
    for i in range(0, len(wire), 65536):
        frames += dec.feed(wire[i : i + 65536])
        assert dec.buffered == (i + len(wire[i : i + 65536])) % len(wire)
    (frame,) = frames
    assert decode_batch(frame.body) == msgs
    # A frame that arrives whole is a view of the input, not a copy.
    (whole,) = FrameDecoder().feed(wire)
    assert isinstance(whole.body, memoryview) and whole.body.obj is wire


def test_unknown_kind_cannot_be_encoded():
    with pytest.raises(FrameError):
        encode_frame(99, b"")


# ---------------------------------------------------------------- fuzz


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(300, 500))
def test_fuzz_valid_stream_split_anywhere_decodes_exactly(seed, n):
    rng = random.Random(seed)
    frames = make_frames(rng, n)
    data, _ = stream_of(frames)
    dec = FrameDecoder()
    assert feed_split(dec, data, rng) == frames
    assert dec.buffered == 0
    for f in frames:
        if f.kind == BATCH:
            decode_batch(f.body)  # valid batches decode without error
    FRAMES_FED["n"] += n


@FUZZ
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(150, 250),
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_fuzz_mutated_stream_only_frame_error_and_exact_prefix(seed, n, flips):
    rng = random.Random(seed)
    frames = make_frames(rng, n)
    data, starts = stream_of(frames)
    buf = bytearray(data)
    for where, xor in flips:
        buf[int(where * len(buf))] ^= xor
    changed = [i for i in range(len(buf)) if buf[i] != data[i]]
    # Index of the frame holding the first changed byte: frames before it are intact.
    k = max(i for i, s in enumerate(starts) if s <= changed[0]) if changed else n
    dec = FrameDecoder()
    out: list[Frame] = []
    try:
        pos = 0
        while pos < len(buf):
            step = rng.choice((1, 13, 64, 4096))
            out.extend(dec.feed(bytes(buf[pos : pos + step])))
            pos += step
    except FrameError as exc:
        out.extend(exc.frames)
    out = norm(out)
    # Every frame before the damage is decoded exactly; the damaged frame is
    # refused (FrameError) or, if its length grew, still pending; nothing
    # after it is accepted.
    assert out == frames[:k]
    FRAMES_FED["n"] += n


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(150, 250), cut=st.floats(0, 1))
def test_fuzz_truncated_stream_yields_exact_prefix(seed, n, cut):
    rng = random.Random(seed)
    frames = make_frames(rng, n)
    data, starts = stream_of(frames)
    end = int(cut * len(data))
    dec = FrameDecoder()
    out = feed_split(dec, data[:end], rng)
    complete = sum(1 for i, s in enumerate(starts) if s + HEADER_SIZE + len(frames[i].body) <= end)
    assert out == frames[:complete]
    assert dec.buffered == end - (starts[complete] if complete < n else len(data))
    FRAMES_FED["n"] += n


@FUZZ
@given(data=st.binary(max_size=600), prefix_frames=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_fuzz_random_bytes_only_frame_error(data, prefix_frames, seed):
    rng = random.Random(seed)
    frames = make_frames(rng, prefix_frames)
    valid, _ = stream_of(frames)
    dec = FrameDecoder(max_frame_bytes=rng.choice((0, 100, 1 << 16)))
    out: list[Frame] = []
    try:
        out = feed_split(dec, valid, rng)
        out += feed_split(dec, data, rng)
    except FrameError as exc:
        out += exc.frames
    try:
        for f in out:
            if f.kind == BATCH:
                decode_batch(f.body)
    except FrameError:
        pass
    try:
        decode_batch(data)
    except FrameError:
        pass
    FRAMES_FED["n"] += prefix_frames + 1


@FUZZ
@given(msgs=st.lists(st.binary(max_size=200), max_size=50))
def test_fuzz_batch_round_trip(msgs):
    assert decode_batch(encode_batch(msgs)) == msgs
    body = encode_batch(msgs)
    for cut in range(max(0, len(body) - 5), len(body)):
        try:
            decode_batch(body[:cut])
        except FrameError:
            pass


# ---------------------------------------------------------------- handshake (sans-I/O)


def frame_of(data: bytes) -> Frame:
    (f,) = FrameDecoder().feed(data)
    return f


def shuttle(d: DialerHandshake, lst: ListenerHandshake) -> None:
    """Run both halves against each other through real frames until both are done."""
    to_listener = d.hello()
    while True:
        reply = lst.receive(frame_of(to_listener))
        assert reply is not None
        back = d.receive(frame_of(reply))
        if back is None:
            break
        to_listener = back


@pytest.mark.parametrize("secret", [None, b"s3cret", bytes(range(256))])
def test_handshake_succeeds_with_the_same_secret(secret):
    d = DialerHandshake("a", "b", secret)
    lst = ListenerHandshake("b", {"a", "b", "c"}, secret)
    shuttle(d, lst)
    assert d.done and lst.done and lst.peer == "a"


@pytest.mark.parametrize("dialer_secret, listener_secret", [(b"x", b"y"), (None, b"y"), (b"x", None)])
def test_handshake_listener_refuses_a_dialer_without_the_secret(dialer_secret, listener_secret):
    d = DialerHandshake("a", "b", dialer_secret)
    lst = ListenerHandshake("b", {"a", "b"}, listener_secret)
    auth = d.receive(frame_of(lst.receive(frame_of(d.hello()))))
    assert d.awaiting_accept
    with pytest.raises(HandshakeError, match="'a' could not prove it knows the group secret"):
        lst.receive(frame_of(auth))
    assert not lst.done and lst.peer == "a"


def test_handshake_dialer_refuses_a_listener_without_the_secret():
    d = DialerHandshake("a", "b", b"k")
    fake = ListenerHandshake("b", {"a"}, None)
    fake.receive(frame_of(d.hello()))
    d.receive(frame_of(encode_frame(HELLO, b'{"v":1,"id":"b","nonce":"' + fake.nonce.encode() + b'"}')))
    # The fake listener accepts blindly but cannot produce the listener proof.
    with pytest.raises(HandshakeError, match="peer could not prove"):
        d.receive(frame_of(encode_frame(AUTH, b'{"ok":true,"proof":""}')))


def test_handshake_resists_reflection_and_replay():
    secret = b"k"
    d = DialerHandshake("a", "b", secret)
    lst = ListenerHandshake("b", {"a"}, secret)
    lst.receive(frame_of(d.hello()))
    # Reflection: the listener-role proof over the same nonces is not a dialer proof.
    forged = handshake_proof(secret, "listener", d.nonce, lst.nonce, "a", "b")
    with pytest.raises(HandshakeError, match="could not prove"):
        lst.receive(frame_of(encode_frame(AUTH, ('{"proof":"%s"}' % forged).encode())))
    # Replay: a genuine AUTH recorded from one session fails against a fresh listener nonce.
    d1, l1 = DialerHandshake("a", "b", secret), ListenerHandshake("b", {"a"}, secret)
    recorded_auth = d1.receive(frame_of(l1.receive(frame_of(d1.hello()))))
    l2 = ListenerHandshake("b", {"a"}, secret)
    l2.receive(frame_of(d1.hello()))  # same dialer nonce replayed, new listener nonce
    with pytest.raises(HandshakeError, match="could not prove"):
        l2.receive(frame_of(recorded_auth))


@pytest.mark.parametrize(
    "body, match",
    [
        (b'{"v":1,"id":"mallory","to":"b","nonce":"1"}', "unknown member id 'mallory'"),
        (b'{"v":1,"id":"b","to":"b","nonce":"1"}', "unknown member id 'b'"),  # our own id
        (b'{"v":1,"id":"a","to":"zz","nonce":"1"}', "meant to reach 'zz'"),
        (b'{"v":2,"id":"a","to":"b","nonce":"1"}', "unsupported handshake version 2"),
        (b'{"v":1,"id":"a","to":"b"}', "field 'nonce' missing"),
        (b'{"v":1,"id":7,"to":"b","nonce":"1"}', "field 'id' missing or not a string"),
        (b"[1,2]", "not an object"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 1000, "not JSON"),  # nesting past the recursion limit
        (b"[" * 70_000, "too large"),  # beyond 60 KiB (the contract names every member)
    ],
)
def test_handshake_listener_rejects_bad_hello(body, match):
    lst = ListenerHandshake("b", {"a", "b"}, None)
    with pytest.raises(HandshakeError, match=match):
        lst.receive(frame_of(encode_frame(HELLO, body)))


def test_handshake_rejects_wrong_frame_kind_and_non_ascii_proof():
    lst = ListenerHandshake("b", {"a"}, b"k")
    with pytest.raises(HandshakeError, match="expected HELLO"):
        lst.receive(frame_of(encode_frame(PING)))
    lst = ListenerHandshake("b", {"a"}, b"k")
    lst.receive(frame_of(DialerHandshake("a", "b", b"k").hello()))
    with pytest.raises(HandshakeError, match="could not prove"):
        lst.receive(frame_of(encode_frame(AUTH, '{"proof":"é☃"}'.encode())))


@FUZZ
@given(body=st.binary(max_size=300), kind=st.sampled_from(sorted(KINDS)), step=st.integers(0, 1))
def test_fuzz_handshake_only_handshake_error(body, kind, step):
    lst = ListenerHandshake("b", {"a"}, b"k")
    d = DialerHandshake("a", "b", b"k")
    if step:
        lst.receive(frame_of(d.hello()))
        d.receive(frame_of(encode_frame(HELLO, ('{"v":1,"id":"b","nonce":"%s"}' % lst.nonce).encode())))
    for machine in (lst, d):
        try:
            machine.receive(Frame(kind, 0, body))
        except HandshakeError:
            pass


def test_zz_fuzz_fed_at_least_100k_frames():
    """Runs last in this module (pytest keeps file order)."""
    if FRAMES_FED["n"] == 0:
        pytest.skip("fuzz tests were not run in this session")
    assert FRAMES_FED["n"] >= 100_000, FRAMES_FED
