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


def weighted_percentile(pairs: Sequence[tuple[float, int]], q: float, *, linear: bool = False) -> float:
    """`percentile` of the values of `pairs` (value, weight), sorted by value,
    each value counted `weight` times — without expanding them; NaN when the
    weights sum to 0.  `linear`: interpolated between the two nearest ranks
    instead (Spark's exact `percentile`, which `kdsync audit` reports: the
    simulator's `latency_ms` must equal the audit of its own trace)."""
    total = sum(w for _, w in pairs)
    if not total:
        return math.nan
    if linear:
        return _interpolated(pairs, (total - 1) * q / 100)
    k = min(total - 1, max(0, math.ceil(q / 100 * total) - 1))
    seen = 0
    for v, w in pairs:
        seen += w
        if seen > k:
            return float(v)
    return float(pairs[-1][0])  # pragma: no cover - seen reaches total > k


def _interpolated(pairs: Sequence[tuple[float, int]], pos: float) -> float:
    lo = int(pos)
    frac = pos - lo
    seen = 0
    for i, (v, w) in enumerate(pairs):
        if seen + w > lo:
            if frac == 0.0 or seen + w > lo + 1:
                return float(v)
            nxt = pairs[i + 1][0] if i + 1 < len(pairs) else v
            return float(v + (nxt - v) * frac)
        seen += w
    return float(pairs[-1][0])


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{'p50': ..., 'p90': ..., 'p99': ..., 'max': ...} of `values`; zeros when empty."""
    if not len(values):
        return {**{f"p{q:g}": 0.0 for q in qs}, "max": 0.0}
    return {**{f"p{q:g}": percentile(values, q) for q in qs}, "max": float(values.max() if hasattr(values, "dtype") else max(values))}
