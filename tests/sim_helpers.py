"""Shared helpers of the simulator tests (tests/test_sim_*.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "sim" / "scenarios"


def have_protocol(protocol: str) -> bool:
    return importlib.util.find_spec(f"kdsync.core.{protocol}") is not None


def need_protocol(protocol: str) -> None:
    if not have_protocol(protocol):
        pytest.skip(f"kdsync/core/{protocol}.py has not landed yet")
