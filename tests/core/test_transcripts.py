"""Golden interaction transcripts in tests/transcripts/*.txt.

Regenerate after an intended behaviour change with KDSYNC_REWRITE=1 and read
the diff: it is the protocol's behaviour, in order.
"""

import os
import pathlib

import pytest

from kdsync.testing.transcript import run_transcript

DIR = pathlib.Path(__file__).resolve().parents[1] / "transcripts"
FILES = sorted(DIR.glob("*.txt"))
REQUIRED = {
    "normal_flow",
    "concurrent_submits",
    "follower_crash",
    "leader_crash_during_view_change",
    "partition_heal",
    "rejoin_catchup",
    "witness_two_clusters",
}


def test_required_transcripts_exist():
    assert REQUIRED <= {f.stem for f in FILES}


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_transcript(path):
    text = path.read_text()
    got = run_transcript(text)
    if os.environ.get("KDSYNC_REWRITE"):
        path.write_text(got)
    assert got == text
    assert "agreement:" not in got and "loss:" not in got and "integrity:" not in got
