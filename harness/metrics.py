"""Prometheus figures read back from a live process's /metrics page."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples on `base_url`/metrics whose labels include `labels`
    (0 when there are none: a counter never incremented is not exported)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )
