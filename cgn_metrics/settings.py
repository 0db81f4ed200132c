"""cgn-metrics' settings tree."""

from dataclasses import dataclass

from cgn_core.settings import ListenSettings, LogSettings


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    http: ListenSettings = ListenSettings(port=9092)
    scrape_interval_s: float = 5.0
    targets: tuple[str, ...] = ()  # extra /metrics URLs to federate
    log: LogSettings = LogSettings()
