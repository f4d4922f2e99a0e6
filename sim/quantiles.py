"""Distributions given as evenly spaced quantiles (0, 1/n, ..., 1): how the
calibration hands measured delays to the model (a member's wake-up delay,
`member_cost.wakeup_quantiles_us`; a link's extra delay,
`extra_quantiles_ms`)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["check_quantiles", "inverse_cdf"]


def check_quantiles(q: Sequence[float] | None, name: str) -> None:
    """Raise ValueError (one line naming `name`) unless `q` is None or
    non-negative and non-decreasing."""
    if q is not None and (any(b < a for a, b in zip(q, q[1:])) or q[0] < 0):
        raise ValueError(f"{name} must be >= 0 and non-decreasing")


def inverse_cdf(q: Sequence[float], u: float) -> float:
    """The value at probability `u` in [0, 1): linear between the quantiles."""
    x = u * (len(q) - 1)
    i = min(int(x), len(q) - 2)
    return q[i] + (q[i + 1] - q[i]) * (x - i)
