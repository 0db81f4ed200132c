"""cgn-kvcached's Prometheus metrics, read from the live store at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cgn_core.kv.store import BlockStore


class StoreCollector(Collector):
    def __init__(self, store: BlockStore):
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s, ram, ssd = self.store, self.store.ram, self.store.ssd
        tiers = {"ram": (ram.used_bytes, len(ram), ram.budget_bytes)}
        if ssd is not None:
            tiers["ssd"] = (ssd.used_bytes, len(ssd), ssd.budget_bytes)
        gauges = (
            ("cgn_kvcached_bytes", 0, "Bytes stored, by tier."),
            ("cgn_kvcached_blocks", 1, "Blocks stored, by tier."),
            ("cgn_kvcached_budget_bytes", 2, "Byte budget, by tier."),
        )
        for name, index, doc in gauges:
            g = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, values in tiers.items():
                g.add_metric([tier], values[index])
            yield g
        hits = CounterMetricFamily("cgn_kvcached_hits", "Blocks served, by tier.", labels=["tier"])
        for tier, n in s.stats.hits.items():
            hits.add_metric([tier], n)
        yield hits
        evictions = CounterMetricFamily(
            "cgn_kvcached_evictions", "Blocks evicted by a tier's budget.", labels=["tier"]
        )
        evictions.add_metric(["ram"], s.stats.ram_evictions)
        evictions.add_metric(["ssd"], s.stats.ssd_evictions)
        yield evictions
        for name, doc, value in (
            ("cgn_kvcached_misses", "Blocks asked for and not held.", s.stats.misses),
            ("cgn_kvcached_dropped", "Blocks neither tier could take.", s.stats.dropped),
            (
                "cgn_kvcached_ssd_write_failures",
                "SSD writes that failed (full or failing disk).",
                s.stats.ssd_write_failures,
            ),
            (
                "cgn_kvcached_checksum_failures",
                "SSD blocks that failed their checksum on read.",
                ssd.checksum_failures if ssd else 0,
            ),
            (
                "cgn_kvcached_quarantined",
                "SSD files moved to quarantine/.",
                ssd.quarantined if ssd else 0,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "cgn_kvcached_ssd_degraded",
            "1 while the SSD tier is down (RAM only).",
            value=1.0 if s.ssd_degraded else 0.0,
        )


def registry_for(store: BlockStore) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(store))
    return reg
