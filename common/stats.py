"""Summary statistics shared by the benchmarks and the autoscaling simulation."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`-th percentile (q in [0, 100]) of `values`; nan when there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
