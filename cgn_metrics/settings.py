"""cgn-metrics' settings tree."""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cgn_core.errors import ConfigError
from cgn_core.settings import EtcdSettings, ListenSettings, LogSettings, TlsSettings
from cgn_metrics.targets import static_targets


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    http: ListenSettings = ListenSettings(port=9092)
    # etcd: agents, engines and kvcached daemons from the cluster's records; static: only
    # `targets`
    discovery: Literal["etcd", "static"] = "etcd"
    # KIND=URL (KIND: router, agent, engine, kvcached, other) or URL; routers do not
    # register in etcd, so list them here
    targets: tuple[str, ...] = ()
    scrape_interval_s: float = 5.0
    scrape_timeout_s: float = 2.0  # a target slower than this is down for the round
    scrape_concurrency: int = 32  # targets scraped at once
    window_s: float = 60.0  # rates, percentiles and energy per token are over this
    retention_s: float = 3600.0  # history kept for the dashboard's charts
    # Write a Prometheus file_sd target list here on every change (a site's own Prometheus
    # scrapes the fleet directly); None: off
    file_sd: Path | None = None
    # With discovery etcd: write each measured node's output tokens per joule to
    # /cognitora/efficiency/<node> this often (placement's tie-break and the router's
    # `efficiency` scorer read it); 0: never
    efficiency_publish_s: float = 30.0
    tls: TlsSettings = TlsSettings()  # client certificate and CA for https targets
    etcd: EtcdSettings = EtcdSettings()
    log: LogSettings = LogSettings()

    def check(self) -> None:
        if self.scrape_interval_s <= 0 or self.scrape_timeout_s <= 0:
            raise ConfigError("scrape_interval_s and scrape_timeout_s must be positive")
        if self.window_s < 2 * self.scrape_interval_s:
            raise ConfigError("window_s must cover at least two scrape intervals")
        if self.retention_s < self.window_s:
            raise ConfigError("retention_s must be at least window_s")
        try:
            static_targets(self.targets)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
