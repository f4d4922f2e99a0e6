"""Throughput of framing: encode a BATCH frame, decode it in 1 MiB reads, split the batch.

Run with `pytest tests/test_framing_bench.py --benchmark-enable`; the MB/s
figure is in the benchmark's extra_info (and printed by `make bench`).  In
the normal suite (--benchmark-disable) each case runs once as a correctness
check.
"""

from __future__ import annotations

import os

import pytest

from kdsync.transport.framing import FrameDecoder, decode_batch, encode_batch_frame

CASES = {
    "1000x1KiB": [os.urandom(1024) for _ in range(1000)],
    "100x64KiB": [os.urandom(65536) for _ in range(100)],
    "10000x100B": [os.urandom(100) for _ in range(10000)],
}


def round_trip(messages: list[bytes], chunk: int) -> list[bytes]:
    wire = bytes(encode_batch_frame(messages))  # bytes, as a socket read returns
    dec = FrameDecoder()
    frames = []
    for i in range(0, len(wire), chunk):
        frames += dec.feed(wire[i : i + chunk])
    (frame,) = frames
    return decode_batch(frame.body)


@pytest.mark.benchmark
@pytest.mark.parametrize("case", sorted(CASES))
def test_bench_batch_encode_decode(benchmark, case):
    messages = CASES[case]
    payload = sum(len(m) for m in messages)
    out = benchmark(round_trip, messages, 1 << 20)  # reads of 1 MiB, like the TCP reader
    assert out == messages
    benchmark.extra_info["payload_bytes"] = payload
    if benchmark.stats is not None:
        mean = benchmark.stats.stats.mean
        benchmark.extra_info["MB_per_s"] = round(payload / mean / 1e6, 1)
        benchmark.extra_info["messages_per_s"] = round(len(messages) / mean)
