"""The one percentile every figure in tests, the benchmark and the simulator
goes through, so a simulated p50 and a real p50 are the same statistic."""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["percentile", "percentiles", "weighted_percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (`q` in 0..100) of `values` (a list or a numpy
    array): the smallest value with at least q % of the values at or below it;
    NaN when empty."""
    n = len(values)
    if not n:
        return math.nan
    k = min(n - 1, max(0, math.ceil(q / 100 * n) - 1))
    if hasattr(values, "dtype"):  # numpy: select without a full sort
        import numpy as np

        return float(np.partition(values, k)[k])
    return float(sorted(values)[k])


def weighted_percentile(pairs: Sequence[tuple[float, int]], q: float) -> float:
    """`percentile` of the values of `pairs` (value, weight), sorted by value,
    each value counted `weight` times — without expanding them; NaN when the
    weights sum to 0."""
    total = sum(w for _, w in pairs)
    if not total:
        return math.nan
    k = min(total - 1, max(0, math.ceil(q / 100 * total) - 1))
    seen = 0
    for v, w in pairs:
        seen += w
        if seen > k:
            return float(v)
    return float(pairs[-1][0])  # pragma: no cover - seen reaches total > k


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{'p50': ..., 'p90': ..., 'p99': ..., 'max': ...} of `values`; zeros when empty."""
    if not len(values):
        return {**{f"p{q:g}": 0.0 for q in qs}, "max": 0.0}
    return {**{f"p{q:g}": percentile(values, q) for q in qs}, "max": float(values.max() if hasattr(values, "dtype") else max(values))}
