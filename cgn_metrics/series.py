"""Rolling time series in fixed rings, and the PromQL-like arithmetic the fleet view needs.

`Ring` holds the last `capacity` (time, value) points of one series in two
preallocated float64 arrays: 16 bytes a point, nothing allocated after start.
`increase` is Prometheus' counter increase over a window (a value that drops is a
restart: the counter starts again from zero, so the new value is all increase),
`quantile` is `histogram_quantile` over cumulative `le` buckets (linear inside a
bucket; the `+Inf` bucket answers its lower bound).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

POINT_BYTES = 16


class Ring:
    """The last `capacity` points of one series, oldest first on read."""

    __slots__ = ("_n", "_next", "times", "values")

    def __init__(self, capacity: int):
        self.times = np.zeros(max(1, capacity))
        self.values = np.zeros(max(1, capacity))
        self._next = 0
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, t: float, v: float) -> None:
        self.times[self._next] = t
        self.values[self._next] = v
        self._next = (self._next + 1) % self.times.size
        self._n = min(self._n + 1, self.times.size)

    def points(self, since: float = -math.inf) -> tuple[np.ndarray, np.ndarray]:
        """(times, values) oldest first, from `since` on."""
        if self._n < self.times.size:
            t, v = self.times[: self._n], self.values[: self._n]
        else:
            t = np.roll(self.times, -self._next)
            v = np.roll(self.values, -self._next)
        keep = t >= since
        return t[keep], v[keep]

    def last(self) -> tuple[float, float] | None:
        if not self._n:
            return None
        i = (self._next - 1) % self.times.size
        return float(self.times[i]), float(self.values[i])


def increase(values: Iterable[float]) -> float:
    """A counter's increase across consecutive samples, restarts counted from zero."""
    total, prev = 0.0, None
    for v in values:
        if prev is not None:
            total += v - prev if v >= prev else v
        prev = v
    return total


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of a histogram given as cumulative counts per upper bound `le`;
    None when it counted nothing."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower
