"""Counters and histograms the request path adds to without prometheus_client's lock and
checks (cgn_router/metrics.py builds its series from them), and their collector."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector


class Tally:
    """A counter's series the request path adds to: plain numbers, no lock and no checks
    (prometheus_client takes a lock and validates on every `inc`, 1-4 us each, a dozen a
    request). The worker's event loop is the only writer; a scrape reads them between
    its steps. `series(*labels)` is looked up once per label tuple and kept by the caller."""

    def __init__(self, name: str, doc: str, *labels: str):
        self.name, self.doc, self.labels = name, doc, labels
        self._series: dict[tuple[str, ...], list[float]] = {}

    def series(self, *values: str) -> list[float]:
        """The one-element list to add to: `series[0] += n`."""
        found = self._series.get(values)
        if found is None:
            found = self._series[values] = [0.0]
        return found

    def collect(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for values, (total,) in list(self._series.items()):
            family.add_metric(values, total)
        return family


class Buckets:
    """One histogram series: counts per bucket (the last is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: the first bound >= value
        self.sum += value


class TallyHistogram:
    """A histogram the request path observes into, as `Tally` is a counter."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...], *labels: str):
        self.name, self.doc, self.bounds, self.labels = name, doc, bounds, labels
        self._series: dict[tuple[str, ...], Buckets] = {}

    def series(self, *values: str) -> Buckets:
        found = self._series.get(values)
        if found is None:
            found = self._series[values] = Buckets(self.bounds)
        return found

    def collect(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        les = [*(_le(b) for b in self.bounds), "+Inf"]
        for values, b in list(self._series.items()):
            cumulative, total = [], 0
            for le, n in zip(les, list(b.counts), strict=True):
                total += n
                cumulative.append((le, float(total)))
            family.add_metric(values, cumulative, b.sum)
        return family


def _le(bound: float) -> str:
    """A bucket's bound as prometheus_client writes it (1 -> "1.0")."""
    return repr(float(bound))


class TallyCollector(Collector):
    def __init__(self, tallies: list[Tally | TallyHistogram]):
        self.tallies = tallies

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        for tally in self.tallies:
            yield tally.collect()
