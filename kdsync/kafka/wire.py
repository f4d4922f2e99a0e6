"""The little of the Kafka wire protocol kdsync speaks itself: one Fetch
(version 4) of one partition, answered with the record batches' headers.

librdkafka hands its application records, never the batches they came in:
a consumer cannot tell a transaction marker (control batch) or an aborted
record it skipped from a record the broker failed to send.  The source
consumer's gap accounting (kdsync.kafka.gaps) asks the partition's leader
itself, with `fetch_batches`, and reads what lies in the gap from the batch
headers (`BatchHeader`: offsets, transactional and control bits, producer,
record count) and the control records' type (commit / abort).

Fetch v4 (non-flexible, topics by name) is answered by every broker kdsync
is tested on and by Apache Kafka 4 (which dropped Fetch v0-v3).  Plaintext
and SSL listeners only (`security.protocol`); SASL is not spoken here.

The encoders and parsers are pure functions (unit tests build responses
with them); the test fault proxy (kdsync.testing.fault_proxy) uses them to
drop a batch from a Fetch response.
"""

from __future__ import annotations

import socket
import ssl
import struct
from dataclasses import dataclass, field

__all__ = ["BatchHeader", "FetchAnswer", "WireError", "encode_fetch_v4", "fetch_batches", "parse_batches",
           "parse_fetch_v4", "FETCH", "API_VERSIONS", "BATCH_HEADER"]

FETCH, API_VERSIONS = 1, 18
BATCH_HEADER = 61  # bytes of a v2 record batch before its records
_TRANSACTIONAL, _CONTROL = 0x10, 0x20
OFFSET_OUT_OF_RANGE = 1
FETCH_WAIT_MS = (100, 400, 1600)  # an empty answer while records wait: asked again with a longer wait


class WireError(Exception):
    """The look could not be made: no connection, a broker error, a frame it cannot read."""


@dataclass(frozen=True)
class BatchHeader:
    base_offset: int
    last_offset: int
    attributes: int
    producer_id: int
    records: int  # record count
    control_type: int | None = None  # control batches: 0 abort, 1 commit (None: not read)
    offsets: tuple[int, ...] | None = None  # the records' offsets, when the batch is uncompressed

    @property
    def transactional(self) -> bool:
        return bool(self.attributes & _TRANSACTIONAL)

    @property
    def control(self) -> bool:
        return bool(self.attributes & _CONTROL)

    @property
    def compressed(self) -> bool:
        return bool(self.attributes & 0x07)


@dataclass
class FetchAnswer:
    error: int
    high_watermark: int
    last_stable_offset: int
    batches: list[BatchHeader] = field(default_factory=list)
    aborted: list[tuple[int, int]] = field(default_factory=list)  # (producer id, first offset)


# ------------------------------------------------------------------ encoding
def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">h", len(b)) + b


def encode_fetch_v4(correlation: int, topic: str, partition: int, offset: int, *, max_wait_ms: int = 100,
                    max_bytes: int = 1 << 20, isolation: int = 0, client_id: str = "kdsync-gap-look") -> bytes:
    """A Fetch v4 request frame (size prefix included) of one partition from `offset`."""
    body = (struct.pack(">hhi", FETCH, 4, correlation) + _str(client_id)
            + struct.pack(">iiiib", -1, max_wait_ms, 1, max_bytes, isolation)
            + struct.pack(">i", 1) + _str(topic) + struct.pack(">i", 1)
            + struct.pack(">iqi", partition, offset, max_bytes))
    return struct.pack(">i", len(body)) + body


# ------------------------------------------------------------------ decoding
class _Reader:
    __slots__ = ("b", "i")

    def __init__(self, b: bytes | memoryview, i: int = 0):
        self.b, self.i = b, i

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.b, self.i)
        self.i += struct.calcsize(fmt)
        return v if len(v) > 1 else v[0]

    def string(self) -> str | None:
        n = self.take(">h")
        if n < 0:
            return None
        s = bytes(self.b[self.i:self.i + n]).decode()
        self.i += n
        return s

    def uvarint(self) -> int:
        """An unsigned varint (the compact lengths and tagged fields of flexible versions)."""
        shift = v = 0
        while True:
            byte = self.b[self.i]
            self.i += 1
            v |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return v
            shift += 7

    def varint(self) -> int:
        """A signed, zigzag-encoded varint (the fields of a record)."""
        v = self.uvarint()
        return (v >> 1) ^ -(v & 1)


def parse_fetch_v4(frame: bytes, topic: str, partition: int) -> FetchAnswer:
    """The answer for (`topic`, `partition`) in a Fetch v4 response frame
    (without its size prefix, from the correlation id on)."""
    r = _Reader(frame)
    r.take(">i")  # correlation id
    r.take(">i")  # throttle time
    for _ in range(r.take(">i")):
        name = r.string()
        for _ in range(r.take(">i")):
            p, err, hw, lso = r.take(">ihqq")
            n = r.take(">i")
            aborted = [r.take(">qq") for _ in range(max(n, 0))]
            size = r.take(">i")
            records = frame[r.i:r.i + max(size, 0)]
            r.i += max(size, 0)
            if name == topic and p == partition:
                return FetchAnswer(err, hw, lso, parse_batches(records), [tuple(a) for a in aborted])
    raise WireError(f"the fetch response holds no answer for {topic}[{partition}]")


def batch_spans(records: bytes | memoryview) -> list[tuple[int, int, int]]:
    """(start, end, base offset) of every whole batch in a Fetch response's
    records (a partial batch at the end, which brokers may send, is left out)."""
    out, i, n = [], 0, len(records)
    while i + 12 <= n:
        base, length = struct.unpack_from(">qi", records, i)
        end = i + 12 + length
        if length <= 0 or end > n:
            break
        out.append((i, end, base))
        i = end
    return out


def parse_batches(records: bytes | memoryview) -> list[BatchHeader]:
    """The headers of every whole v2 batch in `records` (older message
    formats: one header per message, as plain data)."""
    out = []
    for start, end, base in batch_spans(records):
        magic = records[start + 16] if end - start > 16 else 2
        if magic < 2:  # a v0/v1 message: one record, no transactions
            out.append(BatchHeader(base, base, 0, -1, 1))
            continue
        if end - start < BATCH_HEADER:
            break
        attributes, last_delta = struct.unpack_from(">hi", records, start + 21)
        producer_id = struct.unpack_from(">q", records, start + 43)[0]
        count = struct.unpack_from(">i", records, start + 57)[0]
        control_type = offsets = None
        if not attributes & 0x07:  # uncompressed: the records' offsets (and a control record's type)
            offsets, control_type = _records(memoryview(records)[start + BATCH_HEADER:end], base, count,
                                             bool(attributes & _CONTROL))
        out.append(BatchHeader(base, base + last_delta, attributes, producer_id, count, control_type, offsets))
    return out


def _records(b: memoryview, base: int, count: int, control: bool) -> tuple[tuple[int, ...] | None, int | None]:
    r = _Reader(b)
    offsets = []
    control_type = None
    try:
        for _ in range(count):
            length = r.varint()
            end = r.i + length
            r.i += 1  # attributes
            r.varint()  # timestamp delta
            offsets.append(base + r.varint())
            if control and control_type is None:
                klen = r.varint()
                if klen >= 4:
                    control_type = struct.unpack_from(">hh", b, r.i)[1]
            r.i = end
    except (IndexError, struct.error):
        return None, control_type
    return tuple(offsets), control_type


# ------------------------------------------------------------------ the call
def _connect(host: str, port: int, conf: dict, timeout: float) -> socket.socket:
    proto = str(conf.get("security.protocol", "plaintext")).lower()
    if proto not in ("plaintext", "ssl"):
        raise WireError(f"security.protocol={proto} is not spoken by the gap look (plaintext and ssl only)")
    s = socket.create_connection((host, port), timeout=timeout)
    if proto == "ssl":
        ctx = ssl.create_default_context(cafile=conf.get("ssl.ca.location"))
        if conf.get("ssl.certificate.location"):
            ctx.load_cert_chain(conf["ssl.certificate.location"], conf.get("ssl.key.location"),
                                conf.get("ssl.key.password"))
        if str(conf.get("ssl.endpoint.identification.algorithm", "https")).lower() == "none":
            ctx.check_hostname = False
        s = ctx.wrap_socket(s, server_hostname=host)
    return s


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise WireError("the broker closed the connection")
        buf += chunk
    return bytes(buf)


def fetch_batches(host: str, port: int, topic: str, partition: int, start: int, stop: int, *, conf: dict | None = None,
                  timeout: float = 5.0, max_fetches: int = 20) -> tuple[list[BatchHeader], FetchAnswer]:
    """Fetch (read_uncommitted) `topic`[`partition`] from `start` until a
    batch reaches `stop` or beyond, the high watermark is reached or
    `max_fetches` answers came; returns every batch header read and the
    last answer.  Raises WireError.

    An answer with nothing while the high watermark is ahead is asked again
    with a longer fetch wait (FETCH_WAIT_MS): Tansu on S3 answers a fetch
    whose wait is shorter than its listing of the partition's objects with
    nothing (docs/durable.md), so with one 100 ms wait every look at a
    durable Tansu partition of many small batches came back empty."""
    conf = conf or {}
    batches: list[BatchHeader] = []
    try:
        with _connect(host, port, conf, timeout) as s:
            s.settimeout(timeout)
            offset, ans, waits = start, None, 0
            for corr in range(1, max_fetches + 1):
                s.sendall(encode_fetch_v4(corr, topic, partition, offset, max_wait_ms=FETCH_WAIT_MS[waits]))
                size = struct.unpack(">i", _recv_exact(s, 4))[0]
                ans = parse_fetch_v4(_recv_exact(s, size), topic, partition)
                if ans.error:
                    return batches, ans
                new = [b for b in ans.batches if b.last_offset >= offset]
                batches += new
                if not new:
                    if ans.high_watermark > offset and waits + 1 < len(FETCH_WAIT_MS):
                        waits += 1
                        continue
                    break
                offset = new[-1].last_offset + 1
                if offset >= stop or offset >= ans.high_watermark:
                    break
            return batches, ans
    except OSError as e:
        raise WireError(f"{host}:{port}: {e}") from e
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise WireError(f"{host}:{port}: a fetch answer kdsync cannot read ({e})") from e
